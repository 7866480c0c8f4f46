"""Workers read the dataset's large lists from one shared, read-only copy.

A forked worker that reads a Python list writes to every element it touches (its reference
count), so the page each element lives on is copied into the worker: over an epoch every
worker ends up with a private copy of the list (torch's "copy-on-read", pytorch issue 13246;
about 220 MB a worker for ImageNet's 1.28M ``(path, class)`` samples). Spawned workers get the
list pickled to each of them instead, which is slow to start.

So, when a pool's process workers start, the large lists and tuples of plain values the dataset
holds (and the datasets it wraps hold) are packed once into shared memory, and the workers read
those instead; the user's objects in the main process are not changed. One module a job:

- :mod:`~.finder`: which lists (attributes of the dataset chain, :data:`MIN_LENGTH` elements or
  more);
- :mod:`~.columns`: their elements as flat arrays, and back, with their exact types;
- :mod:`~.packing`: the arrays in one sealed ``memfd``, mapped read-only;
- :mod:`~.shared_list`: :class:`SharedList`, the read-only sequence a worker reads;
- :mod:`~.handoff`: how forked and spawned workers get them (:class:`ListsSnapshot`,
  :func:`received_config`);
- :mod:`~.cache`: a loader's last snapshot, reused by the next epoch's workers while the lists
  are unchanged (:class:`ListsCache`).
"""

from fastfeed.shared_lists.cache import ListsCache
from fastfeed.shared_lists.finder import MIN_LENGTH
from fastfeed.shared_lists.handoff import ListsHandOff, ListsSnapshot, received_config
from fastfeed.shared_lists.shared_list import SharedList

__all__ = ["MIN_LENGTH", "ListsCache", "ListsHandOff", "ListsSnapshot", "SharedList",
           "received_config"]
