"""Comparing mlx-lm caches by what the next forward pass will see (tests and benches)."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import mlx.core as mx
from mlx_lm.models.cache import ArraysCache, RotatingKVCache

from ..kvcodec import slot_of, window


def logical_state(cache: Sequence[Any]) -> list[tuple[Any, ...]]:
    """What each layer will show the next forward pass, independent of buffer layout.

    A key/value layer: its offset and the keys/values of its positions. A sliding-window
    layer: its offset and the positions its next update keeps (the sinks and the newest
    ``max_size - 1``). A recurrent layer: its arrays. Two caches with equal logical
    states give identical continuations.
    """
    out: list[tuple[Any, ...]] = []
    for layer in cache:
        if isinstance(layer, ArraysCache):
            out.append(("recurrent", *layer.cache))
        elif isinstance(layer, RotatingKVCache):
            keys, values, positions = window(layer)
            offset = int(layer.offset)
            if not positions:
                out.append(("window", offset))
                continue
            visible = min(offset, layer.max_size - 1)
            keep = min(layer.keep, visible) if offset > visible else 0
            wanted = list(range(keep)) + list(range(offset - (visible - keep), offset))
            slots = mx.array([slot_of(positions, p) for p in wanted])
            out.append(("window", offset, keys[..., slots, :], values[..., slots, :]))
        else:
            offset = int(layer.offset)
            if layer.keys is None:
                out.append(("kv", offset))
            else:
                out.append(
                    ("kv", offset, layer.keys[..., :offset, :], layer.values[..., :offset, :])
                )
    return out


def caches_equal(a: Sequence[Any], b: Sequence[Any]) -> bool:
    """True when both caches hold exactly the same logical state (``==`` on every array)."""
    left, right = logical_state(a), logical_state(b)
    if len(left) != len(right):
        return False
    for x, y in zip(left, right):
        if len(x) != len(y):
            return False
        for p, q in zip(x, y):
            if isinstance(p, mx.array) or isinstance(q, mx.array):
                if not isinstance(p, mx.array) or not isinstance(q, mx.array):
                    return False
                if p.shape != q.shape or p.dtype != q.dtype or not mx.array_equal(p, q).item():
                    return False
            elif p != q:
                return False
    return True
