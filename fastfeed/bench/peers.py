"""Peer loaders of the classic ImageNet train pipeline, each set up in its own documented way.

Every peer yields ``(float32 N×3×224×224 images normalised with ImageNet's mean and std,
int64 labels)``, shuffled, with a random-resized crop (scale 0.08–1, ratio 3/4–4/3) and a
random horizontal flip: what torchvision's ``RandomResizedCrop(224), RandomHorizontalFlip(),
ToTensor(), Normalize()`` gives, so that their rates compare with a ``DataLoader`` over it.

- ``dali-cpu``: NVIDIA DALI's ResNet-50 recipe with CPU operators (``readers.file``,
  ``decoders.image_random_crop``, ``resize``, ``crop_mirror_normalize`` with a coin-flip
  mirror), ``threads`` DALI threads.
- ``spdl``: SPDL's thread pipeline with its own (FFmpeg) decode: each image is demuxed, then
  decoded through a crop/scale/flip filter graph, ``threads`` concurrent decodes; the batch is
  converted by ``spdl.io.convert_frames`` and normalised in torch.
- ``ffcv``: FFCV from a ``.beton`` of the same JPEGs at full size (re-encoded at its default
  quality 90, written next to the folder on first use), its ImageNet decoder
  ``RandomResizedCropRGBImageDecoder``, ``RandomHorizontalFlip``, ``NormalizeImage``,
  ``threads`` workers; ``ffcv`` keeps its default channels-last view, ``ffcv-nchw`` asks for
  contiguous NCHW. ``NormalizeImage`` runs before ``ToTensor``: FFCV 1.0.2 hangs building a
  CPU pipeline whose jitted operation follows a non-jitted one.

- ``dataloader-rs``: dataloader-rs's ``PyDataloader`` (a Rust core, worker threads instead of
  processes; Python >= 3.13) over torchvision's ``ImageFolder`` with the classic transforms
  themselves (its samples are a ``PyDataset``'s), torch's ``default_collate``, ``threads``
  worker threads; ``dataloader-rs-deep`` lets them run 8 batches ahead instead of 2, and
  ``dataloader-rs-items2`` fetches 2 items of a batch at once on each thread, its two settings
  for more work in flight on the same threads.

None is a dependency of fastfeed. To install them (in a virtual environment of their own)::

    python -m venv --system-site-packages .venv-peers   # sees the torch already installed
    .venv-peers/bin/pip install nvidia-dali-cuda120 spdl==0.8.0
    apt-get install pkg-config libturbojpeg0-dev libopencv-dev \\
        libavdevice59 libavfilter8 libavformat59 libavcodec59 libswscale6   # FFCV, SPDL
    .venv-peers/bin/pip install ffcv==1.0.2
    python3.13 -m venv .venv-peers313   # dataloader-rs: Python >= 3.13
    .venv-peers313/bin/pip install -c .ci/constraints-clients.txt torch==2.14.1 \
        -e ".[test,torchvision]" dataloader-rs==0.2.0
"""

from __future__ import annotations

import importlib
import random
from collections.abc import Callable, Iterable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from fastfeed.vision.augment import random_resized_crop_box
from fastfeed.vision.folder import ImageFolder

__all__ = ["PEERS", "Peer", "build_peer"]

MEAN = (0.485, 0.456, 0.406)
STD = (0.229, 0.224, 0.225)
SIZE = 224

Batches = Iterable[tuple[torch.Tensor, torch.Tensor]]


def _normalize_nhwc(images: torch.Tensor) -> torch.Tensor:
    """uint8 N×H×W×3 -> normalised float32 N×3×H×W, as ToTensor + Normalize give."""
    mean = torch.tensor(MEAN).view(1, 3, 1, 1) * 255
    std = torch.tensor(STD).view(1, 3, 1, 1) * 255
    return ((images.permute(0, 3, 1, 2).float() - mean) / std).contiguous()


class DaliRecipe:
    """NVIDIA DALI's ResNet-50 training pipeline, CPU operators."""

    def __init__(self, root: Path, batch_size: int, threads: int) -> None:
        from nvidia.dali import fn, pipeline_def, types
        from nvidia.dali.plugin.pytorch import DALIGenericIterator, LastBatchPolicy

        folder = ImageFolder(root)

        @pipeline_def
        def pipeline() -> Any:
            jpegs, labels = fn.readers.file(files=[p for p, _ in folder.samples],
                                            labels=folder.targets, random_shuffle=True,
                                            name="reader")
            images = fn.decoders.image_random_crop(jpegs, device="cpu", output_type=types.RGB,
                                                   random_area=[0.08, 1.0],
                                                   random_aspect_ratio=[3 / 4, 4 / 3],
                                                   num_attempts=100)
            images = fn.resize(images, device="cpu", resize_x=SIZE, resize_y=SIZE,
                               interp_type=types.INTERP_TRIANGULAR)
            images = fn.crop_mirror_normalize(
                images, device="cpu", dtype=types.FLOAT, output_layout="CHW", crop=(SIZE, SIZE),
                mean=[255 * m for m in MEAN], std=[255 * s for s in STD],
                mirror=fn.random.coin_flip(probability=0.5))
            return images, labels

        built = pipeline(batch_size=batch_size, num_threads=threads, device_id=None, seed=0)
        built.build()
        self._iterator = DALIGenericIterator([built], ["img", "label"], reader_name="reader",
                                             last_batch_policy=LastBatchPolicy.PARTIAL,
                                             auto_reset=True)

    def __iter__(self) -> Iterator[tuple[torch.Tensor, torch.Tensor]]:
        for outputs in self._iterator:
            yield outputs[0]["img"], outputs[0]["label"].view(-1).long()


class SpdlPipeline:
    """SPDL's thread pipeline: demux and decode through an FFmpeg crop/scale/flip filter on
    ``threads`` threads, batches converted by SPDL and normalised in torch."""

    def __init__(self, root: Path, batch_size: int, threads: int) -> None:
        self.samples = ImageFolder(root).samples
        self.batch_size, self.threads = batch_size, threads

    @staticmethod
    def _decode(sample: tuple[str, int]) -> tuple[Any, int]:
        import spdl.io

        path, target = sample
        packets = spdl.io.demux_image(path)
        x, y, w, h = random_resized_crop_box(packets.width, packets.height)
        flip = ",hflip" if random.random() < 0.5 else ""
        graph = (f"crop={w}:{h}:{x}:{y},scale={SIZE}:{SIZE}:flags=bilinear{flip},"
                 "format=pix_fmts=rgb24")
        return spdl.io.decode_packets(packets, filter_desc=graph), target

    @staticmethod
    def _collate(decoded: list[tuple[Any, int]]) -> tuple[torch.Tensor, torch.Tensor]:
        import spdl.io

        frames, targets = zip(*decoded, strict=True)
        images = spdl.io.to_torch(spdl.io.convert_frames(list(frames)))
        return _normalize_nhwc(images), torch.tensor(targets)

    def __iter__(self) -> Iterator[tuple[torch.Tensor, torch.Tensor]]:
        from spdl.pipeline import PipelineBuilder

        order = random.sample(self.samples, len(self.samples))
        pipeline = (PipelineBuilder().add_source(order)
                    .pipe(self._decode, concurrency=self.threads)
                    .aggregate(self.batch_size)
                    .pipe(self._collate)
                    .add_sink(3)
                    .build(num_threads=self.threads))
        with pipeline.auto_stop():
            yield from pipeline


def beton_of(root: Path) -> Path:
    """The full-size FFCV ``.beton`` of an ImageFolder, written beside it on first use."""
    beton = root.parent / f"{root.name}.beton"
    if beton.exists():
        return beton
    from ffcv.fields import IntField, RGBImageField
    from ffcv.writer import DatasetWriter
    from PIL import Image

    samples = ImageFolder(root).samples

    class Decoded:
        def __len__(self) -> int:
            return len(samples)

        def __getitem__(self, i: int) -> tuple[Any, int]:
            path, target = samples[i]
            return Image.open(path).convert("RGB"), target

    partial = beton.with_suffix(".partial")
    writer = DatasetWriter(str(partial), {"image": RGBImageField(write_mode="jpg",
                                                                 max_resolution=None),
                                          "label": IntField()}, num_workers=2)
    writer.from_indexed_dataset(Decoded())
    partial.rename(beton)
    return beton


def _ffcv(channels_last: bool) -> Callable[[Path, int, int], Batches]:
    def build(root: Path, batch_size: int, threads: int) -> Batches:
        import numpy as np
        from ffcv.fields.decoders import IntDecoder, RandomResizedCropRGBImageDecoder
        from ffcv.loader import Loader, OrderOption
        from ffcv.transforms import (
            NormalizeImage,
            RandomHorizontalFlip,
            Squeeze,
            ToTensor,
            ToTorchImage,
        )

        image = [RandomResizedCropRGBImageDecoder((SIZE, SIZE)), RandomHorizontalFlip(),
                 NormalizeImage(np.array(MEAN) * 255, np.array(STD) * 255, np.float32),
                 ToTensor(), ToTorchImage(channels_last=channels_last)]
        return Loader(str(beton_of(root)), batch_size=batch_size, num_workers=threads,
                      order=OrderOption.RANDOM, os_cache=True, drop_last=False,
                      pipelines={"image": image, "label": [IntDecoder(), ToTensor(), Squeeze()]})
    return build


def _dataloader_rs(**settings: int) -> Callable[[Path, int, int], Batches]:
    def build(root: Path, batch_size: int, threads: int) -> Batches:
        import dataloader_rs
        from torch.utils.data import default_collate

        from fastfeed.bench.data import classic_imagefolder

        folder = classic_imagefolder(root)

        class Samples(dataloader_rs.PyDataset):
            def __len__(self) -> int:
                return len(folder)  # type: ignore[arg-type]

            def __getitem__(self, index: int) -> Any:
                return folder[index]

        loader: Batches = dataloader_rs.PyDataloader(
            Samples(), batch_size=batch_size, shuffle=True, num_workers=threads,
            collate_fn=default_collate, **settings)
        return loader
    return build


def _spdl_decodes() -> None:
    """SPDL imports without FFmpeg's libraries, and loads them at the first decode."""
    import io

    import spdl.io
    from PIL import Image

    jpeg = io.BytesIO()
    Image.new("RGB", (8, 8)).save(jpeg, "JPEG")
    spdl.io.load_image(jpeg.getvalue())


@dataclass(frozen=True)
class Peer:
    """A peer loader: the module it needs, how to install it, how to build it."""

    name: str
    module: str
    install: str
    build: Callable[[Path, int, int], Batches]  # (ImageFolder root, batch size, threads)
    probe: Callable[[], None] | None = None  # beyond the import: does it work here?

    def missing(self) -> str | None:
        """None when the peer works here, else a one-line note saying how to install it."""
        try:
            importlib.import_module(self.module)
            if self.probe is not None:
                self.probe()
        except Exception as error:  # ImportError, or a library that fails to load
            return (f"{self.name}: not installed ({type(error).__name__}: {error}); "
                    f"{self.install}")
        return None


_HOW = "see fastfeed/bench/peers.py"
PEERS = {peer.name: peer for peer in (
    Peer("dali-cpu", "nvidia.dali", f"pip install nvidia-dali-cuda120 ({_HOW})", DaliRecipe),
    Peer("spdl", "spdl.io", f"pip install spdl==0.8.0 and FFmpeg's libraries ({_HOW})",
         SpdlPipeline, probe=_spdl_decodes),
    Peer("ffcv", "ffcv", f"pip install ffcv==1.0.2 ({_HOW})", _ffcv(channels_last=True)),
    Peer("ffcv-nchw", "ffcv", f"pip install ffcv==1.0.2 ({_HOW})", _ffcv(channels_last=False)),
    *(Peer(name, "dataloader_rs", f"pip install dataloader-rs==0.2.0 on Python 3.13 ({_HOW})",
           _dataloader_rs(**settings))
      for name, settings in (("dataloader-rs", {}), ("dataloader-rs-deep", {"prefetch_depth": 8}),
                             ("dataloader-rs-items2", {"items_in_parallel": 2}))),
)}


def build_peer(name: str, root: Path, batch_size: int, threads: int) -> Batches:
    """A re-iterable loader of peer ``name`` over the ImageFolder at ``root``."""
    return PEERS[name].build(root, batch_size, threads)
