"""The KV codec: cutting a live mlx-lm prompt cache into whole blocks, and back.

mlx-lm caches are read and written through their public attributes (``keys``, ``values``,
``offset``, ``cache``, ``max_size``, ``keep``), never through ``state``, whose layout
differs between releases. A sliding-window cache's write position ``_idx`` has no public
name; it is read and set here only.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any

import mlx.core as mx
from mlx_lm.models.cache import ArraysCache, KVCache, RotatingKVCache

from .state import BlockState, KVBlock, LayerBlock, RecurrentSnapshot


class UnsupportedCacheError(TypeError):
    """A model layer uses a cache class whose state cannot be cut into blocks."""


SUPPORTED_CACHES = (KVCache, RotatingKVCache, ArraysCache)


def check_supported(cache: Sequence[Any]) -> None:
    """Raise :class:`UnsupportedCacheError` unless every layer can be cut into blocks."""
    for i, layer in enumerate(cache):
        if not isinstance(layer, SUPPORTED_CACHES):
            names = ", ".join(c.__name__ for c in SUPPORTED_CACHES)
            raise UnsupportedCacheError(
                f"layer {i} uses {type(layer).__name__}; blocks support {names}"
            )


def has_recurrent_layers(cache: Sequence[Any]) -> bool:
    return any(isinstance(layer, ArraysCache) for layer in cache)


# -- reading positions out of a live cache ----------------------------------------------


def window(layer: RotatingKVCache) -> tuple[mx.array | None, mx.array | None, list[int]]:
    """A sliding-window cache's buffer in temporal order, and the position of each slot.

    Mirrors the order mlx-lm itself restores before it appends: the ``keep`` sink
    positions first, then the rest oldest to newest. An empty cache has no buffer (None).
    """
    keys, values = layer.keys, layer.values
    if keys is None:
        return keys, values, []
    idx = int(layer._idx)
    size = keys.shape[2]
    if idx == size:
        pass
    elif idx < layer.offset:
        keep = layer.keep

        def order(v: mx.array) -> mx.array:
            return mx.concatenate(
                [v[..., :keep, :], v[..., idx:, :], v[..., keep:idx, :]], axis=2
            )

        keys, values = order(keys), order(values)
    else:
        keys, values = keys[..., :idx, :], values[..., :idx, :]
    held = keys.shape[2]
    offset = int(layer.offset)
    if held >= offset:
        return keys[..., :offset, :], values[..., :offset, :], list(range(offset))
    keep = min(layer.keep, held)
    return keys, values, list(range(keep)) + list(range(offset - (held - keep), offset))


def kv_positions(layer: Any, start: int, end: int) -> tuple[mx.array, mx.array]:
    """Compact copies of the keys/values of absolute positions ``[start, end)``."""
    if not 0 <= start < end:
        raise ValueError(f"empty or negative position range [{start}, {end})")
    if end > layer.offset:
        raise ValueError(f"positions up to {end} requested, cache holds {layer.offset}")
    if isinstance(layer, RotatingKVCache):
        keys, values, positions = window(layer)
        first = slot_of(positions, start)
        last = slot_of(positions, end - 1)
        if keys is None or values is None or first is None or last is None or last - first != end - 1 - start:
            held = f"{positions[0]}..{positions[-1]}" if positions else "nothing"
            raise ValueError(
                f"positions [{start}, {end}) left the sliding window (it holds {held})"
            )
        k, v = keys[..., first : last + 1, :], values[..., first : last + 1, :]
    elif isinstance(layer, KVCache):
        k, v = layer.keys[..., start:end, :], layer.values[..., start:end, :]
    else:
        raise UnsupportedCacheError(f"cannot cut {type(layer).__name__} into blocks")
    return mx.contiguous(k), mx.contiguous(v)


def slot_of(positions: list[int], position: int) -> int | None:
    if not positions:
        return None
    # Slots are the sink positions, then one contiguous run ending at the newest.
    if position < len(positions) and positions[position] == position:
        return position
    slot = position - positions[-1] + len(positions) - 1
    if 0 <= slot < len(positions) and positions[slot] == position:
        return slot
    return None


def recurrent_snapshot(layer: ArraysCache) -> RecurrentSnapshot:
    """A compact copy of a recurrent layer's state as it is now."""
    return RecurrentSnapshot(
        tuple(None if a is None else mx.contiguous(a) for a in layer.cache)
    )


def blocks_from_cache(
    cache: Sequence[Any],
    first_block: int,
    end_block: int,
    block_size: int,
    *,
    origin: str = "dense",
    offset: int | None = None,
) -> list[BlockState]:
    """Cut blocks ``[first_block, end_block)`` out of a live mlx-lm prompt cache.

    The arrays are compact copies (lazy until evaluated). Recurrent layers can only be
    snapshotted at the cache's current position, so with such layers the range must be
    a single block ending exactly at the cache's offset (the runner stops at every
    boundary for that reason). ``offset`` is needed only for a cache of recurrent
    layers alone, which records no position.
    """
    check_supported(cache)
    offset = cache_offset(cache) if offset is None else offset
    blocks: list[BlockState] = []
    for index in range(first_block, end_block):
        start, end = index * block_size, (index + 1) * block_size
        layers: list[LayerBlock] = []
        for layer in cache:
            if isinstance(layer, ArraysCache):
                if end != offset:
                    raise ValueError(
                        f"recurrent state exists only at position {offset}, not at {end}"
                    )
                layers.append(recurrent_snapshot(layer))
            else:
                layers.append(KVBlock(*kv_positions(layer, start, end)))
        blocks.append(BlockState(index, tuple(layers), origin=origin))
    return blocks


def cache_offset(cache: Sequence[Any]) -> int:
    """Tokens a prompt cache has consumed (recurrent layers carry no offset)."""
    for layer in cache:
        if not isinstance(layer, ArraysCache):
            return int(layer.offset)
    raise UnsupportedCacheError("a cache of recurrent layers only has no position")


def cache_arrays(cache: Sequence[Any]) -> list[mx.array]:
    """Every array a prompt cache holds, for ``mx.eval`` (public attributes only)."""
    out: list[mx.array] = []
    for layer in cache:
        if isinstance(layer, ArraysCache):
            out += [a for a in layer.cache if a is not None]
        elif getattr(layer, "keys", None) is not None:
            out += [layer.keys, layer.values]
    return out


# -- rebuilding a cache ------------------------------------------------------------------


def cache_from_blocks(
    make_cache: Callable[[], list[Any]], blocks: Sequence[BlockState]
) -> list[Any]:
    """Rebuild an mlx-lm prompt cache from blocks ``0..n-1`` (contiguous, in order).

    Recurrent layers share the last block's arrays: mlx-lm replaces a recurrent layer's
    arrays on every step and never writes into them, so the stored block stays intact.
    """
    cache = make_cache()
    check_supported(cache)
    if not blocks:
        return cache
    for expected, block in enumerate(blocks):
        if block.index != expected:
            raise ValueError(f"blocks must start at 0 and be contiguous, got {block.index}")
        if len(block.layers) != len(cache):
            raise ValueError(
                f"block {block.index} has {len(block.layers)} layers, the model has {len(cache)}"
            )
    for i, layer in enumerate(cache):
        parts = [block.layers[i] for block in blocks]
        if isinstance(layer, ArraysCache):
            last = parts[-1]
            if not isinstance(last, RecurrentSnapshot):
                raise UnsupportedCacheError(f"layer {i} expects a recurrent snapshot")
            layer.cache = list(last.arrays)
            continue
        if not all(isinstance(p, KVBlock) for p in parts):
            raise UnsupportedCacheError(f"layer {i} expects key/value blocks")
        kv_parts: list[KVBlock] = parts  # type: ignore[assignment]
        if isinstance(layer, RotatingKVCache):
            _fill_rotating(layer, kv_parts)
        else:
            layer.keys = mx.concatenate([p.keys for p in kv_parts], axis=2)
            layer.values = mx.concatenate([p.values for p in kv_parts], axis=2)
            layer.offset = layer.keys.shape[2]
    return cache


def _fill_rotating(layer: RotatingKVCache, parts: Sequence[KVBlock]) -> None:
    """Hold what a live sliding-window cache holds after the same positions.

    Past ``max_size`` positions mlx-lm keeps the ``keep`` sink positions and the newest
    ones, in temporal order; only the blocks those come from are concatenated.
    """
    block = parts[0].keys.shape[2]
    total = block * len(parts)
    if total <= layer.max_size:
        spans = [(0, total)]
    else:
        keep = min(layer.keep, layer.max_size)
        spans = [(0, keep), (total - (layer.max_size - keep), total)]
    keys, values = [], []
    for start, end in spans:
        for index in range(start // block, (end + block - 1) // block):
            lo = max(start, index * block) - index * block
            hi = min(end, (index + 1) * block) - index * block
            if hi > lo:
                keys.append(parts[index].keys[..., lo:hi, :])
                values.append(parts[index].values[..., lo:hi, :])
    layer.keys = mx.concatenate(keys, axis=2)
    layer.values = mx.concatenate(values, axis=2)
    layer.offset = total
    layer._idx = layer.keys.shape[2]
