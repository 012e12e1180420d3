"""Which layers of an mlx-lm prompt cache a partial reuse must restore from saved state.

mlx-lm trims a reused entry only when every layer is trimmable. Plain attention caches
(``KVCache`` and its quantised and concatenating kinds) can always be cut back to any
token count; recurrent caches (``ArraysCache``, ``MambaCache``) never can, and a
``RotatingKVCache`` stops being trimmable once it has wrapped past its window. Those
layers are the ones whose state the adapter saves at block boundaries.

Pure functions over cache objects; no state. Imports mlx-lm (the adapter loads this
module only once mlx-lm's server is being imported).
"""

from __future__ import annotations

import copy
from collections.abc import Sequence
from typing import Any

import mlx.core as mx
from mlx_lm.models import cache as mlx_cache

# Layers that stay trimmable whatever their length: restored by trimming a copy.
_ALWAYS_TRIMMABLE: tuple[type, ...] = tuple(
    cls for cls in (
        getattr(mlx_cache, "KVCache", None),
        getattr(mlx_cache, "QuantizedKVCache", None),
        getattr(mlx_cache, "ConcatenateKVCache", None),
    ) if cls is not None
)


def needs_state(layer: Any) -> bool:
    """True for a layer that a partial reuse must restore from a boundary snapshot."""
    return type(layer) not in _ALWAYS_TRIMMABLE


def stateful_layers(cache: Sequence[Any]) -> list[int]:
    """Indexes of the layers of ``cache`` that need boundary state."""
    return [i for i, layer in enumerate(cache) if needs_state(layer)]


def model_needs_state(model: Any) -> bool:
    """Does ``model``'s prompt cache have any layer that cannot always be trimmed?"""
    return bool(stateful_layers(mlx_cache.make_prompt_cache(model)))


def copy_layer(layer: Any) -> Any:
    """An independent, evaluated copy of one layer cache (so the snapshot keeps no
    reference into a batch the host goes on writing); a rotating cache keeps only its
    window."""
    window = _window_only(layer)
    if window is not None:
        return window
    copied = copy.deepcopy(layer)
    state = [a for a in _arrays(copied.state)]
    if state:
        mx.eval(*state)
    return copied


def _window_only(layer: Any) -> Any:
    """A ``RotatingKVCache`` past its window holds, after a multi-token step, the window
    plus the step less one token; every later step keeps only the last window of them
    (``_update_concat`` trims to ``max_size - 1``, ``_update_in_place`` to ``max_size``,
    a batch merge takes ``size()``), so a copy of the last ``max_size`` tokens in temporal
    order is the same state at a fraction of the bytes. None where that does not hold."""
    rotating = getattr(mlx_cache, "RotatingKVCache", None)
    if type(layer) is not rotating or layer.keep != 0 or layer.keys is None:
        return None
    size = layer.max_size
    if layer.offset < size or layer.keys.shape[2] <= size:
        return None
    out = rotating(max_size=size, keep=0)
    out.keys = mx.contiguous(layer._temporal_order(layer.keys)[..., -size:, :])
    out.values = mx.contiguous(layer._temporal_order(layer.values)[..., -size:, :])
    out.offset = layer.offset
    out._idx = size
    mx.eval(out.keys, out.values)
    return out


def layer_bytes(layer: Any) -> int:
    return int(layer.nbytes)


def trimmed_copy(layer: Any, drop: int) -> Any:
    """A copy of a trimmable layer with its last ``drop`` tokens cut off."""
    copied = copy.deepcopy(layer)
    if drop:
        if not copied.is_trimmable():
            raise ValueError(f"{type(layer).__name__} cannot be trimmed")
        if copied.trim(drop) != drop:
            raise ValueError(f"{type(layer).__name__} trimmed less than {drop} tokens")
    return copied


def _arrays(value: Any) -> list[Any]:
    if isinstance(value, mx.array):
        return [value]
    if isinstance(value, (list, tuple)):
        return [a for item in value for a in _arrays(item)]
    return []
