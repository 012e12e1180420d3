"""``python tests/lab budget``: what recovery delivers per idle second, and what share
of wall time it takes against its cap.

Two measurements on the mock host with a random float32 llama (the runner bench's model,
BENCH_TARGET, unless ``--model`` is given):

* **rate**: one engine, budget 100 %, a sparse-served prompt, then idle steps until the
  job is done; recovered tokens per idle second against plain mlx-lm chunked prefill of
  the same tokens with the same chunk (arms alternating). The gap is everything around
  the forward pass: gate, fetch and rebuild, block extraction, store and read-back probe.
* **budget**: two engines sharing one process budget (10 % by default), each with more
  recovery work than the run can finish, the host's real threaded loop, for a fixed wall
  time; the share measured (slice seconds / wall seconds) against the cap. Slices are
  charged after they run; each is fitted to the window's remaining allowance at the
  measured rate, so only a first, unmeasured slice can overshoot a window.

Float32 on Linux is 15-20x faster with the system OpenBLAS; by default it re-runs the
bench under it when MLX uses its bundled reference BLAS.
"""

from __future__ import annotations

import argparse
import sys
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import mlx.core as mx

from mlx_recovery_plugin.bench.balance import measure_or_say_why
from mlx_recovery_plugin.bench.openblas import add_openblas_flag, maybe_reexec
from mlx_recovery_plugin.plugins import make_plugin_manager
from mlx_recovery_plugin.recovery.plugin import RecoveryPlugin
from mlx_recovery_plugin.runner import blas
from mlx_recovery_plugin.settings import RecoverySettings
from mlx_recovery_plugin.testing.host import MockHost
from mlx_recovery_plugin.testing.tiny_model import BENCH_DRAFT, cached_model_dir, load_tiny_model

from .runner import BenchHandle, bench_tokens, load_bench_model, plain_prefill
from .stats import describe as describe_samples

MODEL_ID = "bench"


@dataclass(slots=True)
class RateResult:
    tokens: int
    slice_tokens: int
    recovered_tps: list[float] = field(default_factory=list)
    plain_tps: list[float] = field(default_factory=list)

    @property
    def ratios(self) -> list[float]:
        return [r / p for r, p in zip(self.recovered_tps, self.plain_tps)]


@dataclass(slots=True)
class BudgetResult:
    pct: float
    window_s: float
    engines: int
    wall_s: float
    slice_seconds: float
    slices: int
    tokens_recovered: int
    budget_share: float
    longest_slice_s: float
    work_left: bool

    @property
    def measured_pct(self) -> float:
        return 100.0 * self.slice_seconds / self.wall_s if self.wall_s > 0 else 0.0


@dataclass(slots=True)
class BudgetBenchResult:
    blas: str
    model: str
    rate: RateResult | None
    budget: BudgetResult | None
    balance_line: str = "cost balance: not measured"

    def summary(self) -> str:
        lines = [f"BLAS: {self.blas}", f"model: {self.model}", self.balance_line]
        if self.rate is not None:
            r = self.rate
            lines.append(
                f"rate ({r.tokens} tokens, {r.slice_tokens}-token slices): recovered "
                f"{describe_samples(r.recovered_tps, '{:.0f}')} tok/idle-s, plain prefill "
                f"{describe_samples(r.plain_tps, '{:.0f}')} tok/s, ratio {describe_samples(r.ratios, '{:.3f}')}"
            )
        if self.budget is not None:
            b = self.budget
            lines.append(
                f"budget ({b.engines} engines, cap {b.pct:g} %, window {b.window_s:g} s, "
                f"{b.wall_s:.1f} s wall): measured {b.measured_pct:.2f} % "
                f"(budget's own account {100 * b.budget_share:.2f} %), {b.slices} slices, "
                f"longest {b.longest_slice_s:.3f} s (one slice per window is "
                f"{100 * b.longest_slice_s / b.window_s:.2f} % of a window), "
                f"{b.tokens_recovered} tokens recovered, work left at the end: {b.work_left}"
            )
        return "\n".join(lines)


def _draft_model() -> Any:
    return load_tiny_model(cached_model_dir(BENCH_DRAFT))[0]


def _settings(pct: float, window_s: float, slice_tokens: int, max_jobs: int = 4) -> RecoverySettings:
    return RecoverySettings(
        budget_pct=pct,
        budget_window_s=window_s,
        slice_tokens=slice_tokens,
        idle_steps=1,
        max_jobs_per_engine=max_jobs,
        models={MODEL_ID: {"enabled": True}},
    )


def _host(settings: RecoverySettings, model: Any, draft: Any, engines: Sequence[str], block_size: int, step: int):
    plugin = RecoveryPlugin(settings, control_socket=False)
    host = MockHost(make_plugin_manager([plugin], settings=settings, entry_points_too=False))
    for engine_id in engines:
        host.add_engine(
            engine_id, model=model, draft_model=draft, model_id=MODEL_ID, block_size=block_size,
            prefill_step=step, sparse_threshold=64, pool_blocks=8192,
        )
    return host, plugin


def measure_rate(
    model: Any, draft: Any, *, tokens: int, slice_tokens: int, block_size: int, repeats: int,
    out: Callable[[str], None],
) -> RateResult:
    result = RateResult(tokens, slice_tokens)
    handle = BenchHandle(MODEL_ID, model)
    plain_prefill(handle, bench_tokens(slice_tokens + 1), slice_tokens)  # warm-up
    for repeat in range(repeats):
        prompt = bench_tokens(tokens, seed=100 + repeat)
        for arm in (("plain", "recovery") if repeat % 2 == 0 else ("recovery", "plain")):
            if arm == "plain":
                started = time.perf_counter()
                plain_prefill(handle, prompt, slice_tokens)
                result.plain_tps.append(tokens / (time.perf_counter() - started))
                continue
            host, plugin = _host(_settings(100.0, 10.0, slice_tokens), model, draft, ["e"], block_size, slice_tokens)
            host.submit("e", prompt, sparse=True, max_tokens=1)
            host.run_until_idle()
            started = time.perf_counter()
            while plugin.status()["engines"]["e"]["jobs"]:
                host.drive_idle()
            seconds = time.perf_counter() - started
            recovered = plugin.status()["engines"]["e"]["counters"]["tokens_recovered"]
            result.recovered_tps.append(recovered / seconds)
            plugin.close()
            mx.clear_cache()
        out(
            f"rate {repeat + 1}/{repeats}: recovered {result.recovered_tps[-1]:.0f} tok/idle-s, "
            f"plain {result.plain_tps[-1]:.0f} tok/s"
        )
    return result


def measure_budget(
    model: Any, draft: Any, *, pct: float, window_s: float, duration_s: float, engines: int,
    tokens: int, slice_tokens: int, block_size: int, out: Callable[[str], None],
) -> BudgetResult:
    ids = [f"e{i}" for i in range(engines)]
    host, plugin = _host(_settings(pct, window_s, slice_tokens), model, draft, ids, block_size, slice_tokens)
    for i, engine_id in enumerate(ids):
        for session in range(2):
            host.submit(engine_id, bench_tokens(tokens, seed=1000 + 10 * i + session), sparse=True, max_tokens=1)
    out(f"serving {2 * engines} sparse prompts of {tokens} tokens ...")
    host.run_until_idle()

    def slice_seconds() -> tuple[float, int, int, float]:
        engines_status = list(plugin.status()["engines"].values())
        return (
            sum(e["counters"]["slice_seconds"] for e in engines_status),
            sum(e["counters"]["slices"] for e in engines_status),
            sum(e["counters"]["tokens_recovered"] for e in engines_status),
            max(e["counters"]["slice_seconds_max"] for e in engines_status),
        )

    plugin.budget.reset_share()
    seconds0, slices0, recovered0, _ = slice_seconds()
    started = time.monotonic()
    host.start()
    out(f"idle for {duration_s:g} s with a {pct:g} % cap ...")
    time.sleep(duration_s)
    host.stop()
    wall = time.monotonic() - started
    seconds, slices, recovered, longest = slice_seconds()
    share = plugin.budget.share_used()
    work_left = any(e["jobs"] for e in plugin.status()["engines"].values())
    plugin.close()
    return BudgetResult(
        pct, window_s, engines, wall, seconds - seconds0, slices - slices0, recovered - recovered0,
        share, longest, work_left,
    )


def run_budget_bench(
    model_dir: str | Path | None = None,
    *,
    pct: float = 10.0,
    window_s: float = 10.0,
    duration_s: float = 60.0,
    engines: int = 2,
    tokens: int = 2048,
    slice_tokens: int = 256,
    block_size: int = 256,
    repeats: int = 3,
    rate: bool = True,
    budget: bool = True,
    out: Callable[[str], None] = print,
) -> BudgetBenchResult:
    """Run the rate and budget measurements (see the module docstring)."""
    name, model = load_bench_model(model_dir)
    draft = _draft_model()
    out(f"model {name}, {blas.describe()}")
    balance_line = measure_or_say_why(model, tokens)[1]
    out(balance_line)
    rate_result = (
        measure_rate(model, draft, tokens=tokens, slice_tokens=slice_tokens, block_size=block_size, repeats=repeats, out=out)
        if rate
        else None
    )
    budget_result = (
        measure_budget(
            model, draft, pct=pct, window_s=window_s, duration_s=duration_s, engines=engines,
            tokens=tokens, slice_tokens=slice_tokens, block_size=block_size, out=out,
        )
        if budget
        else None
    )
    return BudgetBenchResult(blas.describe(), name, rate_result, budget_result, balance_line)


# -- command line ------------------------------------------------------------------------


def _configure(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--model", default=None, metavar="NAME|PATH", help="a fetched model's name (smollm2) or an mlx-lm model dir (default: BENCH_TARGET, two random float32 llama layers of hidden 4,096, feed-forward 11,008)")
    parser.add_argument("--pct", type=float, default=10.0, help="budget cap, percent (default 10)")
    parser.add_argument("--window", type=float, default=10.0, dest="window_s", help="budget window, seconds (default 10, the setting's default)")
    parser.add_argument("--duration", type=float, default=60.0, dest="duration_s", help="idle wall time of the budget run, seconds (default 60)")
    parser.add_argument("--engines", type=int, default=2, help="engines sharing the budget (default 2)")
    parser.add_argument("--tokens", type=int, default=2048, help="prompt tokens per session (default 2048)")
    parser.add_argument("--slice", type=int, default=256, dest="slice_tokens", help="tokens per slice (default 256)")
    parser.add_argument("--block", type=int, default=256, dest="block_size", help="cache block size (default 256)")
    parser.add_argument("--repeats", type=int, default=3, help="alternating repeats of the rate run (default 3)")
    parser.add_argument("--skip", choices=("rate", "budget"), default=None, help="leave one measurement out")
    add_openblas_flag(parser)


def add_parser(subparsers: Any) -> None:
    """Add ``budget`` to the lab's suites (``python tests/lab budget``; handler in ``func``)."""
    parser = subparsers.add_parser(
        "budget", help="recovered tokens per idle second vs plain prefill; budget share vs cap"
    )
    _configure(parser)
    parser.set_defaults(func=handle_args)


def handle_args(args: argparse.Namespace) -> int:
    maybe_reexec(args)
    result = run_budget_bench(
        args.model,
        pct=args.pct,
        window_s=args.window_s,
        duration_s=args.duration_s,
        engines=args.engines,
        tokens=args.tokens,
        slice_tokens=args.slice_tokens,
        block_size=args.block_size,
        repeats=args.repeats,
        rate=args.skip != "rate",
        budget=args.skip != "budget",
    )
    print(result.summary())
    return 0


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python tests/lab budget", description=__doc__.split("\n\n")[0])
    _configure(parser)
    return handle_args(parser.parse_args(argv))


if __name__ == "__main__":
    sys.exit(main())
