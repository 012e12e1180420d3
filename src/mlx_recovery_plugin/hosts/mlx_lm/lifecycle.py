"""mlx-lm's server, seen as one engine: its requests' lifecycle as hook calls, and the
:class:`~...ports.EnginePort` the plugins get.

mlx-lm has no request ids and no scheduler object; what the adapter sees is its
generation thread taking a request (``_tokenize``, then ``fetch_nearest_cache``), the
``BatchGenerator`` it prefills and decodes in (``insert_segments``, ``next``, ``remove``),
and the one-by-one route for requests it cannot batch (``_serve_single``).

=============================================  ==========================================
where, in mlx-lm                               hook
=============================================  ==========================================
``ResponseGenerator.__init__`` (returns)       ``engine_attached``
``_tokenize`` (the prompt's tokens are known)  ``request_arrived``
``fetch_nearest_cache`` (returns)              ``request_admitted`` (cached tokens)
``BatchGenerator.next``: first token           ``request_prefilled`` (dense)
``BatchGenerator.next``: finish reason, then   ``request_departed`` (finished), once the
the loop's next ``_next_request`` / ``next``   server has stored the request's cache
``BatchGenerator.remove`` of a live request    ``request_aborted``, ``request_departed``
``_serve_single`` returns                      ``request_departed`` (finished)
``ResponseGenerator.stop_and_join``            ``engine_shutdown``, then ``model_unloaded``
=============================================  ==========================================

A request is reported as arriving when mlx-lm's generation thread tokenizes it (before
that the adapter has no tokens to report). mlx-lm has no abort-all, fail-all or reset.

Threads: every hook but ``engine_attached`` (the thread that builds the server) and the
shutdown pair (the thread that stops it) is called on mlx-lm's generation thread;
``_lock`` guards the records, which the status, the port and tests read from other threads.
Nothing here raises into the host.
"""

from __future__ import annotations

import functools
import itertools
import logging
import threading
import time
from collections.abc import Callable, Hashable, Sequence
from dataclasses import dataclass, field
from typing import Any

from ...events import DepartureReason, RequestAdmitted, RequestArrived, RequestDeparted, RequestPrefilled, Route
from ...plugins import HookEmitter
from ...ports import FetchedPrefix, StoreUnit
from ..prefill_shares import PrefillShares

log = logging.getLogger(__name__)

ENGINE_ID = "mlx_lm"


@dataclass(slots=True)
class _Live:
    """One request between its arrival and its departure."""

    request_id: str
    tokens: tuple[int, ...]
    model: Hashable
    request_key: int
    admitted_at: float | None = None
    cached_tokens: int = 0
    uid: tuple[int, int] | None = field(default=None)
    prefilled: bool = False
    share_from: float | None = None  # the prefill-share clock at its admission


class Requests:
    """The lifecycle of mlx-lm's requests, as hook calls (see the module docstring).

    ``on_aborted(model, tokens)`` runs after an aborted request departs (the adoption
    drops the snapshots only that request's prefill had taken).
    """

    def __init__(
        self, emitter: HookEmitter, block_size: int,
        on_aborted: Callable[[Hashable, Sequence[int]], None] | None = None,
        clock: Callable[[], float] = time.perf_counter,
    ) -> None:
        self.emitter = emitter
        self.block_size = block_size
        self.on_aborted = on_aborted
        self.clock = clock
        self._lock = threading.Lock()
        self._ids = itertools.count(1)
        self._live: dict[str, _Live] = {}
        # Each prefill's share of the batched steps (mlx-lm prefills the prompts it holds
        # together); under ``_lock``.
        self._shares = PrefillShares()
        self._departing: set[str] = set()
        self._by_request: dict[int, str] = {}
        self._by_uid: dict[tuple[int, int], str] = {}
        self._finishing: list[str] = []  # finished in a step; depart once the server is done
        self._current: str | None = None  # tokenized, not yet admitted (generation thread)
        self._admitted: str | None = None  # admitted, not yet in a batch (generation thread)
        self.engine: MlxLmEngine | None = None
        self._unloading = ""
        #: The adoption's snapshot store (the port's fetch counts what they restore).
        self.snapshots: Any = None
        self.faults = 0

    # -- what the wrappers call ------------------------------------------------------

    def attached(self, generator: Any) -> None:
        self._guard("attached", lambda: self._attach(generator))

    def arrived(self, generator: Any, request: Any, prompt: Sequence[int]) -> None:
        self._guard("arrived", lambda: self._arrive(generator, request, prompt))

    def admitted(self, tokens: Sequence[int], rest: Sequence[int]) -> None:
        self._guard("admitted", lambda: self._admit(len(tokens) - len(rest)))

    def batched(self, batch: Any, uids: Sequence[int]) -> None:
        def bind() -> None:
            rid, self._admitted = self._admitted, None
            if rid is None or len(uids) != 1:
                return
            with self._lock:
                live = self._live.get(rid)
                if live is not None:
                    live.uid = (id(batch), int(uids[0]))
                    self._by_uid[live.uid] = rid

        self._guard("batched", bind)

    def flush(self) -> None:
        """The generation loop came back for more: requests that finished in an earlier
        step (their cache stored by now) depart."""
        if self._finishing:
            finished, self._finishing = self._finishing, []
            for rid in finished:
                self._guard("flush", functools.partial(self._depart, rid, DepartureReason.FINISHED))

    def stepped(self, batch: Any, responses: Any) -> None:
        self._guard("stepped", lambda: self._step(batch, responses))

    def removing(self, batch: Any, uids: Sequence[int]) -> list[str]:
        """Before ``BatchGenerator.remove``: the live requests it takes away."""
        out: list[str] = []

        def find() -> None:
            with self._lock:
                out.extend(r for u in uids if (r := self._by_uid.get((id(batch), int(u)))) is not None)

        self._guard("removing", find)
        return out

    def removed(self, request_ids: Sequence[str]) -> None:
        for rid in request_ids:
            self._guard("removed", functools.partial(self._depart, rid, DepartureReason.ABORTED))

    def single_done(self) -> None:
        """``_serve_single`` returned: its request (admitted, never batched) departs."""
        rid, self._admitted = self._admitted, None
        if rid is not None:
            self._guard("single", lambda: self._depart(rid, DepartureReason.FINISHED))

    def shutting_down(self) -> None:
        def stop() -> None:
            # Named now: the generation thread forgets the model as it ends.
            self._unloading = self.engine.model_id if self.engine is not None else ""
            self.emitter.engine_shutdown(ENGINE_ID)

        self._guard("shutdown", stop)

    def shut_down(self) -> None:
        def end() -> None:
            self.flush()
            for rid in self.live_ids():
                self._depart(rid, DepartureReason.ABORTED)
            self.emitter.model_unloaded(ENGINE_ID, self._unloading)

        self._guard("shut down", end)

    # -- reads (any thread) ----------------------------------------------------------

    @property
    def current(self) -> str | None:
        """The request being admitted now (generation thread)."""
        return self._current

    def live_ids(self) -> list[str]:
        """Requests told as arrived and not yet told as departed."""
        with self._lock:
            return [*self._live, *self._departing]

    def request_id(self, request: Any) -> str | None:
        """The id the adapter gave ``request`` (a ``CompletionRequest``) while it is live."""
        with self._lock:
            return self._by_request.get(id(request))

    # -- internals -------------------------------------------------------------------

    def _attach(self, generator: Any) -> None:
        self.engine = MlxLmEngine(generator, self, self.snapshots)
        self.emitter.engine_attached(self.engine)

    def _arrive(self, generator: Any, request: Any, prompt: Sequence[int]) -> None:
        model = generator.model_provider.model_key
        rid = f"mlx_lm-{next(self._ids)}"
        live = _Live(rid, tuple(int(t) for t in prompt), model, id(request))
        with self._lock:
            self._live[rid] = live
            self._by_request[live.request_key] = rid
        self._current = rid
        self.emitter.request_arrived(RequestArrived(
            engine_id=ENGINE_ID, request_id=rid, model_id=_model_id(model), prompt_tokens=live.tokens,
        ))

    def _admit(self, cached: int) -> None:
        rid, self._current = self._current, None
        if rid is None:
            return
        with self._lock:
            live = self._live.get(rid)
            if live is None:
                return
            live.admitted_at = self.clock()
            live.share_from = self._share_clock(live.admitted_at)
            live.cached_tokens = cached
        self._admitted = rid
        self.emitter.request_admitted(RequestAdmitted(engine_id=ENGINE_ID, request_id=rid, cached_tokens=cached))

    def _step(self, batch: Any, responses: Any) -> None:
        _prompts, generated = responses
        for response in generated:
            with self._lock:
                rid = self._by_uid.get((id(batch), int(response.uid)))
                live = self._live.get(rid) if rid is not None else None
                first = live is not None and not live.prefilled
                prefill_s = 0.0
                if live is not None and first:
                    now = self.clock()
                    share_from = live.share_from if live.share_from is not None else self._share_clock(now)
                    prefill_s = max(0.0, self._share_clock(now) - share_from)
                    live.prefilled = True
            if live is None:
                continue
            if first:
                self.emitter.request_prefilled(RequestPrefilled(
                    engine_id=ENGINE_ID, request_id=live.request_id, model_id=_model_id(live.model),
                    tokens=live.tokens, cached_tokens=live.cached_tokens, route=Route.DENSE,
                    prefill_s=prefill_s,
                ))
            if response.finish_reason is not None:
                self._finishing.append(live.request_id)

    def _share_clock(self, now: float) -> float:
        """The prefill-share clock at ``now``, before any change at ``now`` (under ``_lock``)."""
        in_flight = sum(1 for x in self._live.values() if x.share_from is not None and not x.prefilled)
        return self._shares.read(now, in_flight)

    def _depart(self, rid: str, reason: DepartureReason) -> None:
        with self._lock:
            if rid in self._live:
                self._share_clock(self.clock())  # its share so far, before it leaves the count
            live = self._live.pop(rid, None)
            if live is None:
                return
            self._by_request.pop(live.request_key, None)
            if live.uid is not None:
                self._by_uid.pop(live.uid, None)
            # Still counted as live until its departure is told (a reader waiting for no
            # live request must not run ahead of the hook).
            self._departing.add(rid)
        try:
            if reason is DepartureReason.ABORTED:
                self.emitter.request_aborted(ENGINE_ID, rid)
                if self.on_aborted is not None:
                    self.on_aborted(live.model, live.tokens)
            self.emitter.request_departed(RequestDeparted(engine_id=ENGINE_ID, request_id=rid, reason=reason))
        finally:
            with self._lock:
                self._departing.discard(rid)

    def _guard(self, where: str, action: Callable[[], None]) -> None:
        try:
            action()
        except Exception as exc:  # noqa: BLE001 - bookkeeping never costs the host a request
            log.warning("mlx-recovery: mlx-lm lifecycle %s failed: %r", where, exc)
            with self._lock:
                self.faults += 1


def _model_id(model_key: Hashable) -> str:
    """mlx-lm's model key is ``(path, adapter, draft)``; the path names the model."""
    if isinstance(model_key, tuple) and model_key:
        return str(model_key[0])
    return str(model_key)


class _ModelHandle:
    """The server's current model (mlx-lm loads and swaps it on its generation thread)."""

    def __init__(self, provider: Any) -> None:
        self._provider = provider

    @property
    def model_id(self) -> str:
        key = self._provider.model_key
        if key is None:  # not loaded yet (or dropped at the end): the model it serves by default
            return str(getattr(self._provider.cli_args, "model", None) or "")
        return _model_id(key)

    @property
    def model(self) -> Any:
        return self._provider.model

    @property
    def stream(self) -> Any:
        return None

    def make_cache(self) -> list[Any]:
        from mlx_lm.models.cache import make_prompt_cache

        return list(make_prompt_cache(self._provider.model))


class PromptCachePort:
    """mlx-lm's ``LRUPromptCache`` as a :class:`~...ports.WholeEntryCachePort`, read only.

    :meth:`fetch` says how much of ``tokens`` the next request would reuse (the host's own
    lookup, or the adapter's adoption of a snapshot boundary), floored to whole blocks,
    without copying any state: it takes nothing, so :meth:`release` has nothing to give
    back. mlx-lm has no sparse route, so nothing needs recovery here: :meth:`store` stores
    nothing and says so (0 tokens held).
    """

    store_unit = StoreUnit.WHOLE_ENTRY

    def __init__(self, generator: Any, block_size: int, snapshots: Any = None) -> None:
        self._generator = generator
        self._block = block_size
        self.snapshots = snapshots

    @property
    def block_size(self) -> int:
        return self._block

    def fetch(self, holder_id: str, tokens: Sequence[int]) -> FetchedPrefix:
        return FetchedPrefix(restorable(self._generator, list(tokens), self._block, self.snapshots))

    def release(self, holder_id: str) -> None:
        return None

    def store(self, holder_id: str, tokens: Sequence[int], blocks: Sequence[Any]) -> int:
        return 0


def restorable(generator: Any, tokens: list[int], block: int, snapshots: Any) -> int:
    """Tokens of ``tokens`` the prompt cache restores now (whole blocks), read only."""
    from mlx_lm.models.cache import can_trim_prompt_cache

    provider = generator.model_provider
    prompt_cache = getattr(generator, "prompt_cache", None)
    if prompt_cache is None or provider.model_key is None or not tokens:
        return 0
    model = provider.model_key
    found = prompt_cache._trie.search(model, tokens)
    if found.exact is not None:
        reused = len(tokens)
    else:
        reused = len(found.shorter) if found.shorter is not None else 0
        if found.longer is not None and found.common_prefix > reused:
            matched = min(len(tokens) - 1, found.common_prefix)
            entry = prompt_cache._trie.get(found.model, found.longer)
            if can_trim_prompt_cache(entry.prompt_cache):
                reused = matched
            elif snapshots is not None:
                usable = snapshots.boundaries(model, tokens, block, matched)
                reused = max([reused, *usable[:1]])
    return reused // block * block


class MlxLmEngine:
    """The :class:`~...ports.EnginePort` of mlx-lm's server (one engine, one model)."""

    def __init__(self, generator: Any, requests: Requests, snapshots: Any = None) -> None:
        self._generator = generator
        self._requests = requests
        self._model = _ModelHandle(generator.model_provider)
        self._cache = PromptCachePort(generator, requests.block_size, snapshots)

    @property
    def engine_id(self) -> str:
        return ENGINE_ID

    @property
    def model_id(self) -> str:
        return self._model.model_id

    @property
    def block_size(self) -> int:
        return self._requests.block_size

    @property
    def prefill_step(self) -> int:
        return int(getattr(self._generator.model_provider.cli_args, "prefill_step_size", 2048))

    @property
    def model(self) -> _ModelHandle:
        return self._model

    @property
    def prefix_cache(self) -> PromptCachePort:
        return self._cache

    def queues_empty(self) -> bool:
        return self._generator.requests.empty() and not self._requests.live_ids()

    def is_busy(self) -> bool:
        return bool(self._requests.live_ids())

    def sparse_route_live(self) -> bool:
        return False
