"""Reversible attribute swaps, and the check of the FastLoader options a patch passes on."""

from __future__ import annotations

from typing import Any

from fastfeed.loader import OWN_OPTIONS

# FastLoader keywords that DataLoader does not have: frameworks never pass them.
FASTLOADER_OPTIONS = frozenset(OWN_OPTIONS)


def check_options(options: dict[str, Any]) -> None:
    """Raise ``TypeError`` unless every key of ``options`` is a FastLoader-only keyword."""
    unknown = sorted(set(options) - FASTLOADER_OPTIONS)
    if unknown:
        raise TypeError(f"patch() got {unknown}, which are not FastLoader options; "
                        f"it takes {sorted(FASTLOADER_OPTIONS)}")


class Swaps:
    """Attributes replaced on other modules, each restorable to the value it had first.

    Setting an attribute twice keeps the first original, so a second ``patch()`` replaces the
    options without losing what :meth:`restore` must put back.
    """

    def __init__(self) -> None:
        self._originals: dict[tuple[int, str], tuple[Any, Any]] = {}

    def set(self, owner: Any, name: str, value: Any) -> None:
        """Set ``owner.name = value``, remembering the original value."""
        self._originals.setdefault((id(owner), name), (owner, getattr(owner, name)))
        setattr(owner, name, value)

    def original(self, owner: Any, name: str) -> Any:
        """The value ``owner.name`` had before the first :meth:`set`."""
        entry = self._originals.get((id(owner), name))
        return getattr(owner, name) if entry is None else entry[1]

    def restore(self) -> None:
        """Put every original value back."""
        for (_, name), (owner, value) in self._originals.items():
            setattr(owner, name, value)
        self._originals.clear()

    def __bool__(self) -> bool:
        return bool(self._originals)


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
