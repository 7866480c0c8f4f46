"""A user's own torchvision training pipeline under the stock DataLoader and fastfeed.

The dataset is torchvision's ``ImageFolder`` with the classic ImageNet train transforms
(RandomResizedCrop(224), RandomHorizontalFlip, ToTensor, Normalize), batch 64, shuffled,
persistent workers: what ``examples/train_resnet.py``-style scripts use. Configurations:

- ``stock``: ``torch.utils.data.DataLoader``.
- ``swap``: ``FastLoader`` with the same arguments (the one-import change).
- ``accelerate``: ``FastLoader`` over ``fastfeed.vision.accelerate(dataset)``.
- ``accelerate-threads``: the same with ``worker_mode="thread"``.
- ``swap-auto``: the swap with ``num_workers="auto", worker_mode="auto"`` (not in the default
  set; ``--configs stock,swap,swap-auto``).
- Peers, each in its own documented best way with ``--workers`` threads, the same JPEGs and
  the same output (normalised float32 N×3×224×224), see ``fastfeed/bench/peers.py``:
  ``dali-cpu`` (NVIDIA DALI's ResNet-50 recipe on CPU operators), ``spdl`` (SPDL's thread
  pipeline, FFmpeg decode), ``ffcv`` and ``ffcv-nchw`` (FFCV from a full-size ``.beton``; its
  default channels-last view, and contiguous NCHW). A peer that is not installed is left out
  with a note saying so. Peers run in ``--peers-python`` (default ``.venv-peers/bin/python``
  when it exists), since FFCV needs its own environment; install them there, never as
  fastfeed dependencies::

      python -m venv --system-site-packages .venv-peers   # sees the main env's torch
      .venv-peers/bin/pip install nvidia-dali-cuda120 spdl==0.8.0
      apt-get install pkg-config libturbojpeg0-dev libopencv-dev \\
          libavdevice59 libavfilter8 libavformat59 libavcodec59 libswscale6
      .venv-peers/bin/pip install ffcv==1.0.2

Each run is a fresh process that builds the loader, runs one warm-up epoch, then times
``--epochs`` epochs; configurations alternate order from repeat to repeat; the table gives the
median images/s over every timed epoch of every repeat, and the ratio to ``stock``; then the
spread of each row, fastfeed's best row against the best peer, and the load average (the
machine's business) before and after.
Needs torchvision. The data (``--images`` ImageNet-like JPEGs, about 500×375, q90, 18 KB each)
is generated on first use and never committed.

    .venv-clients/bin/python benchmarks/torchvision_pipeline.py --images 600 \\
        --json benchmarks/out/torchvision.json
"""

from __future__ import annotations

import json
import os
import statistics
import subprocess
import sys
import time
from collections.abc import Iterable
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from benchmarks.interleaved import interleaved_rates, pipeline_parser, print_ratio_table

ROOT = Path(__file__).resolve().parents[1]
FASTFEED_CONFIGS = ("stock", "swap", "accelerate", "accelerate-threads")
PEER_CONFIGS = ("dali-cpu", "spdl", "ffcv", "ffcv-nchw", "dataloader-rs", "dataloader-rs-deep",
                "dataloader-rs-items2")
CONFIGS = FASTFEED_CONFIGS + PEER_CONFIGS
EXTRA_CONFIGS = ("swap-auto",)


def epochs_per_s(config: str, root: Path, workers: int, batch_size: int, epochs: int
                 ) -> list[float]:
    """Images/s of each timed epoch of one configuration (run in this process)."""
    from torch.utils.data import DataLoader

    from fastfeed import FastLoader

    loader: Any
    if config in PEER_CONFIGS:
        from fastfeed.bench.peers import build_peer

        loader = build_peer(config, root, batch_size, threads=workers)
        return timed_epochs(loader, epochs)

    from fastfeed.bench.data import classic_imagefolder

    dataset = classic_imagefolder(root, accelerated=config.startswith("accelerate"))
    kwargs = {"batch_size": batch_size, "shuffle": True, "num_workers": workers,
              "persistent_workers": True}
    if config == "stock":
        loader = DataLoader(dataset, **kwargs)
    elif config == "swap-auto":
        loader = FastLoader(dataset, **{**kwargs, "num_workers": "auto"}, worker_mode="auto")
    else:
        mode = "thread" if config.endswith("threads") else "process"
        loader = FastLoader(dataset, worker_mode=mode, **kwargs)
    return timed_epochs(loader, epochs)


def timed_epochs(loader: Iterable[Any], epochs: int) -> list[float]:
    """Images/s of ``epochs`` epochs after a warm-up one (it starts workers, compiles)."""
    rates = []
    for epoch in range(epochs + 1):
        start, images = time.perf_counter(), 0
        for batch, _ in loader:
            images += len(batch)
        if epoch:  # the first epoch starts the workers: a warm-up
            rates.append(images / (time.perf_counter() - start))
    return rates


def peer_notes(python: str, peers: list[str]) -> dict[str, str | None]:
    """Per peer, None when it works in ``python``, else a note saying it is not installed."""
    if not Path(python).exists():
        return {p: f"{p}: not installed (no {python}; see this script's docstring)"
                for p in peers}
    probe = ("import json, sys; from fastfeed.bench.peers import PEERS; "
             "print(json.dumps({p: PEERS[p].missing() for p in sys.argv[1:]}))")
    out = subprocess.run([python, "-c", probe, *peers], capture_output=True, text=True,
                         cwd=ROOT, check=False)
    if out.returncode:
        last = (out.stderr.strip().splitlines() or ["no output"])[-1]
        return {p: f"{p}: not installed ({python} failed: {last})" for p in peers}
    return json.loads(out.stdout.strip().splitlines()[-1])


def print_against_peers(rates: dict[str, list[float]]) -> None:
    """Each row's spread, and fastfeed's best row against the best peer, both medians."""
    print("\n| loader | median | min–max |\n|---|---|---|")
    for config, values in rates.items():
        print(f"| {config} | {statistics.median(values):,.0f} | "
              f"{min(values):,.0f}–{max(values):,.0f} |")
    medians = {c: statistics.median(v) for c, v in rates.items()}
    ours = {c: m for c, m in medians.items() if c in FASTFEED_CONFIGS and c != "stock"}
    peers = {c: m for c, m in medians.items() if c in PEER_CONFIGS}
    if ours and peers:
        best, peer = max(ours, key=ours.__getitem__), max(peers, key=peers.__getitem__)
        print(f"\nfastfeed ({best}) against the best peer ({peer}): "
              f"**{ours[best] / peers[peer]:.2f}×**")


def main() -> None:
    parser = pipeline_parser(__doc__, CONFIGS, batch_size=64)
    parser.add_argument("--data", type=Path, default=None,
                        help="an ImageFolder (default: generate --images into the cache)")
    parser.add_argument("--images", type=int, default=2000)
    parser.add_argument("--peers-python", default=str(ROOT / ".venv-peers" / "bin" / "python"),
                        help="the interpreter that runs the peers (DALI, SPDL, FFCV)")
    args = parser.parse_args()

    if args.one:
        print(json.dumps(epochs_per_s(args.one, args.data, args.workers, args.batch_size,
                                      args.epochs)))
        return

    from fastfeed.bench.data import CACHE
    from fastfeed.vision.synthetic import make_imagefolder

    root = args.data
    if root is None:
        root = CACHE / f"imagenet-like-{args.images}"
        if not root.exists():
            make_imagefolder(root, args.images, classes=50)
    configs = args.configs.split(",")
    notes = peer_notes(args.peers_python, [c for c in configs if c in PEER_CONFIGS])
    for note in filter(None, notes.values()):
        print(note)
    configs = [c for c in configs if not notes.get(c)]
    load_before = os.getloadavg()
    rates = interleaved_rates(
        __file__, configs, args.repeats,
        ["--data", str(root), "--workers", str(args.workers), "--batch-size",
         str(args.batch_size), "--epochs", str(args.epochs)], desc="torchvision pipeline",
        python=lambda c: args.peers_python if c in PEER_CONFIGS else sys.executable)
    load_after = os.getloadavg()
    title = (f"torchvision ImageFolder + classic transforms, {root.name}: batch "
             f"{args.batch_size}, {args.workers} workers or threads, median of "
             f"{args.repeats} runs × {args.epochs} epochs")
    print_ratio_table(title, rates, json_path=args.json)
    print_against_peers(rates)
    print(f"\nload average (1 min) {load_before[0]:.1f} before, {load_after[0]:.1f} after, "
          f"on {os.cpu_count()} cores")


if __name__ == "__main__":
    main()
