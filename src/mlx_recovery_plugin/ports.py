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
    """The host's prefix cache, through its own fetch / release / store path."""

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
