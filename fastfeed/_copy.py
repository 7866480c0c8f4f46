"""The hot copy: gather samples into a ring slot.

``fastfeed._C`` does it with the GIL released and several threads for large batches. Where the
extension was not built, ``torch.stack(out=...)`` does the same work in one thread, so results
never depend on which path ran.
"""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np
import torch

try:
    from fastfeed import _C  # type: ignore[attr-defined]
except ImportError:  # built without a compiler: the pure-torch path takes over
    _C = None

__all__ = ["extension_loaded", "set_copy_threads", "stack_hwc_to_chw", "stack_into"]

# Threads per gather; 0 lets the extension use every core. A worker process sets its share of
# the cores: two workers on two cores, each starting two threads per batch, would fight over
# the cores with each other and with the main process.
_copy_threads = 0


def set_copy_threads(threads: int) -> None:
    """Set the threads each gather in this process may use (0: every core)."""
    global _copy_threads
    _copy_threads = max(0, int(threads))


def extension_loaded() -> bool:
    """Return whether the compiled gather kernels (``fastfeed._C``) are in use."""
    return _C is not None


def stack_into(out: torch.Tensor, samples: Sequence[torch.Tensor], threads: int | None = None
               ) -> None:
    """Copy equally shaped ``samples`` into ``out``, which has shape ``(len(samples), *shape)``.

    Equivalent to ``torch.stack(samples, 0, out=out)``. Contiguous sources of ``out``'s dtype
    take the compiled path; anything else (strided views, mixed dtypes) takes torch's.
    """
    if out.shape[0] != len(samples):
        raise ValueError(f"out holds {out.shape[0]} samples but {len(samples)} were given")
    if (
        _C is not None
        and out.is_contiguous()
        and all(s.dtype == out.dtype and s.is_contiguous() for s in samples)
        and all(s.shape == out.shape[1:] for s in samples)
    ):
        if samples:
            nbytes = out.nbytes // len(samples)
            _C.gather(out.data_ptr(), [s.data_ptr() for s in samples], nbytes,
                      _copy_threads if threads is None else threads)
    else:
        torch.stack(list(samples), 0, out=out)


def stack_hwc_to_chw(
    out: torch.Tensor, images: Sequence[np.ndarray | torch.Tensor], threads: int | None = None
) -> None:
    """Gather uint8 ``H×W×C`` images into the uint8 ``N×C×H×W`` tensor ``out`` in one pass.

    Equivalent to ``torch.stack([torch.as_tensor(i).permute(2, 0, 1) for i in images], out=out)``.
    """
    if out.dtype != torch.uint8 or out.dim() != 4 or not out.is_contiguous():
        raise ValueError("out must be a contiguous uint8 N×C×H×W tensor")
    n, c, h, w = out.shape
    if len(images) != n:
        raise ValueError(f"out holds {n} images but {len(images)} were given")
    sources = [torch.as_tensor(image) for image in images]
    for i, src in enumerate(sources):
        if src.dtype != torch.uint8 or tuple(src.shape) != (h, w, c):
            raise ValueError(
                f"image {i} has shape {tuple(src.shape)} and dtype {src.dtype}; "
                f"expected ({h}, {w}, {c}) uint8"
            )
    if _C is not None and all(src.is_contiguous() for src in sources):
        _C.gather_hwc_to_chw(out.data_ptr(), [s.data_ptr() for s in sources], h, w, c,
                             _copy_threads if threads is None else threads)
    else:
        torch.stack([src.permute(2, 0, 1) for src in sources], 0, out=out)
