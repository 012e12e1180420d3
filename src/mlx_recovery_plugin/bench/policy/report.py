"""What ``bench policy`` prints and writes: the cells, the confusion matrix, the goals."""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from ...testing.tiny_model import TinyModelSpec
from .cells import Cell
from .measure import PAYS_BY, SLOWER_MARGIN, CellResult

TRUTHS = ("pays", "close", "loses")


@dataclass(slots=True)
class PolicyReport:
    results: list[CellResult] = field(default_factory=list)
    blas: str = ""
    budget_pct: float = 50.0
    repeats: int = 2
    threshold: int = 0

    def confusion(self) -> dict[str, dict[str, int]]:
        """Truth (rows) against what the policy did (published or not)."""
        table = {truth: {"published": 0, "not_published": 0} for truth in TRUTHS}
        for r in self.results:
            table[r.truth]["published" if r.published else "not_published"] += 1
        return table

    def goals(self) -> dict[str, bool]:
        return {
            f"no wrong stand-down where the full prefix pays by {PAYS_BY:g}x or more": not any(
                r.truth == "pays" and r.verdict in ("stood_down", "paused") for r in self.results),
            f"no publication that makes a turn slower than {SLOWER_MARGIN:g}x the sparse route": not any(
                r.recovery_cached > 0 and r.turn_ratio > SLOWER_MARGIN for r in self.results),
            f"no next turn with recovery above {SLOWER_MARGIN:g}x the sparse route": not any(
                r.slow_turn for r in self.results),
        }

    def as_dict(self) -> dict[str, Any]:
        return {
            "blas": self.blas, "budget_pct": self.budget_pct, "repeats": self.repeats,
            "threshold": self.threshold,
            "cells": [r.as_dict() for r in self.results],
            "confusion": self.confusion(), "goals": self.goals(),
            "wrong": sum(r.wrong for r in self.results),
            "wrong_cost_s": sum(r.cost_s for r in self.results),
        }

    def write_json(self, path: str | Path) -> None:
        Path(path).write_text(json.dumps(self.as_dict(), indent=1))

    @classmethod
    def read_json(cls, path: str | Path) -> PolicyReport:
        """A report written by :meth:`write_json`, its verdicts judged again by this
        version's rules from the measured times."""
        data = json.loads(Path(path).read_text())
        report = cls(blas=data["blas"], budget_pct=data["budget_pct"], repeats=data["repeats"],
                     threshold=data["threshold"])
        for c in data["cells"]:
            s = c["shape"]
            shape = TinyModelSpec(arch="llama", hidden_size=s["hidden"], num_layers=s["layers"],
                                  intermediate_size=s["ffn"], num_heads=s["heads"], num_kv_heads=s["kv_heads"],
                                  seed=s["seed"])
            report.results.append(CellResult(
                cell=Cell(shape, c["context"], c["append"], c["loaded"], c.get("load_at", "first")),
                dense_append_s=c["dense_append_s"], sparse_rerun_s=c["sparse_rerun_s"],
                dense_cached=c["dense_cached"], recovery_turn_s=c["recovery_turn_s"],
                recovery_cached=c["recovery_cached"], verdict=c["verdict"], policy=c["policy"],
                tokens_run=c["tokens_run"], tokens_recovered=c["tokens_recovered"], idle_s=c["idle_s"],
                sparse_after_s=c.get("sparse_after_s"), sparse_before_s=c.get("sparse_before_s"),
                load_at_turns=tuple(c.get("load_at_turns", (False, False))),
                recovery_turns_s=c.get("recovery_turns_s", [c["recovery_turn_s"]]),
                recovery_turns_cached=c.get("recovery_turns_cached", [c["recovery_cached"]]),
            ))
        return report


def format_report(report: PolicyReport) -> str:
    lines = [
        f"bench policy: {len(report.results)} cells, budget {report.budget_pct:g} %, "
        f"host threshold {report.threshold}, BLAS {report.blas}",
        "truth: the host's cached dense append of the next turn against its sparse rerun, "
        f"{report.repeats} pair(s) alternating, on a quiet machine (loaded, in cells loaded at the next turn)",
        "",
        f"{'cell':<44} {'dense s':>8} {'sparse s':>8} {'pays':>5} {'range':>11} {'truth':>6} "
        f"{'verdict':>10} {'rec s':>7} {'rec/sp':>6} {'cached':>7} {'kept':>5} {'cost s':>6}",
    ]
    for r in report.results:
        lo, hi = r.spread
        kept = f"{r.committed_share:.2f}" if r.committed_share is not None else "-"
        mark = " !" if r.wrong else ""
        lines.append(
            f"{r.cell.label:<44} {r.dense_s:8.2f} {r.sparse_s:8.2f} {r.pays:5.2f} {lo:5.2f}-{hi:<5.2f} "
            f"{r.truth:>6} {r.verdict:>10} {r.recovery_turn_s:7.2f} {r.turn_ratio:6.2f} "
            f"{r.recovery_cached:7d} {kept:>5} {r.cost_s:6.2f}{mark}"
        )
    around = [r for r in report.results if r.drift is not None]
    if around:
        lines += ["", "the sparse rerun right before and after the turn with recovery (rec/sp is the turn "
                  "against their mean), and their mean against the truth's reruns:"]
        lines += [f"  {r.cell.label}: {r.sparse_before_s:.2f} s and {r.sparse_after_s:.2f} s, "
                  f"{r.drift:.2f}x the truth's {r.sparse_s:.2f} s" for r in around]
    held_back = [r for r in report.results if r.policy.get("job_reason")]
    if held_back:
        lines += ["", "why a job stood down or paused (its own reason):"]
        lines += [f"  {r.cell.label}: {r.verdict}: {r.policy['job_reason']}" for r in held_back]
    factors = [r for r in report.results if r.policy.get("host_append_factor_after") is not None]
    if factors:
        lines += ["", "the host's dense append over the slices' estimate, measured on the next turn:"]
        lines += [f"  {r.cell.label}: {r.policy['host_append_factor_after']:.2f}" for r in factors]
    lines += ["", "confusion (truth x what the policy did):"]
    for truth, row in report.confusion().items():
        lines.append(f"  {truth:<6} published {row['published']:3d}   not published {row['not_published']:3d}")
    wrong = [r for r in report.results if r.wrong]
    lines.append(f"wrong verdicts: {len(wrong)}, costing {sum(r.cost_s for r in wrong):.2f} s of next-turn time")
    for r in wrong:
        lines.append(f"  {r.cell.label}: {r.verdict} ({r.policy.get('job_reason') or r.policy.get('reason')})")
        at_request = r.policy.get("at_request")
        if at_request:
            lines.append(f"    at the turn's arrival: {at_request['verdict']} ({at_request['reason']})")
    for goal, met in report.goals().items():
        lines.append(f"{'met' if met else 'MISSED'}: {goal}")
    return "\n".join(lines)
