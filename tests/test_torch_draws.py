"""The numbers of torch's default generator, drawn from a copy of its state: each equal to the
torch op it stands for, the generator left where those ops leave it, and no copy made where
another thread could draw meanwhile."""

import threading
from unittest import mock

import pytest
import torch

from fastfeed.vision.accelerate import torch_draws
from fastfeed.vision.accelerate.torch_draws import Draws, Undecided, draw_session

pytestmark = pytest.mark.skipif(torch_draws._mt19937 is None,
                                reason="fastfeed._mt19937 was not built")

# One random op after another, as RandomResizedCrop and a flip make them: (what Draws calls,
# the torch op); enough of them to cross the generator's regeneration of its 624 words.
OPS = [
    (lambda d: d.uniform(0.08, 1.0), lambda: torch.empty(1).uniform_(0.08, 1.0).item()),
    (lambda d: d.uniform(-0.2877, 0.2877), lambda: torch.empty(1).uniform_(-0.2877, 0.2877).item()),
    (lambda d: d.randint(0, 281), lambda: torch.randint(0, 281, size=(1,)).item()),
    (lambda d: d.randint(0, 2**27 + 7), lambda: torch.randint(0, 2**27 + 7, size=(1,)).item()),
    (lambda d: d.rand(), lambda: torch.rand(1).item()),
]


@pytest.mark.parametrize("skip", [0, 1, 623, 624, 1000])
def test_every_number_and_the_state_after_equal_torchs(skip):
    torch.manual_seed(11)
    torch.rand(skip)  # anywhere in the generator's cycle of 624 words
    start = torch.get_rng_state()
    expected = [torch_op() for _ in range(300) for _, torch_op in OPS]
    after = torch.get_rng_state()
    torch.set_rng_state(start)
    draws = Draws(torch.get_rng_state(), torch_draws._uniform_is_fused())
    got = [draw(draws) for _ in range(300) for draw, _ in OPS]
    assert torch.equal(torch.get_rng_state(), start), "drawing must not touch the generator"
    draws.commit()
    assert got == expected
    assert torch.equal(torch.get_rng_state(), after)


def test_a_value_rounding_to_the_upper_bound_is_left_to_torch():
    """torch releases differ there (2.14 returns the lower bound): never guessed."""
    torch.manual_seed(0)
    draws = Draws(torch.get_rng_state(), torch_draws._uniform_is_fused())
    high = 1.0 + 2**-23  # the next float32: half the draws round up to it
    with pytest.raises(Undecided):
        for _ in range(64):
            draws.uniform(1.0, high)


@pytest.mark.parametrize(("low", "high"), [(5, 5), (0, 2**28)])
def test_ranges_torch_refuses_or_draws_64_bits_for_are_left_to_torch(low, high):
    draws = Draws(torch.get_rng_state(), torch_draws._uniform_is_fused())
    with pytest.raises(Undecided):
        draws.randint(low, high)


def test_the_fused_form_is_the_one_torch_uses():
    """The calibration picks the form whose draws equal torch's; a form that agrees with
    neither (a torch whose formula changed) turns the copies off."""
    fused = torch_draws._uniform_is_fused()
    assert fused is not None
    torch.manual_seed(5)
    state = torch.get_rng_state()
    expected = torch.empty(4096).uniform_(0.08, 1.0).tolist()
    words = torch_draws._mt19937.draw_words(state.data_ptr(), 4096)
    made = [torch_draws._mt19937.uniform_float(w, 0.08, 1.0, fused) for w in words]
    other = [torch_draws._mt19937.uniform_float(w, 0.08, 1.0, not fused) for w in words]
    assert made == expected != other
    torch_draws._uniform_is_fused.cache_clear()
    try:
        with mock.patch.object(torch_draws, "_mt19937", mock.Mock(
                wraps=torch_draws._mt19937, uniform_float=lambda w, lo, hi, f: 0.5)):
            assert torch_draws._uniform_is_fused() is None
    finally:
        torch_draws._uniform_is_fused.cache_clear()


def test_sessions_only_in_a_worker_process_main_thread():
    assert draw_session() is None  # the main process: a training thread may draw meanwhile
    with mock.patch.object(torch_draws, "get_worker_info", return_value=object()):
        assert isinstance(draw_session(), Draws)
        in_thread = []
        thread = threading.Thread(target=lambda: in_thread.append(draw_session()))
        thread.start()
        thread.join()
        assert in_thread == [None]
        default = torch.get_default_dtype()
        torch.set_default_dtype(torch.float64)
        try:
            assert draw_session() is None  # torchvision's one-element tensors are float64
        finally:
            torch.set_default_dtype(default)
