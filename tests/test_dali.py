"""The DALI backend in CPU-only mode (installed through the ``dali`` extra)."""

import math

import pytest
import torch

from fastfeed.vision import ImageFolder, image_loader
from fastfeed.vision.synthetic import make_imagefolder

pytest.importorskip("nvidia.dali",
                    reason="NVIDIA DALI is not installed (the dali extra)")

from fastfeed.vision import dali
from fastfeed.vision.dali import DaliLoader, epoch_batches


@pytest.fixture(scope="module")
def folder(tmp_path_factory):
    return make_imagefolder(tmp_path_factory.mktemp("dali"), images=45, classes=3)


def test_eval_batches_match_the_cpu_backend(folder):
    loader = DaliLoader(folder, batch_size=8, size=64, train=False)
    reference = ImageFolder(folder, size=64, train=False)
    seen = 0
    for images, targets in loader:
        assert images.dtype == torch.uint8 and images.shape[1:] == (3, 64, 64)
        for image, target in zip(images, targets.tolist(), strict=True):
            want, want_target = reference[seen]
            assert target == want_target
            diff = (image.int() - want.int()).abs().float().mean()
            assert diff < 6.0, (seen, diff)
            seen += 1
    assert seen == len(reference)


@pytest.mark.parametrize("drop_last", [False, True])
def test_epochs_len_and_last_batch(folder, drop_last):
    loader = DaliLoader(folder, batch_size=8, size=32, train=True, drop_last=drop_last)
    expected = 45 // 8 if drop_last else math.ceil(45 / 8)
    assert len(loader) == expected
    for _ in range(2):
        sizes = [len(targets) for _, targets in loader]
        assert len(sizes) == expected
        assert sizes[-1] == (8 if drop_last else 45 % 8)


def test_image_loader_picks_dali(folder):
    loader = image_loader(folder, batch_size=8, size=32, backend="dali")
    images, targets = next(iter(loader))
    assert images.shape == (8, 3, 32, 32) and targets.dtype == torch.int64


def as_rank(monkeypatch, rank, world):
    """What DaliLoader sees in rank ``rank`` of an initialised torch.distributed job."""
    monkeypatch.setattr(dali.dist, "is_initialized", lambda: True)
    monkeypatch.setattr(dali.dist, "get_rank", lambda: rank)
    monkeypatch.setattr(dali.dist, "get_world_size", lambda: world)


@pytest.fixture(scope="module")
def numbered(tmp_path_factory):
    """13 images, each its own class: a target names its sample."""
    return make_imagefolder(tmp_path_factory.mktemp("dali13"), images=13, classes=13)


@pytest.mark.parametrize("world, batch_size, drop_last", [
    (3, 3, False), (3, 4, False), (4, 3, False), (4, 4, False), (3, 4, True), (2, 3, True),
    (4, 2, True)])  # shards of 3 and 4: one whole batch in the smallest, two in the largest
def test_every_rank_yields_len_batches_and_together_every_sample(numbered, monkeypatch, world,
                                                                  batch_size, drop_last):
    """DDP needs the same number of batches in every rank, every epoch (else a collective
    waits forever): checked against DALI's own sharding, over epochs in which the ranks move
    to other shards of different sizes."""
    epochs = []  # per rank: per epoch, the batches' targets
    for rank in range(world):
        as_rank(monkeypatch, rank, world)
        loader = DaliLoader(numbered, batch_size=batch_size, size=16, drop_last=drop_last,
                            num_threads=1)
        assert len(loader) == epoch_batches(13, world, batch_size, drop_last)[0]
        epochs.append([[targets.tolist() for _, targets in loader] for _ in range(3)])
        assert all(len(epoch) == len(loader) for epoch in epochs[-1]), epochs[-1]
    for epoch in range(3):
        sizes = {tuple(len(b) for b in ranks[epoch]) for ranks in epochs}
        assert len(sizes) == 1, sizes  # the same batch sizes in every rank
        seen = [t for ranks in epochs for batch in ranks[epoch] for t in batch]
        if not drop_last:  # every sample, a few of them twice (as DistributedSampler pads)
            assert set(seen) == set(range(13)) and len(seen) == world * -(-13 // world)
        else:  # whole batches only: no sample padded in, none twice
            assert len(seen) == len(set(seen)), seen


def test_ranks_draw_different_seeds(numbered, monkeypatch):
    seeds = set()
    for rank in range(3):
        as_rank(monkeypatch, rank, 3)
        loader = DaliLoader(numbered, batch_size=4, size=16, seed=7)
        next(iter(loader))
        seeds.add(loader._iterator._pipes[0].seed)
    assert len(seeds) == 3


@pytest.mark.parametrize("drop_last", [False, True])
def test_an_epoch_left_early_does_not_shorten_the_next(numbered, drop_last):
    """A ``break`` (Lightning's sanity check, ``limit_train_batches``): the next ``iter()`` is a
    whole epoch of ``len()`` batches, every sample once, the last batch cut as it should be."""
    loader = DaliLoader(numbered, batch_size=4, size=16, train=False, drop_last=drop_last,
                        num_threads=1)
    whole = [targets.tolist() for _, targets in loader]
    for stop in (1, len(loader) - 1, len(loader)):
        for step, _ in enumerate(loader):
            if step + 1 == stop:
                break
        assert [targets.tolist() for _, targets in loader] == whole
    assert len(whole) == len(loader)
    assert [t for batch in whole for t in batch] == list(range(12 if drop_last else 13))


def test_too_few_images_for_one_batch_is_a_clear_error(numbered):
    with pytest.raises(ValueError, match="fill no batch of 8"):
        DaliLoader(numbered, batch_size=8, size=16, drop_last=True, rank=0, world_size=2)


def test_targets_are_on_the_images_device():
    """On a GPU the labels leave the pipeline on the GPU too (checked on DALI's graph, which
    builds without one)."""
    from nvidia.dali import Pipeline

    with Pipeline(batch_size=2, num_threads=1, device_id=None):
        images, labels = dali._graph(["a.jpg"], [0], (0, 1), 16, True, on_gpu=True)
    assert images.device == labels.device == "gpu"
    with Pipeline(batch_size=2, num_threads=1, device_id=None):
        images, labels = dali._graph(["a.jpg"], [0], (0, 1), 16, False, on_gpu=False)
    assert images.device == labels.device == "cpu"


def on_two_gpus(monkeypatch, current=0):
    """What DaliLoader sees on a machine with two visible GPUs; returns the pipeline's
    arguments once it is built (recorded: there is no GPU here)."""
    import nvidia.dali
    import nvidia.dali.plugin.pytorch

    state = {"current": current}
    for name, value in (("is_available", True), ("device_count", 2), ("is_initialized", True)):
        monkeypatch.setattr(torch.cuda, name, lambda value=value: value)
    monkeypatch.setattr(torch.cuda, "current_device", lambda: state["current"])
    monkeypatch.setattr(torch.cuda, "set_device", lambda index: state.update(current=index))
    built = {}

    def record_pipeline(function):
        def make(**kwargs):
            built.update(kwargs)
            return type("Recorded", (), {"build": lambda self: None})()
        return make

    monkeypatch.setattr(nvidia.dali, "pipeline_def", record_pipeline)
    monkeypatch.setattr(nvidia.dali.plugin.pytorch, "DALIGenericIterator",
                        lambda *args, **kwargs: iter(()))
    return built


def test_bare_cuda_decodes_on_this_ranks_gpu(folder, monkeypatch):
    """A bare "cuda" in rank LOCAL_RANK of a node whose GPUs all are visible: that rank's GPU,
    not GPU 0 in every rank."""
    built = on_two_gpus(monkeypatch)
    monkeypatch.setenv("LOCAL_RANK", "1")
    loader = DaliLoader(folder, batch_size=8, device="cuda")
    list(loader)
    assert built["device_id"] == 1 and loader.device == torch.device("cuda", 1)


def test_the_gpu_a_script_sets_after_making_the_loader_is_the_one_used(folder, monkeypatch):
    """mp.spawn, no LOCAL_RANK: each rank calls torch.cuda.set_device(rank) after building its
    loader. DALI must decode on that GPU, not on GPU 0 in every rank."""
    built = on_two_gpus(monkeypatch)
    monkeypatch.delenv("LOCAL_RANK", raising=False)
    loader = DaliLoader(folder, batch_size=8, device="cuda")
    torch.cuda.set_device(1)
    list(loader)
    assert built["device_id"] == 1


@pytest.mark.gpu
def test_gpu_pipeline_after_a_break_yields_whole_epochs(numbered):
    loader = DaliLoader(numbered, batch_size=4, size=32, train=False, device="cuda")
    for _ in loader:
        break
    targets = [t.cpu() for _, t in loader]
    assert len(targets) == len(loader) and torch.cat(targets).tolist() == list(range(13))


@pytest.mark.gpu
def test_gpu_pipeline_yields_cuda_images_and_targets(numbered):
    loader = DaliLoader(numbered, batch_size=4, size=32, train=True, device="cuda")
    batches = 0
    for images, targets in loader:
        assert images.is_cuda and targets.device == images.device
        assert images.dtype == torch.uint8 and targets.dtype == torch.int64
        batches += 1
    assert batches == len(loader) == math.ceil(13 / 4)
