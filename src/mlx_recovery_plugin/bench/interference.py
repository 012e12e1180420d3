"""``mlx-recovery bench interference``: what a request pays for arriving during recovery.

Per trial, on a threaded mock host with recovery on: a long sparse-served prompt leaves a
recovery job; while slices run, a short request arrives at a random moment and its time to
first token is measured; the same request is then served on the now idle host for the
baseline. Extra wait = during - baseline. Slice sizes 4096/1024/512/256, interruptible
slices on and off, configurations interleaved trial by trial.

The budget is 100 % of a one-hour window, so slices keep their configured size (a smaller
allowance would fit them to it). A slice's cost grows with the context it attends over,
so the full-slice time reported is the longest whole slice measured in the trials
without interruption, not a slice timed on an empty cache.
"""

from __future__ import annotations

import argparse
import random
import time
from dataclasses import dataclass
from typing import Any

from ..plugins import make_plugin_manager
from ..recovery.plugin import RecoveryPlugin
from ..runner.blas import add_openblas_flag, maybe_reexec
from ..settings import ModelSettings, RecoverySettings
from ..testing.host import MockHost
from ..testing.tiny_model import BENCH_DRAFT, BENCH_TARGET, cached_model_dir, load_tiny_model
from .balance import measure_or_say_why
from .stats import Spread, spread

MODEL_ID = "bench-interference"


@dataclass(slots=True)
class InterferenceRow:
    slice_tokens: int
    interruptible: bool
    extra_wait: Spread
    slice_seconds: float

    @property
    def worst_fraction_of_slice(self) -> float:
        return self.extra_wait.high / self.slice_seconds if self.slice_seconds else float("nan")


@dataclass(slots=True)
class InterferenceReport:
    rows: list[InterferenceRow]
    balance_line: str  # the target's cost balance at the recovered prompt's length


def _host(models: Any, slice_tokens: int, interruptible: bool, block_size: int, context: int) -> tuple[MockHost, RecoveryPlugin]:
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
    host = MockHost(make_plugin_manager([plugin], settings=RecoverySettings(), entry_points_too=False))
    model, tokenizer, draft = models
    host.add_engine(
        "e0", model=model, tokenizer=tokenizer, draft_model=draft, model_id=MODEL_ID,
        block_size=block_size, prefill_step=512, sparse_threshold=min(1024, context // 2), pool_blocks=4096,
    )
    return host, plugin


def _trial(models: Any, slice_tokens: int, interruptible: bool, rng: random.Random, context: int, block_size: int, probe_len: int) -> tuple[float, float, float]:
    """One arrival during recovery and its idle baseline; returns (during, baseline) time
    to first token and the longest whole slice the trial ran."""
    host, plugin = _host(models, slice_tokens, interruptible, block_size, context)
    long_prompt = [rng.randrange(256) for _ in range(context)]
    probe = [rng.randrange(256) for _ in range(probe_len)]
    host.start()
    try:
        host.wait(host.submit("e0", long_prompt, max_tokens=1, sparse=True), timeout=600)
        # Land at a random moment once slices are under way.
        deadline = time.monotonic() + 60
        while plugin.status()["process"]["slices"] == 0 and time.monotonic() < deadline:
            time.sleep(0.005)
        time.sleep(rng.uniform(0.0, 1.0))
        during = host.wait(host.submit("e0", probe, max_tokens=1), timeout=600).ttft_s or 0.0
        plugin.set_budget(0.0)  # the baseline must not meet a slice
        probe2 = [(t + 1) % 256 for t in probe]
        baseline = host.wait(host.submit("e0", probe2, max_tokens=1), timeout=600).ttft_s or 0.0
        service = plugin.service("e0")
        longest = service.snapshot().counters.slice_seconds_max if service is not None else 0.0
    finally:
        host.stop()
        plugin.close()
    return during, baseline, longest


def run_interference_bench(
    slice_sizes: tuple[int, ...] = (4096, 1024, 512, 256),
    trials: int = 5,
    context: int = 8192,
    probe_len: int = 64,
    block_size: int = 256,
    seed: int = 0,
    models: Any = None,
    progress: Any = print,
) -> InterferenceReport:
    if models is None:
        # The demo's pair. Stop checks come between layers and passes (at most 256
        # tokens each), so an interruptible slice of the two-layer target stops after
        # one layer of one pass.
        model, tokenizer = load_tiny_model(cached_model_dir(BENCH_TARGET))
        draft, _ = load_tiny_model(cached_model_dir(BENCH_DRAFT))
        models = (model, tokenizer, draft)
    balance_line = measure_or_say_why(models[0], context)[1]
    progress(balance_line)
    rng = random.Random(seed)
    configs = [(s, i) for s in slice_sizes for i in (True, False)]
    waits: dict[tuple[int, bool], list[float]] = {c: [] for c in configs}
    whole_slice: dict[int, list[float]] = {s: [] for s in slice_sizes}
    for trial in range(trials):
        for config in configs:
            during, baseline, longest = _trial(models, *config, rng, context, block_size, probe_len)
            waits[config].append(max(0.0, during - baseline))
            if not config[1]:
                whole_slice[config[0]].append(longest)
            progress(f"trial {trial + 1}/{trials} slice {config[0]:>5} interruptible {config[1]!s:<5} "
                     f"ttft during {during:.3f}s baseline {baseline:.3f}s longest slice {longest:.3f}s")
    rows = [InterferenceRow(s, i, spread(waits[(s, i)]), spread(whole_slice[s]).median) for s, i in configs]
    return InterferenceReport(rows, balance_line)


def format_rows(report: InterferenceReport) -> str:
    from ..runner.blas import describe

    rows = report.rows
    lines = [f"BLAS: {describe()}", report.balance_line,
             f"{'slice':>6} {'interruptible':>13} | {'extra wait s: median [min, max]':<36} | {'slice s':>8} | worst/slice",
             "(slice s: the longest whole slice of a trial, median over trials)"]
    for r in rows:
        lines.append(f"{r.slice_tokens:>6} {r.interruptible!s:>13} | {r.extra_wait!s:<36} | "
                     f"{r.slice_seconds:>8.3f} | {r.worst_fraction_of_slice:.2f}")
    return "\n".join(lines)


def _run(args: argparse.Namespace) -> int:
    maybe_reexec(args)
    report = run_interference_bench(slice_sizes=tuple(args.slices), trials=args.trials, context=args.context, seed=args.seed)
    print(format_rows(report))
    return 0


def add_parser(subparsers: argparse._SubParsersAction) -> None:
    p = subparsers.add_parser("interference", help="extra wait of a request arriving during recovery")
    p.add_argument("--slices", type=int, nargs="+", default=[4096, 1024, 512, 256])
    p.add_argument("--trials", type=int, default=5)
    p.add_argument("--context", type=int, default=8192, help="tokens of the recovered prompt")
    p.add_argument("--seed", type=int, default=0)
    add_openblas_flag(p)
    p.set_defaults(func=_run)
