"""Batch transforms against straightforward reference code, on random inputs."""

import pytest
import torch

from fastfeed import transforms as T


def images(n=6, c=3, h=10, w=12, seed=0):
    g = torch.Generator().manual_seed(seed)
    return torch.randint(0, 256, (n, c, h, w), generator=g, dtype=torch.uint8)


@pytest.mark.parametrize(("dtype", "atol"), [(torch.float32, 1e-5), (torch.float16, 1e-2),
                                             (torch.bfloat16, 5e-2)])
def test_normalize_matches_reference(dtype, atol):
    x = images()
    mean, std = (0.4, 0.5, 0.6), (0.2, 0.25, 0.3)
    out = T.Normalize(mean, std, dtype=dtype)(x)
    ref = (x.double() / 255 - torch.tensor(mean).view(-1, 1, 1)) / torch.tensor(std).view(-1, 1, 1)
    assert out.dtype == dtype and out.shape == x.shape
    torch.testing.assert_close(out.double(), ref, atol=atol, rtol=0)


def test_normalize_float_input_and_errors():
    x = torch.rand(2, 1, 4, 4)
    out = T.Normalize((0.5,), (0.5,), max_value=1.0)(x)
    torch.testing.assert_close(out, (x - 0.5) / 0.5)
    with pytest.raises(ValueError, match="channels"):
        T.Normalize((0.5,), (0.5,))(images())
    with pytest.raises(ValueError, match="N×C×H×W"):
        T.Normalize()(torch.zeros(3, 4, 4))
    with pytest.raises(ValueError, match="std must be positive"):
        T.Normalize((0.0,), (0.0,))
    with pytest.raises(ValueError, match="dtype"):
        T.Normalize(dtype=torch.int32)


def test_channels_last():
    x = images().float()
    out = T.ChannelsLast()(x)
    assert out.is_contiguous(memory_format=torch.channels_last) and torch.equal(out, x)


def test_keys_select_leaves():
    batch = {"img": images(), "cls": torch.arange(6)}
    out = T.Normalize(key="img")(batch)
    assert out["cls"] is batch["cls"] and out["img"].dtype == torch.float32
    assert batch["img"].dtype == torch.uint8  # the input batch is not mutated
    pair = T.ChannelsLast(key=0)((images().float(), torch.arange(6)))
    assert isinstance(pair, tuple) and pair[0].is_contiguous(memory_format=torch.channels_last)
    with pytest.raises(KeyError, match="no key 'image'"):
        T.Normalize(key="image")(batch)


@pytest.mark.parametrize("box_format", ["xywhn", "xyxy"])
def test_flip_images_and_boxes_match_reference(box_format):
    x = images(n=8)
    g = torch.Generator().manual_seed(1)
    boxes = torch.rand(20, 4, generator=g) * (1 if box_format == "xywhn" else 12)
    batch_idx = torch.randint(0, 8, (20,), generator=g).float()
    flip = T.RandomHorizontalFlip(p=0.5, key="img", boxes_key="bboxes", batch_idx_key="batch_idx",
                                  box_format=box_format)
    flip.seed(3)
    out = flip({"img": x, "bboxes": boxes, "batch_idx": batch_idx})
    flip.seed(3)
    decisions = flip.sample(8, x.device)
    assert 0 < decisions.sum() < 8
    for i in range(8):
        expected = x[i].flip(-1) if decisions[i] else x[i]
        assert torch.equal(out["img"][i], expected)
    for j in range(20):
        b = boxes[j].clone()
        if decisions[int(batch_idx[j])]:
            if box_format == "xywhn":
                b[0] = 1 - b[0]
            else:
                b[0], b[2] = 12 - boxes[j, 2], 12 - boxes[j, 0]
        torch.testing.assert_close(out["bboxes"][j], b)


def test_random_erasing_matches_reference():
    x = images(n=16, h=20, w=24).float()
    erase = T.RandomErasing(p=0.7, value=-1.0)
    erase.seed(5)
    out = erase(x)
    erase.seed(5)
    params = erase.sample(16, 20, 24, x.device)
    ref = x.clone()
    for i, (apply, top, left, h, w) in enumerate(params.tolist()):
        assert 1 <= h <= 20 and 1 <= w <= 24 and top + h <= 20 and left + w <= 24
        if apply:
            ref[i, :, top:top + h, left:left + w] = -1.0
    assert torch.equal(out, ref)
    assert 0 < params[:, 0].sum() < 16


def test_seeding_is_deterministic_and_compose_seeds_each():
    x = images(n=32)
    def run(seed):
        pipeline = T.Compose([T.RandomHorizontalFlip(), T.RandomErasing(p=1.0)])
        pipeline.seed(seed)
        return pipeline(x)

    assert torch.equal(run(1), run(1))
    assert not torch.equal(run(1), run(2))
