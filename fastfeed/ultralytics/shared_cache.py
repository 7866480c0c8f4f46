"""One decoded-image cache per machine for Ultralytics' ``cache="ram"``.

Ultralytics' ``cache="ram"`` decodes and resizes every image in ``BaseDataset.cache_images``,
before training, into a buffer of the process that builds the dataset. Under DDP every rank
builds its own datasets (``BaseTrainer._build_train_pipeline`` calls ``get_dataloader`` with its
``LOCAL_RANK``), so a machine with 8 GPUs holds the decoded images 8 times and decodes each one
8 times before the first epoch.

With ``patch(cache="shared")`` the same datasets keep their images in one file in ``/dev/shm``
that every rank and every loader worker on the machine maps: :class:`SharedImages`. Nothing is
decoded up front; the first process that needs an image decodes it with Ultralytics' own
``load_image`` (so the bytes are ``cache="ram"``'s) and publishes it, and every later read, in
any process, is a view of the shared pages. Each image has a place reserved from the size
Ultralytics recorded when it scanned the labels; an image whose decode does not fit its place
is not cached (it is decoded on every read, as without a cache).

The file is named after what determines its contents (the image files, their sizes and times,
``imgsz``, the channels and the decoder), so runs on the same data share it and runs on other
data do not. Each process holds a shared ``flock`` on it while it uses it; the last one to close
removes it. A run killed by a signal (``SIGKILL``; ``SIGTERM`` under Python's default handler)
leaves it behind: the next run on the same data reuses it and removes it at its end.
"""

from __future__ import annotations

import contextlib
import errno
import fcntl
import hashlib
import math
import mmap
import os
import shutil
import tempfile
import warnings
import weakref
from collections.abc import Callable
from pathlib import Path
from typing import Any

import numpy as np

try:
    from fastfeed import _flags  # type: ignore[attr-defined]
except ImportError:  # installed without a C++ compiler: see available()
    _flags = None

__all__ = ["CacheDoesNotFit", "SharedImages", "available", "cache_dir", "shared_cache_images",
           "shared_check_cache_ram", "shared_load_image"]

_MAGIC = 0x46465943_00000001  # "FFYC", layout version 1
# Per image, int64: offset, height, width, channels, original height, original width, ready.
_FIELDS = 7
_OFFSET, _HEIGHT, _WIDTH, _CHANNELS, _H0, _W0, _READY = range(_FIELDS)
_ALIGN = 64

LoadImage = Callable[..., tuple[np.ndarray, tuple[int, int], tuple[int, int]]]


class CacheDoesNotFit(RuntimeError):
    """The images need more memory than the cache may take."""


def available() -> bool:
    """Whether images can be published across processes: ``fastfeed._flags`` was built."""
    return _flags is not None


def cache_dir() -> Path:
    """Where the shared files live: ``/dev/shm`` (memory) where there is one."""
    shm = Path("/dev/shm")
    return shm if shm.is_dir() else Path(tempfile.gettempdir())


def _resized_shape(hw0: tuple[int, int], imgsz: int) -> tuple[int, int]:
    """``(h, w)`` of an image of original size ``hw0`` after Ultralytics' long-side resize."""
    h0, w0 = hw0
    r = imgsz / max(h0, w0)
    if r == 1:
        return h0, w0
    return min(math.ceil(h0 * r), imgsz), min(math.ceil(w0 * r), imgsz)


def _key(dataset: Any, decoder: str) -> str:
    digest = hashlib.sha256(f"{dataset.imgsz}|{dataset.channels}|{decoder}".encode())
    for name in dataset.im_files:
        st = os.stat(name)
        digest.update(f"|{name}|{st.st_size}|{st.st_mtime_ns}".encode())
    return digest.hexdigest()[:24]


class SharedImages:
    """A dataset's images as ``load_image`` returns them, in a file every process maps.

    Indexing gives the image (a view of the shared pages, writeable as the views of
    Ultralytics' own cache are) or ``None`` where no process has published it yet, as
    ``BaseDataset.ims`` does for images not in RAM.

    Args:
        path: the file; created, sized and laid out by the first process to open it.
        shapes: ``N×3`` reserved ``(height, width, channels)`` of each image.
        budget: the most bytes the file may take, or ``None`` for the space where it lives.

    Raises:
        CacheDoesNotFit: the file would exceed ``budget``, or the first process to open it
            finds too little space for it.
    """

    def __init__(self, path: Path, shapes: np.ndarray, budget: int | None) -> None:
        sizes = np.asarray(shapes, np.int64).prod(1)
        places = (sizes + _ALIGN - 1) // _ALIGN * _ALIGN
        header = 16 + len(shapes) * _FIELDS * 8
        first = (header + _ALIGN - 1) // _ALIGN * _ALIGN
        self.nbytes = int(first + places.sum())
        if budget is not None and self.nbytes > budget:
            raise CacheDoesNotFit(f"{len(shapes)} images need {self.nbytes / 2**30:.2f} GiB, more "
                                  f"than the cache's budget of {budget / 2**30:.2f} GiB")
        self.path, self.shapes, self.budget = path, np.asarray(shapes, np.int64), budget
        self.fd = _open_locked(path, self.nbytes, self._lay_out)
        self.pid = os.getpid()
        self.map = mmap.mmap(self.fd, self.nbytes)
        self.table = np.frombuffer(self.map, np.int64, len(shapes) * _FIELDS, 16).reshape(
            -1, _FIELDS)
        self.data = np.frombuffer(self.map, np.uint8)
        self._closer = weakref.finalize(self, _release, self.fd, path, self.pid)

    def _lay_out(self, fd: int) -> None:
        """Size and lay out a new file, which no other process has opened yet."""
        free = shutil.disk_usage(self.path.parent).free
        too_little = CacheDoesNotFit(f"{len(self.shapes)} images need "
                                     f"{self.nbytes / 2**30:.2f} GiB, and {self.path.parent} "
                                     f"has {free / 2**30:.2f} GiB free")
        if self.nbytes > free:
            raise too_little
        try:
            os.posix_fallocate(fd, 0, self.nbytes)  # the pages now, rather than a SIGBUS later
        except OSError as error:
            if error.errno != errno.ENOSPC:
                raise
            raise too_little from error
        sizes = self.shapes.prod(1)
        places = (sizes + _ALIGN - 1) // _ALIGN * _ALIGN
        table = np.zeros((len(sizes), _FIELDS), np.int64)
        table[:, _OFFSET] = self.nbytes - places.sum() + np.cumsum(places) - places
        table[:, _HEIGHT:_CHANNELS + 1] = self.shapes
        os.pwrite(fd, np.array([_MAGIC, len(sizes)], np.int64).tobytes() + table.tobytes(), 0)

    def __len__(self) -> int:
        return len(self.table)

    def __getitem__(self, i: int) -> np.ndarray | None:
        hit = self.get(i)
        return None if hit is None else hit[0]

    def get(self, i: int) -> tuple[np.ndarray, tuple[int, int], tuple[int, int]] | None:
        """``load_image(i)``'s answer if a process published image ``i``, else ``None``."""
        record = self.table[i]
        if not _load(self.table, i):
            return None
        offset, h, w, c, h0, w0 = (int(v) for v in record[:_READY])
        return self.data[offset:offset + h * w * c].reshape(h, w, c), (h0, w0), (h, w)

    def put(self, i: int, image: np.ndarray, hw0: tuple[int, int]) -> bool:
        """Publish image ``i`` for every process; ``False`` if it does not fit its place."""
        record = self.table[i]
        shape = image.shape if image.ndim == 3 else (*image.shape, 1)
        if image.dtype != np.uint8 or tuple(shape) != tuple(record[_HEIGHT:_CHANNELS + 1]):
            return False
        offset = int(record[_OFFSET])
        self.data[offset:offset + image.size].reshape(shape)[...] = image.reshape(shape)
        # Several processes may publish the same image at once: they write the same bytes.
        record[_H0], record[_W0] = hw0
        _publish(self.table, i)
        return True

    def close(self) -> None:
        """Unmap nothing (views may live on); drop this process's hold on the file, and remove
        it if no other process holds it."""
        self._closer()

    def __getstate__(self) -> dict[str, Any]:
        return {"path": self.path, "shapes": self.shapes, "budget": self.budget}

    def __setstate__(self, state: dict[str, Any]) -> None:
        self.__init__(state["path"], state["shapes"], state["budget"])  # type: ignore[misc]


def _publish(table: np.ndarray, i: int) -> None:
    _flags.publish(table.ctypes.data + (i * _FIELDS + _READY) * 8, 1)


def _load(table: np.ndarray, i: int) -> bool:
    return bool(_flags.load(table.ctypes.data + (i * _FIELDS + _READY) * 8))


def _open_locked(path: Path, nbytes: int, lay_out: Callable[[int], None]) -> int:
    """Open ``path`` under a shared lock, first creating it with ``lay_out`` if it is missing.

    A new file is laid out under a name of its own and then linked to ``path``, so that no
    process ever opens a file that is still being laid out; if another process linked its file
    first, that one is used. An open is retried if the last holder removed the file between
    our open and our lock (it then finds the file missing, or another file at its name).
    """
    while True:
        try:
            fd = os.open(path, os.O_RDWR)
        except FileNotFoundError:
            _create(path, lay_out)
            continue
        fcntl.flock(fd, fcntl.LOCK_SH)
        try:
            current = os.stat(path).st_ino
        except FileNotFoundError:
            current = -1
        if current != os.fstat(fd).st_ino:
            os.close(fd)
            continue
        if os.fstat(fd).st_size != nbytes or _magic(fd) != _MAGIC:
            os.close(fd)
            raise RuntimeError(f"fastfeed: {path} is not this dataset's image cache; remove it")
        return fd


def _create(path: Path, lay_out: Callable[[int], None]) -> None:
    """Put a new file laid out by ``lay_out`` at ``path``, unless another process puts its
    own there first."""
    staging = path.with_name(f"{path.name}.{os.getpid()}.new")
    fd = os.open(staging, os.O_RDWR | os.O_CREAT | os.O_EXCL, 0o600)
    try:
        lay_out(fd)
        with contextlib.suppress(FileExistsError):
            os.link(staging, path)
    finally:
        os.close(fd)
        staging.unlink(missing_ok=True)


def _magic(fd: int) -> int:
    return int(np.frombuffer(os.pread(fd, 8, 0), np.int64)[0])


def _release(fd: int, path: Path, pid: int) -> None:
    if os.getpid() != pid:  # a forked worker: the lock belongs to the process that opened it
        return
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except BlockingIOError:
        pass  # another process still uses it
    else:
        path.unlink(missing_ok=True)
    # The map holds a duplicate of fd, and with it the lock: release it explicitly.
    fcntl.flock(fd, fcntl.LOCK_UN)
    os.close(fd)


def _open_for(dataset: Any, budget_gib: float | None, decoder: str) -> SharedImages:
    imgsz = max(dataset.imgsz) if isinstance(dataset.imgsz, (tuple, list)) else dataset.imgsz
    shapes = []
    for i, label in enumerate(dataset.labels):
        hw0 = label.get("shape")
        if hw0 is None:  # rect training pops it; read the size back from the file
            from fastfeed.vision.window_decode import image_size

            width, height = image_size(Path(dataset.im_files[i]).read_bytes(),
                                       str(dataset.im_files[i]))
            hw0 = (height, width)
        shapes.append((*_resized_shape((int(hw0[0]), int(hw0[1])), imgsz), dataset.channels))
    path = cache_dir() / f"fastfeed-yolo-{_key(dataset, decoder)}"
    budget = None if budget_gib is None else int(budget_gib * 2**30)
    return SharedImages(path, np.array(shapes), budget)


def shared_cache_images(original: Callable[[Any], None], budget_gib: float | None,
                        decoder: str) -> Callable[[Any], None]:
    """``BaseDataset.cache_images`` for ``cache="ram"``: a :class:`SharedImages` in place of
    decoding every image now. Falls back to no cache, with a warning that says why and what
    to change, where the images do not fit; ``cache="disk"`` stays Ultralytics'."""

    def cache_images(self: Any) -> None:
        if self.cache != "ram" or self.channels not in (1, 3):
            return original(self)
        try:
            self.ims = _open_for(self, budget_gib, decoder)
        except CacheDoesNotFit as error:
            self.cache = None
            warnings.warn(
                f"fastfeed: the shared image cache is off: {error}. Images are decoded on every "
                f"read, as with cache=False. Give it room (a larger /dev/shm, for example "
                f"docker --shm-size) or a larger patch(cache_budget_gib=...)",
                RuntimeWarning, stacklevel=2)

    cache_images.__wrapped__ = original  # type: ignore[attr-defined]
    return cache_images


def shared_check_cache_ram(original: Callable[..., bool]) -> Callable[..., bool]:
    """``BaseDataset.check_cache_ram``, which decodes 30 images to weigh the cache against this
    process's free RAM, left out where :func:`shared_cache_images` weighs the shared file."""

    def check_cache_ram(self: Any, safety_margin: float = 1.0) -> bool:
        if self.channels not in (1, 3):
            return original(self, safety_margin)
        return True

    check_cache_ram.__wrapped__ = original  # type: ignore[attr-defined]
    return check_cache_ram


def shared_load_image(original: LoadImage) -> LoadImage:
    """``BaseDataset.load_image`` reading and filling a dataset's :class:`SharedImages`.

    As with Ultralytics' own RAM cache, every call gives the image ``load_image(i)`` gave
    with its default arguments."""

    def load_image(self: Any, i: int, rect_mode: bool = True, resize_short: bool = False
                   ) -> tuple[np.ndarray, tuple[int, int], tuple[int, int]]:
        shared = self.ims
        if not isinstance(shared, SharedImages):
            return original(self, i, rect_mode, resize_short)
        hit = shared.get(i)
        if hit is not None:
            return hit
        image, hw0, hw = original(self, i)
        if shared.put(i, image, hw0):
            return shared.get(i)  # type: ignore[return-value]
        return image, hw0, hw

    load_image.__wrapped__ = original  # type: ignore[attr-defined]
    return load_image
