"""The host ports over a live oMLX scheduler and its ``BlockAwarePrefixCache``.

Reference counting, as oMLX does it: a stored block sits in the paged cache with
``ref_count`` 0 (evictable, still findable by hash); whoever uses it holds +1.
``fetch_cache`` takes +1 on every block it returns and files them in a block table under
the caller's id; oMLX's own requests give them back with ``release_for_eviction`` (which
never frees a block, unlike ``release_cache`` / ``delete_block_table``). The ports do
exactly that, keep a ledger of every reference they took, and drop their block tables
afterwards, so a released holder leaves no trace in the cache.

``store`` goes through oMLX's own path, one block per ``store_cache`` call: the holder's
block table already covers the earlier blocks (a fetch of them), so each call adds one
block whose data is a one-block mlx-lm cache turned into oMLX's per-layer records by the
scheduler's own ``_extract_cache_states``. One block per call keeps ``store_cache``'s
slicing of relative vs. absolute positions unambiguous and never materialises the earlier
blocks. A store holds oMLX's ``_mx_buffer_access_lock``, as oMLX's own cache writer does,
so the two writers never interleave. Before each block it waits (boundedly) for room in
the host's SSD write queue: oMLX drops a block that finds that queue full and rolls the
store back to before it (:func:`wait_for_ssd_room`).

Threads: every method runs on the engine thread (inside an idle step), except
``release``, which may also run on a control thread during shutdown; the ledger is
guarded by ``_lock`` and the paged cache by its own re-entrant lock. The ports hold the
scheduler weakly: once oMLX drops it, fetch restores nothing and store stores nothing.
"""

from __future__ import annotations

import itertools
import logging
import os
import threading
import time
import weakref
from collections.abc import Callable, Sequence
from contextlib import nullcontext
from dataclasses import dataclass
from typing import Any

from mlx_lm.models.cache import make_prompt_cache

from ...kvcodec import UnsupportedCacheError
from ...ports import HOLDER_PREFIX, FetchedPrefix
from ...state import BlockState
from .codec import blocks_of_restored, cache_of_block
from .members import Member, member_of

log = logging.getLogger(__name__)

_table_ids = itertools.count(1)


def model_id_of(scheduler: Any) -> str:
    """oMLX's model id: the model directory's name (``model_name`` is its path)."""
    name = str(getattr(scheduler.config, "model_name", "") or "")
    return os.path.basename(name.rstrip("/")) or name


class OmlxModel:
    """:class:`~mlx_recovery_plugin.ports.ModelHandle` over the scheduler's model."""

    def __init__(self, scheduler: Any, model_id: str) -> None:
        self._scheduler = weakref.ref(scheduler)
        self._model_id = model_id

    @property
    def model_id(self) -> str:
        return self._model_id

    @property
    def model(self) -> Any:
        scheduler = self._scheduler()
        return None if scheduler is None else scheduler.model

    @property
    def stream(self) -> Any:
        scheduler = self._scheduler()
        return None if scheduler is None else getattr(scheduler, "_stream", None)

    def make_cache(self) -> list[Any]:
        model = self.model
        if model is None:
            raise RuntimeError(f"the model of {self._model_id} was unloaded")
        return make_prompt_cache(model)


@dataclass(slots=True)
class _Held:
    """References one fetch took: the block ids, and the pool they belong to."""

    table_id: str
    block_ids: list[int]
    pool: Any  # weakref to the PagedCacheManager
    blocks_list: list[Any]  # the pool's block list at fetch time (replaced by a clear)


class OmlxPrefixCache:
    """:class:`~mlx_recovery_plugin.ports.PrefixCachePort` over ``block_aware_cache``."""

    def __init__(self, scheduler: Any, engine_id: str, member: Member | None = None) -> None:
        self._scheduler = weakref.ref(scheduler)
        self._engine_id = engine_id
        self._member = member or member_of(scheduler)
        self._lock = threading.Lock()
        self._held: dict[str, list[_Held]] = {}
        self._fallback_block_size = int(scheduler.config.paged_cache_block_size)

    # -- the port --------------------------------------------------------------------

    @property
    def block_size(self) -> int:
        cache = self._cache()
        return int(cache.block_size) if cache is not None else self._fallback_block_size

    @property
    def enabled(self) -> bool:
        """False when oMLX runs without its prefix cache (no ``paged_ssd_cache_dir``)."""
        return self._cache() is not None

    def fetch(self, holder_id: str, tokens: Sequence[int]) -> FetchedPrefix:
        cache = self._cache()
        if cache is None or not tokens:
            return FetchedPrefix(tokens=0)
        table_id = self._new_table_id(holder_id)
        block_table, _ = cache.fetch_cache(table_id, list(tokens))
        if block_table is None or not block_table.block_ids:
            self._drop_table(cache, table_id)
            return FetchedPrefix(tokens=0)
        pool = cache.paged_cache
        with self._lock:
            self._held.setdefault(holder_id, []).append(
                _Held(table_id, list(block_table.block_ids), weakref.ref(pool), pool.blocks)
            )
        # reconstruct_cache may shorten the table in place (a block it cannot load).
        restored = cache.reconstruct_cache(block_table)
        if not restored:
            return FetchedPrefix(tokens=0)
        size = int(cache.block_size)
        n_blocks = int(block_table.num_tokens) // size
        blocks = blocks_of_restored(restored, n_blocks, size)
        return FetchedPrefix(tokens=n_blocks * size, blocks=tuple(blocks))

    def release(self, holder_id: str) -> None:
        """Give back every table held under ``holder_id``. A table leaves the ledger only
        once it is released, so after a failure part-way a later call releases the rest."""
        with self._lock:
            held = list(self._held.get(holder_id, []))
        cache = self._cache()
        for entry in held:
            pool = entry.pool()
            # After a reset the pool (or its block list) is new: those ids now name other
            # blocks, and the old references died with the old pool.
            if pool is not None and pool.blocks is entry.blocks_list:
                pool.release_for_eviction(entry.block_ids)
                pool.request_tables.pop(entry.table_id, None)
            if cache is not None:
                cache.clear_request_entry(entry.table_id)
            with self._lock:
                remaining = [e for e in self._held.get(holder_id, []) if e is not entry]
                if remaining:
                    self._held[holder_id] = remaining
                else:
                    self._held.pop(holder_id, None)

    def store(self, holder_id: str, tokens: Sequence[int], blocks: Sequence[BlockState]) -> int:
        scheduler, cache = self._scheduler(), self._cache()
        if scheduler is None or cache is None or scheduler.model is None:
            return 0
        size = int(cache.block_size)
        n_blocks = len(tokens) // size
        prefix = [int(t) for t in tokens[: n_blocks * size]]
        first = n_blocks - len(blocks)
        for offset, block in enumerate(blocks):
            if block.index != first + offset:
                raise ValueError(
                    f"blocks must be the last {len(blocks)} of {n_blocks}, got index {block.index}"
                )
        if not blocks:
            return self.stored_tokens(prefix)
        with host_buffer_lock(self._member):
            return self._store_blocks(scheduler, cache, holder_id, prefix, blocks, first)

    def _store_blocks(
        self,
        scheduler: Any,
        cache: Any,
        holder_id: str,
        prefix: list[int],
        blocks: Sequence[BlockState],
        first: int,
    ) -> int:
        size = int(cache.block_size)
        table_id = self._new_table_id(holder_id)
        held = 0
        try:
            if first > 0:
                # The earlier blocks must already be stored; taking them under the table
                # is what makes each store_cache below add exactly one block.
                table, _ = cache.fetch_cache(table_id, prefix[: first * size])
                held = int(table.num_tokens) if table is not None else 0
                if held < first * size:
                    return held
            for block in blocks:
                end = (block.index + 1) * size
                one_block = cache_of_block(scheduler.model, block)
                records, cache_config = scheduler._extract_cache_states(one_block)
                if not records:
                    break
                if not wait_for_ssd_room(cache):
                    log.info("mlx-recovery: %s: the host's SSD write queue stayed full for %.1f s; storing "
                             "block %d anyway", self._engine_id, SSD_QUEUE_WAIT_S, block.index)
                table = cache.store_cache(
                    table_id, prefix[:end], records, model_cache_config=cache_config
                )
                if table is None or int(table.num_tokens) < end:
                    break
                held = end
            return held
        except UnsupportedCacheError as exc:
            log.warning("mlx-recovery: %s cannot store recovered blocks: %s", self._engine_id, exc)
            return held
        finally:
            self._drop_table(cache, table_id)

    # -- inspection ------------------------------------------------------------------

    def stored_tokens(self, tokens: Sequence[int]) -> int:
        """Leading tokens of ``tokens`` the cache holds as whole blocks (no reference taken)."""
        cache = self._cache()
        if cache is None:
            return 0
        _, count = cache.paged_cache.get_computed_blocks([int(t) for t in tokens])
        return int(count)

    def holders(self) -> list[str]:
        """Holder ids that still have references (tests, status)."""
        with self._lock:
            return sorted(self._held)

    # -- internals -------------------------------------------------------------------

    def _cache(self) -> Any:
        scheduler = self._scheduler()
        return None if scheduler is None else scheduler.block_aware_cache

    def _new_table_id(self, holder_id: str) -> str:
        return f"{HOLDER_PREFIX}/{self._engine_id}/{holder_id}/{next(_table_ids)}"

    @staticmethod
    def _drop_table(cache: Any, table_id: str) -> None:
        """Give back every reference filed under ``table_id`` and forget the table."""
        pool = cache.paged_cache
        table = pool.get_block_table(table_id)
        if table is not None:
            pool.release_for_eviction(list(table.block_ids))
        pool.request_tables.pop(table_id, None)
        cache.clear_request_entry(table_id)


# oMLX writes each stored block to its SSD cache from a bounded queue (its depth half the
# machine's memory in GB, at least 32 and at most 256) and drops a block that finds the
# queue full, rolling the store back to before it. A whole prefix published at once (48
# blocks at 12,288 tokens) outran the writer: the publication came back one block short
# and the next turn ran dense over it, 16.31 s against a sparse rerun of 14.45 s (bench
# policy, 1792x6, this 23 GB machine). The writer drains a block in milliseconds, so a
# store waits for room instead, up to this long a block.
SSD_QUEUE_WAIT_S = 1.0
SSD_QUEUE_POLL_S = 0.005


def wait_for_ssd_room(
    cache: Any, *, wait_s: float | None = None, clock: Callable[[], float] = time.monotonic,
    sleep: Callable[[float], None] = time.sleep,
) -> bool:
    """Wait until the host's SSD cache has room in its write queue for one block, at most
    ``wait_s`` (default :data:`SSD_QUEUE_WAIT_S`). True when it has room, or keeps no such
    queue (no SSD cache, or its in-memory hot cache takes the writes); False at the limit."""
    ssd = getattr(cache, "paged_ssd_cache", None)
    pending = getattr(ssd, "_write_queue", None)
    if pending is None or getattr(ssd, "_hot_cache_enabled", False) or not hasattr(pending, "full"):
        return True
    deadline = clock() + (SSD_QUEUE_WAIT_S if wait_s is None else wait_s)
    while pending.full():
        if clock() >= deadline:
            return False
        sleep(SSD_QUEUE_POLL_S)
    return True


def host_buffer_lock(member: Member | None) -> Any:
    """The host's lock around its cache writer's reads of MLX buffers (re-entrant; where it
    lives is the member's data). Holding it while storing keeps our writes and its
    worker's from interleaving."""
    lock = member.host_buffer_lock() if member is not None else None
    return lock if lock is not None else nullcontext()


class OmlxEngine:
    """:class:`~mlx_recovery_plugin.ports.EnginePort` over one oMLX scheduler.

    ``queues_empty`` also counts requests that reached the engine's front door
    (``EngineCore.add_request``) but not yet its scheduler: those wait on the engine
    thread behind whatever step is running, and a recovery slice must already yield to
    them. ``pending_arrivals`` is that count, kept by the instrumentor.
    """

    def __init__(
        self, scheduler: Any, engine_id: str, pending_arrivals: Any = None, member: Member | None = None
    ) -> None:
        self._scheduler = weakref.ref(scheduler)
        self._engine_id = engine_id
        self._model_id = model_id_of(scheduler)
        self._model = OmlxModel(scheduler, self._model_id)
        self._prefix_cache = OmlxPrefixCache(scheduler, engine_id, member)
        self._prefill_step = int(scheduler.config.prefill_step_size)
        self._pending_arrivals = pending_arrivals or (lambda: 0)
        #: Set by the instrumentor while a real ``step()`` runs.
        self.stepping = False

    @property
    def engine_id(self) -> str:
        return self._engine_id

    @property
    def model_id(self) -> str:
        return self._model_id

    @property
    def block_size(self) -> int:
        return self._prefix_cache.block_size

    @property
    def prefill_step(self) -> int:
        return self._prefill_step

    @property
    def model(self) -> OmlxModel:
        return self._model

    @property
    def prefix_cache(self) -> OmlxPrefixCache:
        return self._prefix_cache

    @property
    def scheduler(self) -> Any:
        """The live scheduler, or None once oMLX dropped it."""
        return self._scheduler()

    def queues_empty(self) -> bool:
        scheduler = self._scheduler()
        if scheduler is None:
            return True
        if self._pending_arrivals() > 0:
            return False
        return not (scheduler.waiting or scheduler.prefilling or scheduler.running)

    def is_busy(self) -> bool:
        scheduler = self._scheduler()
        if scheduler is None:
            return False
        return self.stepping or bool(scheduler.running or scheduler.prefilling)

    def sparse_route_live(self) -> bool:
        scheduler = self._scheduler()
        return scheduler is not None and scheduler._specprefill_active_request_id is not None
