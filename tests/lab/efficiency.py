"""``python tests/lab efficiency``: committed tokens against what the charged time buys.

Recovery is charged wall time; what it commits for that time is the figure that matters
on a slow machine, where a window's allowance pays for less than one block. Per budget
share and window, on the mock host with the demo's target (real slices, real model): one
sparse-served prompt, then idle time on a virtual clock (waits are skipped, slices run
for real and their real duration counts) until the job is done; efficiency = committed
tokens / (charged seconds x the plain dense rate), the plain rate measured in the same
process on the same tokens, alternating with the recovery runs. The allowance per window
in tokens is printed beside each row: below one block is the slow-machine regime.
Beside it, the share of the dense work recovery ran that ended up committed (committed /
tokens run): the part of the figure that the machine's noise cannot move.
"""

from __future__ import annotations

import argparse
import sys
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any

import mlx.core as mx

from mlx_recovery_plugin.bench.openblas import add_openblas_flag, maybe_reexec
from mlx_recovery_plugin.demo.arms import VirtualClock
from mlx_recovery_plugin.plugins import make_plugin_manager
from mlx_recovery_plugin.recovery.plugin import RecoveryPlugin
from mlx_recovery_plugin.settings import ModelSettings, RecoverySettings
from mlx_recovery_plugin.testing.host import MockHost
from mlx_recovery_plugin.testing.tiny_model import BENCH_DRAFT, BENCH_TARGET, cached_model_dir, load_tiny_model

from .runner import BenchHandle, plain_prefill
from .stats import Spread, spread

MODEL_ID = "bench-efficiency"


@dataclass(slots=True)
class EfficiencyRow:
    pct: float
    window_s: float
    block_size: int
    allowance_tokens: float  # what one window's allowance buys at the plain rate
    efficiencies: list[float] = field(default_factory=list)
    committed: list[int] = field(default_factory=list)
    work_kept: list[float] = field(default_factory=list)  # committed / tokens run

    @property
    def efficiency(self) -> Spread:
        return spread(self.efficiencies)


def plain_prefill_rate(model: Any, tokens: Sequence[int], chunk: int) -> float:
    """Tokens per second of mlx-lm's own chunked prefill of ``tokens`` (cache only, as a
    host's prefill evaluates it)."""
    started = time.perf_counter()
    plain_prefill(BenchHandle(MODEL_ID, model), tokens, chunk)
    return len(tokens) / (time.perf_counter() - started)


def recover_once(
    models: tuple[Any, Any], prompt: Sequence[int], *, pct: float, window_s: float, block_size: int,
    slice_tokens: int,
) -> tuple[int, float, int]:
    """Serve ``prompt`` sparsely, then idle until recovery is done; returns the tokens the
    host restores, the seconds charged to the budget and the tokens the slices ran."""
    model, draft = models
    clock = VirtualClock()
    settings = RecoverySettings(
        budget_pct=pct, budget_window_s=window_s, slice_tokens=slice_tokens, idle_steps=1,
        publish_policy="always", models={MODEL_ID: ModelSettings(enabled=True)},
    )
    plugin = RecoveryPlugin(settings, clock=clock, control_socket=False)
    host = MockHost(make_plugin_manager([plugin], settings=settings, entry_points_too=False))
    engine = host.add_engine(
        "e", model=model, draft_model=draft, model_id=MODEL_ID, block_size=block_size,
        prefill_step=slice_tokens, sparse_threshold=64, pool_blocks=8192,
    )
    try:
        host.submit("e", prompt, sparse=True, max_tokens=1)
        host.run_until_idle()
        plugin.budget.reset_share()
        while plugin.status()["engines"]["e"]["jobs"]:
            answers = engine.offer_idle_step()
            if any(a is True for a in answers):
                continue
            delays = [a for a in answers if isinstance(a, float) and a > 0]
            if not delays:
                break
            clock.advance(min(delays))
        charged = float(plugin.budget.snapshot()["charged_s"])
        ran = int(plugin.status()["engines"]["e"]["counters"]["tokens_run"])
        restored = engine.prefix_cache.fetch("bench-probe", prompt).tokens
        engine.prefix_cache.release("bench-probe")
        return int(restored), charged, ran
    finally:
        plugin.close()
        mx.clear_cache()


def run_efficiency_bench(
    budgets: Sequence[tuple[float, float]] = ((5.0, 1.0), (10.0, 10.0), (50.0, 10.0)),
    *, tokens: int = 2048, block_size: int = 256, slice_tokens: int = 512, repeats: int = 2,
    models: tuple[Any, Any] | None = None, progress: Callable[[str], None] = print,
) -> list[EfficiencyRow]:
    if models is None:
        models = (
            load_tiny_model(cached_model_dir(BENCH_TARGET))[0],
            load_tiny_model(cached_model_dir(BENCH_DRAFT))[0],
        )
    prompt = [(31 * i + 7) % 256 for i in range(tokens)]
    plain_prefill_rate(models[0], prompt[:slice_tokens], slice_tokens)  # warm-up
    rows = [EfficiencyRow(pct, window, block_size, 0.0) for pct, window in budgets]
    for repeat in range(repeats):
        for row in rows:
            rate = plain_prefill_rate(models[0], prompt, slice_tokens)
            committed, charged, ran = recover_once(
                models, prompt, pct=row.pct, window_s=row.window_s, block_size=block_size,
                slice_tokens=slice_tokens,
            )
            if charged <= 0 or ran <= 0:
                raise RuntimeError(f"no recovery ran at {row.pct:g} %: nothing measured")
            row.allowance_tokens = rate * row.window_s * row.pct / 100.0
            row.committed.append(committed)
            row.efficiencies.append(committed / (charged * rate))
            row.work_kept.append(committed / ran)
            progress(
                f"[{repeat + 1}/{repeats}] {row.pct:g} % of {row.window_s:g} s: committed {committed} "
                f"in {charged:.2f} s charged ({ran} run); plain rate {rate:.0f} tok/s; "
                f"efficiency {row.efficiencies[-1]:.3f}"
            )
    return rows


def format_rows(rows: Sequence[EfficiencyRow]) -> str:
    from mlx_recovery_plugin.runner.blas import describe

    lines = [
        f"BLAS: {describe()}",
        "efficiency = committed tokens / (charged s x plain dense rate); goal >= 0.8",
        f"{'budget':>7} {'window s':>8} {'allowance tok':>13} {'block':>5} | efficiency: median [min, max]"
        " | committed / run",
    ]
    for r in rows:
        lines.append(
            f"{r.pct:>6g}% {r.window_s:>8g} {r.allowance_tokens:>13.0f} {r.block_size:>5} | {r.efficiency} | "
            f"{min(r.work_kept):.3f}"
        )
    return "\n".join(lines)


def _run(args: argparse.Namespace) -> int:
    maybe_reexec(args)
    budgets = tuple((float(p), float(w)) for p, w in (spec.split("/") for spec in args.budgets))
    rows = run_efficiency_bench(
        budgets, tokens=args.tokens, block_size=args.block, slice_tokens=args.slice_tokens,
        repeats=args.repeats, progress=lambda line: print(line, file=sys.stderr, flush=True),
    )
    print(format_rows(rows))
    return 0


def add_parser(subparsers: argparse._SubParsersAction) -> None:
    p = subparsers.add_parser("efficiency", help="committed tokens per charged second against the dense rate")
    p.add_argument("--budgets", nargs="+", default=["5/1", "10/10", "50/10"], metavar="PCT/WINDOW_S",
                   help="budget share and window pairs (default: 5/1 10/10 50/10)")
    p.add_argument("--tokens", type=int, default=2048, help="tokens of the recovered prompt")
    p.add_argument("--block", type=int, default=256, help="cache block size")
    p.add_argument("--slice-tokens", type=int, default=512)
    p.add_argument("--repeats", type=int, default=2)
    add_openblas_flag(p)
    p.set_defaults(func=_run)
