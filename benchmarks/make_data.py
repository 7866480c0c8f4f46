"""Generate the benchmark image sets (never committed): an ImageNet-like folder and a
YOLO-format detection set.

    python benchmarks/make_data.py --out ~/.cache/fastfeed --images 2000
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from fastfeed.vision.synthetic import make_imagefolder, make_yolo


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--out", type=Path, default=Path.home() / ".cache" / "fastfeed")
    parser.add_argument("--images", type=int, default=2000)
    parser.add_argument("--classes", type=int, default=100)
    parser.add_argument("--detection-images", type=int, default=300)
    args = parser.parse_args()
    make_imagefolder(args.out / "imagenet-like", args.images, args.classes)
    make_yolo(args.out / "yolo-like", args.detection_images)
    print(f"wrote {args.out / 'imagenet-like'} and {args.out / 'yolo-like'}")


if __name__ == "__main__":
    main()
