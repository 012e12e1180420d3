"""Between the plugin's blocks and oMLX's stored caches: one block as an mlx-lm cache for
oMLX's ``_extract_cache_states``, and the blocks of a cache oMLX rebuilt from its store.

Used on the engine thread, inside the port's store and fetch."""

from __future__ import annotations

from typing import Any

from mlx_lm.models.cache import ArraysCache, KVCache, RotatingKVCache, make_prompt_cache

from ...kvcodec import UnsupportedCacheError, blocks_from_cache
from ...state import BlockState, KVBlock, LayerBlock, RecurrentSnapshot


def cache_of_block(model: Any, block: BlockState) -> list[Any]:
    """A one-block mlx-lm cache holding exactly ``block``'s state."""
    cache = make_prompt_cache(model)
    if len(cache) != len(block.layers):
        raise UnsupportedCacheError(
            f"block has {len(block.layers)} layers, the model's cache {len(cache)}"
        )
    for i, (layer, part) in enumerate(zip(cache, block.layers)):
        if isinstance(layer, ArraysCache):
            if not isinstance(part, RecurrentSnapshot) or not part.arrays:
                raise UnsupportedCacheError(f"layer {i}: no recurrent snapshot in block {block.index}")
            layer.cache = list(part.arrays)
        elif isinstance(layer, RotatingKVCache):
            raise UnsupportedCacheError(f"layer {i}: sliding-window layers are not stored per block")
        elif isinstance(layer, KVCache):
            if not isinstance(part, KVBlock):
                raise UnsupportedCacheError(f"layer {i}: expected keys/values in block {block.index}")
            layer.keys, layer.values = part.keys, part.values
            layer.offset = int(part.keys.shape[2])
        else:
            raise UnsupportedCacheError(f"layer {i}: cannot store {type(layer).__name__}")
    return cache


def unwrapped(layer: Any) -> Any:
    """The mlx-lm cache inside a host wrapper: the oMLX family restores recurrent layers
    as a ``SizedArraysCache`` that holds the ``ArraysCache`` as ``_inner`` (to report a size)."""
    inner = getattr(layer, "__dict__", {}).get("_inner")
    return inner if isinstance(inner, ArraysCache) and not isinstance(layer, ArraysCache) else layer


def blocks_of_restored(restored: list[Any], n_blocks: int, block_size: int) -> list[BlockState]:
    """Blocks ``0..n_blocks-1`` of a cache oMLX rebuilt from its stored blocks.

    Recurrent layers are restored at the last block only, so earlier blocks carry an
    empty snapshot there (enough to rebuild the cache, never stored again).
    """
    if n_blocks == 0:
        return []
    restored = [unwrapped(layer) for layer in restored]
    if not any(isinstance(layer, ArraysCache) for layer in restored):
        return blocks_from_cache(restored, 0, n_blocks, block_size)
    blocks = []
    for index in range(n_blocks):
        start, end = index * block_size, (index + 1) * block_size
        layers: list[LayerBlock] = []
        for layer in restored:
            if isinstance(layer, ArraysCache):
                arrays = tuple(layer.cache) if index == n_blocks - 1 else ()
                layers.append(RecurrentSnapshot(arrays))
            else:
                layers.append(KVBlock(layer.keys[..., start:end, :], layer.values[..., start:end, :]))
        blocks.append(BlockState(index, tuple(layers)))
    return blocks
