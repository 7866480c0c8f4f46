"""The gather kernels against torch.stack, on random inputs."""

from pathlib import Path
from unittest import mock

import numpy as np
import pytest
import torch

from fastfeed import _stack

DTYPES = [torch.uint8, torch.int16, torch.int64, torch.float16, torch.bfloat16, torch.float32,
          torch.float64, torch.bool, torch.complex64]


def random_tensor(shape, dtype, generator):
    if dtype == torch.bool:
        return torch.rand(shape, generator=generator) > 0.5
    if dtype.is_floating_point or dtype.is_complex:
        return torch.randn(shape, generator=generator).to(dtype)
    return torch.randint(0, 100, shape, generator=generator).to(dtype)


def test_extension_is_built():
    # The README's install builds it on this platform; the fallback is for other platforms.
    assert _stack.extension_loaded()


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("shape", [(), (1,), (3, 5, 7), (0, 4)])
@pytest.mark.parametrize("n", [0, 1, 9])
def test_stack_into_matches_torch_stack(dtype, shape, n):
    g = torch.Generator().manual_seed(n)
    samples = [random_tensor(shape, dtype, g) for _ in range(n)]
    out = torch.empty((n, *shape), dtype=dtype)
    _stack.stack_into(out, samples)
    expected = torch.stack(samples) if n else torch.empty((0, *shape), dtype=dtype)
    assert torch.equal(out, expected)


def test_stack_into_non_contiguous_sources():
    g = torch.Generator().manual_seed(0)
    samples = [torch.randn(6, 8, generator=g).t()[::2] for _ in range(5)]
    out = torch.empty((5, *samples[0].shape))
    _stack.stack_into(out, samples)
    assert torch.equal(out, torch.stack(samples))


def lazy_views(kind):
    """Samples whose bytes are not their values: lazy conjugate or negative views."""
    g = torch.Generator().manual_seed(0)
    if kind == "conj":
        return [torch.randn(4, 3, dtype=torch.complex64, generator=g).conj() for _ in range(5)]
    # A contiguous neg-bit view (x.conj().imag of a one-element tensor is one too).
    return [torch._neg_view(torch.randn(4, 3, generator=g)) for _ in range(5)]


@pytest.mark.parametrize("kind", ["conj", "neg"])
def test_stack_into_and_collate_into_resolve_lazy_views(kind):
    from torch.utils.data import default_collate

    from fastfeed.collate import default_collate_into
    from fastfeed.slots import Arena

    samples = lazy_views(kind)
    out = torch.empty((5, *samples[0].shape), dtype=samples[0].dtype)
    _stack.stack_into(out, samples)
    assert torch.equal(out, torch.stack(samples))
    arena = Arena(0, torch.empty(1 << 12, dtype=torch.uint8))
    assert torch.equal(default_collate_into(samples, arena.empty), default_collate(samples))


@pytest.mark.parametrize("threads", [1, 2, 4])
def test_stack_into_large_batches_split_across_threads(threads):
    samples = [torch.full((3, 512, 1024), i, dtype=torch.uint8) for i in range(12)]  # 18 MiB
    out = torch.empty((12, 3, 512, 1024), dtype=torch.uint8)
    _stack.stack_into(out, samples, threads=threads)
    assert torch.equal(out, torch.stack(samples))


@pytest.mark.parametrize("threads", [1, 2])
@pytest.mark.parametrize("misalign", [0, 1, 15])
@pytest.mark.parametrize("nbytes", [1, 15, 63, 64, 65, 1000, 3 * 224 * 224 + 7])
def test_the_streaming_gather_writes_every_byte(nbytes, misalign, threads):
    """Batches above the threshold are written with non-temporal stores: a 16-byte aligned
    body between memcpy'd ends, whatever the destination's alignment and the sample size."""
    g = torch.Generator().manual_seed(nbytes)
    samples = [torch.randint(0, 256, (nbytes,), dtype=torch.uint8, generator=g) for _ in range(9)]
    buffer = torch.zeros(9 * nbytes + 64, dtype=torch.uint8)
    out = buffer[misalign:misalign + 9 * nbytes]
    _stack._gather.gather(out.data_ptr(), [s.data_ptr() for s in samples], nbytes, threads,
                          streaming_above=0)
    assert torch.equal(out.view(9, nbytes), torch.stack(samples))
    assert not buffer[:misalign].any() and not buffer[misalign + 9 * nbytes:].any()


@pytest.mark.parametrize("channels_last", [False, True])
@pytest.mark.parametrize("streaming_above", [0, 1 << 40])
@pytest.mark.parametrize("misalign", [0, 4, 12])
@pytest.mark.parametrize(("channels", "height", "width"), [(3, 5, 7), (1, 1, 3), (3, 32, 33)])
def test_the_table_gather_maps_every_byte_through_its_channels_table(
        channels, height, width, misalign, streaming_above, channels_last):
    """Contiguous samples and samples in H×W×C memory (as a resize writes them)."""
    g = torch.Generator().manual_seed(height)
    if channels_last:
        samples = [torch.randint(0, 256, (height, width, channels), dtype=torch.uint8,
                                 generator=g).permute(2, 0, 1) for _ in range(5)]
        strides = (1, width * channels, channels)
    else:
        samples = [torch.randint(0, 256, (channels, height, width), dtype=torch.uint8,
                                 generator=g) for _ in range(5)]
        strides = (height * width, width, 1)
    tables = torch.randn(channels, 256, generator=g)
    buffer = torch.zeros(5 * channels * height * width + 4)
    out = buffer[misalign // 4:misalign // 4 + 5 * channels * height * width].view(
        5, channels, height, width)
    _stack._gather.gather_through_tables(out.data_ptr(), [s.data_ptr() for s in samples],
                                         channels, height, width, *strides, tables.data_ptr(),
                                         2, streaming_above=streaming_above)
    batch = torch.stack(samples).long()
    expected = tables[torch.arange(channels).view(1, channels, 1, 1), batch]
    assert torch.equal(out, expected)


def test_images_in_hwc_memory_are_stacked_by_the_transposing_gather(monkeypatch):
    """uint8 C×H×W views of H×W×C images (permute(2, 0, 1), a channels-last resize) take the
    compiled transposing gather, equal to torch.stack; other strides keep torch's path."""
    g = torch.Generator().manual_seed(0)
    images = [torch.randint(0, 256, (6, 7, 3), dtype=torch.uint8, generator=g).permute(2, 0, 1)
              for _ in range(4)]
    assert _stack.gather_addresses(images) is None
    assert _stack.gather_addresses(images, channels_last=True) == [i.data_ptr() for i in images]
    transposed = [i.transpose(1, 2) for i in images]  # C×W×H: neither layout
    assert _stack.gather_addresses(transposed, channels_last=True) is None
    out = torch.empty(4, 3, 6, 7, dtype=torch.uint8)
    calls = []
    kernel = _stack._gather.gather_hwc_to_chw
    monkeypatch.setattr(_stack, "_gather", mock.Mock(
        wraps=_stack._gather, gather_hwc_to_chw=lambda *a: calls.append(a) or kernel(*a)))
    _stack.stack_into(out, images)
    assert torch.equal(out, torch.stack(images)) and len(calls) == 1
    _stack.stack_into(out, [*images[:3], images[3].contiguous()])  # a mixed batch: torch's path
    assert torch.equal(out, torch.stack(images)) and len(calls) == 1


def test_the_table_gather_refuses_what_it_cannot_write():
    samples = [torch.zeros(3, 2, 2, dtype=torch.uint8)]
    addresses = _stack.gather_addresses(samples)
    with pytest.raises(ValueError, match="float32"):
        _stack.gather_through_tables(torch.empty(1, 3, 2, 2, dtype=torch.float64), addresses,
                                     torch.zeros(3, 256))
    with pytest.raises(ValueError, match="C×256"):
        _stack.gather_through_tables(torch.empty(1, 3, 2, 2), addresses, torch.zeros(1, 256))


def test_batches_stream_above_three_quarters_of_the_l3():
    size = Path("/sys/devices/system/cpu/cpu0/cache/index3/size")
    if not size.exists():
        pytest.skip("no L3 size in sysfs here")
    kib = int(size.read_text().strip().rstrip("K"))
    assert _stack._gather.streaming_threshold() == kib * 1024 // 4 * 3


def test_stack_into_rejects_wrong_batch_size():
    with pytest.raises(ValueError, match="holds 2 samples"):
        _stack.stack_into(torch.empty(2, 3), [torch.ones(3)])


@pytest.mark.parametrize("hwc", [(7, 5, 3), (32, 48, 1), (224, 224, 3), (2, 3, 4)])
@pytest.mark.parametrize("as_numpy", [True, False])
def test_hwc_to_chw_matches_permute_stack(hwc, as_numpy):
    rng = np.random.default_rng(0)
    images = [rng.integers(0, 255, hwc, dtype=np.uint8) for _ in range(5)]
    if not as_numpy:
        images = [torch.from_numpy(i) for i in images]
    h, w, c = hwc
    out = torch.empty((5, c, h, w), dtype=torch.uint8)
    _stack.stack_hwc_to_chw(out, images)
    expected = torch.stack([torch.as_tensor(i).permute(2, 0, 1) for i in images])
    assert torch.equal(out, expected)


def test_hwc_to_chw_non_contiguous_and_bad_input():
    rng = np.random.default_rng(1)
    images = [rng.integers(0, 255, (8, 12, 3), dtype=np.uint8)[:, ::2] for _ in range(3)]
    out = torch.empty((3, 3, 8, 6), dtype=torch.uint8)
    _stack.stack_hwc_to_chw(out, images)
    assert torch.equal(out, torch.stack([torch.as_tensor(i).permute(2, 0, 1) for i in images]))
    with pytest.raises(ValueError, match="image 0 has shape"):
        _stack.stack_hwc_to_chw(out, [np.zeros((8, 6, 4), np.uint8)] * 3)
    with pytest.raises(ValueError, match="uint8"):
        _stack.stack_hwc_to_chw(out.float(), images)


def strided_views(rng):
    """Views a pipeline produces: mirrored both ways, cropped, and a transposed tensor."""
    base = rng.integers(0, 255, (12, 16, 3), dtype=np.uint8)
    return [np.fliplr(base[:, :12]), np.flipud(base[:, 2:14]), base[::1, 4:16],
            torch.from_numpy(rng.integers(0, 255, (12, 12, 3), dtype=np.uint8)).transpose(0, 1)]


@pytest.mark.parametrize("compiled", [True, False], ids=["extension", "fallback"])
def test_hwc_to_chw_strided_views_and_channel_reversal(monkeypatch, compiled):
    if not compiled:
        monkeypatch.setattr(_stack, "_gather", None)
    images = strided_views(np.random.default_rng(3))
    reverse = [True, False, True, False]
    out = torch.empty((4, 3, 12, 12), dtype=torch.uint8)
    _stack.stack_hwc_to_chw(out, images, reverse_channels=reverse)
    expected = [np.asarray(i).transpose(2, 0, 1) for i in images]
    expected = np.stack([x[::-1] if r else x for x, r in zip(expected, reverse, strict=True)])
    assert np.array_equal(out.numpy(), expected)
    with pytest.raises(ValueError, match="3 flags for 4 images"):
        _stack.stack_hwc_to_chw(out, images, reverse_channels=reverse[:3])


def test_pure_torch_fallback_matches(monkeypatch):
    monkeypatch.setattr(_stack, "_gather", None)
    samples = [torch.arange(12, dtype=torch.float32).view(3, 4) + i for i in range(4)]
    out = torch.empty(4, 3, 4)
    _stack.stack_into(out, samples)
    assert torch.equal(out, torch.stack(samples))
    images = [np.full((4, 5, 3), i, np.uint8) for i in range(2)]
    chw = torch.empty(2, 3, 4, 5, dtype=torch.uint8)
    _stack.stack_hwc_to_chw(chw, images)
    assert torch.equal(chw, torch.stack([torch.from_numpy(i).permute(2, 0, 1) for i in images]))
