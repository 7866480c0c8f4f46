"""A stock Ultralytics YOLO training run, for the doctor (client tests, GPU suite).

``YOLO(model).train(...)`` with Ultralytics' own loader (no fastfeed line), on ``--data`` or on a
generated YOLO set. On the CPU Ultralytics trains with ``workers=0``; ``--workers`` is set
back from a callback, as a run on a GPU would keep it.

    python train_yolo.py --device 0 --imgsz 640 --workers 8 --images 512
"""

import argparse
import os
import tempfile
from pathlib import Path

os.environ.setdefault("YOLO_OFFLINE", "1")  # no downloads, no telemetry


def generated(images):
    from fastfeed.vision.synthetic import make_yolo

    root = make_yolo(Path(tempfile.mkdtemp()) / "yolo", images=images)
    names = "".join(f"  {i}: c{i}\n" for i in range(8))
    (root / "data.yaml").write_text(f"path: {root}\ntrain: images\nval: images\nnames:\n{names}")
    return str(root / "data.yaml")


def main():
    parser = argparse.ArgumentParser()
    parser.add_argument("--data", default=None, help="an Ultralytics data.yaml")
    parser.add_argument("--images", type=int, default=24, help="generated set size")
    parser.add_argument("--model", default="yolov8n.yaml")
    parser.add_argument("--epochs", type=int, default=2)
    parser.add_argument("--imgsz", type=int, default=64)
    parser.add_argument("--batch", type=int, default=4)
    parser.add_argument("--workers", type=int, default=2)
    parser.add_argument("--device", default="cpu")
    args = parser.parse_args()
    from ultralytics import YOLO

    model = YOLO(args.model)

    def keep_workers(trainer):
        trainer.args.workers = args.workers

    model.add_callback("on_pretrain_routine_start", keep_workers)
    model.train(data=args.data or generated(args.images), epochs=args.epochs, imgsz=args.imgsz,
                batch=args.batch, workers=args.workers, device=args.device, plots=False,
                val=False, amp=args.device != "cpu", project=tempfile.mkdtemp(), name="run",
                verbose=False)


if __name__ == "__main__":
    main()
