"""How far ``accelerate(..., decode_device="cuda")``'s pixels are from the user's own pipeline.

Each image goes through ``RandomResizedCrop(size)``, ``RandomHorizontalFlip()`` and
``PILToTensor()``: the stock way (Pillow), and through the GPU route with the same seed, so the
same crop window and flip. The route's batches are decoded by torchvision's ``decode_jpeg`` on
``--device``: on ``cuda`` that is nvJPEG (no fancy chroma upsampling, its own IDCT) and the
whole distance shows; on ``cpu`` it is libjpeg, as Pillow's, and only the batched float
resize's share of it shows. The CPU route (``accelerate`` without ``decode_device``) is
measured alongside. Per route: the mean absolute difference over all pixels, the worst image's
mean and the worst pixel, in grey levels. Accuracy only: nothing here is timed.

Without ``--data``, ``--images`` photo-like JPEGs are generated (about 500×375, q90, smooth
shapes with grain, ``fastfeed.vision.synthetic``); real photos are sharper:

    .venv-clients/bin/python benchmarks/gpu_decode_pixels.py --device cpu --seeds 4
    python3 benchmarks/gpu_decode_pixels.py --device cuda --data photos/ --seeds 10
"""

from __future__ import annotations

import argparse
import sys
import tempfile
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))


def distances(args: argparse.Namespace, root: Path) -> dict[str, list[torch.Tensor]]:
    """Per route, the absolute difference from stock of each image (float, grey levels)."""
    from torchvision import datasets
    from torchvision import transforms as T

    from fastfeed.tree import map_tensors
    from fastfeed.vision.accelerate import accelerate
    from fastfeed.vision.gpu_decode import DecodeCrops, encoded_collate

    stock = datasets.ImageFolder(str(root), transform=T.Compose([
        T.RandomResizedCrop(args.size), T.RandomHorizontalFlip(), T.PILToTensor()]))
    on_cpu, on_gpu = accelerate(stock), accelerate(stock, decode_device="cuda")
    crops = on_gpu.transform.split_batch_tail(on_gpu).dataset
    decode = DecodeCrops(on_gpu.transform.affine)  # on --device, whatever it is
    device = torch.device(args.device)
    found: dict[str, list[torch.Tensor]] = {"gpu-decode": [], "cpu route": []}
    for seed in range(args.seeds):
        for start in range(0, len(stock), args.batch_size):
            indices = range(start, min(start + args.batch_size, len(stock)))
            expected, items, cpu_items = [], [], []
            for index in indices:
                for dataset, out in ((stock, expected), (crops, items), (on_cpu, cpu_items)):
                    torch.manual_seed(seed * 100_003 + index)
                    out.append(dataset[index][0])
            batch = map_tensors(lambda t: t.to(device), encoded_collate(
                [(item, 0) for item in items]))
            got = decode(batch)[0].cpu()
            for route, images in (("gpu-decode", got), ("cpu route", cpu_items)):
                found[route] += [(e.float() - g.float()).abs()
                                 for e, g in zip(expected, images, strict=True)]
    return found


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--data", type=Path, help="an ImageFolder root (default: generated)")
    parser.add_argument("--images", type=int, default=64)
    parser.add_argument("--device", default="cpu")
    parser.add_argument("--size", type=int, default=224)
    parser.add_argument("--seeds", type=int, default=4)
    parser.add_argument("--batch-size", type=int, default=32)
    args = parser.parse_args()
    with tempfile.TemporaryDirectory(prefix="fastfeed-pixels-") as folder:
        root = args.data
        if root is None:
            from fastfeed.vision.synthetic import make_imagefolder

            root = make_imagefolder(Path(folder), args.images, classes=4)
        found = distances(args, root)
    print(f"{root if args.data else f'{args.images} generated photo-like JPEGs'}: "
          f"RandomResizedCrop({args.size}), flip, PILToTensor; {args.seeds} seeds; decoded "
          f"on {args.device}\n")
    print("| route | mean (grey levels) | worst image's mean | worst pixel |\n|---|---|---|---|")
    for route, differences in found.items():
        means = torch.stack([d.mean() for d in differences])
        total = sum(float(d.sum()) for d in differences) / sum(d.numel() for d in differences)
        worst = max(float(d.max()) for d in differences)
        print(f"| {route} | {total:.2f} | {float(means.max()):.2f} | {worst:.0f} |")


if __name__ == "__main__":
    main()
