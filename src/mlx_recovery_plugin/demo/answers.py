"""What the sparse route does to answers, and what recovery gives back: per turn and per
arm, the greedy answer, whether it equals sparse off's (the dense answer), and the share
of later turns that do. Reads a finished :class:`~.report.DemoReport`; no state.

Answers are deterministic for a given model, session and route; only the recovery arm's
progress (how much it had restored by each turn) can differ between repeats, so every
share counts each repeat's later turns.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass

from .report import ARM_TITLES, ARMS, DemoReport


@dataclass(slots=True, frozen=True)
class Share:
    same: int  # later turns whose answer equals sparse off's
    of: int
    restored_same: int  # the same, among later turns that restored a cached prefix
    restored_of: int
    correct: int  # later turns whose answer holds the room number the passage gives

    @staticmethod
    def ratio(num: int, den: int) -> float | None:
        return num / den if den else None


def shares(report: DemoReport) -> dict[str, Share]:
    out: dict[str, Share] = {}
    for arm in ARMS:
        same = of = restored_same = restored_of = correct = 0
        for run in report.repeats:
            dense = run["sparse_off"].turns
            for t, row in enumerate(run[arm].turns):
                if t == 0:
                    continue
                equal = row.output_tokens == dense[t].output_tokens
                of += 1
                same += equal
                if row.cached_tokens > 0:
                    restored_of += 1
                    restored_same += equal
                expected = report.expected[t] if t < len(report.expected) else ""
                correct += bool(expected) and expected in row.answer
        out[arm] = Share(same, of, restored_same, restored_of, correct)
    return out


def _pct(num: int, den: int) -> str:
    return f"{num}/{den} ({100 * num / den:.0f} %)" if den else "0/0"


def format_answers(report: DemoReport, width: int = 48) -> str:
    """Per turn and arm (first repeat): route, cached tokens, time to first token, whether
    the answer equals sparse off's, and the answer; then the shares over every repeat."""
    run = report.repeats[0]
    lines = ["", "answers (first repeat; '=' equals sparse off's answer):"]
    for t in range(len(run[ARMS[0]].turns)):
        expected = report.expected[t] if t < len(report.expected) else ""
        lines.append(f"turn {t + 1}" + (f" (the passage says room {expected})" if expected else ""))
        dense = run["sparse_off"].turns[t].output_tokens
        for arm in ARMS:
            row = run[arm].turns[t]
            mark = "=" if row.output_tokens == dense else "x"
            answer = row.answer.replace("\n", " ")[:width]
            lines.append(
                f"  {ARM_TITLES[arm]:<21} {mark} {row.route:<6} cached {row.cached_tokens:>6} "
                f"ttft {row.ttft_s:7.3f}s  {answer!r}"
            )
    lines.append("")
    for arm, share in shares(report).items():
        lines.append(
            f"later turns, {ARM_TITLES[arm]:<21}: dense answer {_pct(share.same, share.of)}; "
            f"where a prefix was restored {_pct(share.restored_same, share.restored_of)}; "
            f"right room {_pct(share.correct, share.of)}"
        )
    return "\n".join(lines)


def answers_json(report: DemoReport) -> dict:
    return {
        "expected": report.expected,
        "shares": {
            arm: asdict(s) | {"dense_share": Share.ratio(s.same, s.of), "restored_dense_share": Share.ratio(s.restored_same, s.restored_of)}
            for arm, s in shares(report).items()
        },
    }
