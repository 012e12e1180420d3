"""``python tests/lab faults --host omlx``: the fault bench on the real oMLX scheduler.

The same kind of interleavings as :mod:`.faults` (sparse and dense requests, aborts,
resets, shutdowns and unloads, budget changes, idle steps, clock jumps, and the closing
sparse turn, idle time and dense turn), played against an :class:`OmlxContractHost` (one
real ``EngineCore`` with its prefix cache on) with a :class:`RecoveryPlugin` attached, and
the same faults armed in the recovery path: the runner (``runner_error``, ``oom``) through
the plugin's runner factory, the port's store, probe read-back and release through the
engine's ``prefix_cache`` (holders ``mlx-recovery:*`` only). A shutdown or unload retires
the host (closed and checked at once) and a new one takes its place.

Counted per fault kind, as on the mock host:

* leaked references: ``outstanding_refs()`` of every host (blocks with a reference,
  plugin holders, open recovery tables) once the plugin is closed (a retired host: once
  it is closed);
* exceptions into the host: any exception reaching the driver from a host call, plus
  every plugin failure the instrumentor's hook emitter had to swallow;
* wrong outputs: a dense request's greedy output against the same prompt's on a fresh
  ``OmlxContractHost`` with no plugin (memoized per prompt, block size and prefill step).
"""

from __future__ import annotations

import importlib
import random
import time
from collections.abc import Callable, Sequence
from typing import Any

import mlx.core as mx

from mlx_recovery_plugin.testing.tiny_model import TinyModelSpec, cached_model_dir, load_tiny_model

from .faults import (
    HOLDER_PREFIX,
    MODEL_ID,
    ONCE_KINDS,
    PERSISTENT_KINDS,
    FaultBenchResult,
    FaultRun,
    Injector,
    KindRow,
    arm,
    install_cache_faults,
    load_models,
)

SPARSE_THRESHOLD = 16
# The kinds injected from another thread need the mock host's control over its engine
# thread; on oMLX the faults of the recovery path, once and persisting, are injected.
OMLX_KINDS = ONCE_KINDS + PERSISTENT_KINDS
# Why aborts and resets never catch a sparse request after its first step here: oMLX
# itself (no plugin attached) then never admits another request (run_until_idle gives
# up), and after a shallow reset with a sparse request in flight a later dense request
# gave other greedy tokens than a cold engine's, with recovery disabled.
OMLX_WEDGE = "a sparse (SpecPrefill) request aborted or reset after its first step wedges oMLX"
MAX_TOKENS = 4
FINISHED = ("stop", "length")


def omlx_available() -> str | None:
    """None when oMLX can be imported, else why not."""
    try:
        importlib.import_module("omlx.engine_core")
        importlib.import_module("omlx.scheduler")
    except Exception as exc:  # noqa: BLE001 - any import failure means no oMLX
        return f"oMLX (flyto-mlx) is not importable: {exc!r}"
    return None


class OmlxColdReference:
    """Greedy dense outputs of a fresh oMLX host with no plugin, memoized.

    It loads its own copy of the model: an ``EngineCore`` built on a model object another
    engine owns takes it over and deep-resets that engine (which drops its model)."""

    def __init__(self) -> None:
        self.model, self.tokenizer = load_tiny_model(cached_model_dir(TinyModelSpec()))
        self.memo: dict[tuple[tuple[int, ...], int, int, int], tuple[int, ...]] = {}
        self.made = 0

    def __call__(self, prompt: Sequence[int], max_tokens: int, block_size: int, step: int) -> tuple[int, ...]:
        from mlx_recovery_plugin.testing.omlx_host import OmlxContractHost

        key = (tuple(prompt), max_tokens, block_size, step)
        if key not in self.memo:
            self.made += 1
            with OmlxContractHost(
                self.model, self.tokenizer, block_size=block_size, prefill_step=step,
                model_id=f"{MODEL_ID}-cold{self.made}",
            ) as host:
                rid = host.submit(prompt, max_tokens=max_tokens)
                host.run_until_idle()
                self.memo[key] = tuple(host.result(rid).output_tokens)
        return self.memo[key]


class OmlxRun(FaultRun):
    """One interleaving on oMLX: a host (replaced after shutdown or unload), the plugin,
    and the counters of what went wrong."""

    def __init__(
        self, models: tuple[Any, Any, Any], cold: OmlxColdReference, rng: random.Random, injector: Injector,
        extra_plugins: Callable[[], Sequence[object]] = tuple,
    ) -> None:
        super().__init__(models, cold, rng, injector)
        self.extra_plugins = extra_plugins
        self.host: Any = None
        self.leaked = 0
        self._new_host()

    # -- plumbing -------------------------------------------------------------------
    def _new_host(self) -> None:
        from mlx_recovery_plugin.testing.omlx_host import OmlxContractHost

        model, tokenizer, draft = self.models
        self.host = self.guard(
            "new host",
            lambda: OmlxContractHost(
                model, tokenizer, draft, block_size=self.block, prefill_step=self.step,
                sparse_threshold=SPARSE_THRESHOLD, plugins=[self.plugin, *self.extra_plugins()], model_id=MODEL_ID, clock=self.clock,
            ),
        )
        if self.host is not None:
            install_cache_faults(self.host.engine.prefix_cache, self.injector, self.block)

    def _retire(self, *, plugin_closed: bool) -> None:
        """Count what the host's emitter swallowed, close it and count its references."""
        host, self.host = self.host, None
        if host is None:
            return
        life = host.instrumentor._life
        errors = life.emitter.errors if life is not None else 0
        if errors:
            self.escapes += errors
            self.problems.append(f"{errors} plugin error(s) swallowed by the host's emitter")
        self.guard("close host", host.close)
        refs = host.outstanding_refs()
        if refs:
            self.leaked += len(refs)
            self.problems.append(f"leaked{' after plugin close' if plugin_closed else ''}: {refs}")

    # -- operations -----------------------------------------------------------------
    def serve(self, sparse: bool) -> None:
        host = self.host
        if host is None:
            return
        prompt = self.prompt(next_turn=sparse)
        rid = self.guard("submit", lambda: host.submit(prompt, sparse=sparse, max_tokens=MAX_TOKENS))
        if rid is None:
            return
        self.guard("run_until_idle", host.run_until_idle)
        result = self.guard("result", lambda: host.result(rid))
        if result is None or sparse or result.error is not None or result.finish_reason not in FINISHED:
            return
        self.check_dense(prompt, MAX_TOKENS, result.output_tokens, result.cached_tokens)

    def abort(self) -> None:
        host = self.host
        if host is None:
            return
        prompt = self.prompt(next_turn=False)
        sparse = self.rng.random() < 0.5
        rid = self.guard("submit", lambda: host.submit(prompt, sparse=sparse))
        if rid is None:
            return
        steps = self.rng.randrange(3)
        for _ in range(0 if sparse else steps):  # a sparse one only before its first step (OMLX_WEDGE)
            self.guard("step", host._step)  # one scheduler step, as the engine loop takes it
        self.guard("abort", lambda: host.abort(rid))
        self.guard("run_until_idle", host.run_until_idle)

    def reset(self) -> None:
        host = self.host
        if host is None:
            return
        if self.rng.random() < 0.5:  # with a request in flight: a dense one (see OMLX_WEDGE)
            prompt = self.prompt(next_turn=False)
            self.guard("submit", lambda: host.submit(prompt, sparse=False))
            self.guard("step", host._step)
        deep = self.rng.random() < 0.3
        self.guard("reset", lambda: host.reset(deep=deep))
        if deep:  # oMLX's deep reset drops the scheduler's model: that engine is done
            self._retire(plugin_closed=False)
            self._new_host()
            return
        self.guard("run_until_idle", host.run_until_idle)

    def stop_engine(self, unload: bool) -> None:
        host = self.host
        if host is not None:
            self.guard("unload" if unload else "shutdown", host.unload if unload else host.shutdown)
            self._retire(plugin_closed=False)
        self._new_host()

    def idle(self, rounds: int) -> None:
        host = self.host
        if host is None:
            return
        for _ in range(rounds):
            offered = self.guard("drive_idle", host.drive_idle)
            if not offered:
                break
            self.clock.advance(1.0)

    def finish(self) -> int:
        """Close the plugin, then the host; returns the leaked references."""
        self.close_plugin()
        host = self.host
        if host is not None:
            refs = host.outstanding_refs()
            held = [h for h in host.engine.prefix_cache.holders() if h.startswith(HOLDER_PREFIX)]
            if refs or held:
                self.leaked += len(refs) or len(held)
                self.problems.append(f"leaked after plugin close: {refs}")
        self._retire(plugin_closed=True)
        return self.leaked


def run_omlx_fault_bench(
    runs: int = 100, *, seed: int = 0, ops: int = 8, models: tuple[Any, Any, Any] | None = None,
    extra_plugins: Callable[[], Sequence[object]] = tuple, progress: Callable[[str], None] | None = None,
) -> FaultBenchResult:
    """``runs`` interleavings on oMLX, fault kinds taken in turn (see the module doc);
    ``extra_plugins`` builds plugins added to each host (to check that the checks can fail)."""
    why = omlx_available()
    if why is not None:
        raise RuntimeError(why)
    models = models or load_models()
    cold = OmlxColdReference()
    rows = {kind: KindRow(kind) for kind in OMLX_KINDS}
    result = FaultBenchResult(rows, runs, 0.0, timed_hooks=False)
    started = time.perf_counter()
    for index in range(runs):
        rng = random.Random(f"omlx:{seed}:{index}")
        kind = OMLX_KINDS[index % len(OMLX_KINDS)]
        injector = arm(kind, rng, forever=False)
        run = OmlxRun(models, cold, rng, injector, extra_plugins)
        try:
            run.play(rng.randrange(max(1, ops // 2), ops + 1))
        finally:
            leaked = run.finish()
        result.book(index, kind, injector, run, leaked)
        if progress and (index + 1) % 10 == 0:
            progress(f"[{index + 1}/{runs}] {time.perf_counter() - started:.0f} s")
        if index % 20 == 19:
            mx.clear_cache()
    result.seconds = time.perf_counter() - started
    return result
