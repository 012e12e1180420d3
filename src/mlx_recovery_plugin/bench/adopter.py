"""``mlx-recovery bench adopter``: reuse on the workloads the adopter is for, and what a
decision costs.

Each workload runs on the mock host's detached-set store four times: without the
adopter as a host that declines every partial match (``plain``: no real host does this,
it is a floor, not a baseline), without the adopter as a host that matches whole blocks
(``blocks``: a partial match restores the whole blocks of the shared prefix, as oMLX's
paged cache does), and with the adopter in clone mode (the default) and in trim mode.
Every request's *block-floor optimum* is computed from every entry stored so far (a
whole-entry match counts whole, anything else floored to the block), so each arm is
compared with the best any block-floored adopter could do, and the adopter's gain is
stated, signed, against the ``blocks`` arm: what a real host already gets without it.

The decision cost is the hook call alone (describe, plan, clone-and-pin) with 1,000
stored entries; the host's own match and the state reconstruction are not timed, and
the goal applies to the median (the tail mostly measures a busy machine). The store
here is bookkeeping only (no model states), so the bench needs no model.
"""

from __future__ import annotations

import argparse
import gc
import json
import random
import statistics
import threading
import time
from collections.abc import Iterator, Sequence
from dataclasses import asdict, dataclass, field
from typing import Any, Literal

from ..adopter.plugin import AdopterPlugin
from ..events import PrefixLookup
from ..plugins import make_plugin_manager
from ..settings import RecoverySettings
from ..testing.block_pool import BlockPool
from ..testing.detached_store import Admission, DetachedSet, DetachedStore
from .openblas import add_openblas_flag, maybe_reexec

ARMS = ("plain", "clone", "trim", "blocks")
ADOPTER_ARMS = ("clone", "trim")
BASELINE_ARM = "blocks"  # what a host that matches whole blocks (oMLX) gets without the adopter
ARM_NOTES = {
    "plain": "no adopter; declines every partial match (no real host does: a floor, not a baseline)",
    "blocks": "no adopter; a partial match restores the whole blocks of the shared prefix (as oMLX)",
    "clone": "adopter, clone-and-pin of the block-floored prefix (default)",
    "trim": "adopter, take-and-trim of the entry (one-shot)",
}
DECISION_GOAL_US = 1000.0


@dataclass(slots=True, frozen=True)
class WorkloadRow:
    workload: str
    arm: str
    requests: int
    cached_tokens: int
    optimum_tokens: int

    @property
    def reached_optimum(self) -> bool:
        return self.cached_tokens == self.optimum_tokens


@dataclass(slots=True, frozen=True)
class Gain:
    """An adopter arm's cached tokens against the ``blocks`` arm's on one workload."""

    workload: str
    arm: str
    cached_tokens: int
    baseline_tokens: int

    @property
    def tokens(self) -> int:
        """Signed: negative when the adopter arm cached less than whole-block matching."""
        return self.cached_tokens - self.baseline_tokens


@dataclass(slots=True, frozen=True)
class DecisionCost:
    entries: int
    lookups: int
    adopted: int
    median_us: float
    p99_us: float
    max_us: float


@dataclass(slots=True)
class AdopterBenchReport:
    block_size: int
    rows: list[WorkloadRow] = field(default_factory=list)
    decision: DecisionCost | None = None

    @property
    def goals_met(self) -> bool:
        optimum = all(r.reached_optimum for r in self.rows if r.arm == "clone")
        fast = self.decision is None or self.decision.median_us < DECISION_GOAL_US
        return optimum and fast

    def gains(self) -> list[Gain]:
        """Per workload and adopter arm, the signed gain over the ``blocks`` arm (empty
        when that arm did not run)."""
        base = {r.workload: r.cached_tokens for r in self.rows if r.arm == BASELINE_ARM}
        return [
            Gain(r.workload, r.arm, r.cached_tokens, base[r.workload])
            for r in self.rows
            if r.arm in ADOPTER_ARMS and r.workload in base
        ]

    def to_dict(self) -> dict[str, Any]:
        return {
            "block_size": self.block_size,
            "arms": {a: ARM_NOTES[a] for a in dict.fromkeys(r.arm for r in self.rows)},
            "workloads": [{**asdict(r), "reached_optimum": r.reached_optimum} for r in self.rows],
            "gains_vs_blocks": [{**asdict(g), "tokens": g.tokens} for g in self.gains()],
            "decision_cost": asdict(self.decision) if self.decision else None,
            "goals_met": self.goals_met,
        }

    def format_table(self) -> str:
        lines = [f"cached tokens per workload (block {self.block_size}; optimum = block floor)"]
        lines.append(f"  {'workload':<11} {'arm':<6} {'requests':>8} {'cached':>8} {'optimum':>8}  reached")
        for r in self.rows:
            lines.append(
                f"  {r.workload:<11} {r.arm:<6} {r.requests:>8} {r.cached_tokens:>8} "
                f"{r.optimum_tokens:>8}  {'yes' if r.reached_optimum else 'no'}"
            )
        lines.append("arms:")
        lines.extend(f"  {a:<6} {ARM_NOTES[a]}" for a in dict.fromkeys(r.arm for r in self.rows))
        gains = self.gains()
        if gains:
            lines.append(f"adopter gain over '{BASELINE_ARM}' (cached tokens, signed):")
            for g in gains:
                share = f"{g.tokens / g.baseline_tokens:+.1%}" if g.baseline_tokens else "n/a"
                lines.append(
                    f"  {g.workload:<11} {g.arm:<6} {g.tokens:+8d} ({g.cached_tokens} vs {g.baseline_tokens}; {share})"
                )
        else:
            lines.append(f"adopter gain over '{BASELINE_ARM}': not measured (arm not run)")
        if self.decision:
            d = self.decision
            lines.append(
                f"decision cost at {d.entries} stored entries, {d.lookups} lookups ({d.adopted} adopted): "
                f"median {d.median_us:.1f} us, p99 {d.p99_us:.1f} us, max {d.max_us:.1f} us "
                f"(goal < {DECISION_GOAL_US:.0f} us)"
            )
        lines.append(f"goals met: {'yes' if self.goals_met else 'no'}")
        return "\n".join(lines)


# -- workloads -------------------------------------------------------------------------
Step = tuple[Literal["admit", "finish", "burst"], Any]


def _tokens(rng: random.Random, n: int) -> list[int]:
    return [rng.randrange(256) for _ in range(n)]


def _siblings(rng: random.Random, system: int, n: int) -> Iterator[Step]:
    shared = _tokens(rng, system)
    for i in range(n):
        prompt = [*shared, 300 + i, *_tokens(rng, 40)]
        yield "admit", prompt
        yield "finish", [*prompt, *_tokens(rng, 24), 257]


def _multi_turn(rng: random.Random, system: int, turns: int) -> Iterator[Step]:
    conversation = _tokens(rng, system)
    for _ in range(turns):
        conversation += [258, *_tokens(rng, 60), 259]
        yield "admit", list(conversation)
        reply = _tokens(rng, 48)
        # The server fed the final EOS; the next turn renders the reply without it.
        yield "finish", [*conversation, *reply, 257]
        conversation += reply


def _burst(rng: random.Random, system: int, n: int) -> Iterator[Step]:
    shared = _tokens(rng, system)
    yield "finish", [*shared, 299, *_tokens(rng, 40)]
    yield "burst", [[*shared, 300 + i, *_tokens(rng, 40)] for i in range(n)]


WORKLOADS = {"siblings": _siblings, "multi-turn": _multi_turn, "burst": _burst}


def _block_floor_optimum(stored: Sequence[tuple[int, ...]], prompt: Sequence[int], block: int) -> int:
    prompt = tuple(prompt)
    best = 0
    for entry in stored:
        limit = min(len(entry), len(prompt) - 1)
        n = next((i for i in range(limit) if entry[i] != prompt[i]), limit)
        best = max(best, n if n == len(entry) else n - n % block)
    return best


def _make_store(arm: str, block_size: int, pool_blocks: int) -> tuple[DetachedStore, AdopterPlugin]:
    settings = RecoverySettings(
        adopter_enabled=arm in ADOPTER_ARMS, adopter_mode="trim" if arm == "trim" else "clone"  # type: ignore[arg-type]
    )
    plugin = AdopterPlugin(settings=settings)
    pm = make_plugin_manager([plugin], settings=RecoverySettings(), entry_points_too=False)
    partial: Literal["decline", "whole_blocks"] = "whole_blocks" if arm == "blocks" else "decline"
    return DetachedStore(BlockPool(pool_blocks, block_size), pm=pm, partial=partial), plugin


def _admit_concurrently(store: DetachedStore, prompts: Sequence[Sequence[int]]) -> list[Admission]:
    results: list[Admission | None] = [None] * len(prompts)
    barrier = threading.Barrier(len(prompts))

    def one(i: int) -> None:
        barrier.wait()
        results[i] = store.admit(f"burst-{i}", prompts[i])

    threads = [threading.Thread(target=one, args=(i,)) for i in range(len(prompts))]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    return [r for r in results if r is not None]


def run_workload(name: str, arm: str, *, block_size: int, system_tokens: int, requests: int, seed: int) -> WorkloadRow:
    """Run one workload on one arm; the steps are the same for every arm (same seed)."""
    store, _ = _make_store(arm, block_size, pool_blocks=4096)
    stored: list[tuple[int, ...]] = []
    cached = optimum = admitted = 0
    for kind, payload in WORKLOADS[name](random.Random(seed), system_tokens, requests):
        if kind == "finish":
            store.store(payload)
            stored.append(tuple(payload))
            continue
        prompts = [payload] if kind == "admit" else payload
        optimum += sum(_block_floor_optimum(stored, p, block_size) for p in prompts)
        if kind == "admit":
            admissions = [store.admit(f"r{admitted}", payload)]
        else:
            admissions = _admit_concurrently(store, payload)
        admitted += len(admissions)
        cached += sum(a.cached_tokens for a in admissions)
        for admission in admissions:
            if admission.handle is not None:
                store.release(admission.handle)
    return WorkloadRow(name, arm, admitted, cached, optimum)


def measure_decision_cost(
    *, entries: int = 1000, lookups: int = 2000, entry_tokens: int = 512, block_size: int = 16, seed: int = 0
) -> DecisionCost:
    """Time the hook (describe, plan, clone-and-pin) on partial and whole matches."""
    rng = random.Random(seed)
    blocks_per_entry = -(-entry_tokens // block_size)
    store, plugin = _make_store("clone", block_size, entries * blocks_per_entry + 64)
    stems = [_tokens(rng, entry_tokens) for _ in range(16)]
    for _ in range(entries):
        stem = rng.choice(stems)
        keep = rng.randrange(block_size, entry_tokens)
        store.store([*stem[:keep], *_tokens(rng, entry_tokens - keep)])
    stored = store.entries()
    # The stored entries are long-lived; keep the collector from rescanning them, so a
    # full collection of the bench's own heap is not counted as decision time.
    gc.collect()
    gc.freeze()
    try:
        samples, adopted = _timed_lookups(store, plugin, stored, lookups, block_size, rng)
    finally:
        gc.unfreeze()
    samples.sort()
    p99 = samples[min(len(samples) - 1, int(0.99 * len(samples)))]
    return DecisionCost(entries, lookups, adopted, statistics.median(samples), p99, samples[-1])


def _timed_lookups(
    store: DetachedStore,
    plugin: AdopterPlugin,
    stored: Sequence[DetachedSet],
    lookups: int,
    block_size: int,
    rng: random.Random,
) -> tuple[list[float], int]:
    """Microseconds per hook call, and how many calls adopted."""
    samples: list[float] = []
    adopted = 0
    for i in range(lookups):
        entry = rng.choice(stored)
        cut = rng.randrange(1, entry.length + 1)
        prompt = [*entry.tokens[:cut], 1000 + i % 7, *_tokens(rng, 8)]
        found, matched = store.match(prompt)
        assert found is not None
        lookup = PrefixLookup(
            "bench", f"q{i}", found.set_id, found.length, matched, block_size, entry=found, store=store
        )
        start = time.perf_counter_ns()
        decision = plugin.prefix_lookup(lookup)
        samples.append((time.perf_counter_ns() - start) / 1000.0)
        if decision is not None and decision.handle is not None:
            adopted += 1
            store.release(decision.handle)
    return samples, adopted


def run_adopter_bench(
    *,
    block_size: int = 16,
    system_tokens: int = 1000,
    requests: int = 8,
    entries: int = 1000,
    lookups: int = 2000,
    entry_tokens: int = 512,
    seed: int = 0,
    arms: Sequence[str] = ARMS,
) -> AdopterBenchReport:
    """Every workload on every arm, then the decision cost (``entries=0`` skips it)."""
    unknown = set(arms) - set(ARMS)
    if unknown:
        raise ValueError(f"unknown arm(s) {sorted(unknown)}; valid: {', '.join(ARMS)}")
    report = AdopterBenchReport(block_size)
    for name in WORKLOADS:
        for arm in arms:
            report.rows.append(
                run_workload(
                    name, arm, block_size=block_size, system_tokens=system_tokens, requests=requests, seed=seed
                )
            )
    if entries > 0:
        report.decision = measure_decision_cost(
            entries=entries, lookups=lookups, entry_tokens=entry_tokens, block_size=block_size, seed=seed
        )
    return report


# -- command line ----------------------------------------------------------------------
def add_parser(subparsers: argparse._SubParsersAction) -> None:
    """Register ``adopter`` under ``mlx-recovery bench``."""
    p = subparsers.add_parser(
        "adopter", help="partial-prefix adopter: cached tokens per workload, decision cost"
    )
    p.add_argument("--host", choices=("mock", "mlx_lm"), default="mock",
                   help="mock: the detached-set store; mlx_lm: mlx-lm's own server over HTTP (tiny models)")
    p.add_argument("--block-size", type=int, default=None, help="cache block, tokens (default 16; mlx_lm: 64)")
    p.add_argument("--system-tokens", type=int, default=1000, help="shared prefix length (default 1000)")
    p.add_argument("--requests", type=int, default=8, help="requests (or turns) per workload (default 8)")
    p.add_argument("--entries", type=int, default=1000, help="stored entries for the decision cost (0: skip)")
    p.add_argument("--lookups", type=int, default=2000, help="timed lookups (default 2000)")
    p.add_argument("--entry-tokens", type=int, default=512, help="tokens per stored entry (default 512)")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--json", action="store_true", help="machine-readable output")
    p.add_argument("--urllib", action="store_true", help="mlx_lm: plain urllib instead of the OpenAI SDK")
    p.add_argument("--out", default="", help="mlx_lm: also write the JSON report here")
    p.add_argument("--untouched-pairs", type=int, default=7,
                   help="mlx_lm: pairs timing first tokens of fresh prompts, adapter on / off (0: skip; default 7)")
    p.add_argument("--untouched-tokens", type=int, default=1500,
                   help="mlx_lm: tokens per fresh prompt in the untouched timing (default 1500)")
    p.add_argument("--long-run", type=int, default=0, metavar="N",
                   help="mlx_lm: also serve N documents, each with a sibling, under a snapshot budget of a few "
                        "snapshots; the bytes held after every request, evictions, the floor restored (0: skip)")
    p.add_argument("--long-run-snapshots", type=int, default=4, metavar="K",
                   help="mlx_lm: the long run's budget, in snapshots of the model (default 4)")
    p.add_argument("--plot", metavar="FILE",
                   help="mlx_lm: draw cached tokens per workload, snapshot bytes over the KV saved and the long run "
                        "as a PNG")
    add_openblas_flag(p)
    p.set_defaults(func=_cmd_bench_adopter)


def _cmd_bench_adopter(args: argparse.Namespace) -> int:
    if args.host == "mlx_lm":
        from .adopter_mlx_lm import command

        maybe_reexec(args)  # its models prefill float32 (the mock store runs no model)

        args.block_size = args.block_size or 64
        return command(args)
    report = run_adopter_bench(
        block_size=args.block_size or 16,
        system_tokens=args.system_tokens,
        requests=args.requests,
        entries=args.entries,
        lookups=args.lookups,
        entry_tokens=args.entry_tokens,
        seed=args.seed,
    )
    print(json.dumps(report.to_dict(), indent=1) if args.json else report.format_table())
    return 0
