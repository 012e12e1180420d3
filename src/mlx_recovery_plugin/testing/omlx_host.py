"""The host contract suite's adapter for the oMLX family: one real ``EngineCore``, instrumented.

:class:`OmlxContractHost` satisfies :class:`~mlx_recovery_plugin.testing.contract.
ContractHost` (and its threaded form) over a real ``EngineCore`` of a family member
(flyto-mlx's ``omlx``, fusion-mlx's ``fusion_mlx``; :mod:`..hosts.omlx.members`) with its
prefix cache on, attached through :class:`OmlxInstrumentor` (limited to this host's
scheduler).
Requests enter through ``EngineCore.add_request`` and leave through oMLX's own paths.

Synchronous driving steps the scheduler on the calling thread, the way ``EngineCore``'s
loop does (``step()`` while oMLX has work); threaded driving runs the real engine loop on
an event-loop thread, with every step on the engine's own executor thread. A failure is
injected by making the next step raise, after which the host does what the engine loop
does on an error: ``fail_all_requests()``.

Threads: the test thread owns the host in synchronous mode. In threaded mode the event
loop thread runs the engine loop and ``add_request``; ``_results`` is guarded by
``_lock``.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import itertools
import tempfile
import threading
import uuid
from collections.abc import Coroutine, Iterable, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import pluggy

from ..hosts.omlx.instrumentor import OmlxInstrumentor
from ..hosts.omlx.members import FLYTO_MLX, MEMBERS, Member
from ..hosts.omlx.ports import OmlxEngine
from ..plugins import make_plugin_manager
from ..ports import HOLDER_PREFIX
from ..settings import RecoverySettings
from .loop_thread import start_loop_thread, stop_loop_thread

_names = itertools.count(1)
_MAX_STEPS = 100_000



def member_installed(member: Member) -> bool:
    """The member's scheduler and engine import here (tests skip the member otherwise)."""
    try:
        member.scheduler_class()
        member.engine_core_class()
    except ImportError:
        return False
    return True


def installed_members() -> list[Member]:
    return [m for m in MEMBERS.values() if member_installed(m)]


def make_request(
    request_id: str,
    prompt: Sequence[int],
    *,
    max_tokens: int,
    sparse: bool,
    threshold: int = 1024,
    keep_pct: float = 0.2,
    member: Member = FLYTO_MLX,
) -> Any:
    """A greedy request of ``member``; ``sparse`` opts it into SpecPrefill (as
    ``EngineCore`` does)."""
    module = member.resolve(member.request_module)
    Request, SamplingParams = module.Request, module.SamplingParams

    request = Request(
        request_id=request_id,
        prompt=list(prompt),
        sampling_params=SamplingParams(max_tokens=max_tokens, temperature=0.0),
    )
    request._specprefill_enabled = sparse
    request._specprefill_threshold = threshold
    request._specprefill_keep_pct = keep_pct
    return request

@dataclass(slots=True)
class OmlxResult:
    """A departed request's result, as the contract suite reads it."""

    cached_tokens: int = 0
    output_tokens: list[int] = field(default_factory=list)
    finish_reason: str | None = None
    error: str | None = None


class _InjectedFailure(RuntimeError):
    pass


class OmlxContractHost:
    """One instrumented oMLX engine for the contract suite and the integration tests."""

    supports_sparse_route: bool
    supports_abort_all = True
    supports_fail_all = True
    supports_threads = True
    serves_sparse_one_at_a_time: bool

    def __init__(
        self,
        model: Any,
        tokenizer: Any,
        draft: Any | None = None,
        *,
        block_size: int = 64,
        prefill_step: int = 128,
        sparse_threshold: int = 256,
        sparse_keep: float = 0.2,
        plugins: Iterable[object] = (),
        cache_dir: str | Path | None = None,
        model_id: str | None = None,
        clock: Any = None,
        member: Member = FLYTO_MLX,
    ) -> None:
        engine_module = member.resolve(member.engine_core_module)
        EngineConfig, EngineCore = engine_module.EngineConfig, engine_module.EngineCore
        SchedulerConfig = member.resolve(member.scheduler_module).SchedulerConfig

        self.member = member
        # fusion-mlx 0.10.24's SpecPrefill fails on a second queued sparse request
        # ("'_OffsetAdjustedRoPE' object has no attribute 'dims'") and prefills it densely.
        self.serves_sparse_one_at_a_time = member is FLYTO_MLX
        self._tmp = None if cache_dir is not None else tempfile.TemporaryDirectory(prefix="omlx-contract-")
        cache_path = str(cache_dir if cache_dir is not None else self._tmp.name)  # type: ignore[union-attr]
        self.model_name = model_id or f"contract-{next(_names)}"
        self._threshold = sparse_threshold
        self._keep = sparse_keep
        self.supports_sparse_route = draft is not None
        self.tells_of_lookups = True
        self.pm: pluggy.PluginManager = make_plugin_manager(
            list(plugins), settings=RecoverySettings(), entry_points_too=False
        )
        name = self.model_name
        self.instrumentor = OmlxInstrumentor(
            member, accept=lambda s: s.config.model_name == name, **({"clock": clock} if clock else {})
        )
        if not self.instrumentor.instrument(pm=self.pm):
            raise RuntimeError(f"this {member.label} cannot be instrumented")
        self.core = EngineCore(
            model,
            tokenizer,
            EngineConfig(
                model_name=name,
                scheduler_config=SchedulerConfig(
                    model_name=name,
                    paged_cache_block_size=block_size,
                    prefill_step_size=prefill_step,
                    **member.scheduler_cache_config(cache_path),
                    max_cache_blocks=1024,
                    initial_cache_blocks=64,
                ),
            ),
        )
        self.scheduler = self.core.scheduler
        if draft is not None:
            self.scheduler.set_specprefill_draft_model(draft)
        port = self.instrumentor.engine(self.scheduler)
        assert port is not None
        self._engine: OmlxEngine = port
        # The paged pool, kept so references can be checked after oMLX tears it down.
        self.pool = self.scheduler.block_aware_cache.paged_cache
        self._lock = threading.Lock()
        self._results: dict[str, OmlxResult] = {}
        self._fail_next: str | None = None
        self._loop: asyncio.AbstractEventLoop | None = None
        self._loop_thread: threading.Thread | None = None
        self._closed = False

    # -- the contract ------------------------------------------------------------------

    @property
    def block_size(self) -> int:
        return self._engine.block_size

    @property
    def sparse_threshold(self) -> int:
        return self._threshold

    @property
    def engine(self) -> OmlxEngine:
        return self._engine

    @property
    def plugin_manager(self) -> pluggy.PluginManager:
        return self.pm

    def submit(self, prompt_tokens: Sequence[int], *, max_tokens: int = 4, sparse: bool = False) -> str:
        SamplingParams = self.member.resolve(self.member.request_module).SamplingParams

        rid = f"req-{uuid.uuid4().hex[:12]}"
        with self._lock:
            self._results[rid] = OmlxResult()
        params = SamplingParams(max_tokens=max_tokens, temperature=0.0)
        if self._on_engine_thread():
            # Called from inside a step (an idle hook): EngineCore.add_request would queue
            # behind this very step, so do what it does on the engine thread directly.
            request = make_request(
                rid, prompt_tokens, max_tokens=max_tokens, sparse=sparse,
                threshold=self._threshold, keep_pct=self._keep, member=self.member,
            )
            self.scheduler.add_request(request)
            return rid
        arrival = self.core.add_request(
            [int(t) for t in prompt_tokens],
            params,
            request_id=rid,
            specprefill=sparse,
            specprefill_threshold=self._threshold,
            specprefill_keep_pct=self._keep,
        )
        flag = self.member.engine_running_flag
        if self._loop is not None or flag is None or getattr(self.core, flag):
            self._call(arrival)
            return rid
        # Stepped from here, the engine loop is not started: the member's engine refuses
        # requests without its running flag, so raise it for this call only.
        setattr(self.core, flag, True)
        try:
            self._call(arrival)
        finally:
            setattr(self.core, flag, False)
        return rid

    def run_until_idle(self) -> None:
        """Step until oMLX has no request and no background store of a finished one.

        oMLX stores a finished request's cache on a worker thread and releases what that
        request held only at a later step, once the store is done; ``has_requests()`` is
        already False by then. Idle here means that work has settled too, so what the
        caller sees next (references, stored blocks) does not depend on the worker's
        timing."""
        for _ in range(_MAX_STEPS):
            if self.instrumentor.host_has_work(self.scheduler) or self._fail_next:
                self._step()
            elif self._stores_in_flight():
                self._settle_stores()
            else:
                return
        raise RuntimeError("oMLX did not go idle")

    def _stores_in_flight(self) -> bool:
        futures = getattr(self.scheduler, "_inflight_store_futures", None) or {}
        return any(not f.done() for f in list(futures.values())) or bool(
            getattr(self.scheduler, "_pending_async_removes", None)
        )

    def _settle_stores(self) -> None:
        """Wait for oMLX's background stores, then finish them as its next step would."""
        inflight = list(getattr(self.scheduler, "_inflight_store_futures", {}).values())
        if inflight:
            concurrent.futures.wait(inflight, timeout=60.0)
        drain = getattr(self.scheduler, "_drain_pending_async_removes", None)
        if drain is not None:
            self._on_engine(drain)

    def drive_idle(self, max_steps: int = 100) -> int:
        driver_offered = self._offered()
        for _ in range(max_steps):
            if self._real_work() or not self.scheduler.has_requests():
                break
            if self.instrumentor.host_has_work(self.scheduler):
                break  # oMLX's own step is due: not an idle step
            self._step()
        return self._offered() - driver_offered

    def abort(self, request_id: str) -> None:
        self._call(self.core.abort_request(request_id))

    def abort_all(self) -> None:
        self._call(self.core.abort_all_requests())

    def fail_all(self, error: str) -> None:
        self._fail_next = error

    def reset(self, deep: bool = False) -> None:
        self._on_engine(self.scheduler.deep_reset if deep else self.scheduler.reset)

    def shutdown(self) -> None:
        self._call(self.core.stop())

    def unload(self) -> None:
        """oMLX's unload: ``EngineCore.stop()`` then ``close()`` (as ``EnginePool`` does
        through ``BatchedEngine.stop``)."""
        if self._closed:
            return
        self._call(self.core.stop())
        self.core.close()
        self._closed = True

    def result(self, request_id: str) -> OmlxResult:
        with self._lock:
            return self._results[request_id]

    def outstanding_refs(self) -> dict[str, Any]:
        """Blocks someone still holds, and the plugin-side holders that hold them."""
        refs: dict[str, Any] = {f"block {bid}": count for bid, count in self._pool_refs().items()}
        for holder in self._engine.prefix_cache.holders():
            refs[f"port holder {holder}"] = "held"
        for table_id in list(self.pool.request_tables):
            if str(table_id).startswith(f"{HOLDER_PREFIX}/"):
                refs[f"table {table_id}"] = "open"
        return refs

    def step_count(self) -> int:
        return int(self.scheduler._step_counter)

    # -- threaded driving ------------------------------------------------------------

    def start(self) -> None:
        if self._loop is not None:
            return
        loop, self._loop_thread = start_loop_thread("omlx-contract-loop")
        self._loop = loop
        asyncio.run_coroutine_threadsafe(self.core.start(), loop).result(30.0)

    def stop(self) -> None:
        loop, self._loop = self._loop, None
        if loop is None:
            return
        asyncio.run_coroutine_threadsafe(self.core.stop(), loop).result(60.0)
        stop_loop_thread(loop, self._loop_thread)

    def wait(self, request_id: str, timeout: float) -> OmlxResult:
        loop = self._loop
        if loop is None:
            return self.result(request_id)

        async def consume() -> None:
            async for output in self.core.stream_outputs(request_id):
                self._record(output)

        future = asyncio.run_coroutine_threadsafe(consume(), loop)
        try:
            future.result(timeout)
        except RuntimeError:
            pass  # an aborted or failed request ends its stream with an error
        return self.result(request_id)

    # -- lifetime --------------------------------------------------------------------

    def close(self) -> None:
        """Stop, unload, detach and delete the cache directory. Idempotent."""
        try:
            self.stop()
            self.unload()
        finally:
            self.instrumentor.uninstrument()
            if self._tmp is not None:
                self._tmp.cleanup()
                self._tmp = None

    def __enter__(self) -> OmlxContractHost:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    # -- internals -------------------------------------------------------------------

    def _call(self, coro: Coroutine[Any, Any, Any]) -> Any:
        """Run one of EngineCore's coroutines: on its loop when threaded, else here."""
        if self._loop is not None:
            return asyncio.run_coroutine_threadsafe(coro, self._loop).result(60.0)
        return asyncio.run(coro)

    def _on_engine(self, fn: Any) -> Any:
        """Run ``fn`` on the engine's executor thread, as oMLX runs every scheduler call
        (arrays a step makes belong to that thread's stream)."""
        if self._on_engine_thread():
            return fn()
        return self.core._mlx_executor.submit(fn).result()

    def _on_engine_thread(self) -> bool:
        return threading.current_thread().name.startswith(f"mlx-engine-{self.core.engine_id[:8]}")

    def _step(self) -> None:
        if self._fail_next is not None:
            error, self._fail_next = self._fail_next, None
            self._on_engine(lambda: self._step_raising(error))
            return
        output = self._on_engine(self.scheduler.step)
        for request_output in output.outputs:
            self._record(request_output)

    def _step_raising(self, error: str) -> None:
        """The next step raises ``error`` (a fault in admission); then the host does what
        oMLX's engine loop does with a failed step."""

        def fail(*_args: Any, **_kwargs: Any) -> Any:
            raise _InjectedFailure(error)

        self.scheduler._schedule_waiting = fail
        try:
            self.scheduler.step()
        except _InjectedFailure:
            pass
        finally:
            del self.scheduler._schedule_waiting
        for rid in self.scheduler.fail_all_requests():
            with self._lock:
                result = self._results.get(rid)
                if result is not None:
                    result.error, result.finish_reason = error, "error"

    def _record(self, output: Any) -> None:
        with self._lock:
            result = self._results.get(output.request_id)
            if result is None:
                return
            result.output_tokens.extend(int(t) for t in output.new_token_ids)
            result.cached_tokens = int(output.cached_tokens)
            if output.finished:
                result.finish_reason = output.finish_reason
                result.error = output.error

    def _real_work(self) -> bool:
        s = self.scheduler
        return bool(s.waiting or s.prefilling or s.running)

    def _offered(self) -> int:
        snapshot = self.instrumentor.idle_snapshot(self.scheduler)
        return int(snapshot["offered"]) if snapshot else 0

    def _pool_refs(self) -> dict[int, int]:
        return {
            block.block_id: block.ref_count
            for block in list(self.pool.allocated_blocks.values())
            if block.ref_count > 0 and not block.is_null
        }


__all__ = ["OmlxContractHost", "OmlxResult", "installed_members", "member_installed"]
