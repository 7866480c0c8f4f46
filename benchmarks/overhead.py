"""Pipeline overhead: the stock DataLoader against FastLoader on fixed-size samples.

Two datasets, so that what is measured is the loader itself (collation, moving batches
between processes, handing them over) and not decoding:

- hot (a diagnostic): 16 pre-made 3×224×224 tensors, cycled: 2.4 MB that sit in the caches.
- cold (``--cold``, the headline): ``--cold-gb`` of stored uint8 3×224×224 samples (3 GB by
  default, far larger than the caches), shuffled, persistent workers; beside the loaders, the
  same run measures the bound: batches/s of gathering random samples with ``torch.stack`` in
  two processes of one thread each, and in one process with one thread per core, into one
  reused output tensor and, as a loader must, into as many outputs as its slot pool has slots;
  and the same rotating gathers with fastfeed's own kernel, which writes a batch larger than
  most of the L3 with non-temporal stores (the bound a loader that collates with it meets).

The consumer reads one byte of every 4 KiB page of each batch, as a host-to-device copy would
touch every page.

Each measurement runs in its own process (clean peak RSS), the two loaders interleaved, and
the medians of ``--repeats`` runs are reported as a ratio. On a GPU, the script also measures
host-to-device bandwidth from the slot pool against the pinned cudaMemcpy peak.

    python benchmarks/overhead.py                  # the RESULTS.md table
    python benchmarks/overhead.py --quick          # a fast smoke run
    python benchmarks/overhead.py --cold           # stored samples larger than the caches
    python benchmarks/overhead.py --cold --profile # main-process CPU, worker time per batch
    # beside dataloader-rs, on Python 3.13 (fastfeed/bench/peers.py says how to install it):
    .venv-peers313/bin/python benchmarks/overhead.py --cold --loaders \
        stock,fastfeed,fastfeed-threads,dataloader-rs,dataloader-rs-deep,dataloader-rs-items2
"""

from __future__ import annotations

import argparse
import json
import os
import resource
import statistics
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import numpy as np
import torch
from torch.utils.data import DataLoader, Dataset

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from fastfeed import FastLoader
from fastfeed._stack import stack_into
from fastfeed.progress import progress

DTYPES = {"uint8": torch.uint8, "float32": torch.float32}
# dataloader-rs (a Rust-core loader with worker threads, Python >= 3.13) with its defaults,
# and with its two settings for more work in flight on the same threads.
DATALOADER_RS = {"dataloader-rs": {}, "dataloader-rs-deep": {"prefetch_depth": 8},
                 "dataloader-rs-items2": {"items_in_parallel": 2}}
LOADERS = ("stock", "fastfeed", "fastfeed-threads", *DATALOADER_RS)
PAGE = 4096


class FixedSamples(Dataset):
    """Cheap to index: returns one of 16 pre-made samples."""

    def __init__(self, dtype: torch.dtype, length: int = 1_000_000) -> None:
        g = torch.Generator().manual_seed(0)
        self.samples = [(torch.rand(3, 224, 224, generator=g) * 255).to(dtype) for _ in range(16)]
        self.length = length

    def __len__(self) -> int:
        return self.length

    def __getitem__(self, i: int) -> torch.Tensor:
        return self.samples[i % 16]


class StoredSamples(Dataset):
    """``n`` distinct stored samples in one tensor: each read comes from memory, not cache."""

    def __init__(self, gigabytes: float) -> None:
        n = int(gigabytes * 1e9) // (3 * 224 * 224)
        self.data = torch.empty((n, 3, 224, 224), dtype=torch.uint8)
        self.data.view(n, -1)[:, ::PAGE] = torch.arange(n, dtype=torch.uint8).view(n, 1)
        self.data.fill_(7)  # fault every page in now, not during the timed batches

    def __len__(self) -> int:
        return len(self.data)

    def __getitem__(self, i: int) -> torch.Tensor:
        return self.data[i]


def build_loader(name: str, dataset: Dataset, batch_size: int, workers: int,
                 **kwargs: bool) -> Any:
    """Loader ``name`` (one of :data:`LOADERS`) over ``dataset``, each with ``workers``
    processes or threads."""
    if name == "stock":
        return DataLoader(dataset, batch_size=batch_size, num_workers=workers, **kwargs)
    if name.startswith("fastfeed"):
        mode = "thread" if name.endswith("threads") else "process"
        return FastLoader(dataset, batch_size=batch_size, num_workers=workers, worker_mode=mode,
                          **kwargs)
    import dataloader_rs
    from torch.utils.data import default_collate

    class Samples(dataloader_rs.PyDataset):
        def __len__(self) -> int:
            return len(dataset)  # type: ignore[arg-type]

        def __getitem__(self, index: int) -> Any:
            return dataset[index]

    # Its threads live as long as the loader: persistent_workers has nothing to change.
    return dataloader_rs.PyDataloader(Samples(), batch_size=batch_size, num_workers=workers,
                                      shuffle=kwargs.get("shuffle", False),
                                      collate_fn=default_collate, **DATALOADER_RS[name])


def touch(batch: torch.Tensor) -> int:
    flat = batch.view(-1).view(torch.uint8)
    return int(flat[::PAGE].sum())


def endless(loader: DataLoader):
    while True:
        yield from loader


def measure_one(loader_name: str, dtype: str, batch_size: int, workers: int, batches: int,
                cold_gb: float = 0.0) -> dict:
    """Batches/s of one loader in this process, after a warm-up."""
    if cold_gb:
        dataset: Dataset = StoredSamples(cold_gb)
        kwargs = {"shuffle": True, "persistent_workers": True}
    else:
        dataset, kwargs = FixedSamples(DTYPES[dtype]), {}
    loader = build_loader(loader_name, dataset, batch_size, workers, **kwargs)
    iterator = endless(loader)
    for _ in range(5 if not cold_gb else 20):
        touch(next(iterator))
    start = time.perf_counter()
    for _ in range(batches):
        touch(next(iterator))
    elapsed = time.perf_counter() - start
    ring_mb = loader.stats().slot_mb if isinstance(loader, FastLoader) else 0.0
    del iterator
    return {
        "batches_per_s": batches / elapsed,
        "peak_rss_mb": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024,
        "ring_mb": ring_mb,
    }


def _gather_rate(data: torch.Tensor, batch_size: int, batches: int, seed: int,
                 destinations: int = 1, fastfeeds: bool = False) -> float:
    """Batches/s of random gathers into ``destinations`` output tensors taken in turn, with
    ``torch.stack`` or (``fastfeeds``) fastfeed's gather kernel."""
    outs = [torch.empty((batch_size, *data.shape[1:]), dtype=data.dtype)
            for _ in range(destinations)]
    g = torch.Generator().manual_seed(seed)
    start = time.perf_counter()
    for k in range(batches):
        picks = torch.randint(0, len(data), (batch_size,), generator=g).tolist()
        samples = [data[i] for i in picks]
        if fastfeeds:
            stack_into(outs[k % destinations], samples, threads=torch.get_num_threads())
        else:
            torch.stack(samples, out=outs[k % destinations])
    return batches / (time.perf_counter() - start)


def gather_bound(cold_gb: float, batch_size: int, batches: int, destinations: int) -> dict:
    """Batches/s of random gathers from the stored samples alone: two processes with one
    thread each (forked before this process used torch's thread pool), and this process with
    one thread per core. Each into one reused output tensor (the issue's bound), and into
    ``destinations`` outputs taken in turn, as a loader must hand out distinct batches
    (``_rotating``: the destination is no longer in the cache when it is written again)."""
    import multiprocessing as mp

    data = StoredSamples(cold_gb).data
    ctx = mp.get_context("fork")
    rates = ctx.Queue()

    def one_thread(seed: int) -> None:
        torch.set_num_threads(1)
        rates.put((_gather_rate(data, batch_size, batches, seed),
                   _gather_rate(data, batch_size, batches, seed, destinations),
                   _gather_rate(data, batch_size, batches, seed, destinations, fastfeeds=True)))

    procs = [ctx.Process(target=one_thread, args=(seed,)) for seed in range(2)]
    for proc in procs:
        proc.start()
    triples = [rates.get() for _ in procs]
    for proc in procs:
        proc.join()
    torch.set_num_threads(os.cpu_count() or 1)
    return {"two_processes": sum(t[0] for t in triples),
            "two_processes_rotating": sum(t[1] for t in triples),
            "two_processes_fastfeed_gather": sum(t[2] for t in triples),
            "one_process": _gather_rate(data, batch_size, batches, seed=2),
            "one_process_rotating": _gather_rate(data, batch_size, batches, 2, destinations),
            "one_process_fastfeed_gather": _gather_rate(data, batch_size, batches, 2,
                                                        destinations, fastfeeds=True)}


def memcpy_bound(nbytes: int, repeats: int = 10) -> float:
    """GB/s of one np.copyto of ``nbytes`` into a pre-faulted buffer (median)."""
    src = np.ones(nbytes, dtype=np.uint8)
    dst = np.zeros(nbytes, dtype=np.uint8)
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        np.copyto(dst, src)
        times.append(time.perf_counter() - start)
    return nbytes / statistics.median(times) / 1e9


def h2d_figures(batch_size: int, repeats: int = 5) -> dict:
    """On a GPU: H2D GB/s from the slot pool against a pinned cudaMemcpy of the same size."""
    nbytes = batch_size * 3 * 224 * 224
    device = torch.device("cuda")
    pinned = torch.empty(nbytes, dtype=torch.uint8, pin_memory=True)
    dst = torch.empty(nbytes, dtype=torch.uint8, device=device)

    def copy_seconds(src: torch.Tensor) -> float:
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        dst.copy_(src.view(-1).view(torch.uint8), non_blocking=True)
        end.record()
        end.synchronize()
        return start.elapsed_time(end) / 1e3

    for _ in range(3):
        copy_seconds(pinned)
    peak = nbytes / statistics.median(copy_seconds(pinned) for _ in range(repeats * 4)) / 1e9
    loader = FastLoader(FixedSamples(torch.uint8), batch_size=batch_size, num_workers=2,
                        pin_memory=True, persistent_workers=True)
    ring_rates = []
    for i, batch in enumerate(loader):
        if i >= 5:  # the slot pool learns the batch size on the first batches
            assert batch.is_pinned(), "ring batch is not page-locked"
            ring_rates.append(nbytes / copy_seconds(batch) / 1e9)
        if len(ring_rates) == repeats * 4:
            break
    ring = statistics.median(ring_rates)
    return {"pinned_peak_gbs": peak, "ring_gbs": ring, "ring_pct_of_peak": 100 * ring / peak}


def run_child(args: list[str]) -> dict:
    """One measurement in a fresh process. A child that printed its figures and then failed
    to exit (a loader whose threads abort the interpreter's shutdown) keeps its figures, with
    its exit code."""
    out = subprocess.run([sys.executable, __file__, "--child", *args], capture_output=True,
                         text=True, check=False)
    lines = out.stdout.strip().splitlines()
    if not lines or not lines[-1].startswith("{"):
        raise RuntimeError(f"{args[0]} exited {out.returncode}: {out.stderr[-2000:]}")
    return {**json.loads(lines[-1]), "exit_code": out.returncode}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--dtypes", nargs="+", default=["uint8", "float32"], choices=DTYPES)
    parser.add_argument("--batch-sizes", nargs="+", type=int, default=[64, 128, 256])
    parser.add_argument("--workers", type=int, default=2)
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--samples", type=int, default=8192,
                        help="samples timed per run (batches = samples / batch size)")
    parser.add_argument("--quick", action="store_true", help="1 dtype, 1 batch size, 2 repeats")
    parser.add_argument("--json", type=Path, help="also write the raw figures here")
    parser.add_argument("--cold", action="store_true",
                        help="stored samples larger than the caches, against the gather bound")
    parser.add_argument("--cold-gb", type=float, default=3.0)
    parser.add_argument("--cold-batches", type=int, default=300,
                        help="timed batches per cold run (after 20 untimed); more smooths a "
                             "noisy machine")
    parser.add_argument("--loaders", default="stock,fastfeed",
                        help=f"with --cold: which, comma-separated, of {', '.join(LOADERS)}")
    parser.add_argument("--profile", action="store_true",
                        help="with --cold: where FastLoader's time goes, one run per repeat")
    parser.add_argument("--child", nargs=6, help=argparse.SUPPRESS)
    args = parser.parse_args()

    if args.child:
        name, dtype, bs, workers, batches, cold_gb = args.child
        if name == "bound":
            # as many outputs as FastLoader's ring holds: prefetch_factor (2) × workers + 2
            slots = 2 * int(workers) + 2
            print(json.dumps(gather_bound(float(cold_gb), int(bs), int(batches), slots)))
        else:
            print(json.dumps(measure_one(name, dtype, int(bs), int(workers), int(batches),
                                         float(cold_gb))))
        return
    if args.cold and args.profile:
        bs = 128 if args.batch_sizes == [64, 128, 256] else args.batch_sizes[0]
        for _ in range(args.repeats):
            print(profile_cold(args.cold_gb, bs, args.workers))
        return
    if args.cold:
        cold_main(args)
        return
    if args.quick:
        args.dtypes, args.batch_sizes, args.repeats, args.samples = ["uint8"], [128], 2, 2048

    configs = [(d, bs) for d in args.dtypes for bs in args.batch_sizes]
    jobs = [(c, r, name) for c in configs for r in range(args.repeats)
            for name in (("stock", "fastfeed") if r % 2 == 0 else ("fastfeed", "stock"))]
    raw: dict[tuple, dict[str, list[dict]]] = {c: {"stock": [], "fastfeed": []} for c in configs}
    for (dtype, bs), _, name in progress(jobs, total=len(jobs), desc="runs"):
        batches = max(10, args.samples // bs)
        raw[(dtype, bs)][name].append(
            run_child([name, dtype, str(bs), str(args.workers), str(batches), "0"]))

    rows = []
    for (dtype, bs), runs in raw.items():
        batch_bytes = bs * 3 * 224 * 224 * DTYPES[dtype].itemsize
        bound = memcpy_bound(batch_bytes)
        med = {name: statistics.median(r["batches_per_s"] for r in runs[name]) for name in runs}
        rss = {name: statistics.median(r["peak_rss_mb"] for r in runs[name]) for name in runs}
        fast_gbs = med["fastfeed"] * batch_bytes / 1e9
        rows.append({
            "dtype": dtype, "batch_size": bs, "batch_mb": batch_bytes / 1e6,
            "stock_batches_s": med["stock"], "fastfeed_batches_s": med["fastfeed"],
            "ratio": med["fastfeed"] / med["stock"],
            "fastfeed_gbs": fast_gbs, "memcpy_gbs": bound, "pct_of_memcpy": 100 * fast_gbs / bound,
            "stock_peak_rss_mb": rss["stock"], "fastfeed_peak_rss_mb": rss["fastfeed"],
            "ring_mb": statistics.median(r["ring_mb"] for r in runs["fastfeed"]),
        })

    print(f"\n{args.workers} workers, {args.repeats} interleaved runs each, medians\n")
    print("| dtype | batch | MB/batch | stock batches/s | fastfeed batches/s | ratio "
          "| fastfeed GB/s | % of memcpy | peak RSS stock / fastfeed (ring) MB |")
    print("|---|---|---|---|---|---|---|---|---|")
    for r in rows:
        print(f"| {r['dtype']} | {r['batch_size']} | {r['batch_mb']:.1f} "
              f"| {r['stock_batches_s']:.1f} | {r['fastfeed_batches_s']:.1f} "
              f"| **{r['ratio']:.2f}×** | {r['fastfeed_gbs']:.1f} | {r['pct_of_memcpy']:.0f} % "
              f"| {r['stock_peak_rss_mb']:.0f} / {r['fastfeed_peak_rss_mb']:.0f} "
              f"({r['ring_mb']:.0f}) |")
    result: dict = {"rows": rows}
    if torch.cuda.is_available():
        result["h2d"] = h2d_figures(max(args.batch_sizes))
        h = result["h2d"]
        print(f"\nH2D on {torch.cuda.get_device_name()}: ring {h['ring_gbs']:.1f} GB/s, pinned "
              f"peak {h['pinned_peak_gbs']:.1f} GB/s ({h['ring_pct_of_peak']:.0f} %)")
    if args.json:
        args.json.write_text(json.dumps(result, indent=2))


def profile_cold(cold_gb: float, batch_size: int, workers: int, batches: int = 300) -> str:
    """Where FastLoader's time goes on the cold data, in this process: the main process's CPU
    share (and the part the consumer's page touching takes), worker utilisation, and the
    workers' fetch and collate time per batch (``stats()``)."""
    loader = FastLoader(StoredSamples(cold_gb), batch_size=batch_size, num_workers=workers,
                        shuffle=True, persistent_workers=True)
    iterator = endless(loader)
    for _ in range(20):
        touch(next(iterator))
    loader.stats(reset=True)
    cpu, start, touching = time.process_time(), time.perf_counter(), 0.0
    for _ in range(batches):
        batch = next(iterator)
        touched = time.perf_counter()
        touch(batch)
        touching += time.perf_counter() - touched
    wall = time.perf_counter() - start
    main_cpu = (time.process_time() - cpu) / wall
    stats = loader.stats()
    del iterator, batch
    return (f"{batches / wall:.0f} batches/s; main process {main_cpu:.0%} of a core "
            f"({touching / wall:.0%} touching pages); workers {stats.worker_utilization:.0%} "
            f"busy; per batch: fetch {stats.stage_ms['fetch']:.2f} ms, collate "
            f"{stats.stage_ms['collate']:.2f} ms")


def cold_main(args: argparse.Namespace) -> None:
    """The cold rows: each of ``--loaders`` and the gather bound, interleaved, in fresh
    processes."""
    bs = 128 if args.batch_sizes == [64, 128, 256] else args.batch_sizes[0]
    batches = args.cold_batches
    loaders = args.loaders.split(",")
    names = (*loaders, "bound")
    jobs = [n for r in range(args.repeats) for n in (names if r % 2 == 0 else names[::-1])]
    runs: dict[str, list[dict]] = {n: [] for n in names}
    for name in progress(jobs, total=len(jobs), desc="cold runs"):
        runs[name].append(run_child([name, "uint8", str(bs), str(args.workers), str(batches),
                                     str(args.cold_gb)]))
    med = {n: statistics.median(r["batches_per_s"] for r in runs[n]) for n in loaders}
    rss = {n: statistics.median(r["peak_rss_mb"] for r in runs[n]) for n in loaders}
    bounds = {k: statistics.median(r[k] for r in runs["bound"]) for k in runs["bound"][0]}
    best = max(bounds["two_processes"], bounds["one_process"])
    best_rotating = max(bounds["two_processes_rotating"], bounds["one_process_rotating"])
    best_fastfeed = max(bounds["two_processes_fastfeed_gather"],
                        bounds["one_process_fastfeed_gather"])
    print(f"\ncold: {args.cold_gb:g} GB of stored uint8 3×224×224 samples, shuffled, batch "
          f"{bs}, {args.workers} workers (processes or threads), persistent; {batches} timed "
          f"batches a run, medians of {args.repeats} interleaved runs; Python "
          f"{sys.version.split()[0]}, torch {torch.__version__}, {os.cpu_count()} cores\n")
    print(f"bound: 2 processes × 1 thread {bounds['two_processes']:.0f}, 1 process × all cores "
          f"{bounds['one_process']:.0f} batches/s; with rotating outputs (as many as a slot "
          f"pool) {bounds['two_processes_rotating']:.0f} / {bounds['one_process_rotating']:.0f}; "
          f"rotating, with fastfeed's gather {bounds['two_processes_fastfeed_gather']:.0f} / "
          f"{bounds['one_process_fastfeed_gather']:.0f}\n")
    print("| loader | batches/s | / stock | % of best bound | % of best rotating bound "
          "| % of fastfeed's gather bound | peak RSS MB |")
    print("|---|---|---|---|---|---|---|")
    for name in loaders:
        ratio = f"**{med[name] / med['stock']:.2f}×**" if "stock" in med else "n/a"
        print(f"| {name} | {med[name]:.0f} | {ratio} | {100 * med[name] / best:.0f} % "
              f"| {100 * med[name] / best_rotating:.0f} % "
              f"| {100 * med[name] / best_fastfeed:.0f} % | {rss[name]:.0f} |")
    for name in loaders:
        failed = sorted({r["exit_code"] for r in runs[name] if r["exit_code"]})
        if failed:
            print(f"\n{name}: the child exited with {failed} after reporting its figures "
                  f"({sum(bool(r['exit_code']) for r in runs[name])} of {len(runs[name])} "
                  f"runs; a negative code is the signal that ended it)")
    if args.json:
        args.json.parent.mkdir(parents=True, exist_ok=True)
        args.json.write_text(json.dumps({"cold": runs, "medians": med, "bounds": bounds},
                                        indent=2))


if __name__ == "__main__":
    main()
