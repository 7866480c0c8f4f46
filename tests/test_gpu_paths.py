"""The GPU paths as a user with several GPUs meets them, on the modelled machine
(``cuda_model``): the devices a rank touches, device memory, the decoders' errors and streams,
the first batch's Triton compile and the doctor's GPU clock."""

import ctypes
import io

import cuda_model
import numpy as np
import nvjpeg_model
import pytest
import torch
from helpers import assert_same
from PIL import Image
from sample_datasets import TensorDataset
from torch.utils.data import DataLoader

from fastfeed import FastLoader
from fastfeed.device.own_streams import OwnStreamError
from fastfeed.tree import map_tensors
from fastfeed.vision.gpu_decode import DecodeCrops, EncodedCrop, collate_crops
from fastfeed.vision.resample import crop_geometry


class OnTheHelper:
    """A gpu_transform that runs on the device stage's helper thread (``blocks_host``), as the
    GPU decode and the Ultralytics pixel ops do, and computes on the batch."""

    blocks_host = True

    def __call__(self, batch):
        return [batch[0] + 1, batch[1]]


@pytest.mark.parametrize("rank", ["set_device", "device index"])
def test_a_rank_makes_no_context_on_a_gpu_it_does_not_use(monkeypatch, rank):
    # Rank 1 of a DDP job: its script calls torch.cuda.set_device(1), or names cuda:1 and
    # never sets the device. Leaving torch.cuda.stream(copy stream) on the helper thread (on
    # device 0, as every new thread) restored device 0's stream through cudaSetDevice(0):
    # a context (half a GiB) on GPU 0 from every rank.
    gpu = cuda_model.install(monkeypatch, cuda_model.Gpu(devices=2))
    if rank == "set_device":
        torch.cuda.set_device(1)
    dataset = TensorDataset(n=16, shape=(3, 4, 4))
    loader = FastLoader(dataset, batch_size=4, num_workers=2, gpu_transform=OnTheHelper(),
                        device="cuda" if rank == "set_device" else "cuda:1")
    got = list(loader)
    gpu.run()
    assert gpu.contexts == {1}
    assert {batch[0].device for batch in got} == {torch.device("cuda", 1)}
    assert_same([[b[0] + 1, b[1]] for b in DataLoader(dataset, batch_size=4)],
                [map_tensors(gpu.read, batch) for batch in got])


# -- the GPU JPEG decoders -----------------------------------------------------------------------

# torchvision before 0.29 ends its wrapped errors with the inner error's C++ backtrace
LIBRARIES = ["torchvision", "torchvision 0.28", "torchcodec"]


def jpeg(seed, size=(40, 32)):
    values = np.random.default_rng(seed).integers(0, 256, (size[1], size[0], 3), np.uint8)
    file = io.BytesIO()
    Image.fromarray(values).save(file, "JPEG")
    return file.getvalue()


def crops_batch(count, device="cuda", seed=0):
    """A batch of encoded crops (and its labels) on ``device``, as FastLoader's copy makes it;
    and what it should decode to (Pillow's decode, the same resize, on the CPU)."""
    crops = [EncodedCrop.encoded(jpeg(seed + i), crop_geometry((2, 1, 30, 24), (16, 16)),
                                 f"{seed + i}.jpg") for i in range(count)]
    batch = [collate_crops(crops), torch.arange(count)]
    want = DecodeCrops(decoder=nvjpeg_model.decode_with_pillow).images(batch[0])

    def to_device(tensor):
        if not tensor.numel():
            return torch.empty(tensor.shape, dtype=tensor.dtype, device=device)
        return tensor.pin_memory().to(device, non_blocking=True)

    return map_tensors(to_device, batch), want


@pytest.mark.parametrize("library", LIBRARIES)
def test_out_of_memory_in_the_decoder_is_not_taken_for_a_refused_file(monkeypatch, caplog,
                                                                      library):
    # nvJPEG allocates with cudaMalloc, outside torch's cache: once the cache holds the free
    # memory, the decode fails (torchvision wraps even that in "Error while decoding JPEG
    # images: ..."). Taken for a refusal, the batch was retried file by file and decoded on
    # the host. torch's cache released, the decode goes through.
    gpu = cuda_model.install(monkeypatch, cuda_model.Gpu(64 << 20))
    decoder = nvjpeg_model.install(monkeypatch, gpu, library)
    batch, want = crops_batch(4)
    cached = torch.empty(58 << 20, dtype=torch.uint8, device="cuda")
    del cached  # torch's cache holds it, for the default stream
    images = DecodeCrops()(batch)[0]
    gpu.run()
    assert torch.equal(gpu.read(images), want)
    assert decoder.calls == 2 and gpu.allocators[0].flushes == 1
    assert "refused" not in caplog.text


@pytest.mark.parametrize("library", LIBRARIES)
def test_a_file_the_decoder_refuses_is_decoded_on_the_host(monkeypatch, caplog, library):
    # torchvision 0.26-0.28: the status was followed by a C++ backtrace, the anchored match
    # missed it, and the refusal was raised: the batch failed.
    gpu = cuda_model.install(monkeypatch, cuda_model.Gpu())
    decoder = nvjpeg_model.install(monkeypatch, gpu, library)
    batch, want = crops_batch(3)
    decoder.refused.add(batch[0]["encoded"][1].tobytes())
    images = DecodeCrops()(batch)[0]
    gpu.run()
    assert torch.equal(gpu.read(images), want)
    assert "refused 1 file(s)" in caplog.text and "Exception raised from" not in caplog.text


@pytest.mark.parametrize("library", LIBRARIES)
def test_out_of_torchs_memory_is_raised_without_a_second_flush(monkeypatch, library):
    # nvJPEG got its memory, torch's allocator then did not (it released its own cache and
    # tried again before raising): releasing the cache again frees nothing, and the retry
    # flushed every stream's cache on the device for nothing.
    gpu = cuda_model.install(monkeypatch, cuda_model.Gpu(64 << 20))
    decoder = nvjpeg_model.install(monkeypatch, gpu, library)
    batch, _ = crops_batch(4)
    memory = gpu.allocators[0].memory
    other = memory.driver_malloc(memory.capacity - sum(memory.taken.values()) - (5 << 20))
    decode = DecodeCrops()
    with pytest.raises(torch.OutOfMemoryError, match=r"CUDA out of memory\. Tried to allocate"):
        decode(batch)
    assert decoder.calls == 1 and decode.memory_retries == 0
    memory.driver_free(other)


@pytest.mark.parametrize("where", ["this thread", "another thread"])
def test_no_retry_releases_torchs_cache_while_a_cuda_graph_is_captured(monkeypatch, where):
    # torch.cuda.empty_cache() on the decode's thread while the training thread captured a
    # CUDA graph: torch's allocator refuses (an internal assert) and the decode failed with
    # that, not as out of memory; on the capturing thread itself the release would end the
    # capture.
    import threading

    gpu = cuda_model.install(monkeypatch, cuda_model.Gpu(64 << 20))
    decoder = nvjpeg_model.install(monkeypatch, gpu)
    batch, _ = crops_batch(4)
    cached = torch.empty(58 << 20, dtype=torch.uint8, device="cuda")
    del cached  # torch's cache holds it: nvJPEG's cudaMalloc fails
    decode, raised = DecodeCrops(), []

    def decode_batch():
        try:
            decode(batch)
        except Exception as error:
            raised.append(error)

    with gpu.capture(torch.cuda.Stream()):
        if where == "this thread":
            decode_batch()
        else:
            helper = threading.Thread(target=decode_batch)
            helper.start()
            helper.join()
        assert gpu.capturing  # the capture goes on
    assert len(raised) == 1 and isinstance(raised[0], torch.OutOfMemoryError), raised
    assert "not decoded again" in str(raised[0]) and "CUDA graph" in str(raised[0])
    assert decoder.calls == 1 and gpu.allocators[0].flushes == 0


def test_a_retry_after_releasing_torchs_cache_is_counted_and_logged(monkeypatch, caplog):
    gpu = cuda_model.install(monkeypatch, cuda_model.Gpu(64 << 20))
    nvjpeg_model.install(monkeypatch, gpu)
    batch, want = crops_batch(4)
    cached = torch.empty(58 << 20, dtype=torch.uint8, device="cuda")
    del cached
    decode = DecodeCrops()
    images = decode(batch)[0]
    gpu.run()
    assert torch.equal(gpu.read(images), want)
    assert decode.memory_retries == 1
    warned = [r for r in caplog.records if r.levelname == "WARNING"]
    assert len(warned) == 1 and "(1 time(s) so far)" in warned[0].getMessage()


@pytest.mark.parametrize("library", LIBRARIES)
def test_a_device_out_of_memory_is_raised_as_such(monkeypatch, caplog, library):
    gpu = cuda_model.install(monkeypatch, cuda_model.Gpu(64 << 20))
    decoder = nvjpeg_model.install(monkeypatch, gpu, library)
    batch, _ = crops_batch(4)
    held = torch.empty(58 << 20, dtype=torch.uint8, device="cuda")  # the user's, in use
    with pytest.raises(torch.OutOfMemoryError, match=r"out of device memory.*: 5"):
        DecodeCrops()(batch)
    assert decoder.calls == 2 and "refused" not in caplog.text
    del held


@pytest.mark.parametrize("library", LIBRARIES)
def test_a_decode_stream_that_cannot_be_made_is_raised_once_not_refused(monkeypatch, caplog,
                                                                        library):
    # A driver older than the runtime: every call fails. Taken for a refusal, every file of
    # every batch was decoded on the host, the driver asked again for each.
    gpu = cuda_model.install(monkeypatch, cuda_model.Gpu())
    decoder = nvjpeg_model.install(monkeypatch, gpu, library)
    batch, _ = crops_batch(3)
    gpu.driver.fail = 35  # CUDA_ERROR_INSUFFICIENT_DRIVER... as cuInit reports it
    decode = DecodeCrops()
    with pytest.raises(OwnStreamError, match=r"decode stream on cuda:0: cuInit failed: CUDA "
                                             r"driver error 35 \(CUDA driver version is"):
        decode(batch)
    asked = gpu.driver.calls
    with pytest.raises(OwnStreamError, match="driver error 35"):
        decode(batch)
    assert gpu.driver.calls == asked == 1  # remembered
    assert decoder.calls == 0 and "refused" not in caplog.text


@pytest.mark.parametrize("library", LIBRARIES)
def test_the_decoders_host_waits_wait_for_no_one_elses_work(monkeypatch, tmp_path, library):
    # torchvision's decoder writes on a stream of torch's pool, taken when it is built, and
    # waits for it on the host twice a batch. A validation loader built it; NCCL and the user
    # then took the other 31 pool streams, each with work queued (collectives); the training
    # loader's copy stream, from the pool, was then the decoder's: each decode waited for the
    # last batch's resize.
    from fastfeed.vision.encoded_folder import EncodedImageFolder, nvjpeg_transform
    from fastfeed.vision.gpu_decode import encoded_collate
    from fastfeed.vision.synthetic import make_imagefolder

    gpu = cuda_model.install(monkeypatch, cuda_model.Gpu())
    decoder = nvjpeg_model.install(monkeypatch, gpu, library)
    folder = EncodedImageFolder(make_imagefolder(tmp_path, images=12, classes=2), 16,
                                train=False)

    def loader():
        return FastLoader(folder, batch_size=4, device="cuda", collate_fn=encoded_collate,
                          gpu_transform=nvjpeg_transform())

    list(loader())  # validation
    gpu.run()
    for stream in [torch.cuda.Stream() for _ in range(31)]:
        gpu.launch(stream, "all_reduce", lambda: None)
    decoder.waited_for.clear()
    got = list(loader())
    gpu.run()
    assert decoder.waited_for == []
    assert len(got) == 3


@pytest.mark.parametrize("library", LIBRARIES)
def test_two_devices_decoding_in_one_process(monkeypatch, library):
    # Two GPU-decode loaders on two devices: torchvision keeps one decoder for the process
    # and built a new one, leaking the last, whenever the device changed: every batch.
    # TorchCodec keeps one per device; with torchvision the second device is refused.
    gpu = cuda_model.install(monkeypatch, cuda_model.Gpu(devices=2))
    decoder = nvjpeg_model.install(monkeypatch, gpu, library)
    decode = DecodeCrops()
    for _ in range(2):  # each device twice
        for index in (0, 1):
            with torch.cuda.device(index):
                batch, want = crops_batch(2, f"cuda:{index}", seed=index)
                if library.startswith("torchvision") and index == 1:
                    with pytest.raises(RuntimeError, match="one device per process"):
                        decode(batch)
                    continue
                images = decode(batch)[0]
            assert images.device == torch.device("cuda", index)
            gpu.run()
            assert torch.equal(gpu.read(images), want)
    if library.startswith("torchvision"):
        assert decoder.built == [0]
    else:
        assert sorted(decoder.states) == [0, 1]


# -- the doctor's GPU clock ------------------------------------------------------------------------

def test_the_doctors_gpu_clock_reads_the_gpu_the_rank_trains_on(monkeypatch):
    # A DDP script run by torchrun that never calls set_device: its thread's current device is
    # 0, its GPU LOCAL_RANK's. Events recorded on the current device timed GPU 0 (and made a
    # context there).
    from fastfeed.doctor.gpu_waits import GpuWaits

    gpu = cuda_model.install(monkeypatch, cuda_model.Gpu(devices=2))
    monkeypatch.setenv("LOCAL_RANK", "1")
    waits = GpuWaits()
    for index in range(3):
        mark = waits.request()
        gpu.launch(gpu.current_stream(1), "the training step", lambda: None)
        waits.deliver(index, mark)
    waits.finish()
    assert sorted(waits.idle_s) == [0, 1, 2]
    assert mark.recorded.stream is gpu.current_stream(1)
    assert gpu.contexts == {1}


def test_what_watches_a_script_on_cuda_n_without_set_device_watches_gpu_n(monkeypatch):
    # One process, model.to("cuda:1"), no set_device, no LOCAL_RANK: the thread's current
    # device stays 0, which has no context. The doctor's GPU clock timed GPU 0 (and made a
    # context there), its loader-alone trials and GPU sampler ran on and read GPU 0.
    from fastfeed.doctor.gpu_waits import GpuWaits
    from fastfeed.doctor.measure import _device

    gpu = cuda_model.install(monkeypatch, cuda_model.Gpu(devices=2))
    monkeypatch.delenv("LOCAL_RANK", raising=False)
    torch.zeros(4, device="cuda:1")  # the model's parameters
    assert torch.cuda.current_device() == 0 and gpu.contexts == {1}
    waits = GpuWaits()
    mark = waits.request()
    gpu.launch(gpu.current_stream(1), "the training step", lambda: None)
    waits.deliver(0, mark)
    waits.finish()
    assert list(waits.idle_s) == [0] and mark.recorded.stream is gpu.current_stream(1)
    assert _device() == torch.device("cuda", 1)
    assert gpu.contexts == {1}


def test_the_pin_helper_makes_no_context_on_gpu_0_for_a_script_on_cuda_n(monkeypatch):
    # torch's pin thread, and fastfeed's helper, set the training thread's current device:
    # 0 in a script that moved its model to cuda:1 without set_device, so every DDP rank
    # made a context on GPU 0.
    gpu = cuda_model.install(monkeypatch, cuda_model.Gpu(devices=2))
    monkeypatch.delenv("LOCAL_RANK", raising=False)
    torch.zeros(4, device="cuda:1")
    dataset = TensorDataset(n=16, shape=(3,))
    got = list(FastLoader(dataset, batch_size=4, num_workers=2, pin_memory=True))
    assert all(batch[0].is_pinned() for batch in got)
    assert gpu.contexts == {1}


def test_the_doctors_gpu_clock_never_fails_a_rank_given_several_gpus(monkeypatch):
    # Two GPUs per rank (CUDA_VISIBLE_DEVICES), LOCAL_RANK 3: no GPU of this process is
    # LOCAL_RANK's, and the script's next() must not raise for the doctor's sake.
    from fastfeed.doctor.gpu_waits import GpuWaits

    gpu = cuda_model.install(monkeypatch, cuda_model.Gpu(devices=2))
    monkeypatch.setenv("LOCAL_RANK", "3")
    waits = GpuWaits()
    mark = waits.request()
    waits.deliver(0, mark)
    waits.finish()
    assert list(waits.idle_s) == [0]
    assert mark.recorded.stream is gpu.current_stream(0)


# -- device memory ---------------------------------------------------------------------------------

def imagenet_like_files(count, seed=0):
    """JPEGs of ImageNet's usual sizes (500x375 and 375x500, 500x333, smaller ones) with four
    5-megapixel photos among them, each with a RandomResizedCrop window to 224x224."""
    import math
    import random

    rng = random.Random(seed)
    files, sizes = [], []
    for i in range(count):
        if i < 4:
            size = (2592, 1944) if i % 2 else (1944, 2592)
        else:
            size = rng.choice([(500, 375), (500, 375), (375, 500), (500, 333),
                               (rng.randint(200, 500), rng.randint(150, 500))])
        file = io.BytesIO()
        Image.new("RGB", size, (i % 256, 80, 160)).save(file, "JPEG", quality=50)
        files.append(file.getvalue())
        sizes.append(size)

    def crop(w, h):
        while True:
            area = w * h * rng.uniform(0.08, 1.0)
            ratio = math.exp(rng.uniform(math.log(3 / 4), math.log(4 / 3)))
            cw, ch = round(math.sqrt(area * ratio)), round(math.sqrt(area / ratio))
            if 0 < cw <= w and 0 < ch <= h:
                return crop_geometry((rng.randint(0, w - cw), rng.randint(0, h - ch), cw, ch),
                                     (224, 224), flip=rng.random() < 0.5)

    def batch():
        order = rng.sample(range(count), count)
        return collate_crops([EncodedCrop.encoded(files[i], crop(*sizes[i]), f"{i}.JPEG")
                              for i in order])

    return batch


def test_a_batch_of_256_takes_under_three_quarters_of_a_gib_and_the_same_every_batch(
        monkeypatch):
    # Decoded images and the resize's float tables and passes, on torch's caching allocator
    # (cached per stream, where the training stream cannot use it): 0.91 GiB a batch before
    # the resize was cut into pieces of bounded size (and uint8 batches converted piece by
    # piece, not through a float copy of the whole batch); 0.33 GiB now.
    gpu = cuda_model.install(monkeypatch, cuda_model.Gpu(4 << 30))
    nvjpeg_model.install(monkeypatch, gpu)
    allocator = gpu.allocators[0]
    batches = imagenet_like_files(256)
    decode, copy, peaks, reserved = DecodeCrops(), torch.cuda.Stream(), [], []
    labels = torch.arange(256).pin_memory().to("cuda", non_blocking=True)
    with torch.cuda.stream(copy):
        pixels = torch.empty((0, 3, 224, 224), dtype=torch.uint8, device="cuda")
    baseline = allocator.reserved
    for _ in range(3):
        crops = batches()
        allocator.reset_peak()
        with torch.cuda.stream(copy):
            images = decode([{**crops, "pixels": pixels}, labels])[0]
        peaks.append(allocator.peak_reserved - baseline)
        gpu.run()  # the training step takes the batch
        del images
        reserved.append(allocator.reserved)
    print("peak reserved per batch, GiB:", [round(p / 2**30, 3) for p in peaks])
    assert max(peaks) < 0.75 * 2**30, [p / 2**30 for p in peaks]
    assert reserved[1] == reserved[2], reserved


# -- Triton's first compile ------------------------------------------------------------------------

def test_the_pixel_kernel_is_built_before_the_first_batch_is_asked_for(monkeypatch):
    # Triton compiles a kernel at its first launch for each specialisation (its argument types,
    # and each int as 1, a multiple of 16 or neither): seconds with a cold cache, on every rank,
    # which landed in the training thread's first wait. Here the compile is a stand-in that
    # says when, where and for what it ran.
    import sys
    import threading
    import types

    import test_pixel_ops_launches as samples

    from fastfeed.ultralytics.gpu_augment import CanvasCollate, PixelOps

    gpu = cuda_model.install(monkeypatch, cuda_model.Gpu())
    built, compiles = threading.Event(), []

    def apply_pixel_ops(pixels, regions, params, luts, size, border, truncate, columns):
        key = (pixels.dtype, regions.dtype, params.dtype, luts.dtype, params.shape[1],
               *(1 if n == 1 else 16 if n % 16 == 0 else 0 for n in size), truncate, columns)
        if key not in {k for _, k in compiles}:
            compiles.append((threading.current_thread().name, key))
            built.set()
        return torch.zeros((len(regions), 3, size[1], size[0]), dtype=torch.uint8,
                           device=pixels.device)

    kernel = types.ModuleType("fastfeed.ultralytics.pixel_kernel")
    kernel.apply_pixel_ops = apply_pixel_ops
    monkeypatch.setitem(sys.modules, "fastfeed.ultralytics.pixel_kernel", kernel)
    # Ultralytics' sizes are multiples of 32.
    loader = FastLoader(samples.RecordedSamples(size=(32, 64)), batch_size=4, num_workers=2,
                        device="cuda", collate_fn=CanvasCollate(samples.listed),
                        gpu_transform=PixelOps(truncate_hsv=True))
    batches = iter(loader)
    assert built.wait(timeout=60), "nothing was built before the first batch was asked for"
    assert len(list(batches)) == 3
    gpu.run()
    assert len(compiles) == 1 and compiles[0][0].startswith("fastfeed-copy")
    assert gpu.syncs_in("MainThread") == []


def test_torchcodec_decodes_where_it_imports_and_info_says_which(monkeypatch):
    from fastfeed.vision import jpeg_decoders

    monkeypatch.delenv("FASTFEED_JPEG_DECODER", raising=False)
    monkeypatch.setattr(jpeg_decoders.importlib.metadata, "version", lambda name: "9.9")
    for usable, chosen in ((("torchcodec", "torchvision"), "torchcodec"),
                           (("torchvision",), "torchvision"), ((), None)):
        monkeypatch.setattr(jpeg_decoders, "_usable", lambda name, ok=usable: None if name in ok
                            else f"{name} does not import (ModuleNotFoundError)")
        assert jpeg_decoders.chosen_decoder() == chosen
        assert jpeg_decoders.describe().startswith(f"{chosen} 9.9 (auto" if chosen else "none")
    with pytest.raises(ImportError, match="'torchcodec' cannot decode here: torchcodec does "
                                          "not import"):
        jpeg_decoders.jpeg_decoder("torchcodec")
    with pytest.raises(ImportError, match="pip install torchcodec"):
        jpeg_decoders.jpeg_decoder()
    monkeypatch.setenv("FASTFEED_JPEG_DECODER", "torchvision")
    assert jpeg_decoders.describe() == "torchvision 9.9 (FASTFEED_JPEG_DECODER; pip install " \
        "torchcodec: one decoder per device, no stream of torch's pool)"
    monkeypatch.setenv("FASTFEED_JPEG_DECODER", "nvimgcodec")
    with pytest.raises(ValueError, match="unknown JPEG decoder 'nvimgcodec'"):
        DecodeCrops().decode([np.frombuffer(jpeg(0), np.uint8)], ["0.jpg"], torch.device("cpu"))


def test_a_torchcodec_without_the_gpu_jpeg_decode_is_passed_over(monkeypatch):
    # TorchCodec installed for audio or video, a release before decode_jpeg(device=): it was
    # chosen because it imported, and every GPU-decode batch raised.
    import sys
    import types

    from fastfeed.vision import jpeg_decoders

    gpu = cuda_model.install(monkeypatch, cuda_model.Gpu())
    decoder = nvjpeg_model.install(monkeypatch, gpu, "torchvision")
    monkeypatch.delenv("FASTFEED_JPEG_DECODER")
    old = types.ModuleType("torchcodec.decoders")
    old.decode_jpeg = lambda source, *, mode="RGB": nvjpeg_model.decode_with_pillow(source)
    monkeypatch.setitem(sys.modules, "torchcodec", types.ModuleType("torchcodec"))
    monkeypatch.setitem(sys.modules, "torchcodec.decoders", old)
    versions = {"torchcodec": "0.11.0", "torchvision": "0.29.0"}
    monkeypatch.setattr(jpeg_decoders.importlib.metadata, "version", versions.__getitem__)
    batch, want = crops_batch(3)
    images = DecodeCrops()(batch)[0]
    gpu.run()
    assert torch.equal(gpu.read(images), want) and decoder.calls == 1
    assert jpeg_decoders.describe() == (
        "torchvision 0.29.0 (auto; torchcodec 0.11.0 has no GPU JPEG decode "
        "(decode_jpeg(device=...): 0.16 or later): pip install -U torchcodec)")
    with pytest.raises(ImportError, match=r"'torchcodec' cannot decode here: torchcodec 0\.11\.0"):
        jpeg_decoders.jpeg_decoder("torchcodec")


def test_fastfeeds_streams_are_made_in_their_devices_context_none_of_torchs_pool(monkeypatch):
    # cuStreamCreate in the device's primary context, pushed and popped: no cudaSetDevice (the
    # old way, through the first libcudart mapped, restored the previous device with one),
    # non-blocking as torch's pooled streams, one per process, device and purpose.
    from fastfeed.device.own_streams import own_stream

    gpu = cuda_model.install(monkeypatch, cuda_model.Gpu(devices=3))
    copy = own_stream(torch.device("cuda", 2), "copy")
    assert own_stream(torch.device("cuda", 2), "copy") is copy
    assert own_stream(torch.device("cuda", 2), "decode") is not copy
    assert [flags for _, flags in gpu.driver.created] == [1, 1]  # CU_STREAM_NON_BLOCKING
    assert torch.cuda.current_device() == 0 and gpu.driver._stack() == []
    assert gpu.contexts == {2}
    pooled = {torch.cuda.Stream(device) for device in range(3) for _ in range(32)}
    assert copy.device_index == 2 and copy not in pooled


def test_a_decode_on_another_gpu_than_the_threads_makes_no_context_on_the_threads(monkeypatch):
    # The decode stream's context used to rely on its caller's device guard: called from a
    # thread whose device is 0 (a gpu_transform of the user's, or DecodeCrops by hand), leaving
    # it restored GPU 0's stream by setting device 0.
    from fastfeed.vision.jpeg_decoders import _on_decode_stream

    gpu = cuda_model.install(monkeypatch, cuda_model.Gpu(devices=2))
    images = _on_decode_stream(lambda: [torch.empty(4, device="cuda:1")], torch.device("cuda", 1))
    assert images[0].device == torch.device("cuda", 1)
    assert gpu.contexts == {1} and torch.cuda.current_device() == 0

def test_on_rocm_fastfeeds_streams_are_torchs_pooled_ones(monkeypatch):
    # ROCm's torch runs HIP under torch.cuda and maps no libcuda: asking the driver for a
    # stream failed every loader with device="cuda".
    from fastfeed.device import own_streams

    cuda_model.install(monkeypatch, cuda_model.Gpu(devices=2))
    monkeypatch.setattr(torch.version, "hip", "6.4.0")
    monkeypatch.setattr(own_streams, "libcuda", lambda: ctypes.CDLL("libcuda-of-no-one.so"))
    copy = own_streams.own_stream(torch.device("cuda", 1), "copy")
    assert copy.device_index == 1
    assert copy in {torch.cuda.Stream(1) for _ in range(32)}
