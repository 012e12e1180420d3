"""The host ports over one rapid-mlx scheduler: its model, its queues and its memory-aware
prefix cache of whole entries.

rapid-mlx's ``MemoryAwarePrefixCache`` keeps one entry per stored token sequence (a list
of mlx-lm cache layers) and looks a prompt up by exact, prefix, supersequence and
longest-common-prefix match, trimming a longer entry back where its layers can rewind.
It hands out copies and takes no reference, so :meth:`RapidPrefixCache.release` has
nothing to give back in the host; the port still tracks which holders fetched and did not
release, so tests can prove the plugin's bookkeeping balances.

Blocks: the host has none. :attr:`RapidPrefixCache.block_size` is the granularity
recovery publishes at; a store turns every block of the prefix into one entry
(``store(tokens, cache, evict_prefixes=True)``, so the shorter entry it covers goes).

Threads: every cache method runs on the scheduler's ``mlx-step`` thread (idle steps run
there); the queue queries may be called from the event-loop thread and only read.
"""

from __future__ import annotations

import logging
import threading
from collections.abc import Callable, Sequence
from typing import Any

from ...ports import FetchedPrefix, StoreUnit
from ...state import BlockState, floor_block

log = logging.getLogger(__name__)

#: Tokens per published entry step when nobody says otherwise.
DEFAULT_BLOCK_SIZE = 256


def model_id_of(scheduler: Any) -> str:
    config = getattr(scheduler, "config", None)
    name = getattr(config, "model_name", None)
    return str(name) if name else "rapid-mlx"


class RapidModel:
    """The scheduler's model as a :class:`~mlx_recovery_plugin.ports.ModelHandle`."""

    def __init__(self, scheduler: Any, model_id: str) -> None:
        self._scheduler = scheduler
        self._model_id = model_id

    @property
    def model_id(self) -> str:
        return self._model_id

    @property
    def model(self) -> Any:
        model = getattr(self._scheduler, "model", None)
        if model is None:
            raise RuntimeError("rapid-mlx scheduler has no model (unloaded)")
        return model

    @property
    def stream(self) -> Any:
        # The mlx-step thread's default stream (rapid-mlx sets it when the thread starts).
        return None

    def make_cache(self) -> list[Any]:
        from mlx_lm.models.cache import make_prompt_cache

        return list(make_prompt_cache(self.model))


class RapidPrefixCache:
    """:class:`~mlx_recovery_plugin.ports.WholeEntryCachePort` over the scheduler's
    ``memory_aware_cache``."""

    store_unit = StoreUnit.WHOLE_ENTRY

    def __init__(self, scheduler: Any, block_size: int, make_cache: Callable[[], list[Any]]) -> None:
        if block_size <= 0:
            raise ValueError(f"block size must be positive, got {block_size}")
        self._scheduler = scheduler
        self._block_size = block_size
        self._make_cache = make_cache
        self._lock = threading.Lock()
        self._held: set[str] = set()  # holders that fetched and have not released

    @property
    def block_size(self) -> int:
        return self._block_size

    @property
    def enabled(self) -> bool:
        """True when the scheduler has a memory-aware prefix cache (recovery needs one)."""
        return getattr(self._scheduler, "memory_aware_cache", None) is not None

    def fetch(self, holder_id: str, tokens: Sequence[int]) -> FetchedPrefix:
        """The longest whole-block prefix of ``tokens`` rapid-mlx's own lookup restores."""
        store = self._store()
        if store is None or not tokens:
            return FetchedPrefix(tokens=0)
        with self._lock:
            self._held.add(holder_id)
        cache, remaining = store.fetch(list(tokens))
        matched = len(tokens) - len(remaining) if cache else 0
        whole = floor_block(matched, self._block_size) // self._block_size
        if whole == 0:
            return FetchedPrefix(tokens=0)
        from ...kvcodec import blocks_from_cache

        blocks = blocks_from_cache(cache, 0, whole, self._block_size)
        _evaluate(blocks)
        return FetchedPrefix(tokens=whole * self._block_size, blocks=tuple(blocks))

    def release(self, holder_id: str) -> None:
        """rapid-mlx's lookup took nothing; forget the holder. Idempotent."""
        with self._lock:
            self._held.discard(holder_id)

    def store(self, holder_id: str, tokens: Sequence[int], blocks: Sequence[BlockState]) -> int:
        """Store one entry for ``tokens`` from all of its blocks; returns how many leading
        tokens rapid-mlx's lookup restores afterwards."""
        store = self._store()
        if store is None:
            return 0
        whole = len(tokens) // self._block_size
        key = list(tokens[: whole * self._block_size])
        if whole == 0 or [b.index for b in blocks] != list(range(whole)):
            log.warning(
                "mlx-recovery: rapid-mlx store by %s refused: a whole entry needs blocks 0..%d",
                holder_id, whole - 1,
            )
            return self.restorable(key)
        from ...kvcodec import cache_from_blocks

        cache = cache_from_blocks(self._make_cache, blocks)
        if not store.store(key, cache, evict_prefixes=True):
            log.info("mlx-recovery: rapid-mlx declined a %d-token entry", len(key))
        return self.restorable(key)

    # -- host-side reads ------------------------------------------------------------
    def restorable(self, tokens: Sequence[int]) -> int:
        """Whole-block tokens rapid-mlx's side-effect-free probe says a lookup reuses."""
        store = self._store()
        if store is None or not tokens:
            return 0
        probe = store.probe(list(tokens))
        return floor_block(int(getattr(probe, "matched_tokens", 0)), self._block_size)

    def holders(self) -> list[str]:
        """Holders that fetched and have not released (empty when balanced)."""
        with self._lock:
            return sorted(self._held)

    def _store(self) -> Any:
        return getattr(self._scheduler, "memory_aware_cache", None)


class RapidEngine:
    """:class:`~mlx_recovery_plugin.ports.EnginePort` over one rapid-mlx scheduler."""

    def __init__(
        self,
        scheduler: Any,
        engine_id: str,
        *,
        block_size: int = DEFAULT_BLOCK_SIZE,
        pending_arrivals: Callable[[], int] = lambda: 0,
    ) -> None:
        self._scheduler = scheduler
        self._engine_id = engine_id
        self._model = RapidModel(scheduler, model_id_of(scheduler))
        self._cache = RapidPrefixCache(scheduler, block_size, self._model.make_cache)
        self._pending_arrivals = pending_arrivals
        #: True while the wrapped ``step()`` runs a real step (mlx-step thread writes).
        self.stepping = False

    @property
    def engine_id(self) -> str:
        return self._engine_id

    @property
    def model_id(self) -> str:
        return self._model.model_id

    @property
    def block_size(self) -> int:
        return self._cache.block_size

    @property
    def prefill_step(self) -> int:
        config = getattr(self._scheduler, "config", None)
        return int(getattr(config, "prefill_step_size", 2048) or 2048)

    @property
    def model(self) -> RapidModel:
        return self._model

    @property
    def prefix_cache(self) -> RapidPrefixCache:
        return self._cache

    @property
    def scheduler(self) -> Any:
        return self._scheduler

    def queues_empty(self) -> bool:
        s = self._scheduler
        return not (s.waiting or s.running) and self._pending_arrivals() == 0

    def is_busy(self) -> bool:
        return self.stepping

    def sparse_route_live(self) -> bool:
        # PFlash shortens the prompt; it leaves nothing on the shared model.
        return False


def _evaluate(blocks: Sequence[BlockState]) -> None:
    """Materialize the copies now, so the looked-up entry's arrays can be freed."""
    import mlx.core as mx

    mx.eval([a for block in blocks for a in block.arrays()])
