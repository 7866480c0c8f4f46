"""Out of device memory in the GPU JPEG decode: whether, and how, a batch is decoded again.

nvJPEG allocates its working memory with ``cudaMalloc``, outside torch's caching allocator.
A training process grows torch's cache to its peak and keeps it, so nvJPEG's next growth can
find the device full of memory that torch holds unused. The only way to hand that memory back
is ``torch.cuda.empty_cache()``: torch frees no one stream's cache alone, and the memory is
mostly the training stream's, not fastfeed's. So a batch is decoded once more after it, with
these rules:

- Only when nvJPEG's own allocation failed (:attr:`DecoderOutOfMemory.outside_torch`). When
  torch's failed, its allocator has already released its cache and tried again: releasing it
  once more frees nothing, and the error is raised.
- Never while a CUDA graph is captured. A release waits for the device and frees memory, which
  a capture forbids. On this thread torch says so (``is_current_stream_capturing``). Another
  thread's capture torch keeps to its allocator, which then refuses: ``empty_cache()`` fails
  its check that no capture is underway before it waits for or frees anything. The error is
  raised in both cases, with the reason, and the capture goes on.
- Visibly: the release is device-wide (the training step's next allocations call ``cudaMalloc``
  again) and the decode waits for it, so each retry is counted (:attr:`MemoryRetries.count`)
  and logged as a warning at the 1st, 2nd, 4th, 8th... with the count and the way out.
"""

from __future__ import annotations

import logging
import threading

import torch

from fastfeed.vision.jpeg_decoders import DecoderOutOfMemory

__all__ = ["MemoryRetries"]

logger = logging.getLogger(__name__)


class MemoryRetries:
    """The out-of-memory retries of one decode route (see the module's notes)."""

    def __init__(self) -> None:
        self.count = 0
        self._lock = threading.Lock()

    def __reduce__(self) -> tuple[type, tuple[()]]:
        return (MemoryRetries, ())  # a copy (a worker's, a new epoch's) counts its own

    def release_for(self, error: DecoderOutOfMemory) -> None:
        """Release torch's cached memory for the decode to be tried once more.

        Raises:
            DecoderOutOfMemory: ``error``, or one that says why the memory was not released:
                a retry cannot help or is not allowed now.
        """
        if not error.outside_torch:
            raise error
        if torch.cuda.is_current_stream_capturing():
            raise DecoderOutOfMemory(f"{error} (not decoded again: this thread is capturing a "
                                     "CUDA graph, which releasing torch's cache would break)",
                                     outside_torch=True) from error
        try:
            torch.cuda.empty_cache()
        except RuntimeError as refused:
            raise DecoderOutOfMemory(
                f"{error} (not decoded again: torch refused to release its cache, as it does "
                f"while a CUDA graph is captured on another thread: {refused})",
                outside_torch=True) from error
        with self._lock:
            self.count += 1
            count = self.count
        if count & (count - 1) == 0:  # 1, 2, 4, 8...: the count grows, the log does not
            logger.warning(
                "fastfeed's GPU JPEG decode ran out of device memory in nvJPEG's own "
                "allocation (%d time(s) so far): each time torch's cached memory was released "
                "on every device (torch.cuda.empty_cache(): the training step's next "
                "allocations call cudaMalloc again) and the batch decoded once more. Leave "
                "nvJPEG room outside torch's cache: torch.cuda.set_per_process_memory_fraction"
                "(0.9), or a smaller batch.", count)
