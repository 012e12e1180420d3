"""``python tests/lab faults``: random interleavings of host events and injected faults.

Each run builds a mock host with a real tiny model (block size 16-64) and a
:class:`RecoveryPlugin` on a :class:`FakeClock`, then plays a seeded random sequence of
sparse and dense requests, aborts, resets, shutdowns and unloads (the engine is re-added
after each), budget changes, idle steps and clock jumps, ending with a sparse turn, idle
time and a dense turn. Runs differ in more than the sequence: the ``always`` or the
``auto`` publish policy (with a runner whose slices cost fake time, so the policy holds
and stands down), a pool small enough that the host evicts between store, probe and the
next turn, oMLX's paged cache or rapid-mlx's whole entries, and sometimes a second engine
that contends for the execution claim.

One fault of one kind is armed per run in the recovery path. Once: the runner raising
(``runner_error``) or running out of memory (``oom``), the store raising
(``store_error``), the probe's read-back coming back short (``probe_mismatch``), a release
raising (``release_error``). Persisting: a release (``release_persistent``) or a store
(``store_persistent``) that fails for several calls in a row, or for ever. From outside
the slice: a request arriving in its middle (``arrival_mid_slice``), and an unload from
another thread while the slice runs (``unload_mid_slice``) or while it publishes
(``unload_mid_publish``). After each run the plugin is closed and counted per fault kind:

* leaked block references (any reference outside the prefix index, and any holder of the
  cache named ``mlx-recovery:*``), after close;
* exceptions into the host: any exception reaching the driver from a host call, plus
  every plugin failure the host's hook emitter had to swallow;
* wrong outputs: a dense request whose greedy output differs from the same prompt's on a
  fresh host that never stored anything;
* writes after unload: stores of recovery's that began on an engine after its unload hook
  had returned;
* the longest a host thread waited in a plugin hook (idle steps, which are recovery's own
  work, aside).

The first four must be 0; the command exits 1 otherwise. Then the control channel is put
under load (:mod:`.faults_control`): no client may fail, slow clients may not hold it
past the request deadline, and an accept out of descriptors must back off.
"""

from __future__ import annotations

import argparse
import logging
import random
import sys
import threading
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any

import mlx.core as mx

from mlx_recovery_plugin.bench.openblas import add_openblas_flag, maybe_reexec
from mlx_recovery_plugin.events import DepartureReason
from mlx_recovery_plugin.plugins import make_plugin_manager
from mlx_recovery_plugin.ports import FetchedPrefix
from mlx_recovery_plugin.recovery.plugin import RecoveryPlugin
from mlx_recovery_plugin.recovery.service import PARK_MAX_S
from mlx_recovery_plugin.runner import SliceRunner
from mlx_recovery_plugin.settings import ModelSettings, RecoverySettings
from mlx_recovery_plugin.testing.clock import FakeClock, random_tokens
from mlx_recovery_plugin.testing.host import MockHost
from mlx_recovery_plugin.testing.tiny_model import TinyModelSpec, cached_model_dir, load_tiny_model

MODEL_ID = "bench-faults"
HOLDER_PREFIX = "mlx-recovery"
ONCE_KINDS = ("runner_error", "oom", "store_error", "probe_mismatch", "release_error")
PERSISTENT_KINDS = ("release_persistent", "store_persistent")
THREAD_KINDS = ("arrival_mid_slice", "unload_mid_slice", "unload_mid_publish")
FAULT_KINDS = ONCE_KINDS + PERSISTENT_KINDS + THREAD_KINDS
# Operations and their weights in the random draw.
OPS = {
    "sparse": 3, "dense": 2, "abort": 1, "reset": 1, "shutdown": 0.5, "unload": 0.5, "budget": 1,
    "idle": 3, "clock": 1,
}
BLOCK_SIZES = (16, 32, 64)
CONVERSATIONS = 6
TURN_LENGTHS = (160, 260, 380)  # a conversation's prompts: prefixes of one token stream
DRAFT_SPEC = TinyModelSpec(arch="llama", num_layers=1, seed=7)


class Injector:
    """One fault, armed from the ``at``-th call of ``point`` for ``times`` calls in a row
    (None: for ever)."""

    def __init__(self, kind: str, point: str, at: int, times: int | None = 1) -> None:
        self.kind, self.point, self.at, self.times = kind, point, at, times
        self.calls: dict[str, int] = {}
        self.fired = 0
        #: What a fault from outside the slice does when it fires (set by the run).
        self.action: Callable[[], None] | None = None

    def hit(self, point: str) -> bool:
        self.calls[point] = self.calls.get(point, 0) + 1
        if point != self.point or self.calls[point] < self.at:
            return False
        if self.times is not None and self.fired >= self.times:
            return False
        self.fired += 1
        return True


def arm(kind: str, rng: random.Random, *, forever: bool = True) -> Injector:
    """``forever``: a persisting fault may never end (where the bench can tell the holders
    the plugin still accounts for from leaked ones)."""
    at = rng.choice((1, 1, 2))
    if kind == "release_persistent":
        return Injector(kind, "any_release", at, rng.choice((3, 12, None) if forever else (3, 12)))
    if kind == "store_persistent":
        return Injector(kind, "store", at, rng.choice((2, 6, None)))
    point = {
        "runner_error": rng.choice(("begin", "advance", "advance")),
        "oom": "advance",
        "store_error": "store",
        "probe_mismatch": "probe",
        "release_error": rng.choice(("probe_release", "release")),
        "arrival_mid_slice": "advance",
        "unload_mid_slice": "advance",
        "unload_mid_publish": "store",
    }[kind]
    return Injector(kind, point, at)


class FaultyRunner:
    """A slice runner that raises where its injector says (``begin`` or ``advance``)."""

    def __init__(self, inner: SliceRunner, injector: Injector) -> None:
        self.inner, self.injector = inner, injector

    def _maybe_fail(self, point: str) -> None:
        if self.injector.hit(point):
            if self.injector.action is not None:  # a fault from outside: the slice goes on
                self.injector.action()
                return
            if self.injector.kind == "oom":
                raise MemoryError("injected out of memory")
            raise RuntimeError(f"injected runner error in {point}")

    def begin(self, tokens: Sequence[int], prefix: Any) -> Any:
        self._maybe_fail("begin")
        return self.inner.begin(tokens, prefix)

    def advance(self, live: Any, end: int, should_stop: Any = None, stop_grain: int | None = None) -> Any:
        self._maybe_fail("advance")
        return self.inner.advance(live, end, should_stop, stop_grain)

    def discard(self, live: Any) -> None:
        self.inner.discard(live)


class CostedRunner(FaultyRunner):
    """A faulty runner whose slices cost fake time, ``a*n + b*(n*c + n*n/2)`` seconds,
    so the ``auto`` policy learns a dense cost and holds or stands down."""

    def __init__(self, inner: SliceRunner, injector: Injector, clock: FakeClock, a: float, b: float) -> None:
        super().__init__(inner, injector)
        self.clock, self.a, self.b = clock, a, b

    def advance(self, live: Any, end: int, should_stop: Any = None, stop_grain: int | None = None) -> Any:
        c, n = int(live.offset), max(0, end - int(live.offset))
        self.clock.advance(self.a * n + self.b * (n * c + n * n / 2))
        return super().advance(live, end, should_stop, stop_grain)


class StoreLog:
    """When each of recovery's stores on one cache was done writing (a monotonic clock)."""

    def __init__(self) -> None:
        self.done: list[float] = []

    def after(self, moment: float | None) -> int:
        return 0 if moment is None else sum(1 for t in self.done if t > moment)


def install_cache_faults(cache: Any, injector: Injector, block_size: int) -> StoreLog:
    """Fail the cache's recovery calls (holders ``mlx-recovery:*``); the host's own calls
    go through untouched. Returns the log of recovery's stores on this cache."""
    real_fetch, real_store, real_release = cache.fetch, cache.store, cache.release
    stores = StoreLog()

    def fetch(holder: str, tokens: Sequence[int]) -> FetchedPrefix:
        if holder.startswith(HOLDER_PREFIX + ":") and ":probe:" in holder and injector.hit("probe"):
            return real_fetch(holder, tokens[: max(0, len(tokens) - block_size)])  # short read-back
        return real_fetch(holder, tokens)

    def store(holder: str, tokens: Sequence[int], blocks: Sequence[Any]) -> int:
        if not holder.startswith(HOLDER_PREFIX + ":"):
            return real_store(holder, tokens, blocks)
        if injector.hit("store"):
            if injector.action is None:
                raise RuntimeError("injected store error")
            injector.action()  # a fault from outside, during publication: the store goes on
        try:
            return real_store(holder, tokens, blocks)
        finally:
            stores.done.append(time.monotonic())

    def release(holder: str) -> None:
        if holder.startswith(HOLDER_PREFIX + ":"):
            point = "probe_release" if ":probe:" in holder else "release"
            if injector.hit(point) or injector.hit("any_release"):
                raise RuntimeError("injected release error")
        real_release(holder)

    cache.fetch, cache.store, cache.release = fetch, store, release
    return stores


@dataclass(slots=True)
class KindRow:
    kind: str
    runs: int = 0
    injected: int = 0
    leaked_refs: int = 0
    escapes: int = 0
    dense_checked: int = 0
    dense_restored: int = 0  # of those, served with a cached prefix
    wrong_outputs: int = 0
    writes_after_unload: int = 0
    longest_block_s: float = 0.0

    @property
    def clean(self) -> bool:
        return (
            self.leaked_refs == 0 and self.escapes == 0 and self.wrong_outputs == 0
            and self.writes_after_unload == 0
        )


@dataclass(slots=True)
class FaultBenchResult:
    rows: dict[str, KindRow]
    runs: int
    seconds: float
    ops: dict[str, int] = field(default_factory=dict)
    failures: list[str] = field(default_factory=list)  # the first few problems, for the report
    timed_hooks: bool = True  # the host's hook calls were timed (the mock host's are)

    @property
    def ok(self) -> bool:
        return all(r.clean for r in self.rows.values())

    def book(self, index: int, kind: str, injector: Injector, run: FaultRun, leaked: int) -> None:
        """Add run ``index``'s counts to its fault kind's row and the totals."""
        row = self.rows[kind]
        row.runs += 1
        row.injected += injector.fired
        row.leaked_refs += leaked
        row.escapes += run.escapes
        row.dense_checked += run.dense_checked
        row.dense_restored += run.dense_restored
        row.wrong_outputs += run.wrong
        row.writes_after_unload += run.writes_after_unload
        row.longest_block_s = max(row.longest_block_s, run.longest_block_s)
        for op, n in run.ops.items():
            self.ops[op] = self.ops.get(op, 0) + n
        if run.problems and len(self.failures) < 20:
            self.failures.extend(f"run {index} ({kind}): {p}" for p in run.problems[:3])


class ColdReference:
    """Greedy dense outputs of a host that never stored anything (a new engine per
    prompt), memoized per prompt, block size and prefill step."""

    def __init__(self, model: Any, tokenizer: Any) -> None:
        self.model, self.tokenizer = model, tokenizer
        self.host = MockHost(make_plugin_manager([], entry_points_too=False))
        self.memo: dict[tuple[tuple[int, ...], int, int, int], tuple[int, ...]] = {}
        self.made = 0

    def __call__(self, prompt: Sequence[int], max_tokens: int, block_size: int, step: int) -> tuple[int, ...]:
        key = (tuple(prompt), max_tokens, block_size, step)
        if key not in self.memo:
            self.made += 1
            eid = f"cold{self.made}"
            engine = self.host.add_engine(
                eid, model=self.model, tokenizer=self.tokenizer, block_size=block_size,
                prefill_step=step, model_id=MODEL_ID,
            )
            rid = self.host.submit(eid, prompt, max_tokens=max_tokens)
            self.host.run_until_idle()
            self.memo[key] = tuple(self.host.result(rid).output_tokens)
            engine.unload()
            del self.host.engines[eid]
        return self.memo[key]


class FaultRun:
    """What every interleaving shares, whatever the host: the drawn sizes and budget, the
    plugin with its faulty runner, the counters of what went wrong, the operation mix and
    the closing turn. A host's run supplies ``serve``, ``abort``, ``reset``,
    ``stop_engine``, ``idle`` and ``finish``."""

    def __init__(self, models: tuple[Any, Any, Any], cold: Any, rng: random.Random, injector: Injector) -> None:
        self.models, self.cold, self.rng, self.injector = models, cold, rng, injector
        self.block = rng.choice(BLOCK_SIZES)
        self.step = self.block * rng.choice((2, 4))
        self.clock = FakeClock()
        pct = rng.choice((25.0, 50.0, 100.0))
        self.policy = rng.choice(("always", "auto"))
        # The auto policy's fake dense cost: matrix products per token, attention per token
        # per attended position (steep enough at some draws that no prefix pays).
        self.cost = (rng.choice((1e-4, 1e-3)), rng.choice((0.0, 1e-6, 1e-4)))
        self.settings = RecoverySettings(
            budget_pct=pct, budget_window_s=10.0, idle_steps=rng.choice((1, 2)), publish_policy=self.policy,
            slice_tokens=self.step, models={MODEL_ID: ModelSettings(enabled=True)},
        )
        self.writes_after_unload = 0
        self.longest_block_s = 0.0
        self.plugin = RecoveryPlugin(
            self.settings, clock=self.clock, runner_factory=self._runner, control_socket=False
        )
        self.budget = pct
        self.escapes = 0
        self.dense_checked = 0
        self.dense_restored = 0
        self.wrong = 0
        self.problems: list[str] = []
        self.conversation = rng.randrange(CONVERSATIONS)
        self.turn = 0
        self.ops: dict[str, int] = {}

    def _runner(self, handle: Any, block_size: int, interruptible: bool) -> FaultyRunner:
        inner = SliceRunner(handle, block_size, interruptible=interruptible)
        if self.policy == "auto":
            return CostedRunner(inner, self.injector, self.clock, *self.cost)
        return FaultyRunner(inner, self.injector)

    def note_block(self, seconds: float) -> None:
        self.longest_block_s = max(self.longest_block_s, seconds)

    def guard(self, what: str, fn: Callable[[], Any]) -> Any:
        """Call the host; an exception reaching here is one that escaped into the host."""
        try:
            return fn()
        except Exception as exc:  # noqa: BLE001 - counting them is the point
            self.escapes += 1
            self.problems.append(f"{what}: {exc!r}")
            return None

    def prompt(self, *, next_turn: bool) -> list[int]:
        if next_turn and self.turn < len(TURN_LENGTHS) - 1:
            self.turn += 1
        if self.rng.random() < 0.15:  # sometimes another conversation
            self.conversation = self.rng.randrange(CONVERSATIONS)
        return random_tokens(1000 + self.conversation, TURN_LENGTHS[self.turn])

    def check_dense(self, prompt: list[int], max_tokens: int, output: Sequence[int], cached_tokens: int) -> None:
        """A dense request that finished: its greedy tokens must be a fresh host's."""
        self.dense_checked += 1
        if cached_tokens > 0:
            self.dense_restored += 1
        expected = self.cold(prompt, max_tokens, self.block, self.step)
        if tuple(output) != expected:
            self.wrong += 1
            self.problems.append(
                f"wrong output: {len(prompt)} tokens, {cached_tokens} cached: {tuple(output)} != {expected}"
            )

    def close_plugin(self) -> None:
        """Close the plugin; while it still holds references the host refused to take
        back, close again (each close tries them again), a bounded number of times."""
        for _ in range(20):
            self.guard("close", self.plugin.close)
            engines = self.guard("status", self.plugin.status) or {"engines": {}}
            if not any(e.get("unreleased_holders") for e in engines["engines"].values()):
                return

    def set_budget(self) -> None:
        self.budget = self.rng.choice((0.0, 5.0, 25.0, 50.0, 100.0))
        self.guard("set_budget", lambda: self.plugin.set_budget(self.budget))

    # -- what a host's run supplies -------------------------------------------------
    def serve(self, sparse: bool) -> None:
        raise NotImplementedError

    def abort(self) -> None:
        raise NotImplementedError

    def reset(self) -> None:
        raise NotImplementedError

    def stop_engine(self, unload: bool) -> None:
        raise NotImplementedError

    def idle(self, rounds: int) -> None:
        raise NotImplementedError

    def play(self, n_ops: int) -> None:
        for _ in range(n_ops):
            op = self.rng.choices(list(OPS), weights=list(OPS.values()))[0]
            self.ops[op] = self.ops.get(op, 0) + 1
            if op in ("sparse", "dense"):
                self.serve(op == "sparse")
            elif op == "abort":
                self.abort()
            elif op == "reset":
                self.reset()
            elif op in ("shutdown", "unload"):
                self.stop_engine(op == "unload")
            elif op == "budget":
                self.set_budget()
            elif op == "idle":
                self.idle(self.rng.randrange(1, 4))
            else:
                self.clock.advance(self.rng.choice((0.5, 5.0, PARK_MAX_S)))
        # The closing turn: a sparse request leaves debt, idle time recovers it (through
        # the armed fault if it has not fired yet), and a dense request restores it.
        if self.budget == 0:
            self.budget = 50.0
            self.guard("set_budget", lambda: self.plugin.set_budget(self.budget))
        self.serve(True)
        self.idle(8)
        self.serve(False)
        self.idle(2)


class Run(FaultRun):
    """One interleaving on the mock host."""

    def __init__(
        self, models: tuple[Any, Any, Any], cold: ColdReference, rng: random.Random, injector: Injector,
        extra_plugins: Sequence[object] = (),
    ) -> None:
        super().__init__(models, cold, rng, injector)
        self.host = MockHost(
            make_plugin_manager([self.plugin, *extra_plugins], settings=self.settings, entry_points_too=False)
        )
        self.cache_kind = rng.choice(("paged", "paged", "entries"))
        self.pool_blocks = rng.choice((2048, 2048, 40))  # 40: the host evicts as it goes
        self.stores: dict[str, StoreLog] = {}
        self.unloaded_at: dict[str, float] = {}  # engine id -> when its unload hook returned
        self.unloading: threading.Thread | None = None
        self._time_hooks()
        self.generation = 0
        self.eid = ""
        self._add_engine()
        # A second engine that contends for the execution claim.
        self.other = self._new_engine("x1") if rng.random() < 0.25 else None
        if injector.kind == "arrival_mid_slice":
            injector.action = self._arrive_now
        elif injector.kind in ("unload_mid_slice", "unload_mid_publish"):
            injector.action = self._unload_from_another_thread

    # -- plumbing -------------------------------------------------------------------
    def _time_hooks(self) -> None:
        """Time every hook call on a host thread but the idle step (recovery's own work)."""
        emitter = self.host.emitter
        real_emit = emitter.emit

        def emit(hook_name: str, **kwargs: Any) -> list[Any]:
            began = time.perf_counter()
            try:
                return real_emit(hook_name, **kwargs)
            finally:
                if hook_name != "engine_idle_step":
                    self.note_block(time.perf_counter() - began)

        emitter.emit = emit  # type: ignore[method-assign]

    def _new_engine(self, eid: str) -> str | None:
        model, tokenizer, draft = self.models
        engine = self.guard(
            "add_engine",
            lambda: self.host.add_engine(
                eid, model=model, tokenizer=tokenizer, draft_model=draft, model_id=MODEL_ID,
                block_size=self.block, prefill_step=self.step, sparse_threshold=16, clock=self.clock,
                pool_blocks=self.pool_blocks, cache_kind=self.cache_kind,
            ),
        )
        if engine is None:
            return None
        self.stores[eid] = install_cache_faults(engine.prefix_cache, self.injector, self.block)
        return eid

    def _add_engine(self) -> None:
        self.generation += 1
        self.eid = f"e{self.generation}"
        self._new_engine(self.eid)

    def _arrive_now(self) -> None:
        """A foreground request arrives while the slice runs (on the engine's thread)."""
        prompt = self.prompt(next_turn=False)
        self.guard("submit", lambda: self.host.submit(self.eid, prompt, sparse=False, max_tokens=2))

    def _unload_from_another_thread(self) -> None:
        """A control thread unloads the engine while the slice runs or publishes; the
        host's own unload follows once the current operation is over (:meth:`_settle`)."""
        eid, entered = self.eid, threading.Event()

        def unload() -> None:
            entered.set()
            began = time.perf_counter()
            self.guard("unload hook", lambda: self.plugin.model_unloaded(eid, MODEL_ID))
            self.note_block(time.perf_counter() - began)
            self.unloaded_at[eid] = time.monotonic()

        self.unloading = threading.Thread(target=unload, name="control")
        self.unloading.start()
        entered.wait(5.0)
        time.sleep(0.005)  # let the hook reach its wait while the slice or store goes on

    def _settle(self) -> None:
        """After an operation: finish an unload a control thread started (the host's part)."""
        thread, self.unloading = self.unloading, None
        if thread is None:
            return
        thread.join(60.0)
        if thread.is_alive():
            self.escapes += 1
            self.problems.append("an unload from another thread never returned")
            return
        self.stop_engine(unload=True)

    def _engine_for_request(self) -> str:
        if self.other is not None and self.rng.random() < 0.4:
            return self.other
        return self.eid

    # -- operations -----------------------------------------------------------------
    def serve(self, sparse: bool) -> None:
        prompt = self.prompt(next_turn=sparse)
        max_tokens = 4
        eid = self._engine_for_request()
        rid = self.guard("submit", lambda: self.host.submit(eid, prompt, sparse=sparse, max_tokens=max_tokens))
        if rid is None:
            return
        self.guard("run_until_idle", self.host.run_until_idle)
        result = self.guard("result", lambda: self.host.result(rid))
        if result is None or sparse or result.route != "dense" or result.reason != DepartureReason.FINISHED:
            return
        self.check_dense(prompt, max_tokens, result.output_tokens, result.cached_tokens)

    def abort(self) -> None:
        prompt = self.prompt(next_turn=False)
        rid = self.guard("submit", lambda: self.host.submit(self.eid, prompt, sparse=self.rng.random() < 0.5))
        if rid is None:
            return
        engine = self.host.engines[self.eid]
        for _ in range(self.rng.randrange(3)):
            self.guard("step", engine.step)
        self.guard("abort", lambda: self.host.abort(rid))
        self.guard("run_until_idle", self.host.run_until_idle)

    def reset(self) -> None:
        if self.rng.random() < 0.5:  # with a request in flight
            prompt = self.prompt(next_turn=False)
            self.guard("submit", lambda: self.host.submit(self.eid, prompt, sparse=True))
            self.guard("step", self.host.engines[self.eid].step)
        self.guard("reset", lambda: self.host.reset(self.eid, deep=self.rng.random() < 0.3))
        self.guard("run_until_idle", self.host.run_until_idle)

    def stop_engine(self, unload: bool) -> None:
        if unload:
            self.guard("unload", lambda: self.host.unload(self.eid))
        else:
            self.guard("shutdown", lambda: self.host.shutdown(self.eid))
        self._add_engine()

    def idle(self, rounds: int) -> None:
        for _ in range(rounds):
            self.guard("drive_idle", self.host.drive_idle)
            self._settle()
            delay = self.host.last_idle_retry_after
            if delay is None:
                break
            self.clock.advance(delay)

    def finish(self) -> int:
        """Close the plugin; returns the leaked references."""
        self._settle()
        for eid, at in self.unloaded_at.items():
            late = self.stores[eid].after(at)
            if late:
                self.writes_after_unload += late
                self.problems.append(f"{late} store(s) on {eid} after its unload returned")
        self.close_plugin()
        # A holder whose release the host keeps refusing cannot be given back yet; it must
        # still be accounted for (the engine's status lists it), never forgotten.
        engines = self.plugin.status()["engines"]
        leaked = 0
        for eid, refs in self.host.leaked().items():
            own = {h: c for h, c in refs.items() if isinstance(h, str) and h.startswith(HOLDER_PREFIX + ":")}
            other = {h: c for h, c in refs.items() if h not in own}
            accounted = engines.get(eid, {}).get("unreleased_holders", 0)
            if len(own) > accounted:
                other.update(own)  # more holders than the plugin knows of: it forgot some
            count = sum(sum(c.values()) for c in other.values())
            if count:
                leaked += count
                self.problems.append(f"leaked in {eid}: {dict(other)}")
        for eid, engine in self.host.engines.items():
            held = [h for h in engine.prefix_cache.holders if h.startswith(HOLDER_PREFIX)]
            forgotten = len(held) - engines.get(eid, {}).get("unreleased_holders", 0)
            if forgotten > 0:
                leaked += forgotten
                self.problems.append(f"holders left in {eid} that the plugin forgot: {held}")
        self.escapes += self.host.emitter.errors
        if self.host.emitter.errors:
            self.problems.append(f"{self.host.emitter.errors} plugin error(s) swallowed by the host's emitter")
        for engine in self.host.engines.values():
            engine.unload()
        return leaked


def load_models() -> tuple[Any, Any, Any]:
    model, tokenizer = load_tiny_model(cached_model_dir(TinyModelSpec()))
    draft, _ = load_tiny_model(cached_model_dir(DRAFT_SPEC))
    return model, tokenizer, draft


def run_fault_bench(
    runs: int = 2000, *, seed: int = 0, ops: int = 8, models: tuple[Any, Any, Any] | None = None,
    extra_plugins: Callable[[], Sequence[object]] = tuple, progress: Callable[[str], None] | None = None,
) -> FaultBenchResult:
    """``runs`` interleavings of ``ops`` random operations each (plus the closing turn),
    fault kinds taken in turn; ``extra_plugins`` builds plugins added to each run's host
    (to check that the bench's checks can fail)."""
    models = models or load_models()
    cold = ColdReference(models[0], models[1])
    rows = {kind: KindRow(kind) for kind in FAULT_KINDS}
    result = FaultBenchResult(rows, runs, 0.0)
    started = time.perf_counter()
    for index in range(runs):
        rng = random.Random(f"{seed}:{index}")
        kind = FAULT_KINDS[index % len(FAULT_KINDS)]
        injector = arm(kind, rng)
        run = Run(models, cold, rng, injector, extra_plugins())
        run.play(rng.randrange(max(1, ops // 2), ops + 1))
        result.book(index, kind, injector, run, run.finish())
        if progress and (index + 1) % 100 == 0:
            progress(f"[{index + 1}/{runs}] {time.perf_counter() - started:.0f} s")
        if index % 50 == 49:
            mx.clear_cache()
    result.seconds = time.perf_counter() - started
    return result


def format_result(result: FaultBenchResult) -> str:
    from mlx_recovery_plugin.runner.blas import describe

    lines = [
        f"BLAS: {describe()}",
        f"{result.runs} runs in {result.seconds:.0f} s; operations: "
        + ", ".join(f"{op} {n}" for op, n in sorted(result.ops.items())),
        f"{'fault kind':<19} {'runs':>5} {'injected':>8} {'leaked refs':>11} {'into host':>9} "
        f"{'dense checked':>13} {'of them cached':>14} {'wrong outputs':>13} {'writes after unload':>19} "
        f"{'longest host wait':>17}",
    ]
    for r in result.rows.values():
        lines.append(
            f"{r.kind:<19} {r.runs:>5} {r.injected:>8} {r.leaked_refs:>11} {r.escapes:>9} "
            f"{r.dense_checked:>13} {r.dense_restored:>14} {r.wrong_outputs:>13} {r.writes_after_unload:>19} "
            + (f"{r.longest_block_s * 1000:>14.1f} ms" if result.timed_hooks else f"{'-':>17}")
        )
    lines.append(
        "all clean" if result.ok else "FAILED: leaks, exceptions into the host, wrong outputs or writes after unload"
    )
    lines.extend(result.failures)
    return "\n".join(lines)


def _run(args: argparse.Namespace) -> int:
    maybe_reexec(args)
    if not getattr(args, "verbose", False):  # every injected fault is logged as a warning
        logging.getLogger("mlx_recovery_plugin").setLevel(logging.ERROR)
        logging.getLogger("mlx_recovery_plugin.recovery").setLevel(logging.CRITICAL)
    progress = lambda line: print(line, file=sys.stderr, flush=True)  # noqa: E731
    if getattr(args, "host", "mock") == "omlx":
        from .faults_omlx import omlx_available, run_omlx_fault_bench

        why = omlx_available()
        if why is not None:
            print(f"bench faults --host omlx skipped: {why}", file=sys.stderr)
            return 0
        runs = args.runs if args.runs is not None else 100
        result = run_omlx_fault_bench(runs, seed=args.seed, ops=args.ops, progress=progress)
    else:
        runs = args.runs if args.runs is not None else 2000
        result = run_fault_bench(runs, seed=args.seed, ops=args.ops, progress=progress)
    print(format_result(result))
    ok = result.ok
    if args.control_clients > 0:
        from .faults_control import format_control_load, run_control_load

        control = run_control_load(args.control_clients)
        print(format_control_load(control))
        ok = ok and control.ok
    return 0 if ok else 1


def add_parser(subparsers: argparse._SubParsersAction) -> None:
    p = subparsers.add_parser(
        "faults", help="random host events with injected recovery faults: leaks, escapes, wrong outputs"
    )
    p.add_argument(
        "--runs", type=int, default=None, help="random interleavings (default 2000 on the mock host, 100 on oMLX)"
    )
    p.add_argument(
        "--host", choices=("mock", "omlx"), default="mock",
        help="the mock host (default) or the real oMLX scheduler through OmlxContractHost",
    )
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--ops", type=int, default=8, help="most random operations per run before its closing turn")
    p.add_argument(
        "--control-clients", type=int, default=300,
        help="then the control channel under load: this many clients at once, slow clients and an "
        "accept out of descriptors (tests/lab/faults_control.py); 0 skips it",
    )
    add_openblas_flag(p)
    p.set_defaults(func=_run)
