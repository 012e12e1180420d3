"""What a host provides to the plugin, as typed protocols.

A host adapter (or a host that adopts the hooks natively) implements these over its own
scheduler and prefix cache, and hands an :class:`EnginePort` to the plugin through the
``engine_attached`` hook. Every method is called on the engine's own thread (the thread
that runs the host's ``step()``), never concurrently with it, unless its docstring says
otherwise.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field
from enum import Enum
from typing import Any, Protocol, runtime_checkable

from .state import BlockState

# Every holder id the plugin takes host references under starts with this.
HOLDER_PREFIX = "mlx-recovery"


@dataclass(slots=True, frozen=True)
class FetchedPrefix:
    """What a fetch restored: ``tokens`` (a whole number of blocks) and their states.

    The block references behind it stay taken under the fetch's holder id until
    :meth:`PrefixCachePort.release` is called with that id.
    """

    tokens: int
    blocks: tuple[BlockState, ...] = field(default=(), repr=False)


@runtime_checkable
class ModelHandle(Protocol):
    """The model the runner prefills with, shared with the host."""

    @property
    def model_id(self) -> str: ...

    @property
    def model(self) -> Any:
        """An mlx-lm model: ``model(tokens[None], cache=cache)`` returns logits."""

    @property
    def stream(self) -> Any:
        """The MLX stream the engine's work runs on (``None``: the default stream)."""

    def make_cache(self) -> list[Any]:
        """A fresh mlx-lm prompt cache for this model."""


@runtime_checkable
class PrefixCachePort(Protocol):
    """The host's prefix cache, through its own fetch / release / store path.

    This is the paged form (:attr:`StoreUnit.BLOCKS`); a cache of whole entries says so
    with a ``store_unit`` property (:class:`WholeEntryCachePort`).
    """

    @property
    def block_size(self) -> int: ...

    def fetch(self, holder_id: str, tokens: Sequence[int]) -> FetchedPrefix:
        """Restore the longest stored whole-block prefix of ``tokens``.

        Takes a reference on every block it returns, under ``holder_id``.
        """

    def release(self, holder_id: str) -> None:
        """Give back every reference taken under ``holder_id``. Idempotent."""

    def store(self, holder_id: str, tokens: Sequence[int], blocks: Sequence[BlockState]) -> int:
        """Store whole blocks of the prefix ``tokens``.

        ``len(tokens)`` is a multiple of the block size and ``blocks`` are the states of
        the last ``len(blocks)`` blocks of it (earlier blocks must already be stored).
        Returns the number of leading tokens of ``tokens`` the cache now holds. Stores no
        partial block, and takes no reference that outlives the call.
        """


class StoreUnit(str, Enum):
    """What a host's prefix cache stores and finds.

    ``BLOCKS``: fixed-size blocks keyed by a chained hash (oMLX's paged cache); a store
    adds the trailing blocks of a prefix whose earlier blocks are already stored.
    ``WHOLE_ENTRY``: one entry per stored token sequence, holding the state of all of
    it (rapid-mlx's memory-aware cache); a store carries every block of the prefix.
    """

    BLOCKS = "blocks"
    WHOLE_ENTRY = "whole_entry"


@runtime_checkable
class WholeEntryCachePort(PrefixCachePort, Protocol):
    """A prefix cache of whole entries, seen through blocks of the adapter's choosing.

    The host has no blocks; ``block_size`` is the granularity recovery publishes at.
    The methods keep :class:`PrefixCachePort`'s meaning with these differences:

    * :meth:`fetch` restores the longest prefix of ``tokens`` the host's own lookup gives
      back (from an entry equal to it, a prefix of it, or a longer or diverging entry the
      host trims), floored to whole blocks; it takes under ``holder_id`` whatever the
      host's lookup takes (maybe nothing), and :meth:`release` gives that back.
    * :meth:`store` carries **every** block of ``tokens`` (indices ``0 ..
      len(tokens) // block_size - 1``) and stores them as one entry for ``tokens``; the
      host may drop shorter entries the new one covers.
    """

    @property
    def store_unit(self) -> StoreUnit:
        """Always :attr:`StoreUnit.WHOLE_ENTRY`."""


def store_unit(cache: object) -> StoreUnit:
    """How ``cache`` stores prefixes; a port that does not say stores blocks."""
    return StoreUnit(getattr(cache, "store_unit", StoreUnit.BLOCKS))


@runtime_checkable
class EnginePort(Protocol):
    """One engine of the host: a model, its queues and its prefix cache."""

    @property
    def engine_id(self) -> str: ...

    @property
    def model_id(self) -> str: ...

    @property
    def block_size(self) -> int: ...

    @property
    def prefill_step(self) -> int:
        """Tokens per prefill chunk in the host's own dense route."""

    @property
    def model(self) -> ModelHandle: ...

    @property
    def prefix_cache(self) -> PrefixCachePort: ...

    def queues_empty(self) -> bool:
        """True when nothing is waiting or running on this engine. Any thread."""

    def is_busy(self) -> bool:
        """True while this engine prefills or decodes. Any thread."""

    def sparse_route_live(self) -> bool:
        """True while a sparse-route request holds the shared model. Any thread."""
