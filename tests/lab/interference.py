"""``python tests/lab interference``: what a request pays for arriving during recovery.

Per trial, on a threaded mock host with recovery on: a long sparse-served prompt leaves a
recovery job; while slices run, a short request arrives at a random moment and its time to
first token is measured; the same request is then served on the now idle host for the
baseline. Extra wait = during - baseline, signed: a negative wait is reported as it was
measured (the probe met no cost, and the noise shows), never clamped to 0. Slice sizes
4096/1024/512/256, interruptible slices on and off, configurations interleaved trial by
trial.

A trial counts only when a slice was live when the probe arrived: a slice finished (whole
or interrupted) between the probe's submission and its admission, read from the recovery
service's counters at both moments (the admission is observed on the engine thread by a
``request_admitted`` hook, before the probe's prefill). A trial whose probe met no slice
(recovery already done, or not yet started) is flagged, counted per cell and left out of
the spread. The baseline is checked the same way: the budget goes to 0 and a throwaway
request waits out any slice still running, and a trial whose baseline probe still met a
slice is flagged and left out too. A request without a time to first token is an error
(:class:`MissingMeasurement`), never 0 s.

The budget is 100 % of a one-hour window, so slices keep their configured size (a smaller
allowance would fit them to it). A slice's cost grows with the context it attends over,
so the full-slice time reported is the longest whole slice measured in the trials
without interruption, not a slice timed on an empty cache.
"""

from __future__ import annotations

import argparse
import random
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from mlx_recovery_plugin.bench.balance import measure_or_say_why
from mlx_recovery_plugin.bench.openblas import add_openblas_flag, maybe_reexec
from mlx_recovery_plugin.events import RequestAdmitted
from mlx_recovery_plugin.hookspecs import hookimpl
from mlx_recovery_plugin.plugins import make_plugin_manager
from mlx_recovery_plugin.recovery.plugin import RecoveryPlugin
from mlx_recovery_plugin.settings import ModelSettings, RecoverySettings
from mlx_recovery_plugin.testing.host import MockHost
from mlx_recovery_plugin.testing.tiny_model import BENCH_DRAFT, BENCH_TARGET, cached_model_dir, load_tiny_model

from .stats import Spread, spread

MODEL_ID = "bench-interference"


class MissingMeasurement(RuntimeError):
    """A trial lacks a figure it needs (a request got no time to first token, or the
    engine's recovery service is gone); the bench stops rather than count it as 0."""


@dataclass(slots=True, frozen=True)
class TrialOutcome:
    """One trial: the probe's time to first token during recovery and on the idle host,
    the longest slice the trial ran, and whether a slice was live when the probe arrived
    (and was interrupted by it)."""

    during_s: float
    baseline_s: float
    longest_slice_s: float
    live_slice: bool
    interrupted: bool = False
    baseline_clean: bool = True  # no slice ran between the baseline probe's submission and admission

    @property
    def counted(self) -> bool:
        return self.live_slice and self.baseline_clean

    @property
    def extra_wait_s(self) -> float:
        """Signed: negative when the probe was served faster during recovery than idle."""
        return self.during_s - self.baseline_s


TrialFn = Callable[[Any, int, bool, random.Random, int, int, int], TrialOutcome]


@dataclass(slots=True)
class InterferenceRow:
    slice_tokens: int
    interruptible: bool
    extra_wait: Spread | None  # over the trials that met a live slice; None when none did
    slice_seconds: float
    trials: int = 0
    not_live: int = 0  # trials whose probe met no live slice (flagged, not in the spread)
    baseline_met_slice: int = 0  # trials whose baseline met a slice (flagged, not in the spread)
    interrupted: int = 0  # counted trials whose live slice the probe interrupted

    @property
    def worst_fraction_of_slice(self) -> float:
        if self.extra_wait is None or not self.slice_seconds:
            return float("nan")
        return self.extra_wait.high / self.slice_seconds


@dataclass(slots=True)
class InterferenceReport:
    rows: list[InterferenceRow]
    balance_line: str  # the target's cost balance at the recovered prompt's length


class _AdmissionWatch:
    """Reads the recovery service's slice counters when a request is admitted. Runs on
    the engine thread, so any slice live at the request's arrival has returned by then."""

    def __init__(self, plugin: RecoveryPlugin, engine_id: str) -> None:
        self._plugin, self._engine_id = plugin, engine_id
        self._lock = threading.Lock()
        self._seen: dict[str, tuple[int, int]] = {}

    @hookimpl
    def request_admitted(self, event: RequestAdmitted) -> None:
        if event.engine_id != self._engine_id:
            return
        counts = _slice_counts(self._plugin, self._engine_id)
        with self._lock:
            self._seen[event.request_id] = counts

    def at_admission(self, request_id: str) -> tuple[int, int]:
        with self._lock:
            counts = self._seen.get(request_id)
        if counts is None:
            raise MissingMeasurement(f"{request_id} was served but its admission was not observed")
        return counts


def _slice_counts(plugin: RecoveryPlugin, engine_id: str) -> tuple[int, int]:
    """(slices run, slices interrupted) of the engine's recovery so far."""
    service = plugin.service(engine_id)
    if service is None:
        raise MissingMeasurement(f"engine {engine_id} has no recovery service")
    counters = service.snapshot().counters
    return counters.slices, counters.slices_interrupted


def _ttft(host: MockHost, request_id: str, what: str) -> float:
    result = host.wait(request_id, timeout=600)
    if result.ttft_s is None:
        raise MissingMeasurement(f"the {what} request {request_id} got no time to first token")
    return result.ttft_s


def _host(models: Any, slice_tokens: int, interruptible: bool, block_size: int, context: int) -> tuple[MockHost, RecoveryPlugin, _AdmissionWatch]:
    plugin = RecoveryPlugin(
        settings=RecoverySettings(
            budget_pct=100.0,
            budget_window_s=3600.0,
            slice_tokens=slice_tokens,
            interruptible=interruptible,
            idle_steps=1,
            models={MODEL_ID: ModelSettings(enabled=True)},
        ),
        control_socket=False,
    )
    watch = _AdmissionWatch(plugin, "e0")
    host = MockHost(make_plugin_manager([plugin, watch], settings=RecoverySettings(), entry_points_too=False))
    model, tokenizer, draft = models
    host.add_engine(
        "e0", model=model, tokenizer=tokenizer, draft_model=draft, model_id=MODEL_ID,
        block_size=block_size, prefill_step=512, sparse_threshold=min(1024, context // 2), pool_blocks=4096,
    )
    return host, plugin, watch


def arrive_at_random(plugin: RecoveryPlugin, rng: random.Random) -> None:
    """Return at a random moment within a second of the first slice's end. Recovery may
    be over by then; the trial then finds no live slice and is flagged."""
    deadline = time.monotonic() + 60
    while plugin.status()["process"]["slices"] == 0 and time.monotonic() < deadline:
        time.sleep(0.005)
    time.sleep(rng.uniform(0.0, 1.0))


def arrive_after_recovery(plugin: RecoveryPlugin, rng: random.Random) -> None:
    """Return once recovery is over (no live state, and every job's prefix published or
    held whole for its conversation's return): a probe sent then meets no slice."""
    deadline = time.monotonic() + 60
    while time.monotonic() < deadline:
        engines = plugin.status()["engines"].values()
        ready = all(j["committed"] + j["held_tokens"] >= j["publish_end"] for e in engines for j in e["jobs"])
        if ready and all(e["live_job_id"] is None for e in engines):
            return
        time.sleep(0.005)
    raise TimeoutError(f"recovery did not finish within 60 s: {plugin.status()['engines']}")


def run_trial(
    models: Any, slice_tokens: int, interruptible: bool, rng: random.Random, context: int, block_size: int,
    probe_len: int, *, arrive: Callable[[RecoveryPlugin, random.Random], None] = arrive_at_random,
) -> TrialOutcome:
    """One arrival during recovery (``arrive`` returns when the probe is to be sent) and
    its idle baseline."""
    host, plugin, watch = _host(models, slice_tokens, interruptible, block_size, context)
    long_prompt = [rng.randrange(256) for _ in range(context)]
    probe = [rng.randrange(256) for _ in range(probe_len)]
    host.start()
    try:
        _ttft(host, host.submit("e0", long_prompt, max_tokens=1, sparse=True), "long")
        arrive(plugin, rng)
        before = _slice_counts(plugin, "e0")
        probe_id = host.submit("e0", probe, max_tokens=1)
        during = _ttft(host, probe_id, "probe")
        admitted = watch.at_admission(probe_id)
        # The baseline must not meet a slice: no new one starts at budget 0, and a
        # throwaway request waits out one that started after the probe was served.
        plugin.set_budget(0.0)
        _ttft(host, host.submit("e0", [(t + 2) % 256 for t in probe], max_tokens=1), "drain")
        before_baseline = _slice_counts(plugin, "e0")
        baseline_id = host.submit("e0", [(t + 1) % 256 for t in probe], max_tokens=1)
        baseline = _ttft(host, baseline_id, "baseline")
        baseline_admitted = watch.at_admission(baseline_id)
        service = plugin.service("e0")
        if service is None:
            raise MissingMeasurement("engine e0 has no recovery service")
        longest = service.snapshot().counters.slice_seconds_max
    finally:
        host.stop()
        plugin.close()
    return TrialOutcome(
        during_s=during,
        baseline_s=baseline,
        longest_slice_s=longest,
        live_slice=admitted[0] > before[0],
        interrupted=admitted[1] > before[1],
        baseline_clean=baseline_admitted[0] == before_baseline[0],
    )


def summarise(
    configs: list[tuple[int, bool]], outcomes: dict[tuple[int, bool], list[TrialOutcome]]
) -> list[InterferenceRow]:
    """One row per configuration: the signed extra waits of the trials that met a live
    slice (the others counted in ``not_live``), and the median over the trials without
    interruption of their longest whole slice."""
    rows = []
    for s, i in configs:
        trials = outcomes[(s, i)]
        counted = [t for t in trials if t.counted]
        whole = [t.longest_slice_s for t in outcomes.get((s, False), [])]
        rows.append(InterferenceRow(
            slice_tokens=s,
            interruptible=i,
            extra_wait=spread([t.extra_wait_s for t in counted]) if counted else None,
            slice_seconds=spread(whole).median if whole else float("nan"),
            trials=len(trials),
            not_live=sum(1 for t in trials if not t.live_slice),
            baseline_met_slice=sum(1 for t in trials if t.live_slice and not t.baseline_clean),
            interrupted=sum(1 for t in counted if t.interrupted),
        ))
    return rows


def load_models(model: str | None = None) -> tuple[Any, Any, Any]:
    """The target (the demo's two-layer bench model, or ``model``: a known model's name
    or a model directory), its tokenizer, and the bench draft. Stop checks come between
    layers and passes (at most 256 tokens each), so a stop waits for one layer of one
    pass. Prompts are byte tokens, which every target's vocabulary and the draft's cover."""
    if model is None:
        path = cached_model_dir(BENCH_TARGET)
    else:
        from mlx_recovery_plugin.models.library import resolve_model

        path = resolve_model(model)
    target, tokenizer = load_tiny_model(path)
    draft, _ = load_tiny_model(cached_model_dir(BENCH_DRAFT))
    return target, tokenizer, draft


def run_interference_bench(
    slice_sizes: tuple[int, ...] = (4096, 1024, 512, 256),
    trials: int = 5,
    context: int = 8192,
    probe_len: int = 64,
    block_size: int = 256,
    seed: int = 0,
    models: Any = None,
    progress: Any = print,
    trial: TrialFn = run_trial,
) -> InterferenceReport:
    if models is None:
        models = load_models()
    balance_line = measure_or_say_why(models[0], context)[1]
    progress(balance_line)
    rng = random.Random(seed)
    configs = [(s, i) for s in slice_sizes for i in (True, False)]
    outcomes: dict[tuple[int, bool], list[TrialOutcome]] = {c: [] for c in configs}
    for n in range(trials):
        for config in configs:
            t = trial(models, *config, rng, context, block_size, probe_len)
            outcomes[config].append(t)
            live = ("live slice, interrupted" if t.interrupted else "live slice") if t.live_slice else "NO LIVE SLICE (not counted)"
            if not t.baseline_clean:
                live += "; BASELINE MET A SLICE" + ("" if not t.live_slice else " (not counted)")
            progress(f"trial {n + 1}/{trials} slice {config[0]:>5} interruptible {config[1]!s:<5} "
                     f"ttft during {t.during_s:.3f}s baseline {t.baseline_s:.3f}s extra {t.extra_wait_s:+.3f}s "
                     f"longest slice {t.longest_slice_s:.3f}s; {live}")
    return InterferenceReport(summarise(configs, outcomes), balance_line)


def format_rows(report: InterferenceReport) -> str:
    from mlx_recovery_plugin.runner.blas import describe

    rows = report.rows
    lines = [f"BLAS: {describe()}", report.balance_line,
             f"{'slice':>6} {'interruptible':>13} | {'extra wait s (signed): median [min, max]':<41} | "
             f"{'no live slice':>13} | {'dirty baseline':>14} | {'slice s':>8} | worst/slice",
             "(extra wait: during - baseline over the trials counted; no live slice / dirty baseline: "
             "trials flagged and left out, of all trials; slice s: the longest whole slice of a trial, "
             "median over trials)"]
    for r in rows:
        wait = str(r.extra_wait) if r.extra_wait is not None else "n/a (no trial counted)"
        lines.append(f"{r.slice_tokens:>6} {r.interruptible!s:>13} | {wait:<41} | "
                     f"{f'{r.not_live}/{r.trials}':>13} | {f'{r.baseline_met_slice}/{r.trials}':>14} | "
                     f"{r.slice_seconds:>8.3f} | {r.worst_fraction_of_slice:.2f}")
    return "\n".join(lines)


def _run(args: argparse.Namespace) -> int:
    maybe_reexec(args)  # a --model name not fetched was refused before (cli_checks)
    report = run_interference_bench(
        slice_sizes=tuple(args.slices), trials=args.trials, context=args.context, seed=args.seed,
        models=load_models(args.model),
    )
    print(format_rows(report))
    return 0


def add_parser(subparsers: argparse._SubParsersAction) -> None:
    p = subparsers.add_parser("interference", help="extra wait of a request arriving during recovery")
    p.add_argument("--slices", type=int, nargs="+", default=[4096, 1024, 512, 256])
    p.add_argument("--trials", type=int, default=5)
    p.add_argument("--context", type=int, default=8192, help="tokens of the recovered prompt")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--model", default=None, help="target: a known model's name (smollm2) or a model "
                   "directory (default: the two-layer bench model)")
    add_openblas_flag(p)
    p.set_defaults(func=_run)
