"""The deep copy Ultralytics makes of a sample's labels, without ``copy.deepcopy``'s dispatch.

``BaseDataset.get_image_and_label`` deep-copies the image's label dict (four times per mosaic
sample) so that the transforms can edit it in place. A label dict holds numpy arrays, lists of
them and immutable values; ``copy.deepcopy`` walks it through its generic memo machinery, about
a fifteenth of a patched worker's Python time. :func:`copy_labels` copies the same structure
directly, arrays with ``ndarray.copy(order="K")`` as ``ndarray.__deepcopy__`` does, and hands
anything else (object arrays, other types) to ``copy.deepcopy``, sharing one memo so that
aliased values stay aliased as in a deep copy.
"""

from __future__ import annotations

import copy
from typing import Any

import numpy as np

__all__ = ["copy_labels"]

_IMMUTABLE = (str, bytes, int, float, bool, type(None))


def copy_labels(labels: Any, memo: dict[int, Any] | None = None) -> Any:
    """``copy.deepcopy(labels)`` for Ultralytics' label dicts (any other value is handed to
    ``copy.deepcopy`` itself)."""
    return _copy(labels, {} if memo is None else memo)


def _copy(value: Any, memo: dict[int, Any]) -> Any:
    kind = type(value)
    if kind in _IMMUTABLE:
        return value
    key = id(value)
    if key in memo:
        return memo[key]
    if kind is np.ndarray and not value.dtype.hasobject:
        result: Any = value.copy(order="K")
    elif kind is dict:
        result = {}
        memo[key] = result
        for k, v in value.items():
            result[_copy(k, memo)] = _copy(v, memo)
        return result
    elif kind is list:
        result = []
        memo[key] = result
        result.extend(_copy(v, memo) for v in value)
        return result
    elif kind is tuple and all(type(v) in _IMMUTABLE for v in value):
        return value
    else:
        return copy.deepcopy(value, memo)
    memo[key] = result
    return result
