"""``mlx-recovery bench faults``: random interleavings of host events and injected faults.

Each run builds a mock host with a real tiny model (one engine, block size 16-64) and a
:class:`RecoveryPlugin` on a :class:`FakeClock`, then plays a seeded random sequence of
sparse and dense requests, aborts, resets, shutdowns and unloads (the engine is re-added
after each), budget changes, idle steps and clock jumps, ending with a sparse turn, idle
time and a dense turn. One fault of one kind is armed per run in the recovery path: the
runner raising (``runner_error``) or running out of memory (``oom``), the store raising
(``store_error``), the probe's read-back coming back short (``probe_mismatch``), or a
release raising once (``release_error``). After each run the plugin is closed and three
things are counted per fault kind:

* leaked block references (any reference outside the prefix index, and any holder of the
  cache named ``mlx-recovery:*``);
* exceptions into the host: any exception reaching the driver from a host call, plus
  every plugin failure the host's hook emitter had to swallow;
* wrong outputs: a dense request whose greedy output differs from the same prompt's on a
  fresh host that never stored anything.

All three must be 0; the command exits 1 otherwise. Then the control channel is put
under load (:mod:`.faults_control`): no client may fail, slow clients may not hold it
past the request deadline, and an accept out of descriptors must back off.
"""

from __future__ import annotations

import argparse
import logging
import random
import sys
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any

import mlx.core as mx

from ..events import DepartureReason
from ..plugins import make_plugin_manager
from ..ports import FetchedPrefix
from ..recovery.plugin import RecoveryPlugin
from ..recovery.service import PARK_MAX_S
from ..runner import SliceRunner
from ..runner.blas import add_openblas_flag, maybe_reexec
from ..settings import ModelSettings, RecoverySettings
from ..testing.clock import FakeClock, random_tokens
from ..testing.host import MockHost
from ..testing.tiny_model import TinyModelSpec, cached_model_dir, load_tiny_model

MODEL_ID = "bench-faults"
HOLDER_PREFIX = "mlx-recovery"
FAULT_KINDS = ("runner_error", "oom", "store_error", "probe_mismatch", "release_error")
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
    """One fault, armed on the ``at``-th call of ``point``; fires at most once."""

    def __init__(self, kind: str, point: str, at: int) -> None:
        self.kind, self.point, self.at = kind, point, at
        self.calls: dict[str, int] = {}
        self.fired = 0

    def hit(self, point: str) -> bool:
        self.calls[point] = self.calls.get(point, 0) + 1
        if point == self.point and self.calls[point] == self.at:
            self.fired += 1
            return True
        return False


def arm(kind: str, rng: random.Random) -> Injector:
    point = {
        "runner_error": rng.choice(("begin", "advance", "advance")),
        "oom": "advance",
        "store_error": "store",
        "probe_mismatch": "probe",
        "release_error": rng.choice(("probe_release", "release")),
    }[kind]
    return Injector(kind, point, rng.choice((1, 1, 2)))


class FaultyRunner:
    """A slice runner that raises where its injector says (``begin`` or ``advance``)."""

    def __init__(self, inner: SliceRunner, injector: Injector) -> None:
        self.inner, self.injector = inner, injector

    def _maybe_fail(self, point: str) -> None:
        if self.injector.hit(point):
            if self.injector.kind == "oom":
                raise MemoryError("injected out of memory")
            raise RuntimeError(f"injected runner error in {point}")

    def begin(self, tokens: Sequence[int], prefix: Any) -> Any:
        self._maybe_fail("begin")
        return self.inner.begin(tokens, prefix)

    def advance(self, live: Any, end: int, should_stop: Any = None) -> Any:
        self._maybe_fail("advance")
        return self.inner.advance(live, end, should_stop)

    def discard(self, live: Any) -> None:
        self.inner.discard(live)


def install_cache_faults(cache: Any, injector: Injector, block_size: int) -> None:
    """Fail the cache's recovery calls (holders ``mlx-recovery:*``); the host's own calls
    go through untouched."""
    real_fetch, real_store, real_release = cache.fetch, cache.store, cache.release

    def fetch(holder: str, tokens: Sequence[int]) -> FetchedPrefix:
        if holder.startswith(HOLDER_PREFIX + ":") and ":probe:" in holder and injector.hit("probe"):
            return real_fetch(holder, tokens[: max(0, len(tokens) - block_size)])  # short read-back
        return real_fetch(holder, tokens)

    def store(holder: str, tokens: Sequence[int], blocks: Sequence[Any]) -> int:
        if holder.startswith(HOLDER_PREFIX + ":") and injector.hit("store"):
            raise RuntimeError("injected store error")
        return real_store(holder, tokens, blocks)

    def release(holder: str) -> None:
        if holder.startswith(HOLDER_PREFIX + ":"):
            point = "probe_release" if ":probe:" in holder else "release"
            if injector.hit(point):
                raise RuntimeError("injected release error")
        real_release(holder)

    cache.fetch, cache.store, cache.release = fetch, store, release


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

    @property
    def clean(self) -> bool:
        return self.leaked_refs == 0 and self.escapes == 0 and self.wrong_outputs == 0


@dataclass(slots=True)
class FaultBenchResult:
    rows: dict[str, KindRow]
    runs: int
    seconds: float
    ops: dict[str, int] = field(default_factory=dict)
    failures: list[str] = field(default_factory=list)  # the first few problems, for the report

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
        self.settings = RecoverySettings(
            budget_pct=pct, budget_window_s=10.0, idle_steps=rng.choice((1, 2)), publish_policy="always",
            slice_tokens=self.step, models={MODEL_ID: ModelSettings(enabled=True)},
        )
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
        return FaultyRunner(SliceRunner(handle, block_size, interruptible=interruptible), self.injector)

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
        self.generation = 0
        self.eid = ""
        self._add_engine()

    # -- plumbing -------------------------------------------------------------------
    def _add_engine(self) -> None:
        model, tokenizer, draft = self.models
        self.generation += 1
        self.eid = f"e{self.generation}"
        engine = self.guard(
            "add_engine",
            lambda: self.host.add_engine(
                self.eid, model=model, tokenizer=tokenizer, draft_model=draft, model_id=MODEL_ID,
                block_size=self.block, prefill_step=self.step, sparse_threshold=16, clock=self.clock,
            ),
        )
        if engine is not None:
            install_cache_faults(engine.prefix_cache, self.injector, self.block)

    # -- operations -----------------------------------------------------------------
    def serve(self, sparse: bool) -> None:
        prompt = self.prompt(next_turn=sparse)
        max_tokens = 4
        rid = self.guard("submit", lambda: self.host.submit(self.eid, prompt, sparse=sparse, max_tokens=max_tokens))
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
            delay = self.host.last_idle_retry_after
            if delay is None:
                break
            self.clock.advance(delay)

    def finish(self) -> int:
        """Close the plugin; returns the leaked references."""
        self.guard("close", self.plugin.close)
        leaked = 0
        for eid, refs in self.host.leaked().items():
            count = sum(sum(c.values()) for c in refs.values())
            leaked += count
            self.problems.append(f"leaked in {eid}: {dict(refs)}")
        for eid, engine in self.host.engines.items():
            held = [h for h in engine.prefix_cache.holders if h.startswith(HOLDER_PREFIX)]
            if held:
                leaked += len(held)
                self.problems.append(f"holders left in {eid}: {held}")
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
    from ..runner.blas import describe

    lines = [
        f"BLAS: {describe()}",
        f"{result.runs} runs in {result.seconds:.0f} s; operations: "
        + ", ".join(f"{op} {n}" for op, n in sorted(result.ops.items())),
        f"{'fault kind':<14} {'runs':>5} {'injected':>8} {'leaked refs':>11} {'into host':>9} "
        f"{'dense checked':>13} {'of them cached':>14} {'wrong outputs':>13}",
    ]
    for r in result.rows.values():
        lines.append(
            f"{r.kind:<14} {r.runs:>5} {r.injected:>8} {r.leaked_refs:>11} {r.escapes:>9} "
            f"{r.dense_checked:>13} {r.dense_restored:>14} {r.wrong_outputs:>13}"
        )
    lines.append("all clean" if result.ok else "FAILED: leaks, exceptions into the host or wrong outputs")
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
        "accept out of descriptors (bench/faults_control.py); 0 skips it",
    )
    add_openblas_flag(p)
    p.set_defaults(func=_run)
