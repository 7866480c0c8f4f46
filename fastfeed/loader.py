"""``FastLoader``: a ``torch.utils.data.DataLoader`` that feeds the GPU."""

from __future__ import annotations

import inspect
import warnings
import weakref
from collections.abc import Callable, Iterable
from functools import partial
from typing import Any

import torch
from torch.utils.data import DataLoader, Dataset, Sampler

from fastfeed._torch_compat import (
    DATALOADER_RUNTIME,
    drop_persistent_iterator,
    is_datapipe,
    persistent_iterator,
    torch_iterator,
)
from fastfeed.arguments import check_arguments, cores_warning_muted
from fastfeed.backends import backends_for
from fastfeed.device import DeviceStage, check_device
from fastfeed.iterators import SingleProcessIterator, WorkerPoolIterator
from fastfeed.planning import EpochPlan, LoaderOptions, Planner
from fastfeed.resume import EpochStart, LoaderState, RandomSources
from fastfeed.stats import LoaderStats
from fastfeed.telemetry import Telemetry

__all__ = ["OWN_OPTIONS", "FastLoader"]


def _summary(loader_ref: weakref.ref[FastLoader]) -> str:
    loader = loader_ref()
    return "" if loader is None else loader.stats().summary()


class FastLoader(DataLoader):
    r"""A drop-in replacement for :class:`torch.utils.data.DataLoader`.

    ``FastLoader`` *is a* ``DataLoader``: it accepts the same arguments with the same defaults,
    validates them with the same errors, exposes the same attributes, and yields the same
    batches in the same order for the same seed. Frameworks that check
    ``isinstance(loader, DataLoader)`` or rebuild a loader from its attributes keep working.

    With ``num_workers > 0`` it uses its own worker pool. Workers collate each batch directly
    into a slot of a pool of shared-memory slots and send only a small message; the main process
    rebuilds the batch as tensors that are views of that slot. A slot returns to the slot pool only
    when nothing references the batch any more. When every slot is in use, a worker writes
    its batch into shared memory of its own, freed with the batch: nothing is ever overwritten.

    Args:
        dataset, batch_size, shuffle, sampler, batch_sampler, num_workers, collate_fn,
        pin_memory, drop_last, timeout, worker_init_fn, multiprocessing_context, generator,
        prefetch_factor, persistent_workers, pin_memory_device, in_order: as in
            :class:`torch.utils.data.DataLoader`.
        ring_slots (int, optional): how many shared-memory slots (the slot pool; the name is
            historical) the workers may collate into. ``None``
            (default) allocates ``prefetch_factor * num_workers + 2``: enough for every
            in-flight task, the batch being returned and the one the training loop still
            holds (plus ``prefetch_depth + 1`` with ``device``). ``0`` disables the slot pool.
            Memory is about ``ring_slots`` times the size of one batch's tensors (plus 25 %
            headroom once batch sizes vary).
        device (str or torch.device, optional): deliver batches on this device. With CUDA,
            every tensor of a batch is copied ``non_blocking`` from its page-locked pool slot
            on a side stream created once per loader, ``prefetch_depth`` batches ahead; the
            consumer's current stream waits on the copy. A bare ``"cuda"`` means, at the
            first iteration: the only GPU the process sees; else the one the script chose
            with ``torch.cuda.set_device`` (any but 0); else ``LOCAL_RANK``'s (torchrun);
            else GPU 0. ``"cpu"`` runs the same path without streams. Default: ``None``
            (batches stay on the host).
        prefetch_depth (int): batches copied ahead of the consumer. Default: ``2``.
        gpu_transform (callable, optional): applied to each batch on the device, on the copy
            stream, right after the copy: for example
            ``fastfeed.transforms.Normalize(key=0, dtype=torch.float16)``. Transforms with a
            ``seed`` method are seeded from the iterator's base seed. Requires ``device``.
        num_workers (int or "auto"): as in torch, or ``"auto"``: start from a guess based on
            the CPU affinity mask and memory, then add workers while the consumer waits and a
            core is free, and retire them while it never waits (map-style datasets; an
            IterableDataset keeps the starting count). Decisions are logged at DEBUG and
            listed in :meth:`stats`. Batch order is unchanged; which worker reads a sample
            does change, so per-worker random streams do too: use ``deterministic=True``.
        worker_mode (str): ``"process"`` (default), ``"thread"`` (no IPC or pickling: wins
            when ``__getitem__`` releases the GIL, as PIL decode and numpy do; map-style only;
            threads share the global RNGs and :func:`fastfeed.worker_info` describes them),
            ``"auto"`` (one epoch of each, then the faster) or ``"ray"`` (Ray actors on the
            cluster this process is connected to with ``ray.init``: the same batches, and a
            lost node's tasks run again on a new actor; see ``docs/cluster.md``).
        ray_options (dict, optional): with ``worker_mode="ray"``, where each actor goes and
            what it takes, as Ray's ``.options()``: ``num_cpus`` (default ``1``),
            ``resources`` (for example ``{"cpu_node": 1}``), ``num_gpus``, ``memory``,
            ``scheduling_strategy``, ``label_selector``, ``runtime_env``. With
            ``num_workers="auto"``, workers grow into the cluster's free resources.
        deterministic (bool): reseed ``torch``, ``random`` and ``numpy`` before every sample
            from ``(base seed, epoch, index)``, so that a sample's augmentation does not depend
            on which worker reads it: reproducible under auto-tuning and across resumes.
        log_every (int, optional): log (or print, if logging is not configured) a one-line
            :meth:`stats` summary every ``log_every`` batches.
        share_lists (bool): when process workers start, pack the large lists and tuples of plain
            values (``str``, ``bytes``, ``int``, ``float``, ``bool``, ``None`` and tuples of
            them, 10,000 elements or more, such as ``ImageFolder.samples``) that the dataset
            and the datasets it wraps hold into one shared, read-only copy, which every worker
            reads in their place: a forked worker then never copies them as it reads them,
            and a spawned one is not sent them. The dataset in this process is unchanged;
            persistent workers keep the copy taken as they started, as a fork would. In a
            worker each reads as a sequence that is not a ``list`` (``isinstance`` says so),
            and a worker that changes one gets its own copy at its first change. ``False``:
            the workers read the dataset's own lists. Default: ``True``. See
            ``docs/memory.md``.

    Example:
        >>> from fastfeed import FastLoader as DataLoader
        >>> loader = DataLoader(dataset, batch_size=256, shuffle=True, num_workers=8)
        >>> for images, targets in loader:
        ...     ...
    """

    def __init__(
        self,
        dataset: Dataset,
        batch_size: int | None = 1,
        shuffle: bool | None = None,
        sampler: Sampler | Iterable | None = None,
        batch_sampler: Sampler[list] | Iterable[list] | None = None,
        num_workers: int | str = 0,
        collate_fn: Callable[[list], Any] | None = None,
        pin_memory: bool = False,
        drop_last: bool = False,
        timeout: float = 0,
        worker_init_fn: Callable[[int], None] | None = None,
        multiprocessing_context: Any = None,
        generator: Any = None,
        *,
        prefetch_factor: int | None = None,
        persistent_workers: bool = False,
        pin_memory_device: str = "",
        in_order: bool = True,
        ring_slots: int | None = None,
        device: str | int | torch.device | None = None,
        prefetch_depth: int = 2,
        gpu_transform: Callable[[Any], Any] | None = None,
        worker_mode: str = "process",
        ray_options: dict[str, Any] | None = None,
        deterministic: bool = False,
        log_every: int | None = None,
        share_lists: bool = True,
    ) -> None:
        self._placement = check_arguments(
            dataset=dataset, worker_mode=worker_mode, ray_options=ray_options,
            deterministic=deterministic, log_every=log_every, ring_slots=ring_slots,
            prefetch_depth=prefetch_depth, gpu_transform=gpu_transform, device=device,
            share_lists=share_lists)
        self.autotune = num_workers == "auto"
        self._max_workers = 0  # the tuner's bound, with num_workers="auto"
        if self.autotune:  # this machine's cores, or a cluster's free resources
            backend = backends_for(worker_mode, dataset, deterministic)[0]
            num_workers, self._max_workers = backend.worker_bounds(self._placement)
        elif isinstance(num_workers, str):  # a TypeError, as torch's comparison with 0 raises
            raise TypeError(
                f"num_workers should be a non-negative int or 'auto', got {num_workers!r}")
        self.ring_slots = ring_slots
        # Which GPU a bare "cuda" means is decided at the first iteration, when the training
        # script has set up its device (torch.cuda.set_device, a launcher's environment).
        self.device = None if device is None else check_device(device)
        self.prefetch_depth = prefetch_depth
        self.gpu_transform = gpu_transform
        self.worker_mode = worker_mode
        self.ray_options = ray_options
        self.deterministic = deterministic
        self.log_every = log_every
        self.share_lists = share_lists
        self._init_runtime()
        with cores_warning_muted(worker_mode):
            super().__init__(
                dataset,
                batch_size=batch_size,
                shuffle=shuffle,
                sampler=sampler,
                batch_sampler=batch_sampler,
                num_workers=num_workers,
                collate_fn=collate_fn,
                pin_memory=pin_memory,
                drop_last=drop_last,
                timeout=timeout,
                worker_init_fn=worker_init_fn,
                multiprocessing_context=multiprocessing_context,
                generator=generator,
                prefetch_factor=prefetch_factor,
                persistent_workers=persistent_workers,
                pin_memory_device=pin_memory_device,
                in_order=in_order,
            )

    def _init_runtime(self) -> None:
        """State a loader builds for itself, never copied: not by pickling (``ddp_spawn``,
        ``copy.deepcopy``), nor by frameworks that rebuild a loader from ``vars(loader)``
        (they skip private attributes)."""
        # A weak reference: a loader<->telemetry cycle would leave persistent workers to the
        # garbage collector, which may run their shutdown in any thread.
        self._telemetry = Telemetry(self.log_every,
                                    describe=partial(_summary, weakref.ref(self)))
        self._device_stage = DeviceStage(self._telemetry)
        self._planner = Planner(self._telemetry, self._device_stage)
        self._starting_plan: EpochPlan | None = None  # see __iter__
        self._live_iterator: Callable[[], Any] = lambda: None

    def __setattr__(self, name: str, value: Any) -> None:
        # A count set by hand replaces the tuner's. Subclasses may set num_workers before
        # calling __init__ (litdata's StreamingDataLoader does), when there is no tuner yet.
        planner = self.__dict__.get("_planner")
        if name == "num_workers" and planner is not None:
            planner.carry_over.workers = None
        super().__setattr__(name, value)

    def __getstate__(self) -> dict[str, Any]:
        state = self.__dict__
        runtime = ("_telemetry", "_device_stage", "_planner", "_starting_plan", "_live_iterator",
                   *DATALOADER_RUNTIME)
        return {k: v for k, v in state.items() if k not in runtime}

    def __setstate__(self, state: dict[str, Any]) -> None:
        self.__dict__.update(state)
        drop_persistent_iterator(self)
        self._init_runtime()

    def _sync_tuned_workers(self) -> None:
        """With ``num_workers="auto"``, ``num_workers`` follows the tuner between epochs."""
        tuned = self._planner.carry_over.workers
        if tuned is not None and tuned != self.num_workers:
            self.__dict__["num_workers"] = tuned

    def stats(self, reset: bool = False) -> LoaderStats:
        """Where the time went since the loader was created (or last reset).

        Args:
            reset (bool): start counting afresh after this snapshot.
        """
        self._sync_tuned_workers()
        snapshot = self._telemetry.snapshot(self.num_workers, self._device_stage.gpu_sampler())
        if reset:
            self._telemetry.reset()
        return snapshot

    def _plan_epoch(self, new_host: bool = True) -> EpochPlan:
        """The next epoch's plan (see :mod:`fastfeed.planning`), run by a new host iterator or,
        with ``new_host=False``, by the running persistent one."""
        options = LoaderOptions(
            device=self.device, prefetch_depth=self.prefetch_depth,
            gpu_transform=self.gpu_transform, worker_mode=self.worker_mode,
            placement=self._placement, ring_slots=self.ring_slots,
            deterministic=self.deterministic, autotune=self.autotune,
            max_workers=self._max_workers, share_lists=self.share_lists)
        return self._planner.plan(self, options, new_host)

    def state_dict(self) -> dict[str, Any]:
        """Return a snapshot from which :meth:`load_state_dict` resumes at the next batch.

        Taken mid-epoch, a new loader built with the same arguments and given this state
        yields exactly the batches this one would have yielded next, and the same later
        epochs. Map-style datasets with torch's samplers resume by skipping the delivered
        index batches (nothing is loaded again); an IterableDataset resumes from its own
        ``state_dict()``/``load_state_dict()`` if it has them (one state per worker replica,
        so keep ``num_workers``), else by reading and discarding the delivered batches.

        Shuffling without ``generator=`` draws from torch's global RNG: then the state holds
        that RNG's state at the start of the epoch, and loading it restores it, as
        :func:`torch.set_rng_state` would. The state is small and picklable.
        """
        iterator = self._live_iterator()
        if iterator is None:
            return LoaderState(epoch_start=EpochStart.capture(RandomSources.of(self))).to_dict()
        state = iterator.state_dict() if hasattr(iterator, "state_dict") else None
        if state is None:
            raise TypeError("DataPipe datasets run on torch's iterators and cannot be resumed")
        return state.to_dict()

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        """Make the next ``iter(loader)`` resume from ``state_dict`` (see :meth:`state_dict`).

        Running persistent workers are let go: the next ``iter()`` starts new ones, seeded as
        those of the run the state comes from.
        """
        self._planner.carry_over.resume = LoaderState.from_dict(state_dict)
        drop_persistent_iterator(self)

    def __iter__(self) -> Any:
        self._sync_tuned_workers()
        if self.persistent_workers and getattr(persistent_iterator(self), "closed", False):
            warnings.warn("fastfeed: the persistent workers were shut down (a worker exited, "
                          "or the iterator was closed); starting new workers for this epoch",
                          RuntimeWarning, stacklevel=2)
            drop_persistent_iterator(self)
        if self.persistent_workers:  # nothing may read the iterator that starts an epoch
            self._device_stage.release_host()
        # As torch's __iter__ below: persistent workers carry on with their iterator.
        reused = self.persistent_workers and self.num_workers > 0 and (
            persistent_iterator(self) is not None)
        plan = self._plan_epoch(new_host=not reused)
        # torch's __iter__ makes the host iterator through _get_iterator(), which takes no
        # arguments: the plan waits on the loader for that one call.
        self._starting_plan = plan
        try:
            host = super().__iter__()
        finally:
            self._starting_plan = None
        iterator = self._device_stage.wrap(host, plan.stage)
        self._live_iterator = weakref.ref(iterator)
        return iterator

    def _get_iterator(self) -> Any:
        if is_datapipe(self.dataset):
            # DataPipes (deprecated in torch) need torch's sharding hooks: use torch's iterators.
            return torch_iterator(self)
        # Called by torch's __iter__, as ours starts an epoch; else planned here (a framework
        # that makes its iterators itself).
        plan = (self._starting_plan or self._plan_epoch()).host
        if self.num_workers == 0:
            return SingleProcessIterator(self, plan)
        assert plan.backend is not None
        # "auto" goes past the cores only when that measured faster; a cluster's are not these.
        if not self.autotune and not plan.backend.traits.uses_cluster_cores:
            self.check_worker_number_rationality()
        return WorkerPoolIterator(self, plan)


# FastLoader's own keywords and defaults: what integrations pass on and rebuild loaders with.
OWN_OPTIONS: dict[str, Any] = {
    name: parameter.default for name, parameter in inspect.signature(FastLoader).parameters.items()
    if name not in inspect.signature(DataLoader).parameters}
