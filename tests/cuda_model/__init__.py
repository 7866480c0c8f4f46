"""A CUDA device modelled on the CPU, with the semantics the GPU rules are about.

It is not a recorder of calls: code that breaks a rule gets wrong bytes, or a counted sync.

- **Streams** are queues. Queued work runs only when the test lets the device run
  (:meth:`Gpu.run`, streams in the order the test picks: the adversary) or when the host waits
  for it (a sync). An **event** marks a point of a stream; ``query()`` says whether the device
  got there; ``wait_event``/``wait_stream`` hold a stream at a point of another.
- **torch's stream pool.** ``torch.cuda.Stream()`` hands out the next of 32 streams (per
  priority), round-robin, as torch does: the 33rd call gives the first one's stream again.
  A stream of one's own is ``torch.cuda.ExternalStream`` over a handle from
  :attr:`Gpu.runtime` (``stream_create``, cudaStreamCreateWithFlags).
- **The copy engine.** ``tensor.to("cuda", non_blocking=True)`` from page-locked, dense memory
  queues a read of the source *by address*, done when its stream runs: a slot rewritten before
  then is copied with the new bytes. Anything else (pageable or non-dense memory, a blocking
  copy) is copied at once after the host waits for the stream: a sync.
- **Kernels.** An op on device tensors is queued on the current stream and computes when it
  runs, reading its inputs' memory then (views and metadata are immediate). An op that needs
  device values on the host (``.item()``, ``bool()``, ``.tolist()``, ``.cpu()``, a shape that
  depends on values: whatever cannot run on torch's ``meta`` device) makes the host wait for
  the device: a sync.
- **The caching allocator** is stream-ordered: a freed block goes back to the pool of the
  stream it was allocated on and is handed to that stream's next allocation at once, unless
  ``record_stream`` named other streams; then only once each of them has passed the point it
  was at when the block was freed.
- **Page-locked memory**: ranges registered with ``cudaHostRegister`` (through
  :attr:`Gpu.runtime`, the slot pool's) and torch's pinned pool, whose blocks live until the copies
  that read them have run (as torch's events keep them).
- **The sync detector**: :attr:`Gpu.syncs` lists every host-device synchronisation with the
  thread that made it: ``Event``/``Stream``/device ``synchronize``, host reads of device values,
  and blocking host-to-device copies (``torch.as_tensor``/``torch.tensor`` of host data on the
  device, ``.to("cuda")`` from pageable or non-dense memory).

Install it with the ``gpu`` fixture of the tests that use it (:func:`install`).
"""

from cuda_model.device import DEVICE, POOL_SIZE, Event, Gpu, Stream
from cuda_model.tensors import DeviceTensor, install

__all__ = ["DEVICE", "POOL_SIZE", "DeviceTensor", "Event", "Gpu", "Stream", "install"]
