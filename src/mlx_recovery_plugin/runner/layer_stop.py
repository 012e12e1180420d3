"""Stopping a slice between layers, and putting the live cache back as it was.

mlx-lm builds a forward pass lazily and computes it in one ``mx.eval``, so a stop check
between layers means something only if the layers before it have really run. The gate
hooks the runner's own cache objects, never the model the host shares: each layer hands
its cache what it is about to store exactly once per forward, so at that moment the gate
evaluates it (which runs every layer before) and then asks ``should_stop``. Using the
model's own forward keeps every architecture's masks, scalings and layer order exactly
as mlx-lm has them; a layer whose cache cannot be hooked is simply not a stop point.

Everything here is owned by the thread that runs the slice.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

import mlx.core as mx
from mlx_lm.models.cache import ArraysCache, KVCache, RotatingKVCache


class SliceAbandoned(Exception):
    """Raised inside the forward pass when the stop signal is seen; never leaves the runner."""


class StopGate:
    """Evaluates the forward pass so far at each cache touch, then consults ``should_stop``."""

    def __init__(self, should_stop: Callable[[], bool]) -> None:
        self._should_stop = should_stop
        self.checks = 0

    def check(self, *arrays: mx.array) -> None:
        mx.eval(*arrays)
        self.checks += 1
        if self._should_stop():
            raise SliceAbandoned


class _GatedSlots(list):  # type: ignore[type-arg]
    """An ``ArraysCache.cache`` list that passes every new state through the gate."""

    __slots__ = ("_gate",)

    def __init__(self, items: Sequence[Any], gate: StopGate) -> None:
        super().__init__(items)
        self._gate = gate

    def __setitem__(self, index: Any, value: Any) -> None:
        if isinstance(value, mx.array):
            self._gate.check(value)
        super().__setitem__(index, value)


def install(cache: Sequence[Any], gate: StopGate) -> int:
    """Hook every layer cache the gate understands; returns how many are stop points."""
    hooked = 0
    for layer in cache:
        if isinstance(layer, ArraysCache):
            layer.cache = _GatedSlots(layer.cache, gate)
            hooked += 1
        elif isinstance(layer, (KVCache, RotatingKVCache)):
            # An instance attribute shadows the class method for this object only.
            original = layer.update_and_fetch

            def gated(keys: mx.array, values: mx.array, _original: Any = original) -> Any:
                gate.check(keys, values)
                return _original(keys, values)

            layer.update_and_fetch = gated
            hooked += 1
    return hooked


def remove(cache: Sequence[Any]) -> None:
    """Undo :func:`install`; safe to call on a cache that was never hooked."""
    for layer in cache:
        if isinstance(layer, ArraysCache):
            if isinstance(layer.cache, _GatedSlots):
                layer.cache = list(layer.cache)
        else:
            vars(layer).pop("update_and_fetch", None)


@dataclass(slots=True)
class RestorePoint:
    """Enough of each layer cache to undo one slice.

    mlx-lm writes key/value buffers in place only past the offset, and sliding windows
    in place only into the slot that their next update drops anyway; every other update
    replaces the buffer object. So the offsets (and the buffer objects, which a
    reallocation or a window trim replaces) are all that has to go back. Recurrent
    layers replace their arrays on every step, so keeping the references is enough.
    Nothing is copied.
    """

    layers: list[tuple[Any, ...]]

    @classmethod
    def capture(cls, cache: Sequence[Any]) -> RestorePoint:
        layers: list[tuple[Any, ...]] = []
        for layer in cache:
            if isinstance(layer, ArraysCache):
                layers.append((list(layer.cache), layer.left_padding, layer.lengths))
            elif isinstance(layer, RotatingKVCache):
                layers.append((layer.keys, layer.values, layer.offset, layer._idx))
            else:
                layers.append((layer.keys, layer.values, layer.offset))
        return cls(layers)

    def restore(self, cache: Sequence[Any]) -> None:
        for layer, saved in zip(cache, self.layers):
            if isinstance(layer, ArraysCache):
                slots, layer.left_padding, layer.lengths = saved
                layer.cache = list(slots)
            elif isinstance(layer, RotatingKVCache):
                layer.keys, layer.values, layer.offset, layer._idx = saved
            else:
                layer.keys, layer.values, layer.offset = saved
