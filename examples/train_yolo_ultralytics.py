"""Make the Ultralytics trainer load batches with FastLoader instead of InfiniteDataLoader.

Ultralytics builds its loaders in ``DetectionTrainer.get_dataloader``; a trainer subclass that
returns a FastLoader is all it takes, passed to ``YOLO.train(trainer=...)``. Ultralytics stays
optional: it is never a fastfeed dependency.

    pip install ultralytics
    python examples/train_yolo_ultralytics.py --data coco128.yaml --epochs 3

Without Ultralytics installed, the script shows the same data path on a tiny generated YOLO set
(``fastfeed.vision.YoloDataset`` gives Ultralytics' batch layout) with a small model.
"""

from __future__ import annotations

import argparse
import tempfile
from pathlib import Path

import torch
from torch import nn

from fastfeed import FastLoader


class FastInfiniteLoader(FastLoader):
    """What Ultralytics expects of its loader: ``len()``, endless reuse of its workers
    (``persistent_workers``) and ``reset()``, which restarts them after the dataset changed
    (Ultralytics turns mosaic off for the last epochs)."""

    def reset(self) -> None:
        if self._iterator is not None:
            self._iterator._shutdown_workers()
            self._iterator = None


def ultralytics_trainer():
    """A DetectionTrainer whose loaders are FastLoaders (needs ultralytics)."""
    from ultralytics.models.yolo.detect import DetectionTrainer

    class FastDetectionTrainer(DetectionTrainer):
        def get_dataloader(self, dataset_path, batch_size=16, rank=0, mode="train"):
            dataset = self.build_dataset(dataset_path, mode, batch_size)
            workers = self.args.workers if mode == "train" else self.args.workers * 2
            return FastInfiniteLoader(
                dataset, batch_size=batch_size, shuffle=mode == "train",
                num_workers=min(workers, 8), collate_fn=dataset.collate_fn,
                pin_memory=torch.cuda.is_available(), persistent_workers=workers > 0)

    return FastDetectionTrainer


def without_ultralytics(epochs: int, workers: int) -> None:
    from fastfeed.vision import YoloCollate, YoloDataset
    from fastfeed.vision.synthetic import make_yolo

    root = make_yolo(Path(tempfile.mkdtemp()) / "yolo", images=24)
    loader = FastInfiniteLoader(YoloDataset(root, imgsz=128), batch_size=8, shuffle=True,
                                num_workers=workers, collate_fn=YoloCollate(),
                                persistent_workers=workers > 0)
    # A stand-in detector: predicts how many objects each image holds.
    model = nn.Sequential(nn.Conv2d(3, 16, 3, 4, 1), nn.ReLU(), nn.AdaptiveAvgPool2d(1),
                          nn.Flatten(), nn.Linear(16, 1))
    optimizer = torch.optim.Adam(model.parameters(), lr=1e-3)
    for epoch in range(epochs):
        for batch in loader:  # Ultralytics' layout: img, cls, bboxes, batch_idx, im_file
            counts = torch.bincount(batch["batch_idx"].long(), minlength=len(batch["img"]))
            loss = nn.functional.mse_loss(model(batch["img"].float() / 255).squeeze(1),
                                          counts.float())
            optimizer.zero_grad()
            loss.backward()
            optimizer.step()
        loader.reset()  # what Ultralytics does when it switches mosaic off
        print(f"epoch {epoch}: loss {loss.item():.3f}, {len(batch['bboxes'])} boxes in the "
              f"last batch of {len(batch['img'])}")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--data", default="coco128.yaml")
    parser.add_argument("--model", default="yolov8n.yaml")
    parser.add_argument("--epochs", type=int, default=1)
    parser.add_argument("--workers", type=int, default=2)
    args = parser.parse_args()
    try:
        from ultralytics import YOLO
    except ImportError:
        print("ultralytics is not installed: showing the same data path without it")
        without_ultralytics(args.epochs, args.workers)
        return
    YOLO(args.model).train(data=args.data, epochs=args.epochs, workers=args.workers,
                           trainer=ultralytics_trainer())


if __name__ == "__main__":
    main()
