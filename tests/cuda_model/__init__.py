"""A machine with CUDA devices modelled on the CPU, with the semantics the GPU rules are about.

It is not a recorder of calls: code that breaks a rule gets wrong bytes, a counted sync, a
context on a GPU it does not use, or an out-of-memory error.

- **Devices and threads.** ``Gpu(devices=n)`` has ``n`` devices. Each thread has its current
  device (a new thread starts on device 0, as in CUDA) and a current stream per device.
  ``torch.cuda.set_device`` and ``torch.cuda.stream`` change them as torch does: leaving a
  ``torch.cuda.stream`` block restores the previous stream with ``set_stream``, which makes
  its device current again (cudaSetDevice), while ``torch.cuda.device`` restores the previous
  device only where it has a context. Anything done on a device (cudaSetDevice, a launch, an
  allocation, an event) makes its primary context: :attr:`Gpu.contexts` lists them, so a rank
  that touches GPU 0 shows (``torch._C._cuda_hasPrimaryContext`` reads them).
- **Streams** are queues of one device. Queued work runs only when the test lets the device run
  (:meth:`Gpu.run`, streams in the order the test picks: the adversary) or when the host waits
  for it (a sync). An **event** marks a point of a stream; ``query()`` says whether the device
  got there; ``wait_event``/``wait_stream`` hold a stream at a point of another.
- **torch's stream pool.** ``torch.cuda.Stream()`` hands out the next of 32 streams (per device
  and priority), round-robin, as torch does: the 33rd call gives the first one's stream again.
  Libraries take theirs from the same pool (torchvision's JPEG decoder, NCCL). A stream of
  one's own is made through the driver API (:class:`~cuda_model.driver.FakeLibcuda`, whose
  calls return their real error codes and can be made to fail) and used as
  ``torch.cuda.ExternalStream``.
- **The copy engine.** ``tensor.to("cuda", non_blocking=True)`` from page-locked, dense memory
  queues a read of the source *by address*, done when its stream runs: a slot rewritten before
  then is copied with the new bytes. Anything else (pageable or non-dense memory, a blocking
  copy) is copied at once after the host waits for the stream: a sync.
- **Kernels.** An op on device tensors is queued on the current stream of their device and
  computes when it runs, reading its inputs' memory then (views and metadata are immediate).
  An op that needs device values on the host (``.item()``, ``bool()``, ``.tolist()``,
  ``.cpu()``, a shape that depends on values: whatever cannot run on torch's ``meta`` device)
  makes the host wait for the device: a sync.
- **The caching allocator** (:mod:`cuda_model.allocator`) is torch's: requests rounded to 512
  bytes, carved from 2 MiB or 20 MiB (or rounded) segments, cached per stream and handed to that
  stream's next allocation at once, unless ``record_stream`` named other streams; then only
  once each has passed the point it was at when the block was freed. Each device has
  ``memory_bytes``, shared with libraries' own ``cudaMalloc`` (nvJPEG's); when a segment does not
  fit, the allocator releases its unused cached segments and tries again, then raises
  ``torch.OutOfMemoryError`` with torch's message. While a CUDA graph is captured
  (:meth:`Gpu.capture`, on any thread) it skips that release, and ``torch.cuda.empty_cache()``
  fails torch's internal assert before it waits for or frees anything.
- **Page-locked memory**: ranges registered with ``cudaHostRegister`` (through
  :attr:`Gpu.runtime`, the slot pool's) and torch's pinned pool, whose blocks live until the
  copies that read them have run (as torch's events keep them).
- **The sync detector**: :attr:`Gpu.syncs` lists every host-device synchronisation with the
  thread that made it: ``Event``/``Stream``/device ``synchronize``, host reads of device values,
  and blocking host-to-device copies (``torch.as_tensor``/``torch.tensor`` of host data on the
  device, ``.to("cuda")`` from pageable or non-dense memory).

Install it with the ``gpu`` fixture of the tests that use it (:func:`install`).
"""

from cuda_model.device import DEVICE, POOL_SIZE, Gpu
from cuda_model.streams import Event, Stream
from cuda_model.tensors import DeviceTensor, install

__all__ = ["DEVICE", "POOL_SIZE", "DeviceTensor", "Event", "Gpu", "Stream", "install"]
