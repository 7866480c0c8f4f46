"""The hot copy: stack samples into a pool slot (the gather kernels).

``fastfeed._gather`` does it with the GIL released and several threads for large batches. Where the
extension was not built, ``torch.stack(out=...)`` does the same work in one thread, so results
never depend on which path ran.
"""

from __future__ import annotations

import importlib
import threading
from collections.abc import Sequence
from typing import Any

import numpy as np
import torch

try:
    # By name: an extension module is no layer of the package (see pyproject's import contract).
    _gather: Any = importlib.import_module("fastfeed._gather")
except ImportError:  # built without a compiler: the pure-torch path takes over
    _gather = None

__all__ = ["bytes_are_values", "channels_last_strides", "copy_threads", "extension_loaded",
           "gather_addresses", "gather_into", "gather_through_tables", "set_copy_threads",
           "set_shares_the_gil", "shares_the_gil", "stack_hwc_to_chw", "stack_into"]

_dispatch_keys = torch._C._dispatch_keys
_NEGATIVE, _CONJUGATE = torch._C.DispatchKey.Negative, torch._C.DispatchKey.Conjugate

# Per calling thread: the threads each gather may use, 0 (the default) for every core (a
# worker, process or thread, sets its share of the cores: two workers on two cores, each
# starting two threads per batch, would fight over the cores with each other and with the main
# process); and whether the thread shares the GIL with other busy threads (see _lazy_view).
_per_thread = threading.local()


def set_copy_threads(threads: int) -> None:
    """Set the threads each gather called from this thread may use (0: every core)."""
    _per_thread.copy_threads = max(0, int(threads))


def copy_threads() -> int:
    """The threads each gather called from this thread may use (0: every core)."""
    return getattr(_per_thread, "copy_threads", 0)


def set_shares_the_gil(shares: bool) -> None:
    """Say that this thread shares the GIL with other busy threads (a worker thread): the
    per-sample checks then make no torch call that releases it."""
    _per_thread.shares_the_gil = shares


def shares_the_gil() -> bool:
    return getattr(_per_thread, "shares_the_gil", False)


def bytes_are_values(tensor: torch.Tensor) -> bool:
    """Whether ``tensor`` is a plain strided CPU tensor whose raw bytes are its values, which
    fastfeed may copy as bytes: exactly ``torch.Tensor`` (subclasses and autograd leaves keep
    torch's own handling), not a lazy conjugate or negative view, not quantized."""
    return (
        type(tensor) is torch.Tensor
        and tensor.is_cpu  # a fifth of the cost of tensor.device.type, paid per sample
        and tensor.layout == torch.strided
        and not tensor.requires_grad
        and not tensor.is_quantized
        and not _lazy_view(tensor)
    )


def _lazy_view(tensor: torch.Tensor) -> bool:
    """A lazy conjugate or negative view: its bytes are not its values.

    ``is_conj()`` and ``is_neg()`` release the GIL: checked for every sample of a batch in a
    thread that shares the GIL with busy ones, each release can hand it away for far longer
    than the call (thread workers made 11 % fewer batches so). There the bits are read from
    the tensor's dispatch keys instead; but not everywhere: each read makes a pybind object,
    whose registration writes pybind's table of instances, and in a forked worker those writes
    copy the parent's pages of it (4.5 MB in an epoch of 200,000 samples).
    """
    if shares_the_gil():
        keys = _dispatch_keys(tensor)
        return keys.has(_NEGATIVE) or keys.has(_CONJUGATE)
    return tensor.is_conj() or tensor.is_neg()


def extension_loaded() -> bool:
    """Return whether the compiled gather kernels (``fastfeed._gather``) are in use."""
    return _gather is not None


def channels_last_strides(shape: Sequence[int]) -> tuple[int, int, int]:
    """The strides (in elements) of a ``C×H×W`` image whose memory is ``H×W×C``: what
    ``permute(2, 0, 1)`` of an image gives, and what a resize of one writes."""
    channels, _, width = shape
    return 1, width * channels, channels


def gather_addresses(samples: Sequence[Any], channels_last: bool = False) -> list[int] | None:
    """Where the compiled gathers may read ``samples`` as bytes: each one's address, when every
    one is a tensor whose bytes are its values (:func:`bytes_are_values`) of the first one's
    dtype and shape, and contiguous (or, with ``channels_last``, a ``C×H×W`` image with
    :func:`channels_last_strides`); else None (always, without the extension).

    One pass, the cheapest checks first: it runs on every sample of every batch.
    """
    if _gather is None or not samples or not bytes_are_values(samples[0]):
        return None
    first = samples[0]
    dtype, shape = first.dtype, first.shape
    strides = None
    if channels_last:
        if first.dim() != 3:
            return None
        strides = channels_last_strides(shape)
    addresses = []
    for sample in samples:
        # The first one's dtype rules out quantized tensors; the layout before
        # is_contiguous(), which a sparse tensor does not have.
        if (type(sample) is not torch.Tensor or sample.dtype is not dtype or not sample.is_cpu
                or sample.requires_grad or sample.layout is not torch.strided
                or sample.shape != shape
                or (sample.stride() != strides if channels_last else not sample.is_contiguous())
                or _lazy_view(sample)):
            return None
        addresses.append(sample.data_ptr())
    return addresses


def gather_into(out: torch.Tensor, addresses: list[int], threads: int | None = None) -> None:
    """Copy the samples at ``addresses`` (from :func:`gather_addresses`) into ``out``, a
    contiguous tensor of ``len(addresses)`` of them."""
    _gather.gather(out.data_ptr(), addresses, out.nbytes // len(addresses),
                   copy_threads() if threads is None else threads)


def gather_through_tables(out: torch.Tensor, addresses: list[int], tables: torch.Tensor,
                          channels_last: bool = False, threads: int | None = None) -> None:
    """``out[n, c] = tables[c][sample n's channel c]``: uint8 ``C×H×W`` samples at
    ``addresses`` (from :func:`gather_addresses`, contiguous or ``channels_last``) into the
    contiguous float32 ``N×C×H×W`` ``out``, each byte looked up in its channel's row of the
    float32 ``C×256`` ``tables``."""
    n, channels, height, width = out.shape
    if (out.dtype != torch.float32 or not out.is_contiguous() or len(addresses) != n
            or tables.dtype != torch.float32 or tuple(tables.shape) != (channels, 256)
            or not tables.is_contiguous()):
        raise ValueError("gather_through_tables: out must be a contiguous float32 N×C×H×W "
                         "tensor of len(addresses) samples, tables a contiguous float32 C×256")
    strides = (channels_last_strides((channels, height, width)) if channels_last
               else (height * width, width, 1))
    _gather.gather_through_tables(out.data_ptr(), addresses, channels, height, width, *strides,
                                  tables.data_ptr(), copy_threads() if threads is None else threads)


def stack_into(out: torch.Tensor, samples: Sequence[torch.Tensor], threads: int | None = None,
               addresses: list[int] | None = None) -> None:
    """Copy equally shaped ``samples`` into ``out``, which has shape ``(len(samples), *shape)``.

    Equivalent to ``torch.stack(samples, 0, out=out)``. Contiguous sources of ``out``'s dtype,
    and uint8 images in ``H×W×C`` memory (``permute(2, 0, 1)`` of one), take the compiled
    path; anything else (other strided views, mixed dtypes) takes torch's.
    ``addresses``: the samples' :func:`gather_addresses`, where the caller has them already.
    """
    if out.shape[0] != len(samples):
        raise ValueError(f"out holds {out.shape[0]} samples but {len(samples)} were given")
    if not samples:
        return
    if addresses is None and out.is_contiguous():
        addresses = gather_addresses(samples)
        if addresses is None and _stack_channels_last(out, samples, threads):
            return
    if (addresses is not None and samples[0].dtype == out.dtype
            and samples[0].shape == out.shape[1:]):
        gather_into(out, addresses, threads)
    else:
        torch.stack(list(samples), 0, out=out)


def _stack_channels_last(out: torch.Tensor, samples: Sequence[torch.Tensor],
                         threads: int | None) -> bool:
    """Stack uint8 ``C×H×W`` images with :func:`channels_last_strides` (``H×W×C`` memory)
    into the contiguous ``out``, transposed as they are read; False where ``samples`` are not
    such images of ``out``'s shape."""
    if (out.dim() != 4 or out.dtype != torch.uint8 or samples[0].dtype != torch.uint8
            or samples[0].shape != out.shape[1:]):
        return False
    addresses = gather_addresses(samples, channels_last=True)
    if addresses is None:
        return False
    _, channels, height, width = out.shape
    row, column, channel = width * channels, channels, 1  # bytes, of uint8
    _gather.gather_hwc_to_chw(out.data_ptr(), [(a, row, column, channel) for a in addresses],
                              height, width, channels,
                              copy_threads() if threads is None else threads)
    return True


def _strided(image: np.ndarray | torch.Tensor, reverse: bool) -> tuple[int, int, int, int]:
    """``(address of element (0, 0, 0), row, column, channel strides)`` in bytes of a uint8
    ``H×W×C`` image, its channels read last to first when ``reverse``."""
    if isinstance(image, torch.Tensor):
        address, (row, column, channel) = image.data_ptr(), image.stride()
    else:
        address, (row, column, channel) = image.__array_interface__["data"][0], image.strides
    if reverse:
        address, channel = address + (image.shape[2] - 1) * channel, -channel
    return address, row, column, channel


def stack_hwc_to_chw(
    out: torch.Tensor,
    images: Sequence[np.ndarray | torch.Tensor],
    reverse_channels: Sequence[bool] | None = None,
    threads: int | None = None,
) -> None:
    """Gather uint8 ``H×W×C`` images into the uint8 ``N×C×H×W`` tensor ``out`` in one pass.

    Equivalent to ``torch.stack([torch.as_tensor(i).permute(2, 0, 1) for i in images], out=out)``,
    with image ``i``'s channels reversed (BGR to RGB) where ``reverse_channels[i]``. Images may
    be any strided view, mirrored numpy views (negative strides) included: no copy is made first.
    """
    if out.dtype != torch.uint8 or out.dim() != 4 or not out.is_contiguous():
        raise ValueError("out must be a contiguous uint8 N×C×H×W tensor")
    n, c, h, w = out.shape
    if len(images) != n:
        raise ValueError(f"out holds {n} images but {len(images)} were given")
    reverse = [False] * n if reverse_channels is None else list(reverse_channels)
    if len(reverse) != n:
        raise ValueError(f"reverse_channels has {len(reverse)} flags for {n} images")
    for i, image in enumerate(images):
        dtype_ok = image.dtype == (torch.uint8 if isinstance(image, torch.Tensor) else np.uint8)
        if not dtype_ok or tuple(image.shape) != (h, w, c):
            raise ValueError(
                f"image {i} has shape {tuple(image.shape)} and dtype {image.dtype}; "
                f"expected ({h}, {w}, {c}) uint8"
            )
    pairs = list(zip(images, reverse, strict=True))
    if _gather is not None:
        _gather.gather_hwc_to_chw(out.data_ptr(), [_strided(image, r) for image, r in pairs],
                                  h, w, c, copy_threads() if threads is None else threads)
    else:
        chw = [(np.asarray(image).transpose(2, 0, 1), r) for image, r in pairs]
        torch.stack([torch.from_numpy(np.ascontiguousarray(x[::-1] if r else x)) for x, r in chw],
                    0, out=out)
