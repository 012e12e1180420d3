"""The host contract suite's adapter for rapid-mlx: one real ``EngineCore``, instrumented.

:class:`RapidContractHost` satisfies :class:`~mlx_recovery_plugin.testing.contract.
ContractHost` (and its threaded form) over a real rapid-mlx ``EngineCore`` (its scheduler,
its memory-aware prefix cache of whole entries, PFlash in ``auto`` mode with the
``uncached`` threshold basis), attached through :class:`RapidInstrumentor`. A request
asks for PFlash with ``sparse=True``; the others are sent with
``requires_prompt_integrity`` (rapid-mlx's own per-request PFlash opt-out).

Synchronous driving steps the scheduler on the calling thread the way the engine loop
does (``step()`` while it has work); a failure is injected by making the next generation
step raise; idle driving calls ``step()`` while the wrapped
``has_requests()`` says an idle step is wanted. Threaded driving runs the real engine
loop on an event-loop thread, every step on rapid-mlx's own ``mlx-step`` thread.

Threads: the test thread owns the host in synchronous mode; in threaded mode the event
loop thread runs the engine loop and ``add_request``.
"""

from __future__ import annotations

import asyncio
import itertools
import os
import threading
import time
from collections.abc import Coroutine, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import pluggy

from ..hosts.rapid.instrumentor import RapidInstrumentor
from ..hosts.rapid.ports import RapidEngine
from ..plugins import make_plugin_manager
from .loop_thread import start_loop_thread, stop_loop_thread

_names = itertools.count(1)
_MAX_STEPS = 100_000


@dataclass(slots=True)
class RapidResult:
    """What a departed request left: the suite's :class:`ContractResult` and PFlash's
    verdict."""

    cached_tokens: int
    output_tokens: list[int] = field(default_factory=list)
    compressed: bool = False
    kept_tokens: int | None = None


def pflash_config(threshold: int, block: int) -> Any:
    """PFlash in ``auto`` mode on the uncached basis, shrunk to tiny-model prompts."""
    from rapid_mlx.pflash import PFlashConfig

    return PFlashConfig(
        mode="auto", threshold=threshold, threshold_basis="uncached", keep_ratio=0.2,
        min_keep_tokens=max(16, block // 2), sink_tokens=max(8, block // 4),
        tail_tokens=max(16, block // 2), block_size=max(8, block // 4), query_window=max(16, block // 2),
    )


class RapidContractHost:
    """:class:`ContractHost` over one instrumented rapid-mlx ``EngineCore``."""

    supports_sparse_route = True
    tells_of_lookups = True
    supports_abort_all = False  # rapid-mlx has no abort-all of its own
    supports_fail_all = True  # a step that raises: rapid-mlx fails every running request
    supports_threads = True

    def __init__(
        self,
        model_dir: str | Path | None = None,
        *,
        model: Any = None,
        tokenizer: Any = None,
        block_size: int = 64,
        pflash_threshold: int | None = None,
        prefill_step: int = 256,
        pm: pluggy.PluginManager | None = None,
        model_id: str = "tiny/llama-1.0",
        engine_id: str | None = None,
    ) -> None:
        os.environ.setdefault("RAPID_MLX_TELEMETRY", "0")
        from rapid_mlx.engine_core import EngineConfig, EngineCore
        from rapid_mlx.scheduler import SchedulerConfig

        if model is None:
            from .tiny_model import load_tiny_model

            if model_dir is None:
                raise ValueError("give model_dir or an already loaded model")
            model, tokenizer = load_tiny_model(model_dir)
        self._block = block_size
        self._threshold = pflash_threshold if pflash_threshold is not None else 4 * block_size
        self.pm = pm if pm is not None else make_plugin_manager(entry_points_too=False)
        self.instrumentor = RapidInstrumentor(block_size=block_size)
        if not self.instrumentor.instrument(self.pm):
            raise RuntimeError("the rapid-mlx adapter refused to attach (see the log)")
        config = EngineConfig(
            model_name=model_id,
            scheduler_config=SchedulerConfig(
                pflash_config=pflash_config(self._threshold, block_size), prefill_step_size=prefill_step
            ),
        )
        self.core = EngineCore(model, tokenizer, config, engine_id=engine_id or f"rapid-contract-{next(_names)}")
        self.scheduler = self.core.scheduler
        port = self.instrumentor.engine(self.scheduler)
        assert port is not None
        self._engine: RapidEngine = port
        self._requests: dict[str, Any] = {}
        self._steps = 0
        count_real_steps(self)
        self._loop: asyncio.AbstractEventLoop | None = None
        self._thread: threading.Thread | None = None
        self._closed = False

    # -- what the suite reads ----------------------------------------------------------
    @property
    def block_size(self) -> int:
        return self._block

    @property
    def sparse_threshold(self) -> int:
        return self._threshold

    @property
    def engine(self) -> RapidEngine:
        return self._engine

    @property
    def plugin_manager(self) -> pluggy.PluginManager:
        return self.pm

    def result(self, request_id: str) -> RapidResult:
        request = self._requests[request_id]
        if not request.is_finished():
            raise KeyError(f"request {request_id!r} has not finished yet")
        metadata = request.pflash_metadata or {}
        return RapidResult(
            cached_tokens=int(request.cached_tokens or 0),
            output_tokens=list(request.output_token_ids),
            compressed=bool(metadata.get("compressed", False)),
            kept_tokens=metadata.get("kept_tokens"),
        )

    def outstanding_refs(self) -> dict[str, int]:
        return {holder: 1 for holder in self._engine.prefix_cache.holders()}

    def step_count(self) -> int:
        return self._steps

    # -- synchronous driving -----------------------------------------------------------
    def submit(self, prompt_tokens: Sequence[int], *, max_tokens: int = 4, sparse: bool = False) -> str:
        rid = f"rq-{next(_names)}"
        if self._loop is not None:
            self._on_loop(self.core.add_request(
                list(prompt_tokens), _sampling(max_tokens), request_id=rid,
                requires_prompt_integrity=not sparse,
            ))
            self._requests[rid] = self.scheduler.requests[rid]
            return rid
        from rapid_mlx.request import Request

        request = Request(
            request_id=rid, prompt=list(prompt_tokens), sampling_params=_sampling(max_tokens),
            requires_prompt_integrity=not sparse,
        )
        self._requests[rid] = request
        self.scheduler.add_request(request)
        return rid

    def has_work(self) -> bool:
        s = self.scheduler
        return bool(s.waiting or s.running or getattr(s, "_pending_abort_ids", None))

    def run_until_idle(self) -> None:
        for _ in range(_MAX_STEPS):
            if not self.has_work():
                return
            self.scheduler.step()
        raise RuntimeError("rapid-mlx still busy")

    def drive_idle(self, max_steps: int = 100) -> int:
        """Step while the wrapped ``has_requests()`` asks for an idle step and nothing
        real is queued (what the engine loop does); returns the idle steps offered."""
        driver = self.instrumentor.idle_driver(self.scheduler)
        before = driver.offered if driver is not None else 0
        for _ in range(max_steps):
            if driver is None or self.has_work() or not self.scheduler.has_requests():
                break
            if driver.offered - before >= max_steps:
                break
            self.scheduler.step()
        return (driver.offered - before) if driver is not None else 0

    def abort(self, request_id: str) -> None:
        self.scheduler.abort_request(request_id)

    def abort_all(self) -> None:  # pragma: no cover - supports_abort_all is False
        raise NotImplementedError

    def fail_all(self, error: str) -> None:
        """Make the next generation step raise ``error``; rapid-mlx then does what it does
        on a real one (``_recover_from_generation_error``: every running request fails)."""
        scheduler = self.scheduler

        def raise_once() -> Any:
            del scheduler._apply_adaptive_prefill_size  # back to the class's method
            raise RuntimeError(error)

        scheduler._apply_adaptive_prefill_size = raise_once

    def reset(self, deep: bool = False) -> None:
        if deep:
            self.scheduler.deep_reset()
        else:
            self.scheduler.reset()

    def clear_prefix_cache(self) -> bool:
        """What ``--idle-cache-clear-seconds`` does once the engine has been idle that long."""
        return bool(self.core._clear_prefix_cache_on_worker())

    def shutdown(self) -> None:
        self.stop()
        asyncio.run(self.core.stop())

    def unload(self) -> None:
        self.shutdown()
        self.core.close()

    # -- threaded driving --------------------------------------------------------------
    def start(self) -> None:
        if self._loop is not None:
            return
        self._loop, self._thread = start_loop_thread("rapid-contract-loop")
        self._on_loop(self.core.start())

    def stop(self) -> None:
        loop, thread = self._loop, self._thread
        if loop is None or thread is None:
            return
        self._on_loop(self.core.stop())
        stop_loop_thread(loop, thread)
        self._loop, self._thread = None, None

    def wait(self, request_id: str, timeout: float) -> RapidResult:
        request = self._requests[request_id]
        deadline = time.monotonic() + timeout
        while not request.is_finished():
            if time.monotonic() > deadline:
                raise TimeoutError(f"request {request_id!r} not done after {timeout} s")
            time.sleep(0.005)
        while self.scheduler.running.get(request_id) is not None and time.monotonic() < deadline:
            time.sleep(0.005)  # its cleanup runs later in the same step
        return self.result(request_id)

    def _on_loop(self, coro: Coroutine[Any, Any, Any], timeout: float = 60.0) -> Any:
        assert self._loop is not None
        return asyncio.run_coroutine_threadsafe(coro, self._loop).result(timeout)

    def close(self) -> None:
        if self._closed:
            return
        self._closed = True
        try:
            self.stop()
            if not self.core._closed:
                self.core.close()
        finally:
            self.instrumentor.uninstrument()


def count_real_steps(host: RapidContractHost) -> None:
    """Count the steps rapid-mlx really takes: its ``step()`` applies queued aborts
    first, every time; an idle step (the adapter's, in its place) does not."""
    scheduler = host.scheduler
    original = scheduler._process_pending_aborts

    def counted() -> Any:
        host._steps += 1
        return original()

    scheduler._process_pending_aborts = counted


def _sampling(max_tokens: int) -> Any:
    from rapid_mlx.request import SamplingParams

    return SamplingParams(max_tokens=max_tokens, temperature=0.0)
