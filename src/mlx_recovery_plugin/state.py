"""The neutral form of prefix state that crosses the host port: whole cache blocks.

This module is part of the contract: it imports no MLX at run time (the arrays' type is
named for type checkers only). Cutting caches into blocks and back is the KV codec's job
(:mod:`mlx_recovery_plugin.kvcodec`).

A block ``k`` covers token positions ``[k*B, (k+1)*B)``. Per model layer it holds either
the attention keys/values of exactly those positions (:class:`KVBlock`) or, for layers that
carry recurrent state (mlx-lm ``ArraysCache``), a snapshot of that state taken right after
the block's last token (:class:`RecurrentSnapshot`). A host adapter converts blocks into
the host's own records; the mock host stores them as they are.

Block arrays are compact copies of their own positions, never views into a live cache: a
view would keep the whole cache buffer alive and force the next cache write to copy it.

"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    import mlx.core as mx

# ``BlockState.origin`` of blocks the plugin's runner computed.
RECOVERY_ORIGIN = "recovery"


def floor_block(tokens: int, block_size: int) -> int:
    """``tokens`` rounded down to a whole number of blocks."""
    return tokens - tokens % block_size


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

    def arrays(self) -> list[mx.array]:
        """Every array the block holds (for ``mx.eval``)."""
        out: list[mx.array] = []
        for layer in self.layers:
            if isinstance(layer, KVBlock):
                out += [layer.keys, layer.values]
            else:
                out += [a for a in layer.arrays if a is not None]
        return out
