"""The one way fastfeed patches code it does not own.

:func:`fastfeed.ultralytics.patch`, the integrations (timm, Hugging Face Accelerate) and the
doctor's probe replace attributes of other libraries' modules and classes. Each keeps those
replacements in a :class:`Swaps` table (attributes, and items of containers such as the
doctor's timers in a list of transforms), which puts the originals back in reverse order, and
checks the FastLoader options it passes on with :func:`check_fastloader_options`. Every
integration gets its ``patch``, ``unpatch``, ``is_patched`` and ``patched`` from a
:class:`Patch`, which sorts ``patch()``'s keywords into the integration's own and the
FastLoader options.
"""

from __future__ import annotations

import contextlib
import inspect
from collections.abc import Callable, Iterator
from typing import Any, NamedTuple

from fastfeed.loader import OWN_OPTIONS

__all__ = ["FASTLOADER_OPTIONS", "Overlay", "Patch", "Swaps", "check_fastloader_options"]

# FastLoader keywords that DataLoader does not have: frameworks never pass them.
FASTLOADER_OPTIONS = frozenset(OWN_OPTIONS)


def check_fastloader_options(options: dict[str, Any]) -> None:
    """Raise ``TypeError`` unless every key of ``options`` is a FastLoader-only keyword."""
    unknown = sorted(set(options) - FASTLOADER_OPTIONS)
    if unknown:
        raise TypeError(f"patch() got {unknown}, which are not FastLoader options; "
                        f"it takes {sorted(FASTLOADER_OPTIONS)}")


# Stands for an attribute that its owner did not hold itself (a class's method from a base).
_INHERITED = object()


class _Swap(NamedTuple):
    owner: Any
    name: Any  # an attribute's name, or, for an item, its key or index
    own: Any  # what ``vars(owner)`` held before the first swap (a raw descriptor), or _INHERITED
    original: Any  # what ``getattr(owner, name)`` (an item: ``owner[name]``) read before it
    item: bool = False  # ``owner[name]`` rather than ``owner.name``


class Swaps:
    """A table of attributes replaced on other libraries' modules and classes.

    :meth:`undo` puts them back in the reverse of the order they were first replaced, as
    nested patches come off. Replacing an attribute again keeps its first original, so that a
    second ``patch()`` changes the replacements without losing what :meth:`undo` restores. An
    attribute the owner inherited (a subclass's method) is deleted again rather than copied onto
    the owner, and a descriptor (a ``staticmethod``) comes back as it was, not as it read.
    """

    def __init__(self) -> None:
        # Keyed by (id(owner), name, item): the table holds owner, so its id stays its own.
        self._table: dict[tuple[int, Any, bool], _Swap] = {}

    def set(self, owner: Any, name: str, value: Any) -> None:
        """Set ``owner.name = value``, remembering the original the first time."""
        key = (id(owner), name, False)
        if key not in self._table:
            own = vars(owner).get(name, _INHERITED)
            self._table[key] = _Swap(owner, name, own, getattr(owner, name))
        setattr(owner, name, value)

    def set_item(self, container: Any, key: Any, value: Any) -> None:
        """Set ``container[key] = value`` (an element of a list, an entry of a dict),
        remembering the original the first time. The container itself stays the same object,
        so whoever else holds it sees the replacement too."""
        entry = (id(container), key, True)
        if entry not in self._table:
            original = container[key]
            self._table[entry] = _Swap(container, key, original, original, item=True)
        container[key] = value

    def wrap(self, owner: Any, name: str, wrapper: Callable[[Any], Any]) -> None:
        """Set ``owner.name = wrapper(original)``: the replacement made from the original, the
        first one however often this is called."""
        self.set(owner, name, wrapper(self.original(owner, name)))

    def original(self, owner: Any, name: str) -> Any:
        """What ``owner.name`` read before its first replacement (now, if not replaced)."""
        swap = self._table.get((id(owner), name, False))
        return getattr(owner, name) if swap is None else swap.original

    def undo(self) -> None:
        """Put every original back, the last replaced first."""
        for swap in reversed(self._table.values()):
            if swap.item:
                swap.owner[swap.name] = swap.own
            elif swap.own is _INHERITED:
                delattr(swap.owner, swap.name)
            else:
                setattr(swap.owner, swap.name, swap.own)
        self._table.clear()

    def __bool__(self) -> bool:
        return bool(self._table)


class Patch:
    """The ``patch``, ``unpatch``, ``is_patched`` and ``patched`` of an integration.

    Args:
        swap: ``swap(swaps, fastloader_options, **own)`` replaces the library's attributes in
            the table ``swaps``, with the FastLoader options checked; the keyword-only
            parameters of ``swap`` are the integration's own arguments (Ultralytics'
            ``fast_decode``, say), which it checks itself. It imports the library, so
            ``patch()`` raises ``ImportError`` without it. A second ``patch()`` calls it again
            on the same table.
    """

    def __init__(self, swap: Callable[..., None]) -> None:
        self.swaps = Swaps()
        self._swap = swap
        self._own = frozenset(
            name for name, parameter in inspect.signature(swap).parameters.items()
            if parameter.kind is inspect.Parameter.KEYWORD_ONLY)

    def patch(self, **arguments: Any) -> None:
        """Check the FastLoader options among ``arguments``, then make the swaps with them
        and with the integration's own arguments."""
        own = {name: arguments.pop(name) for name in self._own & set(arguments)}
        check_fastloader_options(arguments)
        self._swap(self.swaps, arguments, **own)

    def unpatch(self) -> None:
        """Put back everything :func:`patch` replaced."""
        self.swaps.undo()

    def is_patched(self) -> bool:
        """Whether :func:`patch` is in effect."""
        return bool(self.swaps)

    @contextlib.contextmanager
    def patched(self, **arguments: Any) -> Iterator[None]:
        """:func:`patch` for the duration of a ``with`` block, then :func:`unpatch`."""
        self.patch(**arguments)
        try:
            yield
        finally:
            self.unpatch()


class Overlay:
    """An object that reads as ``target``, except for the attributes in ``overrides``.

    A framework that names ``torch.utils.data.DataLoader`` at call time gets FastLoader from
    an overlay put in place of its module's ``torch``, and the rest of torch unchanged.
    """

    def __init__(self, target: Any, **overrides: Any) -> None:
        self._target = target
        self._overrides = overrides

    def __getattr__(self, name: str) -> Any:
        overrides = self.__dict__["_overrides"]
        if name in overrides:
            return overrides[name]
        return getattr(self.__dict__["_target"], name)

    def __repr__(self) -> str:
        return f"Overlay({self._target!r}, overriding {sorted(self._overrides)})"
