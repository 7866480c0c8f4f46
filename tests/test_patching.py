"""The patching kit (``fastfeed._patching``) that every integration and the doctor's probe use,
tested without the libraries they patch: swaps undone in reverse, a second patch keeping the
first originals, and the FastLoader options checked in one place."""

from __future__ import annotations

import sys
import types

import pytest
import torch

import fastfeed.integrations.hf_accelerate
import fastfeed.integrations.timm
from fastfeed._patching import FASTLOADER_OPTIONS, Overlay, Patch, Swaps, check_fastloader_options
from fastfeed.loader import OWN_OPTIONS


class Recorder:
    """An owner that writes every attribute set on it into ``log``, in order."""

    def __init__(self, log: list, **attributes: object) -> None:
        vars(self).update(attributes, log=log)

    def __setattr__(self, name: str, value: object) -> None:
        self.log.append((name, value))
        super().__setattr__(name, value)


def test_undo_runs_in_reverse_order_of_first_swap():
    log: list = []
    first, second = Recorder(log, a=1, b=2), Recorder(log, c=3)
    swaps = Swaps()
    swaps.set(first, "a", 10)
    swaps.set(second, "c", 30)
    swaps.set(first, "b", 20)
    swaps.set(first, "a", 11)  # a second swap of `a` keeps its place: it was first
    del log[:]
    swaps.undo()
    assert log == [("b", 2), ("c", 3), ("a", 1)]
    assert not swaps


def test_a_second_patch_keeps_the_first_original():
    module = types.ModuleType("library")
    module.read = lambda: "stock"
    stock = module.read
    swaps = Swaps()
    for suffix in ("+first", "+second"):
        swaps.wrap(module, "read", lambda original, s=suffix: lambda: original() + s)
    assert module.read() == "stock+second"  # made from the stock function, not the first wrap
    assert swaps.original(module, "read") is stock
    swaps.undo()
    assert module.read is stock


def test_inherited_methods_and_descriptors_come_back_as_they_were():
    class Base:
        def method(self) -> str:
            return "base"

        @staticmethod
        def static() -> str:
            return "static"

    class Sub(Base):
        pass

    descriptor = vars(Base)["static"]
    swaps = Swaps()
    swaps.wrap(Sub, "method", lambda original: lambda self: "sub over " + original(self))
    swaps.set(Base, "static", staticmethod(lambda: "patched"))
    assert (Sub().method(), Base.static()) == ("sub over base", "patched")
    assert swaps.original(Sub, "method") is Base.method
    swaps.undo()
    assert "method" not in vars(Sub)  # inherited again, not copied onto Sub
    assert vars(Base)["static"] is descriptor and Base.static() == "static"


def test_items_are_swapped_in_their_container_and_put_back_in_order():
    stages = ["read", "decode", "crop"]
    held = stages  # another holder of the same list sees each replacement
    table = {"crop": 1}
    owner = types.SimpleNamespace(stages=stages)
    swaps = Swaps()
    swaps.set_item(stages, 1, "timed decode")
    swaps.set_item(table, "crop", 2)
    swaps.set(owner, "stages", ("a", "tuple"))
    swaps.set_item(stages, 1, "timed again")  # keeps its first original, and its place
    assert held == ["read", "timed again", "crop"] and table == {"crop": 2}
    assert swaps.original(owner, "stages") is stages  # items and attributes apart
    swaps.undo()
    assert owner.stages is stages and held == ["read", "decode", "crop"]
    assert table == {"crop": 1} and not swaps


def test_options_are_checked_against_fastloader_own_keywords():
    assert set(OWN_OPTIONS) == FASTLOADER_OPTIONS
    check_fastloader_options({name: None for name in OWN_OPTIONS})
    with pytest.raises(TypeError, match=r"\['batch_size', 'shuffle'\], which are not "
                                        r"FastLoader options; it takes \["):
        check_fastloader_options({"shuffle": True, "batch_size": 3, "worker_mode": "thread"})


def test_patch_checks_options_once_before_any_swap():
    module = types.ModuleType("library")
    module.DataLoader = torch.utils.data.DataLoader
    calls = []

    def swap(swaps: Swaps, options: dict) -> None:
        calls.append(options)
        swaps.set(module, "DataLoader", options["worker_mode"])

    patch = Patch(swap)
    with pytest.raises(TypeError, match="not FastLoader options"):
        patch.patch(worker_mode="thread", num_workers=2)
    assert calls == [] and not patch.is_patched()
    with pytest.raises(RuntimeError, match="inside"), patch.patched(worker_mode="thread"):
        assert patch.is_patched() and module.DataLoader == "thread"
        raise RuntimeError("inside")
    assert not patch.is_patched() and module.DataLoader is torch.utils.data.DataLoader
    patch.patch(worker_mode="thread")
    patch.patch(worker_mode="process")  # replaces the options only
    assert calls[-1] == {"worker_mode": "process"} and module.DataLoader == "process"
    patch.unpatch()
    assert module.DataLoader is torch.utils.data.DataLoader


@pytest.mark.parametrize("integration", [fastfeed.integrations.timm,
                                         fastfeed.integrations.hf_accelerate])
def test_integrations_check_options_before_importing_their_library(integration):
    with pytest.raises(TypeError, match=r"\['batch_size'\], which are not FastLoader options"):
        integration.patch(batch_size=3)
    assert not integration.is_patched()


def test_overlay_reads_through_but_for_its_overrides():
    overlay = Overlay(torch.utils.data, DataLoader="fast")
    assert overlay.DataLoader == "fast"
    assert overlay.Sampler is torch.utils.data.Sampler
    assert torch.utils.data.DataLoader is not "fast"  # noqa: F632 - the target is untouched


def test_old_accelerate_module_path_warns_and_gives_the_same_functions():
    sys.modules.pop("fastfeed.integrations.accelerate", None)
    with pytest.warns(DeprecationWarning, match="fastfeed.integrations.hf_accelerate") as caught:
        import fastfeed.integrations.accelerate as old
    assert caught[0].filename == __file__  # the warning names the importer
    new = fastfeed.integrations.hf_accelerate
    assert (old.patch, old.unpatch, old.is_patched, old.patched) == (
        new.patch, new.unpatch, new.is_patched, new.patched)


def test_an_integrations_own_keywords_reach_its_swap_and_the_rest_are_checked():
    """Ultralytics' patch() takes arguments of its own beside FastLoader options: one kit
    sorts them, and rejects what is neither."""
    module = types.ModuleType("library")
    module.decode = "stock"
    calls = []

    def swap(swaps: Swaps, options: dict, *, fast_decode: bool = False) -> None:
        calls.append((options, fast_decode))
        swaps.set(module, "decode", "fast" if fast_decode else "same")

    patch = Patch(swap)
    with pytest.raises(TypeError, match=r"\['fast_deocde'\], which are not FastLoader"):
        patch.patch(fast_deocde=True)
    with patch.patched(fast_decode=True, log_every=5):
        assert module.decode == "fast"
    assert calls == [({"log_every": 5}, True)] and module.decode == "stock"
