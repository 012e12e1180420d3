"""The mock host: several :class:`MockEngine` s in one process, one plugin manager.

Two ways to drive it:

* **synchronous** (the default, for deterministic tests): :meth:`MockHost.run_until_idle`
  steps every engine that has requests until none has any, and :meth:`MockHost.drive_idle`
  offers idle steps to idle engines while a plugin asks for more. Nothing happens between
  calls; the test's thread owns every engine.
* **threaded** (:meth:`MockHost.start` / :meth:`MockHost.stop`): one thread per engine runs
  the real host's loop: ``step()`` while it has requests, else idle steps while a plugin
  asks, else it sleeps until an arrival. An idle engine never steps by itself. MLX work of
  all engine threads is serialized by one lock, so engines never run model code at once.

Requests are submitted from any thread; control calls (reset, shutdown) are carried out
on the engine's own thread, so a hook running on one engine's thread must not call them
for another engine (the MLX lock would deadlock them).
"""

from __future__ import annotations

import itertools
import logging
import os
import sys
import threading
import time
from collections import Counter
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import pluggy

from ..plugins import HookEmitter
from .engine import Clock, LoadedModel, MockEngine, RequestResult
from .tiny_model import load_tiny_model

log = logging.getLogger(__name__)


class MockHost:
    """A process hosting several engines; see the module docstring."""

    def __init__(self, pm: pluggy.PluginManager) -> None:
        self.pm = pm
        self.emitter = HookEmitter(pm)
        self.engines: dict[str, MockEngine] = {}
        # The smallest delay a plugin asked for in the last drive_idle (None: none asked).
        self.last_idle_retry_after: float | None = None
        self._loaded: dict[str, tuple[Any, Any]] = {}
        self._request_engine: dict[str, str] = {}
        self._results = threading.Condition()
        self._ids = itertools.count(1)
        self._warned: set[tuple[str, str]] = set()
        self._mlx_lock = threading.Lock()
        self._threads: dict[str, threading.Thread] = {}
        self._stopping: set[str] = set()
        self._started = False

    # -- engines --------------------------------------------------------------------
    def add_engine(
        self,
        engine_id: str,
        model_dir: str | Path | None = None,
        *,
        block_size: int = 64,
        prefill_step: int = 128,
        pool_blocks: int = 2048,
        draft_model_dir: str | Path | None = None,
        sparse_threshold: int = 8192,
        sparse_keep: float = 0.2,
        model_id: str | None = None,
        clock: Clock = time.perf_counter,
        model: Any = None,
        tokenizer: Any = None,
        draft_model: Any = None,
        max_running: int = 8,
        cache_kind: str = "paged",
    ) -> MockEngine:
        """Load (or take) a model and start an engine for it; emits ``engine_attached``.

        Models loaded from the same directory are shared between engines. ``cache_kind``
        is ``"paged"`` (oMLX's refcounted blocks with chained hashes) or ``"entries"``
        (rapid-mlx's whole entries, :class:`~.entry_cache.WholeEntryPrefixCache`).
        """
        if engine_id in self.engines:
            raise ValueError(f"engine {engine_id!r} already exists")
        if model is None:
            if model_dir is None:
                raise ValueError("give model_dir or an already loaded model")
            model, loaded_tokenizer = self._load(model_dir)
            tokenizer = tokenizer if tokenizer is not None else loaded_tokenizer
        if draft_model is None and draft_model_dir is not None:
            draft_model, _ = self._load(draft_model_dir)
        mid = model_id or engine_id
        draft = LoadedModel(f"{mid}#draft", draft_model) if draft_model is not None else None
        engine = MockEngine(
            engine_id,
            LoadedModel(mid, model, tokenizer),
            emitter=self.emitter,
            block_size=block_size,
            prefill_step=prefill_step,
            pool_blocks=pool_blocks,
            draft=draft,
            sparse_threshold=sparse_threshold,
            sparse_keep=sparse_keep,
            max_running=max_running,
            clock=clock,
            on_result=self._on_result,
            cache_kind=cache_kind,
        )
        self.engines[engine_id] = engine
        if self._started:
            self._start_thread(engine)
        return engine

    def _load(self, model_dir: str | Path) -> tuple[Any, Any]:
        key = str(Path(model_dir).resolve())
        if key not in self._loaded:
            self._loaded[key] = load_tiny_model(key)
        return self._loaded[key]

    # -- requests -------------------------------------------------------------------
    def submit(
        self,
        engine_id: str,
        prompt_tokens: Sequence[int],
        *,
        max_tokens: int = 8,
        sparse: bool = False,
        request_id: str | None = None,
    ) -> str:
        """Queue a request on an engine (any thread); returns its id."""
        engine = self.engines[engine_id]
        rid = request_id or f"{engine_id}-{next(self._ids)}"
        with self._results:
            if rid in self._request_engine:
                raise ValueError(f"request id {rid!r} is already in use")
            self._request_engine[rid] = engine_id
        try:
            return engine.submit(rid, prompt_tokens, max_tokens=max_tokens, sparse=sparse)
        except Exception:
            with self._results:
                del self._request_engine[rid]
            raise

    def result(self, request_id: str) -> RequestResult:
        """The result of a departed request (KeyError while it is still in flight)."""
        engine_id = self._request_engine[request_id]
        try:
            return self.engines[engine_id].results[request_id]
        except KeyError:
            raise KeyError(f"request {request_id!r} has not departed yet") from None

    def wait(self, request_id: str, timeout: float = 60.0) -> RequestResult:
        """Wait until a request has departed (threaded mode) and return its result."""
        engine = self.engines[self._request_engine[request_id]]
        with self._results:
            if not self._results.wait_for(lambda: request_id in engine.results, timeout):
                raise TimeoutError(f"request {request_id!r} not done after {timeout} s")
        return engine.results[request_id]

    def _on_result(self, result: RequestResult) -> None:
        with self._results:
            self._results.notify_all()

    # -- control --------------------------------------------------------------------
    def abort(self, request_id: str) -> None:
        """Queue an abort; the engine applies it on its next step."""
        engine_id = self._request_engine.get(request_id)
        if engine_id is None:
            self._warn_once("abort", request_id, "abort of unknown request %r ignored")
            return
        self.engines[engine_id].abort(request_id)

    def abort_all(self, engine_id: str) -> None:
        if engine := self._engine(engine_id, "abort_all"):
            engine.abort_all()

    def fail_all(self, engine_id: str, error: str = "engine error") -> None:
        if engine := self._engine(engine_id, "fail_all"):
            engine.fail_all(error)

    def reset(self, engine_id: str, deep: bool = False) -> None:
        """Reset the engine's scheduler now (on its thread); ``deep`` clears its cache."""
        if engine := self._engine(engine_id, "reset"):
            self._on_engine(engine, lambda: engine.reset(deep))

    def shutdown(self, engine_id: str) -> None:
        """Stop the engine: in-flight requests depart, ``engine_shutdown`` is emitted on
        its thread, and its loop ends."""
        if engine := self._engine(engine_id, "shutdown"):
            self._on_engine(engine, engine.shutdown)
            self._stop_thread(engine_id)

    def unload(self, engine_id: str) -> None:
        """Shut the engine down, then unload its model: ``model_unloaded`` is emitted on
        the calling (control) thread once the engine thread has stopped."""
        if engine := self._engine(engine_id, "unload"):
            self.shutdown(engine_id)
            engine.unload()

    # -- synchronous driving --------------------------------------------------------
    def run_until_idle(self, max_steps: int = 100_000) -> int:
        """Step every engine that has requests until none has any; returns steps taken.
        No idle steps are offered."""
        self._require_sync("run_until_idle")
        steps = 0
        while True:
            busy = [e for e in self.engines.values() if not e.closed and e.has_requests()]
            if not busy:
                return steps
            for engine in busy:
                engine.step()
                steps += 1
            if steps > max_steps:
                raise RuntimeError(f"engines still busy after {max_steps} steps")

    def drive_idle(self, max_steps: int = 1000) -> int:
        """Offer idle steps to every idle engine while any implementation answers True;
        returns idle steps offered. An engine that gets work stops being offered steps.
        The smallest delay asked for is left in :attr:`last_idle_retry_after`."""
        self._require_sync("drive_idle")
        self.last_idle_retry_after = None
        active = [e for e in self.engines.values() if not e.closed and not e.has_requests()]
        steps = 0
        while active and steps < max_steps:
            for engine in list(active):
                if steps >= max_steps:
                    break
                if engine.closed or engine.has_requests():
                    active.remove(engine)
                    continue
                answers = engine.offer_idle_step()
                steps += 1
                if any(a is True for a in answers):
                    continue
                active.remove(engine)
                delay = _retry_after(answers)
                if delay is not None and (
                    self.last_idle_retry_after is None or delay < self.last_idle_retry_after
                ):
                    self.last_idle_retry_after = delay
        return steps

    # -- threaded driving -----------------------------------------------------------
    def start(self) -> None:
        """Start one loop thread per engine (idempotent)."""
        if self._started:
            return
        self._started = True
        for engine in self.engines.values():
            self._start_thread(engine)

    def stop(self, timeout: float = 60.0) -> None:
        """Stop every loop thread; engines keep their state (idempotent)."""
        for engine_id in list(self._threads):
            self._stop_thread(engine_id, timeout)
        self._started = False

    def __enter__(self) -> MockHost:
        return self

    def __exit__(self, *exc: object) -> None:
        self.stop()

    def _start_thread(self, engine: MockEngine) -> None:
        if engine.closed or engine.engine_id in self._threads:
            return
        thread = threading.Thread(
            target=self._loop, args=(engine,), name=f"mock-engine-{engine.engine_id}", daemon=True
        )
        engine.owner_thread = thread
        self._threads[engine.engine_id] = thread
        thread.start()

    def _stop_thread(self, engine_id: str, timeout: float = 60.0) -> None:
        thread = self._threads.pop(engine_id, None)
        if thread is None:
            return
        engine = self.engines[engine_id]
        self._stopping.add(engine_id)
        engine.wake()
        if thread is not threading.current_thread():
            thread.join(timeout)
            _wait_native_exit(thread, timeout)
        self._stopping.discard(engine_id)
        engine.owner_thread = None

    def _loop(self, engine: MockEngine) -> None:
        """The engine loop: step while there are requests, idle steps while a plugin asks,
        otherwise sleep until something arrives (or a plugin's retry delay passes)."""
        offer_idle = True
        retry_at: float | None = None
        while engine.engine_id not in self._stopping:
            with self._mlx_lock:
                engine.run_calls()
            if engine.closed or engine.engine_id in self._stopping:
                break
            if engine.has_requests():
                with self._mlx_lock:
                    engine.step()
                offer_idle, retry_at = True, None
                continue
            if offer_idle:
                with self._mlx_lock:
                    answers = engine.offer_idle_step()
                if any(a is True for a in answers):
                    continue
                offer_idle = False
                delay = _retry_after(answers)
                retry_at = None if delay is None else time.monotonic() + delay
            timeout = None if retry_at is None else max(0.0, retry_at - time.monotonic())
            if not engine.wait_for_work(timeout) and retry_at is not None:
                offer_idle, retry_at = True, None
        with self._mlx_lock:
            engine.run_calls()

    def _on_engine(self, engine: MockEngine, fn: Any) -> None:
        engine.call(fn)

    # -- inspection -----------------------------------------------------------------
    def outstanding_refs(self) -> dict[str, dict[str, Counter[Any]]]:
        """Per engine, every block reference (or pinned entry) not held by the prefix index itself
        (holder -> block id -> count). Empty dicts mean nothing leaked. Read it while the
        engines are quiet: in synchronous mode, or after :meth:`stop`."""
        return {eid: engine.outstanding() for eid, engine in self.engines.items()}

    def leaked(self) -> dict[str, dict[str, Counter[Any]]]:
        """Only the engines with outstanding references."""
        return {eid: refs for eid, refs in self.outstanding_refs().items() if refs}

    # -- helpers --------------------------------------------------------------------
    def _engine(self, engine_id: str, what: str) -> MockEngine | None:
        engine = self.engines.get(engine_id)
        if engine is None:
            self._warn_once(what, engine_id, f"{what} for unknown engine %r ignored")
        return engine

    def _require_sync(self, what: str) -> None:
        if self._threads:
            raise RuntimeError(f"{what}() drives engines synchronously; stop() the threads first")

    def _warn_once(self, kind: str, key: str, message: str) -> None:
        if (kind, key) in self._warned:
            return
        self._warned.add((kind, key))
        log.warning("mlx-recovery mock host: " + message, key)


def _retry_after(answers: list[Any]) -> float | None:
    """The smallest positive delay among idle-step answers (bools are not delays)."""
    delays = [
        float(a) for a in answers
        if isinstance(a, (int, float)) and not isinstance(a, bool) and a > 0
    ]
    return min(delays) if delays else None


def _wait_native_exit(thread: threading.Thread, timeout: float) -> None:
    """Wait until the OS thread is really gone, not just its Python state.

    MLX keeps a per-thread compile cache whose destructor takes the GIL when the OS
    thread ends, after ``join()`` has already returned; if the interpreter is shutting
    down by then, the process aborts. Linux only (elsewhere the race stays possible).
    """
    tid = thread.native_id
    if tid is None or not sys.platform.startswith("linux"):
        return
    deadline = time.monotonic() + timeout
    while os.path.exists(f"/proc/self/task/{tid}") and time.monotonic() < deadline:
        time.sleep(0.001)
