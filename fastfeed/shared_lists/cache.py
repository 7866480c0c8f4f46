"""A loader's packed lists, kept from one pool of workers to the next.

Without persistent workers, every epoch starts a new pool, and each pool's workers must get the
dataset's lists as they are when they start. Packing 1.28M ``(path, class)`` pairs costs the
main process about half a second, at every epoch's start: with the forkserver or spawn start
method (Python 3.14's default on Linux is forkserver) that was most of what a new epoch waited
for. So the loader keeps its last snapshot, and the next pool starts from it when the dataset
still holds the same lists, in the same attributes, with the same elements.

Whether the elements are the same costs a few milliseconds for ImageNet, not a packing: each
list is compared with a shallow copy taken when it was packed. Its elements are immutable values
or tuples of them (:mod:`~.columns`), so an element is the one packed or an equal one, and
``==`` between the two lists compares element by element, an identical one at once. A tuple
cannot change at all.
"""

from __future__ import annotations

from typing import Any

from fastfeed.shared_lists.finder import Found, find_lists
from fastfeed.shared_lists.handoff import ListsSnapshot

__all__ = ["ListsCache"]


class ListsCache:
    """The last :class:`~.handoff.ListsSnapshot` a loader's workers started from. Its
    descriptor (spawn, forkserver) is closed when nothing holds the snapshot any more: the
    loader, and any pool still starting workers from it."""

    def __init__(self) -> None:
        self._snapshot: ListsSnapshot | None = None
        self._dataset_id: int | None = None
        self._found: list[Found] = []  # every large list found, packed or not
        self._copies: list[list[Any] | None] = []  # each list's elements as packed

    def snapshot(self, dataset: Any, keep_fd: bool) -> ListsSnapshot:
        """The lists of ``dataset`` as they are now, packed: the last snapshot while they are
        unchanged (and it kept its descriptor, where ``keep_fd`` needs one), else a new one."""
        found = find_lists(dataset)
        last = self._snapshot
        if (last is not None and id(dataset) == self._dataset_id
                and (not keep_fd or last.packed is None or last.packed.fd is not None)
                and self._unchanged(found)):
            return last
        self._snapshot = ListsSnapshot.take(dataset, keep_fd, found)
        self._dataset_id = id(dataset)
        self._found = found
        self._copies = [list(item.sequence) if type(item.sequence) is list else None
                        for item in found]
        return self._snapshot

    def _unchanged(self, found: list[Found]) -> bool:
        if len(found) != len(self._found):
            return False
        for now, then, copy in zip(found, self._found, self._copies, strict=True):
            if (now.sequence is not then.sequence
                    or [(id(o), n) for o, n in now.owners] != [(id(o), n) for o, n in then.owners]
                    or (copy is not None and copy != now.sequence)):
                return False
        return True
