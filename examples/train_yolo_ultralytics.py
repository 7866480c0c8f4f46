"""Ultralytics YOLO training with fastfeed: one line before ``model.train``.

``fastfeed.ultralytics.patch()`` makes Ultralytics build its train and val loaders as
FastLoaders, with exactly its own arguments; ``fast_decode=True`` also decodes large JPEGs at a
reduced DCT scale (see docs/ultralytics.md). Ultralytics stays optional: never a fastfeed
dependency.

    python3 -m pip install torch==2.14.1 torchvision==0.29.1 -e ".[ultralytics]"  # in the clone
    python examples/train_yolo_ultralytics.py --data coco128.yaml --epochs 3

(the README's Setup gives the line that keeps a torch already installed). Without ``--data``,
the script trains on a tiny generated YOLO set, offline, at ``--imgsz 64`` unless given
another.
"""

from __future__ import annotations

import argparse
import os
import tempfile
from pathlib import Path


def tiny_dataset() -> str:
    """A generated 24-image YOLO set and its data.yaml (no downloads)."""
    from fastfeed.vision.synthetic import make_yolo

    root = make_yolo(Path(tempfile.mkdtemp()) / "yolo", images=24)
    names = "".join(f"  {i}: class{i}\n" for i in range(8))
    (root / "data.yaml").write_text(f"path: {root}\ntrain: images\nval: images\nnames:\n{names}")
    return str(root / "data.yaml")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--data", default=None, help="an Ultralytics data.yaml")
    parser.add_argument("--model", default="yolov8n.yaml")
    parser.add_argument("--epochs", type=int, default=2)
    parser.add_argument("--imgsz", type=int, default=None,
                        help="image size (default: 640; 64 for the generated set)")
    parser.add_argument("--workers", type=int, default=8)
    parser.add_argument("--fast-decode", action="store_true")
    parser.add_argument("--project", default=None,
                        help="the folder Ultralytics writes the run into (default: its "
                             "runs_dir setting)")
    args = parser.parse_args()
    if args.data is None:
        os.environ.setdefault("YOLO_OFFLINE", "1")
        args.data = tiny_dataset()
        args.imgsz = args.imgsz or 64  # a quick run on a CPU: at 640 an epoch takes minutes
        print(f"no --data: training on a generated 24-image YOLO set at imgsz {args.imgsz}")
    args.imgsz = args.imgsz or 640

    from ultralytics import YOLO

    import fastfeed.ultralytics

    fastfeed.ultralytics.patch(fast_decode=args.fast_decode)  # the one line
    model = YOLO(args.model)
    model.train(data=args.data, epochs=args.epochs, imgsz=args.imgsz, workers=args.workers,
                close_mosaic=1, plots=False, project=args.project)
    print(f"trained on {type(model.trainer.train_loader).__name__}")


if __name__ == "__main__":
    main()
