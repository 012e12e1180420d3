"""One mock engine: a real mlx-lm model behind a scheduler shaped like oMLX's.

What it imitates, because the plugin depends on it:

* a **waiting** and a **running** queue; admission happens inside :meth:`MockEngine.step`;
* **deferred aborts**: :meth:`MockEngine.abort` only queues; the next step applies it;
* **two-phase departure**: a request that finishes (or is aborted / failed) is cleaned up
  in one step and finally removed in a later one, which is when its fetch references go
  back and ``request_departed`` is emitted;
* a **dense route** that restores the longest stored whole-block prefix, prefills the
  rest in ``prefill_step`` chunks, stores the prompt's whole blocks and decodes greedily;
* a prefix cache of either kind (``cache_kind``): ``"paged"``, oMLX's refcounted blocks
  with chained hashes, or ``"entries"``, rapid-mlx's whole entries (the prompt's whole
  blocks stored as one entry, restored prefix included);
* a **sparse route** (SpecPrefill-like) for requests that ask for it when the engine has
  a draft model and the uncached part exceeds ``sparse_threshold``: it runs alone, the
  draft model reads the whole uncached range to score it, the target prefills only the
  ``sparse_keep`` share on top of the restored prefix, and nothing of it is stored.

All model work is real (mlx-lm forward passes, ``mx.eval`` per chunk) so timings mean
something. Threads: :meth:`submit`, :meth:`abort`, :meth:`abort_all`, :meth:`fail_all`
and the ``EnginePort`` queries may be called from any thread; everything else runs on
the engine's owner thread (the caller of ``step()``; in threaded mode the engine loop).
Queues are guarded by ``self._cond``; request state, the pool and the prefix cache are
touched only by the owner thread.
"""

from __future__ import annotations

import logging
import math
import threading
import time
from collections import Counter, deque
from collections.abc import Callable, Sequence
from concurrent.futures import Future
from typing import Any, TypeVar

import mlx.core as mx

from ..events import (
    DepartureReason,
    IdleStep,
    LookupDue,
    RequestAdmitted,
    RequestArrived,
    RequestDeparted,
    RequestPrefilled,
    Route,
    SparseRouteServed,
)
from ..hosts.prefill_shares import PrefillShares
from ..kvcodec import UnsupportedCacheError, blocks_from_cache, cache_from_blocks
from ..plugins import HookEmitter
from .block_pool import BlockPool
from .entry_cache import WholeEntryPrefixCache
from .prefix_cache import PagedPrefixCache
from .requests import (
    DECODE,
    DONE,
    PREFILL,
    SCORING,
    SPARSE_TAIL_TOKENS,
    EngineRequest,
    LoadedModel,
    RequestResult,
    eval_cache,
)

log = logging.getLogger(__name__)

Clock = Callable[[], float]
T = TypeVar("T")

# The two kinds of prefix cache a mock engine can have (:class:`~..ports.StoreUnit`).
CACHE_KINDS = ("paged", "entries")

class MockEngine:
    """One model with its scheduler, queues, block pool and prefix cache.

    Conforms to :class:`mlx_recovery_plugin.ports.EnginePort`; ``engine.model`` is its
    :class:`LoadedModel` (a ``ModelHandle``).
    """

    def __init__(
        self,
        engine_id: str,
        model: LoadedModel,
        *,
        emitter: HookEmitter,
        block_size: int = 64,
        prefill_step: int = 128,
        pool_blocks: int = 2048,
        draft: LoadedModel | None = None,
        sparse_threshold: int = 8192,
        sparse_keep: float = 0.2,
        max_running: int = 8,
        clock: Clock = time.perf_counter,
        on_result: Callable[[RequestResult], None] | None = None,
        cache_kind: str = "paged",
    ) -> None:
        if cache_kind not in CACHE_KINDS:
            raise ValueError(f"unknown cache kind {cache_kind!r}; choose one of {', '.join(CACHE_KINDS)}")
        if block_size <= 0 or prefill_step <= 0 or pool_blocks <= 0 or max_running <= 0:
            raise ValueError("block_size, prefill_step, pool_blocks and max_running must be > 0")
        if not 0.0 < sparse_keep <= 1.0:
            raise ValueError(f"sparse_keep must be in (0, 1], got {sparse_keep}")
        if sparse_threshold < 0:
            raise ValueError(f"sparse_threshold must be >= 0, got {sparse_threshold}")
        self._engine_id = engine_id
        self._model: LoadedModel = model
        self.draft = draft
        self._block_size = block_size
        self._prefill_step = prefill_step
        self._shares = PrefillShares()  # each prefill's share of the steps; under _cond
        self.sparse_threshold = sparse_threshold
        self.sparse_keep = sparse_keep
        self.max_running = max_running
        self.clock = clock
        self.on_result = on_result
        self._hooks = emitter
        self.pool = BlockPool(pool_blocks, block_size)
        self.cache_kind = cache_kind
        self._prefix_cache: PagedPrefixCache | WholeEntryPrefixCache = (
            PagedPrefixCache(self.pool, model.model_id)
            if cache_kind == "paged"
            else WholeEntryPrefixCache(block_size)
        )

        self._cond = threading.Condition()
        # Guarded by _cond (any thread may add; the owner thread takes).
        self._waiting: deque[EngineRequest] = deque()
        self._running: list[EngineRequest] = []
        self._departing: list[EngineRequest] = []
        self._aborts: deque[str] = deque()
        self._abort_all_pending = False
        self._fail_pending: list[str] = []
        self._calls: deque[tuple[Callable[[], Any], Future[Any]]] = deque()
        self._wake = False
        self._requests: dict[str, EngineRequest] = {}  # submitted and not yet departed

        # Owner thread only.
        self.results: dict[str, RequestResult] = {}
        self.step_count = 0
        self.idle_steps_offered = 0
        self.idle_consecutive = 0
        self.closed = False
        self.unloaded = False
        self.owner_thread: threading.Thread | None = None  # set by a threaded host loop
        self._busy = False
        self._sparse_live = False
        self._warned: set[tuple[str, str]] = set()

        self._hooks.engine_attached(self)

    # -- EnginePort -----------------------------------------------------------------
    @property
    def engine_id(self) -> str:
        return self._engine_id

    @property
    def model_id(self) -> str:
        return self._model.model_id

    @property
    def block_size(self) -> int:
        return self._block_size

    @property
    def prefill_step(self) -> int:
        return self._prefill_step

    @property
    def model(self) -> LoadedModel:
        return self._model

    @property
    def prefix_cache(self) -> PagedPrefixCache | WholeEntryPrefixCache:
        return self._prefix_cache

    def outstanding(self) -> dict[str, Counter[Any]]:
        """Every reference not held by the prefix index itself: block references in the
        pool, and entries pinned by fetches not yet released. Empty when nothing leaked."""
        refs: dict[str, Counter[Any]] = dict(self.pool.outstanding())
        if isinstance(self._prefix_cache, WholeEntryPrefixCache):
            refs.update(self._prefix_cache.outstanding())
        return refs

    @property
    def port(self) -> MockEngine:
        """The engine's :class:`~mlx_recovery_plugin.ports.EnginePort` (itself)."""
        return self

    def queues_empty(self) -> bool:
        with self._cond:
            return not (self._waiting or self._running or self._departing)

    def is_busy(self) -> bool:
        return self._busy

    def sparse_route_live(self) -> bool:
        return self._sparse_live

    # -- any thread ---------------------------------------------------------------
    def submit(
        self,
        request_id: str,
        prompt_tokens: Sequence[int],
        *,
        max_tokens: int = 8,
        sparse: bool = False,
    ) -> str:
        """Queue a request; ``request_arrived`` is emitted on the calling thread first."""
        prompt = tuple(int(t) for t in prompt_tokens)
        if not prompt:
            raise ValueError("a request needs at least one prompt token")
        if max_tokens < 1:
            raise ValueError(f"max_tokens must be >= 1, got {max_tokens}")
        req = EngineRequest(request_id, prompt, max_tokens, sparse, submitted_at=self.clock())
        with self._cond:
            if self.closed:
                raise RuntimeError(f"engine {self.engine_id!r} is shut down")
            if request_id in self._requests or request_id in self.results:
                raise ValueError(f"request id {request_id!r} is already in use")
            self._requests[request_id] = req
        self._hooks.request_arrived(RequestArrived(self.engine_id, request_id, self.model_id, prompt))
        with self._cond:
            self._waiting.append(req)
            self._cond.notify_all()
        return request_id

    def abort(self, request_id: str) -> None:
        """Queue an abort; the next step applies it (unknown ids are logged there)."""
        with self._cond:
            self._aborts.append(request_id)
            self._cond.notify_all()

    def abort_all(self) -> None:
        with self._cond:
            self._abort_all_pending = True
            self._cond.notify_all()

    def fail_all(self, error: str) -> None:
        with self._cond:
            self._fail_pending.append(error)
            self._cond.notify_all()

    def has_requests(self) -> bool:
        """True while the engine has something for ``step()`` to do."""
        with self._cond:
            return bool(
                self._waiting or self._running or self._departing or self._aborts
                or self._abort_all_pending or self._fail_pending
            )

    def in_flight(self) -> list[str]:
        """Ids submitted and not yet departed."""
        with self._cond:
            return list(self._requests)

    # -- running on the owner thread from elsewhere -------------------------------
    def call(self, fn: Callable[[], T], timeout: float | None = 60.0) -> T:
        """Run ``fn`` on the owner thread: directly when there is no engine loop (or we
        are it), else queued for the loop, waiting for the answer."""
        owner = self.owner_thread
        if owner is None or not owner.is_alive() or owner is threading.current_thread():
            return fn()
        future: Future[T] = Future()
        with self._cond:
            self._calls.append((fn, future))
            self._cond.notify_all()
        return future.result(timeout)

    def run_calls(self) -> None:
        """Run calls queued by :meth:`call` (engine loop only)."""
        while True:
            with self._cond:
                if not self._calls:
                    return
                fn, future = self._calls.popleft()
            if not future.set_running_or_notify_cancel():
                continue
            try:
                future.set_result(fn())
            except BaseException as exc:  # noqa: BLE001 - handed to the waiting caller
                future.set_exception(exc)

    def wait_for_work(self, timeout: float | None) -> bool:
        """Block until a request, a command, a queued call or :meth:`wake`; False when
        ``timeout`` passed first."""
        with self._cond:
            woke = self._cond.wait_for(
                lambda: self._wake or bool(self._calls) or self._has_requests_locked(),
                timeout,
            )
            self._wake = False
            return woke

    def wake(self) -> None:
        with self._cond:
            self._wake = True
            self._cond.notify_all()

    def _has_requests_locked(self) -> bool:
        return bool(
            self._waiting or self._running or self._departing or self._aborts
            or self._abort_all_pending or self._fail_pending
        )

    # -- owner thread -------------------------------------------------------------
    def step(self) -> None:
        """One scheduler step: final removal of last step's departures, queued aborts,
        admission, then one unit of work (a prefill chunk or a token) per running request.
        An error in model work fails every request, as the real engine loop does."""
        self.step_count += 1
        self.idle_consecutive = 0
        self._busy = True
        try:
            self._remove_departed()
            self._apply_commands()
            self._schedule_waiting()
            self._run_once()
        except Exception as exc:
            log.exception("mlx-recovery mock: step of engine %r failed", self.engine_id)
            self._fail_in_flight(f"{type(exc).__name__}: {exc}")
        finally:
            self._busy = False

    def offer_idle_step(self) -> list[Any]:
        """Emit one ``engine_idle_step``; returns the implementations' answers."""
        self.idle_consecutive += 1
        self.idle_steps_offered += 1
        return self._hooks.engine_idle_step(IdleStep(self.engine_id, self.idle_consecutive))

    def reset(self, deep: bool = False) -> None:
        """Drop every request at once (each departs ``aborted``); ``deep`` also empties
        the prefix cache. Then ``engine_reset`` is emitted."""
        self._drain(DepartureReason.ABORTED)
        if deep:
            self._prefix_cache.clear()
        self._hooks.engine_reset(engine_id=self.engine_id, deep=deep)

    def shutdown(self) -> None:
        """Drop every request (each departs ``aborted``), emit ``engine_shutdown``, and
        refuse further work. Idempotent."""
        if self.closed:
            return
        with self._cond:
            self.closed = True
        self._drain(DepartureReason.ABORTED)
        self._hooks.engine_shutdown(engine_id=self.engine_id)

    def unload(self) -> None:
        """Shut down if needed, emit ``model_unloaded``, then free the prefix cache and
        forget the model. Idempotent."""
        if self.unloaded:
            return
        self.shutdown()
        self.unloaded = True
        self._hooks.model_unloaded(engine_id=self.engine_id, model_id=self.model_id)
        self._prefix_cache.clear()
        self._model = LoadedModel(self._model.model_id, None)
        self.draft = None

    # -- step internals -----------------------------------------------------------
    def _remove_departed(self) -> None:
        with self._cond:
            departing, self._departing = self._departing, []
        for req in departing:
            self._finalize(req)

    def _finalize(self, req: EngineRequest) -> None:
        self._prefix_cache.release(req.request_id)
        with self._cond:
            self._requests.pop(req.request_id, None)
        result = req.result(self.engine_id)
        self.results[req.request_id] = result
        self._hooks.request_departed(RequestDeparted(self.engine_id, req.request_id, result.reason))
        if self.on_result is not None:
            self.on_result(result)

    def _apply_commands(self) -> None:
        with self._cond:
            aborts = list(self._aborts)
            self._aborts.clear()
            abort_all, self._abort_all_pending = self._abort_all_pending, False
            fails, self._fail_pending = self._fail_pending, []
        if fails:
            self._fail_in_flight(fails[0])
        if abort_all:
            self._hooks.engine_aborted_all(engine_id=self.engine_id)
            for req in self._live_requests():
                self._clean_up(req, DepartureReason.ABORTED)
        for request_id in aborts:
            with self._cond:
                req = self._requests.get(request_id)
            if req is None:
                self._warn_once("abort", request_id, "abort of unknown request %r ignored")
                continue
            if req.phase == DONE:
                continue  # already leaving
            self._hooks.request_aborted(engine_id=self.engine_id, request_id=request_id)
            self._clean_up(req, DepartureReason.ABORTED)

    def _fail_in_flight(self, error: str) -> None:
        self._hooks.engine_failed_all(engine_id=self.engine_id, error=error)
        for req in self._live_requests():
            self._clean_up(req, DepartureReason.FAILED)

    def _live_requests(self) -> list[EngineRequest]:
        with self._cond:
            return list(self._waiting) + list(self._running)

    def _share_clock(self, now: float, besides: EngineRequest | None = None) -> float:
        """The prefill-share clock at ``now``: the running prefills (all but ``besides``,
        not yet counted) each advanced by their share since the last reading."""
        with self._cond:  # a reset may drain from another thread
            in_flight = sum(1 for r in self._running if r.phase in (SCORING, PREFILL) and r is not besides)
            return self._shares.read(now, in_flight)

    def _clean_up(self, req: EngineRequest, reason: DepartureReason) -> None:
        """First phase of departure: drop the request's state; final removal next step."""
        if req.phase in (SCORING, PREFILL):
            self._share_clock(self.clock())  # its share so far, before it leaves the count
        req.phase = DONE
        req.reason = req.reason or reason
        req.cache = None
        req.draft_cache = None
        req.scores = []
        if req.route == "sparse":
            self._sparse_live = False
        with self._cond:
            if req in self._running:
                self._running.remove(req)
            elif req in self._waiting:
                self._waiting.remove(req)
            self._departing.append(req)

    def _drain(self, reason: DepartureReason) -> None:
        """Remove everything in flight at once (reset / shutdown)."""
        for req in self._live_requests():
            self._clean_up(req, reason)
        with self._cond:
            departing, self._departing = self._departing, []
            self._aborts.clear()
            self._abort_all_pending = False
            self._fail_pending = []
        for req in departing:
            self._finalize(req)

    def _wants_sparse(self, req: EngineRequest, cached: int) -> bool:
        return (
            req.sparse
            and self.draft is not None
            and len(req.prompt) - cached > self.sparse_threshold
        )

    def _schedule_waiting(self) -> None:
        while True:
            with self._cond:
                if not self._waiting or self._sparse_live:
                    return
                if len(self._running) >= self.max_running:
                    return
                req = self._waiting[0]
                running = bool(self._running)
            # The sparse route runs alone: its request waits (and so does everything
            # behind it) until the running requests are done.
            if running and self._wants_sparse(
                req, self._prefix_cache.stored_tokens(req.prompt[:-1])
            ):
                return
            with self._cond:
                self._waiting.popleft()
                self._running.append(req)
            self._admit(req)
            if req.route == "sparse":
                return

    def _admit(self, req: EngineRequest) -> None:
        prompt = tuple(req.prompt)
        self._hooks.prefix_lookup_due(LookupDue(self.engine_id, req.request_id, self.model_id, lambda: prompt))
        # At least the last prompt token is always prefilled, for the first logits.
        prefix = self._prefix_cache.fetch(req.request_id, req.prompt[:-1])
        req.cached_tokens = prefix.tokens
        req.cache = cache_from_blocks(self._model.make_cache, prefix.blocks)
        uncached = list(req.prompt[prefix.tokens :])
        if self._wants_sparse(req, prefix.tokens):
            assert self.draft is not None
            req.route, req.phase = "sparse", SCORING
            req.feed = uncached
            req.draft_cache = self.draft.make_cache()
            self._sparse_live = True
        else:
            req.route, req.phase = "dense", PREFILL
            req.feed = uncached
        req.admitted_at = self.clock()
        req.share_from = self._share_clock(req.admitted_at, besides=req)
        self._hooks.request_admitted(RequestAdmitted(self.engine_id, req.request_id, req.cached_tokens))

    def _run_once(self) -> None:
        with self._cond:
            running = list(self._running)
        for req in running:
            if req.phase == SCORING:
                self._score_chunk(req)
            elif req.phase == PREFILL:
                self._prefill_chunk(req)
            elif req.phase == DECODE:
                self._decode_one(req)

    def _score_chunk(self, req: EngineRequest) -> None:
        """The draft reads one chunk of the uncached range; after the last chunk the kept
        share becomes the target's prefill feed."""
        assert self.draft is not None and req.draft_cache is not None
        chunk = req.feed[req.scored : req.scored + self._prefill_step]
        logits = self.draft.model(mx.array(chunk)[None], cache=req.draft_cache)
        score = logits[0].max(axis=-1)
        eval_cache(req.draft_cache, score)
        req.scores.append(score)
        req.scored += len(chunk)
        req.draft_tokens += len(chunk)
        if req.scored < len(req.feed):
            return
        scores = mx.concatenate(req.scores).tolist()
        total = len(req.feed)
        tail = min(SPARSE_TAIL_TOKENS, total)
        keep = max(tail, math.ceil(self.sparse_keep * total))
        head = sorted(range(total - tail), key=lambda i: (-scores[i], i))[: keep - tail]
        chosen = sorted(head) + list(range(total - tail, total))
        req.feed = [req.feed[i] for i in chosen]
        req.draft_cache, req.scores = None, []
        req.phase = PREFILL

    def _prefill_chunk(self, req: EngineRequest) -> None:
        assert req.cache is not None
        chunk = req.feed[req.fed : req.fed + self._prefill_step]
        logits = self._model.model(mx.array(chunk)[None], cache=req.cache)
        req.fed += len(chunk)
        req.prefilled_tokens += len(chunk)
        if req.fed < len(req.feed):
            # As mlx-lm's own prefill does: a chunk before the last one computes only what
            # the cache keeps, not the last layer's output or the logits.
            eval_cache(req.cache)
            return
        last = logits[0, -1]
        eval_cache(req.cache, last)
        req.feed = []
        req.first_logits = last
        req.output.append(int(mx.argmax(last).item()))
        now = self.clock()
        req.ttft_s = now - req.submitted_at
        # Its own prefill: its share of the steps from admission (not the wait behind
        # other requests, nor the chunks of those prefilled beside it).
        if req.share_from is not None:
            prefill_s = max(0.0, self._share_clock(now) - req.share_from)
        else:
            prefill_s = now - req.submitted_at
        self._hooks.request_prefilled(
            RequestPrefilled(
                self.engine_id, req.request_id, self.model_id, tuple(req.prompt), req.cached_tokens,
                Route.DENSE if req.route == "dense" else Route.SPARSE, prefill_s,
            )
        )
        if req.route == "dense":
            self._store_prompt(req)
        else:
            self._hooks.sparse_route_served(
                SparseRouteServed(
                    self.engine_id, req.request_id, self.model_id, req.prompt,
                    served_start=req.cached_tokens, served_end=len(req.prompt),
                    threshold=self.sparse_threshold, keep=self.sparse_keep,
                    prefill_s=prefill_s,
                )
            )
        req.phase = DECODE
        if len(req.output) >= req.max_tokens:
            self._clean_up(req, DepartureReason.FINISHED)

    def _decode_one(self, req: EngineRequest) -> None:
        assert req.cache is not None
        logits = self._model.model(mx.array([[req.output[-1]]]), cache=req.cache)
        last = logits[0, -1]
        eval_cache(req.cache, last)
        req.output.append(int(mx.argmax(last).item()))
        if len(req.output) >= req.max_tokens:
            self._clean_up(req, DepartureReason.FINISHED)

    def _store_prompt(self, req: EngineRequest) -> None:
        """Store the prompt's whole blocks that the fetch did not already restore."""
        assert req.cache is not None
        size = self._block_size
        whole = len(req.prompt) // size
        # A whole-entry cache stores the prompt as one entry, restored prefix included.
        first = req.cached_tokens // size if self.cache_kind == "paged" else 0
        if whole <= req.cached_tokens // size:
            return
        try:
            blocks = blocks_from_cache(req.cache, first, whole, size)
        except (ValueError, UnsupportedCacheError) as exc:
            self._warn_once("store", type(exc).__name__, "prompt blocks not stored: %s", exc)
            return
        self._prefix_cache.store(req.request_id, req.prompt[: whole * size], blocks)

    # -- helpers ------------------------------------------------------------------

    def _warn_once(self, kind: str, key: str, message: str, *args: Any) -> None:
        if (kind, key) in self._warned:
            return
        self._warned.add((kind, key))
        log.warning("mlx-recovery mock (engine %s): " + message, self.engine_id, *(args or (key,)))
