"""The neutral form of prefix state that crosses the host port: whole cache blocks.

A block ``k`` covers token positions ``[k*B, (k+1)*B)``. Per model layer it holds either
the attention keys/values of exactly those positions (:class:`KVBlock`) or, for layers that
carry recurrent state (mlx-lm ``ArraysCache``), a snapshot of that state taken right after
the block's last token (:class:`RecurrentSnapshot`). A host adapter converts blocks into
the host's own records; the mock host stores them as they are.

mlx-lm caches are read and written through their public attributes (``keys``, ``values``,
``offset``, ``cache``), never through ``state``, whose layout differs between releases.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

import mlx.core as mx
from mlx_lm.models.cache import ArraysCache, KVCache, RotatingKVCache


@dataclass(slots=True, frozen=True)
class KVBlock:
    """Keys and values of one block's positions, shape ``(batch, kv_heads, B, head_dim)``."""

    keys: mx.array
    values: mx.array


@dataclass(slots=True, frozen=True)
class RecurrentSnapshot:
    """A recurrent layer's state right after the block's last token."""

    arrays: tuple[mx.array | None, ...]


LayerBlock = KVBlock | RecurrentSnapshot


@dataclass(slots=True, frozen=True)
class BlockState:
    """Every layer's state for block ``index``.

    ``origin`` says who computed it (``"dense"`` for the host's own prefill,
    ``"recovery"`` for the plugin's runner). ``draft_state`` is False when the block
    carries no draft-model / MTP side data: recovery never runs draft work.
    """

    index: int
    layers: tuple[LayerBlock, ...]
    origin: str = "dense"
    draft_state: bool = False

    @property
    def nbytes(self) -> int:
        total = 0
        for layer in self.layers:
            if isinstance(layer, KVBlock):
                total += layer.keys.nbytes + layer.values.nbytes
            else:
                total += sum(a.nbytes for a in layer.arrays if a is not None)
        return total


class UnsupportedCacheError(TypeError):
    """A model layer uses a cache class whose state cannot be cut into blocks."""


def _kv_positions(layer: Any, start: int, end: int) -> tuple[mx.array, mx.array]:
    """Keys/values of absolute positions ``[start, end)`` from a KV-style cache layer."""
    if isinstance(layer, RotatingKVCache):
        return _rotating_positions(layer, start, end)
    if not isinstance(layer, KVCache):
        raise UnsupportedCacheError(f"cannot cut {type(layer).__name__} into blocks")
    if end > layer.offset:
        raise ValueError(f"positions up to {end} requested, cache holds {layer.offset}")
    return layer.keys[..., start:end, :], layer.values[..., start:end, :]


def _rotating_positions(layer: RotatingKVCache, start: int, end: int) -> tuple[mx.array, mx.array]:
    """Positions of a sliding-window cache, which must still be inside its buffer."""
    if end > layer.offset:
        raise ValueError(f"positions up to {end} requested, cache holds {layer.offset}")
    held = min(layer.offset, layer.keys.shape[2])
    first_held = layer.offset - held
    if start < first_held:
        raise ValueError(
            f"positions from {start} requested, sliding window only holds {first_held}+"
        )
    keys = layer._temporal_order(layer.keys)
    values = layer._temporal_order(layer.values)
    return keys[..., start - first_held : end - first_held, :], values[
        ..., start - first_held : end - first_held, :
    ]


def blocks_from_cache(
    cache: Sequence[Any],
    first_block: int,
    end_block: int,
    block_size: int,
    *,
    origin: str = "dense",
) -> list[BlockState]:
    """Cut blocks ``[first_block, end_block)`` out of a live mlx-lm prompt cache.

    Slices are views, not copies of the whole cache. Recurrent layers can only be
    snapshotted at the cache's current position, so with such layers the range must be
    a single block ending exactly at the cache's offset (the runner stops at every
    boundary for that reason).
    """
    offset = cache_offset(cache)
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
                layers.append(RecurrentSnapshot(tuple(layer.cache)))
            else:
                keys, values = _kv_positions(layer, start, end)
                layers.append(KVBlock(keys, values))
        blocks.append(BlockState(index, tuple(layers), origin=origin))
    return blocks


def cache_offset(cache: Sequence[Any]) -> int:
    """Tokens a prompt cache has consumed (recurrent layers carry no offset)."""
    for layer in cache:
        if not isinstance(layer, ArraysCache):
            return int(layer.offset)
    raise UnsupportedCacheError("a cache of recurrent layers only has no position")


def cache_from_blocks(
    make_cache: Callable[[], list[Any]], blocks: Sequence[BlockState]
) -> list[Any]:
    """Rebuild an mlx-lm prompt cache from blocks ``0..n-1`` (contiguous, in order)."""
    cache = make_cache()
    if not blocks:
        return cache
    for expected, block in enumerate(blocks):
        if block.index != expected:
            raise ValueError(f"blocks must start at 0 and be contiguous, got {block.index}")
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
        keys = mx.concatenate([p.keys for p in parts], axis=2)  # type: ignore[union-attr]
        values = mx.concatenate([p.values for p in parts], axis=2)  # type: ignore[union-attr]
        if isinstance(layer, RotatingKVCache):
            _fill_rotating(layer, keys, values)
        elif isinstance(layer, KVCache):
            layer.keys, layer.values, layer.offset = keys, values, keys.shape[2]
        else:
            raise UnsupportedCacheError(f"cannot restore {type(layer).__name__}")
    return cache


def _fill_rotating(layer: RotatingKVCache, keys: mx.array, values: mx.array) -> None:
    """Feed restored positions through the window so it keeps exactly what a live run keeps."""
    total = keys.shape[2]
    kept = min(total, layer.max_size)
    layer.keys = keys[..., total - kept :, :]
    layer.values = values[..., total - kept :, :]
    layer.offset = total
    layer._idx = kept
