"""``python tests/lab order``: does the order recovery works several conversations in matter?

One engine on the mock host, two conversations, the same schedule served by two arms
that differ only in how the recovery service picks its next job:

* **default**: the plugin as shipped (``EngineRecovery._most_worth_it``): once a gap
  between two turns was seen, the job due back first that can still be finished before
  it is; else the job in hand (the last slice's), else the most recently served one,
  unless another is expected to save ``CLEARLY_MORE`` times as much per token of work
  still to run;
* **recency**: pure recency, by setting ``recovery.service.CLEARLY_MORE`` to infinity and
  ``FINISH_IN_HAND`` and ``DUE_FIRST`` off for that arm only (put back after it).

The schedule is one a server with several agents sees: conversation A (long) is served
sparse and mostly recovered in the idle gap that follows; conversation B arrives and is
served sparse; the next idle gap is enough to finish A's remainder but not all of B; A
comes back first, then B. What matters to a real server is that a partial prefix is
worth little: its next turn's uncached part is then under the sparse threshold and would
be prefilled densely over a long context, so the publish policy holds such blocks back
and the turn takes the sparse route with nothing cached, while a whole prefix makes it a
short cached dense append.

The gaps are sized from this machine's own dense rate (a plain chunked prefill of A and of
B, timed before the arms), so the schedule keeps its shape on a faster or slower machine:
gap 1 = ``a_share`` of A's dense time, gap 2 = the rest of A plus ``b_share`` of B's, gap
3 = ``between_share`` of B's. Each gap is idle time recovery gets whole (budget 100 %; at
50 % a think time twice as long): think time is skipped by a virtual clock while slices
run for real and count against it, as in the demo. Per arm: each returning turn's cached tokens and
time to first token, their sum, and the tokens each conversation had restorable when A
came back; the ratio default / recency of the sums, per repeat, arms alternating. The
sparse-on (no recovery) and sparse-off arms are served beside them as baselines.
"""

from __future__ import annotations

import argparse
import math
import random
import time
from collections.abc import Callable, Iterator, Sequence
from contextlib import contextmanager
from dataclasses import dataclass, field
from typing import Any

from mlx_recovery_plugin.bench.balance import measure_or_say_why
from mlx_recovery_plugin.bench.openblas import add_openblas_flag, maybe_reexec
from mlx_recovery_plugin.bench.server.models import parse_target, shape_text
from mlx_recovery_plugin.demo.arms import ENGINE_ID, ArmSession, Models, ServeConfig
from mlx_recovery_plugin.demo.session import Turn
from mlx_recovery_plugin.recovery import service
from mlx_recovery_plugin.testing.tiny_model import BENCH_DRAFT, TinyModelSpec, cached_model_dir, load_tiny_model

from .runner import BenchHandle, bench_tokens, plain_prefill
from .stats import Spread, spread

# Heavy enough beside the 128x2 draft that the mock's sparse route costs about a quarter of a
# dense prefill (0.23x here; the real server's bench pair 0.30x): on the 1024x2 target used
# before, the draft's scoring alone cost as much as a dense prefill, so a partial prefix paid
# in proportion and no order could show. One arm takes about half a minute.
ORDER_TARGET = TinyModelSpec(
    arch="llama", hidden_size=2048, num_layers=4, num_heads=16, num_kv_heads=4,
    intermediate_size=5632, seed=21, extra=(("head_dim", 128),),
)
ORDERINGS = ("default", "recency")
BASELINES = ("sparse_on", "sparse_off")

# How the lab's arms map onto the demo's.
_DEMO_ARM = {"default": "sparse_recovery", "recency": "sparse_recovery", "sparse_on": "sparse_on",
             "sparse_off": "sparse_off"}


@dataclass(slots=True, frozen=True)
class OrderSchedule:
    """Sizes in tokens; gaps as fractions of the conversations' dense prefill time."""

    a_tokens: int = 4096
    b_tokens: int = 3584
    append_tokens: int = 256
    # Scaled with the prompts from the real server's 8,192 under ~9-12k-token prompts: a
    # first turn is sparse, and a later turn over a partial prefix is prefilled densely.
    sparse_threshold: int = 3072
    a_share: float = 0.75  # of A's dense time, the idle time after A's first turn
    b_share: float = 0.3  # of B's dense time, what the gap after B adds to A's remainder
    between_share: float = 0.1  # of B's dense time, the idle time between A's and B's return
    block_size: int = 256
    # The whole of each gap goes to recovery (one window of an hour at 100 %): the gaps are
    # the idle time recovery gets, so a 50 % budget is a think time twice as long.
    budget_pct: float = 100.0
    budget_window_s: float = 3600.0
    seed: int = 0

    def __post_init__(self) -> None:
        assert self.a_tokens > self.sparse_threshold and self.b_tokens > self.sparse_threshold
        assert 0 < self.a_share < 1 and 0 < self.b_share < 1
        assert self.append_tokens < self.sparse_threshold


@dataclass(slots=True)
class ReturnTurn:
    """A conversation's returning turn in one arm."""

    name: str
    prompt_tokens: int
    cached_tokens: int
    ttft_s: float
    route: str | None


@dataclass(slots=True)
class ArmRun:
    arm: str
    returns: list[ReturnTurn] = field(default_factory=list)
    first_turns_s: float = 0.0
    # Tokens of each conversation's last prompt the host restored when A came back.
    restorable_at_a_return: dict[str, int] = field(default_factory=dict)
    # Each conversation's job then, as "committed+held/end" (and whether it stood down or why it paused).
    jobs_at_a_return: dict[str, str] = field(default_factory=dict)
    tokens_recovered: int = 0
    wall_s: float = 0.0

    @property
    def returns_s(self) -> float:
        return sum(r.ttft_s for r in self.returns)


Idle = Callable[[ArmSession, float], None]


def think_seconds(session: ArmSession, seconds: float) -> None:
    """The demo's think time: idle steps within ``seconds`` of virtual time."""
    session.think(seconds)


@contextmanager
def ordering(name: str) -> Iterator[None]:
    """The job order of one arm: the plugin's own, or pure recency (see the module docstring)."""
    saved = service.CLEARLY_MORE, service.FINISH_IN_HAND, service.DUE_FIRST
    if name == "recency":
        service.CLEARLY_MORE, service.FINISH_IN_HAND, service.DUE_FIRST = math.inf, False, False
    try:
        yield
    finally:
        service.CLEARLY_MORE, service.FINISH_IN_HAND, service.DUE_FIRST = saved


def order_target(text: str) -> TinyModelSpec:
    """``--target``: a shape as ``bench server`` takes it, float32 random weights seeded as the default."""
    try:
        return parse_target(text, base=ORDER_TARGET)
    except ValueError as exc:
        raise argparse.ArgumentTypeError(str(exc)) from None


def conversations(schedule: OrderSchedule) -> dict[str, tuple[tuple[int, ...], tuple[int, ...]]]:
    """Each conversation's first prompt and its returning prompt (the first plus an append)."""
    rng = random.Random(schedule.seed)
    out = {}
    for name, n in (("A", schedule.a_tokens), ("B", schedule.b_tokens)):
        first = tuple(rng.randrange(256) for _ in range(n))
        out[name] = (first, first + tuple(rng.randrange(256) for _ in range(schedule.append_tokens)))
    return out


def restorable(session: ArmSession, prompt: Sequence[int]) -> int:
    """Tokens of ``prompt`` the host's prefix cache restores now."""
    cache = session.engine.prefix_cache
    probe = "order-restorable-probe"
    try:
        return int(cache.fetch(probe, tuple(prompt)).tokens)
    finally:
        cache.release(probe)


def jobs_by_conversation(session: ArmSession, lengths: dict[str, int]) -> dict[str, str]:
    """The recovery jobs on the book, by the conversation whose first prompt they hold."""
    if session.plugin is None:
        return {}
    engine = session.plugin.service(ENGINE_ID)
    if engine is None:
        return {}
    out = {}
    for job in engine.snapshot().jobs:
        name = next((n for n, length in lengths.items() if length == job.tokens), f"job {job.job_id}")
        out[name] = f"{job.committed}+{job.held_tokens}/{job.publish_end}" + (
            " stood down" if job.stood_down else f" paused ({job.paused})" if job.paused else "")
    return out


def serve_config(schedule: OrderSchedule, slice_tokens: int | None = None, budget_pct: float | None = None,
                 budget_window_s: float | None = None) -> ServeConfig:
    return ServeConfig(
        model_id="lab-order", block_size=schedule.block_size, prefill_step=schedule.block_size,
        sparse_threshold=schedule.sparse_threshold, max_tokens=1,
        budget_pct=schedule.budget_pct if budget_pct is None else budget_pct,
        budget_window_s=schedule.budget_window_s if budget_window_s is None else budget_window_s,
        slice_tokens=slice_tokens,
    )


def run_arm(
    arm: str, models: Models, schedule: OrderSchedule, gaps: tuple[float, float, float], *,
    config: ServeConfig | None = None, idle: Idle = think_seconds,
) -> ArmRun:
    """Serve the schedule once: A, gap 1, B, gap 2, A again, gap 3, B again."""
    convs = conversations(schedule)
    session = ArmSession(_DEMO_ARM[arm], models, config or serve_config(schedule))
    run = ArmRun(arm)
    started = time.perf_counter()
    try:
        with ordering(arm):
            gap1, gap2, gap3 = gaps
            for index, (name, gap) in enumerate((("A", gap1), ("B", gap2))):
                first = convs[name][0]
                run.first_turns_s += session.serve(Turn(index, first, len(first))).ttft_s
                idle(session, gap)
            run.restorable_at_a_return = {name: restorable(session, convs[name][0]) for name in convs}
            run.jobs_at_a_return = jobs_by_conversation(session, {name: len(p[0]) for name, p in convs.items()})
            for index, (name, gap) in enumerate((("A", gap3), ("B", 0.0)), start=2):
                first, again = convs[name]
                row = session.serve(Turn(index, again, len(again) - len(first)))
                run.returns.append(ReturnTurn(name, len(again), row.cached_tokens, row.ttft_s, row.route))
                if gap > 0:
                    idle(session, gap)
        if session.plugin is not None:
            run.tokens_recovered = int(session.plugin.status()["process"].get("tokens_recovered", 0))
    finally:
        session.close()
    run.wall_s = time.perf_counter() - started
    return run


def dense_seconds(model: Any, n: int, chunk: int) -> float:
    """A plain chunked dense prefill of ``n`` tokens (mlx-lm's own loop), timed."""
    started = time.perf_counter()
    plain_prefill(BenchHandle("lab-order", model), bench_tokens(n), chunk)
    return time.perf_counter() - started


def schedule_gaps(schedule: OrderSchedule, a_dense_s: float, b_dense_s: float) -> tuple[float, float, float]:
    """Idle seconds of the three gaps (see the module docstring)."""
    s = schedule
    gap1 = s.a_share * a_dense_s
    gap2 = (1 - s.a_share) * a_dense_s + s.b_share * b_dense_s
    return gap1, gap2, s.between_share * b_dense_s


@dataclass(slots=True)
class OrderReport:
    schedule: OrderSchedule
    target: TinyModelSpec
    gaps: tuple[float, float, float]
    dense_s: tuple[float, float]
    balance_line: str
    runs: list[dict[str, ArmRun]]

    def ratios(self) -> list[float]:
        return [r["default"].returns_s / r["recency"].returns_s for r in self.runs]

    def ratio(self) -> Spread:
        return spread(self.ratios())


def run_order_bench(
    schedule: OrderSchedule = OrderSchedule(), repeats: int = 3, baselines: bool = True,
    models: Models | None = None, progress: Callable[[str], None] = print, target: TinyModelSpec = ORDER_TARGET,
) -> OrderReport:
    if models is None:
        model, tokenizer = load_tiny_model(cached_model_dir(target))
        draft, _ = load_tiny_model(cached_model_dir(BENCH_DRAFT))
        models = Models(model, tokenizer, draft)
    balance_line = measure_or_say_why(models.model, schedule.a_tokens)[1]
    progress(balance_line)
    dense_seconds(models.model, schedule.block_size, schedule.block_size)  # warm-up
    a_s = dense_seconds(models.model, schedule.a_tokens, schedule.block_size)
    b_s = dense_seconds(models.model, schedule.b_tokens, schedule.block_size)
    gaps = schedule_gaps(schedule, a_s, b_s)
    progress(f"dense prefill A {a_s:.2f} s, B {b_s:.2f} s; gaps {gaps[0]:.1f} / {gaps[1]:.1f} / {gaps[2]:.1f} s")
    arms = [*ORDERINGS, *(BASELINES if baselines else ())]
    runs: list[dict[str, ArmRun]] = []
    for repeat in range(repeats):
        order = arms if repeat % 2 == 0 else list(reversed(arms))
        runs.append({})
        for arm in order:
            run = run_arm(arm, models, schedule, gaps)
            runs[-1][arm] = run
            progress(f"repeat {repeat + 1}/{repeats} {arm:<10} " + ", ".join(
                f"{r.name}: {r.cached_tokens} cached / {r.ttft_s:.3f} s ({r.route})" for r in run.returns
            ) + f"; sum {run.returns_s:.3f} s; wall {run.wall_s:.1f} s")
    return OrderReport(schedule, target, gaps, (a_s, b_s), balance_line, runs)


def format_report(report: OrderReport) -> str:
    from mlx_recovery_plugin.runner.blas import describe

    s = report.schedule
    lines = [
        f"BLAS: {describe()}",
        f"model: {report.target.label} ({shape_text(report.target)}, float32, random weights), draft {BENCH_DRAFT.label}; {report.balance_line}",
        f"schedule: A {s.a_tokens} tokens sparse, gap {report.gaps[0]:.1f} s; B {s.b_tokens} sparse, gap "
        f"{report.gaps[1]:.1f} s; A +{s.append_tokens}, gap {report.gaps[2]:.1f} s; B +{s.append_tokens}. "
        f"Sparse threshold {s.sparse_threshold} uncached tokens, block {s.block_size}, budget {s.budget_pct:g} % "
        f"of {s.budget_window_s:g} s windows; "
        f"gaps (idle seconds recovery gets) from the dense prefill of A ({report.dense_s[0]:.2f} s) and B "
        f"({report.dense_s[1]:.2f} s): gap 1 = {s.a_share:g} A, gap 2 = {1 - s.a_share:g} A + {s.b_share:g} B, "
        f"gap 3 = {s.between_share:g} B",
        "recency arm: recovery.service.CLEARLY_MORE set to inf, FINISH_IN_HAND and DUE_FIRST off (pure recency); "
        "default: the plugin as shipped",
        "",
        f"{'arm':<10} | {'A back: cached / ttft s':>24} | {'B back: cached / ttft s':>24} | {'sum s':>7} | "
        f"{'restorable at A back (A, B)':>27} | {'jobs then: committed+held/end':<32} | first turns s",
    ]
    for arm in [a for a in (*ORDERINGS, *BASELINES) if a in report.runs[0]]:
        for n, runs in enumerate(report.runs):
            run = runs[arm]
            a, b = run.returns
            lines.append(
                f"{arm if n == 0 else '':<10} | {f'{a.cached_tokens} / {a.ttft_s:.3f}':>24} | "
                f"{f'{b.cached_tokens} / {b.ttft_s:.3f}':>24} | {run.returns_s:>7.3f} | "
                f"{'{A}, {B}'.format(**run.restorable_at_a_return):>27} | "
                f"{'; '.join(f'{k} {v}' for k, v in sorted(run.jobs_at_a_return.items())) or '-':<32} | "
                f"{run.first_turns_s:.3f}"
            )
        sums = spread([r[arm].returns_s for r in report.runs])
        lines.append(f"{'':<10}   returning turns' sum: {sums}")
    lines.append("")
    lines.append(f"default / recency, sum of the returning turns' time to first token: {report.ratio()}")
    if "sparse_on" in report.runs[0]:
        for arm in ORDERINGS:
            r = spread([x[arm].returns_s / x["sparse_on"].returns_s for x in report.runs])
            lines.append(f"{arm} / sparse on: {r}")
    return "\n".join(lines)


def _run(args: argparse.Namespace) -> int:
    maybe_reexec(args)
    schedule = OrderSchedule(a_tokens=args.a_tokens, b_tokens=args.b_tokens, b_share=args.b_share, seed=args.seed)
    report = run_order_bench(schedule, repeats=args.repeats, baselines=not args.no_baselines, target=args.target)
    print(format_report(report))
    return 0


def add_parser(subparsers: argparse._SubParsersAction) -> None:
    p = subparsers.add_parser("order", help="several conversations: the plugin's job order against pure recency")
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--a-tokens", type=int, default=4096)
    p.add_argument("--b-tokens", type=int, default=3584)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--b-share", type=float, default=OrderSchedule().b_share,
                   help="of B's dense time, what gap 2 adds to A's remainder (default %(default)s)")
    p.add_argument("--target", metavar="HxLxFFNxQxKVxD", type=order_target, default=ORDER_TARGET,
                   help="the target's shape, as bench server's --target (default: "
                        f"{shape_text(ORDER_TARGET)})")
    p.add_argument("--no-baselines", action="store_true", help="skip the sparse-on and sparse-off arms")
    add_openblas_flag(p)
    p.set_defaults(func=_run)
