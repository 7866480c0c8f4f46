"""Short epochs against long ones, in the same run (issue 24: "short epochs no worse than long").

The pipeline of ``accelerate_efficiency.py`` (torchvision's ImageNet train transforms through
``fastfeed.vision.accelerate``, float batches of 64, 2 persistent workers) and the stock
``DataLoader`` with torchvision's own transforms, over one set of 2000 JPEGs (larger than the
CPU caches). Long epochs shuffle the whole set; short epochs draw ``--short`` random images
each (``RandomSampler(num_samples=320)``: 5 batches), so that the epoch's length is the only
difference. The four configurations alternate in fresh processes; each runs one warm-up
epoch, then ``--epochs`` timed ones. The table gives medians and each row's ratio to stock on
the same epochs; the last lines compare short with long, as a ratio to stock and in images/s.

    .venv-clients/bin/python benchmarks/short_epochs.py --repeats 5
"""

from __future__ import annotations

import json
import os
import statistics
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from benchmarks.accelerate_efficiency import epochs_per_s
from benchmarks.interleaved import interleaved_rates, pipeline_parser

LOADERS = ("stock", "fastfeed-2w")


def main() -> None:
    parser = pipeline_parser(__doc__, LOADERS, batch_size=64)
    parser.add_argument("--images", type=int, default=2000)
    parser.add_argument("--short", type=int, default=320, help="images in a short epoch")
    args = parser.parse_args()

    from fastfeed.bench.data import CACHE
    from fastfeed.vision.synthetic import make_imagefolder

    root = CACHE / f"imagenet-like-{args.images}"
    if args.one:
        loader, length = args.one.split("@")
        rates = epochs_per_s(loader, root, args.batch_size, args.epochs,
                             epoch_samples=args.short if length == "short" else None)
        print(json.dumps(rates))
        return
    if not root.exists():
        make_imagefolder(root, args.images, classes=50)
    configs = [f"{loader}@{length}" for length in ("short", "long")
               for loader in args.configs.split(",")]
    load_before = os.getloadavg()
    rates = interleaved_rates(__file__, configs, args.repeats,
                              ["--images", str(args.images), "--short", str(args.short),
                               "--batch-size", str(args.batch_size), "--epochs", str(args.epochs)],
                              desc="short epochs")
    medians = {c: statistics.median(r) for c, r in rates.items()}

    print(f"{root.name}, short epochs of {args.short} images, long ones of {args.images}: batch "
          f"{args.batch_size}, median of {args.repeats} runs × {args.epochs} timed epochs")
    print("| loader | epochs | images/s | min–max | vs stock |\n|---|---|---|---|---|")
    ratio = {}
    for config, median in medians.items():
        loader, length = config.split("@")
        ratio[config] = median / medians[f"stock@{length}"]
        print(f"| {loader} | {length} | {median:,.0f} | {min(rates[config]):,.0f}–"
              f"{max(rates[config]):,.0f} | {ratio[config]:.2f}× |")
    stock_kept = medians["stock@short"] / medians["stock@long"]
    for loader in args.configs.split(","):
        if loader == "stock":
            continue
        short, long = f"{loader}@short", f"{loader}@long"
        print(f"{loader}: short epochs {ratio[short]:.2f}× stock, long {ratio[long]:.2f}× "
              f"({ratio[short] / ratio[long]:.0%} of the long ratio); short epochs run at "
              f"{medians[short] / medians[long]:.0%} of the long epochs' images/s "
              f"(stock: {stock_kept:.0%})")
    if args.json is not None:
        args.json.parent.mkdir(parents=True, exist_ok=True)
        args.json.write_text(json.dumps({"rates": rates, "medians": medians}, indent=2))
    print(f"load average (1 min) {load_before[0]:.1f} before, {os.getloadavg()[0]:.1f} after, "
          f"on {os.cpu_count()} cores")


if __name__ == "__main__":
    main()
