"""Which GPU this process uses: pure decisions, with every input passed in.

Nothing here calls CUDA, NVML or reads the environment: the callers gather the facts
(``LOCAL_RANK``, ``CUDA_VISIBLE_DEVICES``, how many devices CUDA shows this process, its current
device) and these functions decide, so that every rule is testable without a GPU.

Two launch layouts are common under ``torchrun`` and SLURM, and they need opposite answers for
a bare ``"cuda"``:

- every rank sees every GPU of the node: rank ``LOCAL_RANK`` uses ``cuda:LOCAL_RANK``;
- each rank sees one GPU (the launcher set ``CUDA_VISIBLE_DEVICES`` per process): that GPU is
  ``cuda:0`` in every rank, whatever ``LOCAL_RANK`` says.
"""

from __future__ import annotations

__all__ = ["local_cuda_index", "nvml_device_for"]


def local_cuda_index(requested_index: int | None, local_rank_env: str | None,
                     visible_device_count: int, current_device: int) -> int:
    """The CUDA device index a process uses for ``cuda`` or ``cuda:N``.

    Args:
        requested_index: ``N`` of ``cuda:N``; ``None`` for a bare ``"cuda"``.
        local_rank_env: the ``LOCAL_RANK`` environment variable, ``None`` when unset.
        visible_device_count: the CUDA devices this process sees
            (``torch.cuda.device_count()``, after ``CUDA_VISIBLE_DEVICES``).
        current_device: ``torch.cuda.current_device()``. Any device but 0 was chosen by the
            script (``torch.cuda.set_device``, before or after the loader was made) and wins
            over ``LOCAL_RANK``; 0 is also what a process that chose nothing sees, so it is the
            answer only without ``LOCAL_RANK``.

    Returns:
        An index in ``[0, visible_device_count)``.

    Raises:
        ValueError: no device is visible, the requested index does not exist, or ``LOCAL_RANK``
            is not an index of a visible device while several are visible.
    """
    if visible_device_count < 1:
        raise ValueError("no CUDA device is visible to this process")
    if requested_index is not None:
        if not 0 <= requested_index < visible_device_count:
            raise ValueError(f"cuda:{requested_index} was requested but this process sees "
                             f"{visible_device_count} CUDA device(s)")
        return requested_index
    if visible_device_count == 1:
        return 0  # one GPU per process: LOCAL_RANK numbers the node's GPUs, not this process's
    if current_device != 0 or local_rank_env is None or not local_rank_env.strip():
        return current_device
    try:
        local_rank = int(local_rank_env)
    except ValueError:
        raise ValueError(f"LOCAL_RANK={local_rank_env!r} is not an integer") from None
    if not 0 <= local_rank < visible_device_count:
        raise ValueError(
            f"LOCAL_RANK={local_rank} but this process sees {visible_device_count} CUDA devices "
            f"(indices 0 to {visible_device_count - 1}): launch at most one rank per visible "
            "GPU, or pass device='cuda:N' explicitly")
    return local_rank


def nvml_device_for(cuda_index: int, visible_devices: str | None) -> int | str:
    """Which NVML device is CUDA device ``cuda_index`` of this process.

    NVML numbers every GPU of the machine in PCI order and ignores ``CUDA_VISIBLE_DEVICES``;
    CUDA numbers only the visible ones, in the order that variable lists them.

    Args:
        cuda_index: the process's CUDA device index.
        visible_devices: ``CUDA_VISIBLE_DEVICES``, ``None`` when unset. Entries are NVML
            indices or (prefixes of) ``GPU-``/``MIG-`` UUIDs; as CUDA does, the list ends at
            the first entry that is neither.

    Returns:
        An NVML index (``int``), or a UUID or UUID prefix (``str``) to look up by UUID.
        Without the variable, the index itself. Indices (with or without the variable) assume
        CUDA numbers GPUs in PCI order as NVML does: true with ``CUDA_DEVICE_ORDER=PCI_BUS_ID``
        and, by default, on a node of identical GPUs (CUDA's "fastest first" ties keep PCI
        order).

    Raises:
        ValueError: ``cuda_index`` is not a device the variable makes visible.
    """
    if visible_devices is None:
        return cuda_index
    entries: list[int | str] = []
    for raw in visible_devices.split(","):
        entry = raw.strip()
        if entry.isdigit():
            entries.append(int(entry))
        elif entry.startswith(("GPU-", "MIG-")):
            entries.append(entry)
        else:
            break  # CUDA ignores this entry and every one after it
    if not 0 <= cuda_index < len(entries):
        raise ValueError(f"CUDA device {cuda_index} is not among CUDA_VISIBLE_DEVICES="
                         f"{visible_devices!r} ({len(entries)} visible)")
    return entries[cuda_index]
