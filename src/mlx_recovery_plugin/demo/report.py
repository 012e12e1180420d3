"""Results of the three-arm demo: records, the printed table, JSON and the plot."""

from __future__ import annotations

import json
import statistics
from collections.abc import Sequence
from dataclasses import asdict, dataclass, field
from pathlib import Path

ARMS = ("sparse_off", "sparse_on", "sparse_recovery")
ARM_TITLES = {
    "sparse_off": "sparse off",
    "sparse_on": "sparse on",
    "sparse_recovery": "sparse on + recovery",
}


@dataclass(slots=True)
class TurnResult:
    turn: int
    prompt_tokens: int
    cached_tokens: int
    ttft_s: float
    # Served tokens of the previous prompt the host held no reusable state for once this
    # turn was looked up (read after it: recovery may publish at the turn's arrival).
    debt_tokens: int
    route: str
    output_tokens: list[int] = field(default_factory=list)  # the greedy answer
    answer: str = ""  # the answer as text


@dataclass(slots=True)
class ArmResult:
    arm: str
    turns: list[TurnResult] = field(default_factory=list)
    recovered_tokens: int = 0
    recovery_seconds: float = 0.0

    @property
    def foreground_s(self) -> float:
        return sum(t.ttft_s for t in self.turns)


@dataclass(slots=True)
class DemoReport:
    """One or more repeats of the same session, every arm alternating turn by turn."""

    model: str
    host: str
    blas: str
    block_size: int
    sparse_threshold: int
    think_time_s: float
    budget_pct: float
    repeats: list[dict[str, ArmResult]] = field(default_factory=list)
    # The target's cost balance at the session's longest context (bench/balance.py), and
    # its one line; None (and the line says why) when it could not be measured.
    balance: dict | None = None
    balance_line: str = "cost balance: not measured"
    # A recall session's (``--answers``): per turn, the room number the passage gives for
    # the item asked about ("" on the first turn); empty for the agent session.
    expected: list[str] = field(default_factory=list)

    def sparse_turns(self, arm: str) -> int:
        """Turns of ``arm`` the sparse route served, over every repeat."""
        return sum(t.route == "sparse" for r in self.repeats for t in r[arm].turns)

    @property
    def sparse_route_applied(self) -> bool:
        return any(self.sparse_turns(arm) for arm in ARMS if arm != "sparse_off")

    def sparse_note(self) -> str:
        """One line where the sparse route never applied (else empty): the arms then differ
        only by noise, and the ratios say nothing about the sparse route or recovery."""
        if self.sparse_route_applied:
            return ""
        longest = max(t.prompt_tokens for r in self.repeats for t in r[ARMS[0]].turns)
        return (
            f"THE SPARSE ROUTE NEVER APPLIED: no turn's uncached part was over the sparse threshold "
            f"({self.sparse_threshold:,} tokens; the longest prompt was {longest:,} tokens), so every arm "
            f"took the dense route, recovery had nothing to recover, and the ratios below compare "
            f"dense with dense"
        )

    def foreground(self, arm: str) -> list[float]:
        return [r[arm].foreground_s for r in self.repeats]

    def ratio(self, num: str, den: str) -> tuple[float, float, float]:
        """Median, min and max over repeats of foreground(num) / foreground(den)."""
        values = [r[num].foreground_s / r[den].foreground_s for r in self.repeats]
        return statistics.median(values), min(values), max(values)

    def median_turn(self, arm: str, turn: int) -> TurnResult:
        """One turn of one arm, each number the median over repeats (recovery's progress,
        and so cached tokens and debt, can differ between repeats)."""
        rows = [r[arm].turns[turn] for r in self.repeats]
        first = rows[0]
        return TurnResult(
            first.turn,
            first.prompt_tokens,
            int(statistics.median_low(t.cached_tokens for t in rows)),
            statistics.median(t.ttft_s for t in rows),
            int(statistics.median_high(t.debt_tokens for t in rows)),
            first.route,
        )

    def to_json(self) -> dict:
        out = {
            "model": self.model,
            "host": self.host,
            "blas": self.blas,
            "block_size": self.block_size,
            "sparse_threshold": self.sparse_threshold,
            "think_time_s": self.think_time_s,
            "budget_pct": self.budget_pct,
            "balance": self.balance,
            "balance_line": self.balance_line,
            "sparse_route_applied": self.sparse_route_applied,
            "sparse_turns": {arm: self.sparse_turns(arm) for arm in ARMS},
            "repeats": [
                {arm: asdict(result) | {"foreground_s": result.foreground_s} for arm, result in r.items()}
                for r in self.repeats
            ],
            "ratios": {},
        }
        for num, den in (("sparse_recovery", "sparse_off"), ("sparse_recovery", "sparse_on"), ("sparse_on", "sparse_off")):
            med, lo, hi = self.ratio(num, den)
            out["ratios"][f"{num}/{den}"] = {"median": med, "min": lo, "max": hi}
        if self.expected:
            from .answers import answers_json

            out["answers"] = answers_json(self)
        return out

    def write_json(self, path: str | Path) -> None:
        Path(path).write_text(json.dumps(self.to_json(), indent=1))


def format_table(report: DemoReport) -> str:
    arms = ARMS
    n_turns = len(report.repeats[0][arms[0]].turns)
    lines = [
        f"model {report.model} | host {report.host} | BLAS {report.blas} | block {report.block_size} "
        f"| sparse threshold {report.sparse_threshold} | think time {report.think_time_s:g}s "
        f"| recovery budget {report.budget_pct:g}% | repeats {len(report.repeats)}",
        report.balance_line,
        *([note] if (note := report.sparse_note()) else []),
        "",
        f"{'turn':>4} {'tokens':>7} | {'cached tokens':^22} | {'time to first token (s)':^26} | {'debt at lookup':^14}",
        f"{'':>4} {'':>7} | {'off':>6} {'on':>6} {'on+rec':>8} | {'off':>7} {'on':>7} {'on+rec':>10} | {'on':>6} {'on+rec':>7}",
    ]
    for t in range(n_turns):
        off, on, rec = (report.median_turn(a, t) for a in arms)
        lines.append(
            f"{t + 1:>4} {off.prompt_tokens:>7} | {off.cached_tokens:>6} {on.cached_tokens:>6} {rec.cached_tokens:>8} "
            f"| {off.ttft_s:>7.3f} {on.ttft_s:>7.3f} {rec.ttft_s:>10.3f} | {on.debt_tokens:>6} {rec.debt_tokens:>7}"
        )
    lines.append("")
    for arm in arms:
        fg = report.foreground(arm)
        lines.append(
            f"cumulative foreground, {ARM_TITLES[arm]:<21}: median {statistics.median(fg):8.3f} s "
            f"(min {min(fg):.3f}, max {max(fg):.3f})"
        )
    for num, den in (("sparse_recovery", "sparse_off"), ("sparse_recovery", "sparse_on"), ("sparse_on", "sparse_off")):
        med, lo, hi = report.ratio(num, den)
        lines.append(f"ratio {ARM_TITLES[num]} / {ARM_TITLES[den]}: {med:.3f} (min {lo:.3f}, max {hi:.3f})")
    if note:
        lines.append(note)
    rec = [r["sparse_recovery"] for r in report.repeats]
    lines.append(
        f"recovery: {statistics.median(r.recovered_tokens for r in rec):.0f} tokens recovered in "
        f"{statistics.median(r.recovery_seconds for r in rec):.2f} s of idle time per session (median)"
    )
    return "\n".join(lines)


def write_plot(report: DemoReport, path: str | Path) -> None:
    """Per-turn time to first token and cached tokens of the three arms, as a PNG."""
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError as exc:
        raise SystemExit(
            "--plot needs matplotlib: pip install 'mlx-recovery-plugin[plot]'"
        ) from exc
    n_turns = len(report.repeats[0][ARMS[0]].turns)
    turns = list(range(1, n_turns + 1))
    fig, (ax_t, ax_c) = plt.subplots(1, 2, figsize=(11, 4.2))
    for arm, marker in zip(ARMS, ("o", "s", "^")):
        rows: Sequence[TurnResult] = [report.median_turn(arm, t) for t in range(n_turns)]
        ax_t.plot(turns, [r.ttft_s for r in rows], marker=marker, label=ARM_TITLES[arm])
        ax_c.plot(turns, [r.cached_tokens for r in rows], marker=marker, label=ARM_TITLES[arm])
    ax_t.set(title="time to first token", xlabel="turn", ylabel="seconds")
    ax_c.set(title="cached tokens restored", xlabel="turn", ylabel="tokens")
    for ax in (ax_t, ax_c):
        ax.set_xticks(turns)
        ax.grid(alpha=0.3)
        ax.legend()
    balance = report.balance
    balance_note = (
        f"a token at {balance['context']:,} context costs {balance['ratio']:.2f}x one at 0 "
        f"({balance['reference_model']}: {balance['reference']:.2f}x)"
        if balance else "cost balance not measured"
    )
    blas = report.blas.split(" (")[0]  # the kind, without the library's path
    fig.suptitle(f"{report.model} on {report.host}, {blas}\n{balance_note}", fontsize=9)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
