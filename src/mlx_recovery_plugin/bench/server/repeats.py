"""Repeats of a session: sparse on and sparse on + recovery served again, side by side.

One run per arm cannot tell recovery's effect from the machine's drift or, in a
concurrent session, from which turn happened to queue behind which: a first turn a
second slower can let the next conversation's turn in ahead of its own first token and
double both. ``--repeats K`` serves the pair K times, alternating which arm goes first
(sparse on always first with ``--arrivals sparse-on``, as the recovery arm waits for its
send times), each concurrent repeat on another seeded schedule (the same schedule for both arms of a
pair; ``--one-schedule``: every pair on the first), and reports each pair's ratio of summed time to first token with their median and
range. Beside it, the seconds the host itself spent in its sparse route (its log: the
draft's scoring and the sparse prefill) tell the host's own work from waiting: a ratio of
host seconds near 1 with a ratio of TTFT far from it is queueing, not slower prefill.
Where every pair served the same turns (the sequential sessions, or concurrent ones on
one schedule) each later turn's median ratio over the pairs is reported too, and each
arm's later turns in one pair against sparse on's in another: sparse on against itself is
how far one turn on one route spreads on the machine, the floor the recovery arm's ratios
are read against.

Sparse off runs once per session (the first schedule): it is the baseline of the oracle
and the best reachable, not part of the pair's comparison.
"""

from __future__ import annotations

import statistics
from collections.abc import Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from .turn_ratios import first_turn_ratios, later_turn_ratios, same_queue_ratios
from .work_shares import committed_share

if TYPE_CHECKING:
    from .report import ArmRun


@dataclass(slots=True)
class RepeatPair:
    """One repeat: both arms on schedule ``seed``; ``first``: the arm served first."""

    seed: int
    first: str
    sparse_on: ArmRun
    sparse_recovery: ArmRun

    def ratio(self) -> float:
        """Recovery's summed time to first token over sparse on's."""
        return self.sparse_recovery.ttft_sum / max(self.sparse_on.ttft_sum, 1e-9)

    def host_sparse_ratio(self) -> float | None:
        """Recovery's host sparse-route seconds over sparse on's (None: the log cannot tell)."""
        on, rec = self.sparse_on.host_sparse_s, self.sparse_recovery.host_sparse_s
        if on is None or rec is None or on <= 0:
            return None
        return rec / on

    def worst_later_turn(self, alone_only: bool = False) -> float | None:
        """The largest ratio of a later turn's time with recovery to sparse on's, same turn
        (``alone_only``: of the turns no queue touched in either arm)."""
        ratios = later_turn_ratios(self.sparse_on.steps, self.sparse_recovery.steps, alone_only)
        return max(ratios) if ratios else None

    def recovered_tokens(self) -> int | None:
        status = self.sparse_recovery.end_status
        return None if not status else int(status.get("tokens_recovered") or 0)

    def summary(self) -> dict[str, Any]:
        return {
            "seed": self.seed, "first": self.first,
            "sparse_on_s": round(self.sparse_on.ttft_sum, 3),
            "sparse_recovery_s": round(self.sparse_recovery.ttft_sum, 3),
            "ratio": round(self.ratio(), 4),
            "host_sparse_s": {"sparse_on": self.sparse_on.host_sparse_s,
                              "sparse_recovery": self.sparse_recovery.host_sparse_s},
            "host_sparse_ratio": _round(self.host_sparse_ratio()),
            "tokens_recovered": self.recovered_tokens(),
            "worst_later_turn_vs_on": _round(self.worst_later_turn()),
            "worst_alone_later_turn_vs_on": _round(self.worst_later_turn(alone_only=True)),
            "committed_share": _round(committed_share(self.sparse_recovery.end_status)),
            "settled_committed_share": _round(committed_share(self.sparse_recovery.settled_status)),
        }


def _round(x: float | None) -> float | None:
    return None if x is None else round(x, 4)


def spread(values: Sequence[float]) -> dict[str, float] | None:
    """Median, min and max of ``values`` (None when there are none)."""
    if not values:
        return None
    return {"median": round(statistics.median(values), 4), "min": round(min(values), 4),
            "max": round(max(values), 4), "n": len(values)}


def later_turns(runs: Sequence[ArmRun]) -> dict[str, float] | None:
    """Median, min and max of the later turns' time to first token over ``runs``: where
    turns queue, one turn against the same turn of the other arm says more about the
    queue than about either arm, and the arms' spreads of later turns compare fairly."""
    return spread([s.ttft_s for run in runs for s in run.steps if s.turn > 1 or s.label])


def _turn_tables(pairs: Sequence[RepeatPair]) -> list[dict[tuple[str, int, str], Any]] | None:
    """Each pair's sparse-on and recovery steps by (conversation, turn, label), in that
    order, pair after pair (a concurrent session's arms may list them in another order);
    None where the pairs served different turns (concurrent repeats each on their own
    schedule, unless ``--one-schedule``)."""
    tables = []
    for p in pairs:
        for run in (p.sparse_on, p.sparse_recovery):
            table = {(s.conversation, s.turn, s.label): s for s in run.steps}
            if len(table) != len(run.steps):
                return None
            tables.append(table)
    if any(t.keys() != tables[0].keys() for t in tables):
        return None
    return tables


def turn_medians(pairs: Sequence[RepeatPair]) -> list[float] | None:
    """Each later turn's ratio of recovery to sparse on, its median over the pairs. A turn
    that one pair served slowly by the machine's drift does not decide it; one that
    recovery makes slower in every pair does. None where the pairs served different turns
    (:func:`_turn_tables`) or there is no later turn."""
    tables = _turn_tables(pairs) if len(pairs) >= 2 else None
    if tables is None:
        return None
    medians = [statistics.median(rec[key].ttft_s / max(on[key].ttft_s, 1e-9)
                                 for on, rec in zip(tables[0::2], tables[1::2]))
               for key in tables[0] if key[1] > 1 or key[2]]
    return medians or None


def across_pairs(pairs: Sequence[RepeatPair], arm: str) -> list[list[float]] | None:
    """``arm``'s later turns in one pair over sparse on's same turns in another, for every
    ordered two of the pairs: one list of ratios each. With ``arm`` "sparse_on" it is
    sparse on against itself, served as far apart as the pairs are: how far the same turn
    on the same route spreads on this machine, the floor a later turn's ratio with
    recovery is read against (the 1.1x goal means nothing where sparse on against itself
    exceeds it); with "sparse_recovery", recovery against sparse on at the same distances,
    so the two compare fairly. None with fewer than two pairs or where the pairs served
    different turns."""
    tables = _turn_tables(pairs) if len(pairs) >= 2 else None
    if tables is None:
        return None
    ons, others = tables[0::2], tables[0::2] if arm == "sparse_on" else tables[1::2]
    keys = [key for key in tables[0] if key[1] > 1 or key[2]]
    return [[others[i][key].ttft_s / max(ons[j][key].ttft_s, 1e-9) for key in keys]
            for i in range(len(pairs)) for j in range(len(pairs)) if i != j]


def _across_summary(pairs: Sequence[RepeatPair], arm: str) -> dict[str, Any] | None:
    """:func:`across_pairs`: the spread of each comparison's worst later turn, and how many
    of all the later-turn ratios are above 1.1x."""
    lists = across_pairs(pairs, arm)
    if not lists or not all(lists):
        return None
    ratios = [r for ratios in lists for r in ratios]
    return {"worst_later_turn": spread([max(ratios) for ratios in lists]),
            "later_turns": len(ratios), "later_turns_above_1_1": sum(r > 1.1 for r in ratios)}


def worst_turn_median(pairs: Sequence[RepeatPair]) -> float | None:
    """The largest of :func:`turn_medians` (None where there are none)."""
    medians = turn_medians(pairs)
    return max(medians) if medians else None


def repeats_summary(pairs: Sequence[RepeatPair]) -> dict[str, Any] | None:
    """Every pair's figures and the spread of their ratios (None without repeats)."""
    if len(pairs) < 2:
        return None
    host = [r for r in (p.host_sparse_ratio() for p in pairs) if r is not None]
    alone = [r for p in pairs for r in later_turn_ratios(p.sparse_on.steps, p.sparse_recovery.steps, alone_only=True)]
    alike = [r for p in pairs if p.sparse_recovery.arrivals_from == "sparse_on"
             for r in later_turn_ratios(p.sparse_on.steps, p.sparse_recovery.steps, alike_only=True)]
    queued = [q for p in pairs for q in same_queue_ratios(p.sparse_on.steps, p.sparse_recovery.steps)]
    first = [r for p in pairs for r in first_turn_ratios(p.sparse_on.steps, p.sparse_recovery.steps)]
    medians = turn_medians(pairs)
    return {
        "pairs": [p.summary() for p in pairs],
        "ratio": spread([p.ratio() for p in pairs]),
        "host_sparse_ratio": spread(host),
        "first_turns_vs_on": spread(first),
        "later_turns_s": {"sparse_on": later_turns([p.sparse_on for p in pairs]),
                          "sparse_recovery": later_turns([p.sparse_recovery for p in pairs])},
        "worst_later_turn_median_vs_on": _round(max(medians)) if medians else None,
        "later_turn_medians": len(medians or ()),
        "later_turn_medians_above_1_1": sum(m > 1.1 for m in medians or ()),
        # Each arm's later turns in one pair against sparse on's in another.
        "across_pairs": {"sparse_on": _across_summary(pairs, "sparse_on"),
                         "sparse_recovery": _across_summary(pairs, "sparse_recovery")},
        "worst_alone_later_turn_vs_on": _round(max(alone)) if alone else None,
        "alone_later_turns": len(alone),
        "worst_alike_later_turn_vs_on": _round(max(alike)) if alike else None,
        "alike_later_turns": len(alike),
        "alike_later_turns_above_1_1": sum(r > 1.1 for r in alike),
        "worst_same_queue_vs_on": _round(max(r for _, r in queued)) if queued else None,
        "same_queues": len(queued),
        "same_queues_above_1_1": sum(r > 1.1 for _, r in queued),
        "committed_share": spread([c for p in pairs if (c := committed_share(p.sparse_recovery.end_status)) is not None]),
        "settled_committed_share": spread([c for p in pairs
                                           if (c := committed_share(p.sparse_recovery.settled_status)) is not None]),
    }


def repeat_lines(pairs: Sequence[RepeatPair]) -> list[str]:
    """The report's lines for the repeats (none for a single run)."""
    summary = repeats_summary(pairs)
    if summary is None:
        return []
    ratio = summary["ratio"]
    first = ("sparse on first in each, the recovery arm on its arrivals"
             if all(p.sparse_recovery.arrivals_from == "sparse_on" for p in pairs) else "alternating which arm goes first")
    lines = [f"repeats ({ratio['n']} pairs, {first}): recovery / sparse on, summed TTFT, "
             f"median {ratio['median']:.2f}x [{ratio['min']:.2f}, {ratio['max']:.2f}]"]
    host = summary["host_sparse_ratio"]
    if host is not None:
        lines[0] += (f"; the host's own sparse-route seconds median {host['median']:.2f}x "
                     f"[{host['min']:.2f}, {host['max']:.2f}]")
    turns = summary["later_turns_s"]
    if turns["sparse_on"] and turns["sparse_recovery"]:
        on, rec = turns["sparse_on"], turns["sparse_recovery"]
        lines.append(f"later turns over all repeats, s: sparse on median {on['median']:.2f} (max {on['max']:.2f}), "
                     f"on + recovery median {rec['median']:.2f} (max {rec['max']:.2f})")
    first = summary["first_turns_vs_on"]
    if first is not None:
        lines.append(f"first turns (nothing of theirs to restore yet), recovery / sparse on: median "
                     f"{first['median']:.2f}x [{first['min']:.2f}, {first['max']:.2f}] over {first['n']}: how far the "
                     "arms differ without a restored turn, the floor the later turns below are read against")
    worst = summary["worst_later_turn_median_vs_on"]
    if worst is not None:
        lines.append(f"worst later turn against sparse on, each turn's median over the pairs: {worst:.2f}x "
                     f"({summary['later_turn_medians']} later turns, {summary['later_turn_medians_above_1_1']} "
                     "with a median above 1.1x)")
    aa, ab = summary["across_pairs"]["sparse_on"], summary["across_pairs"]["sparse_recovery"]
    if aa is not None and ab is not None:
        lines.append(
            "across pairs (one pair's turn over sparse on's same turn in another), worst later turn per comparison: "
            f"sparse on against itself median {aa['worst_later_turn']['median']:.2f}x "
            f"[{aa['worst_later_turn']['min']:.2f}, {aa['worst_later_turn']['max']:.2f}], "
            f"{aa['later_turns_above_1_1']} of {aa['later_turns']} later turns above 1.1x; on + recovery "
            f"median {ab['worst_later_turn']['median']:.2f}x [{ab['worst_later_turn']['min']:.2f}, "
            f"{ab['worst_later_turn']['max']:.2f}], {ab['later_turns_above_1_1']} of {ab['later_turns']} above 1.1x")
    if summary["worst_alone_later_turn_vs_on"] is not None:
        lines.append(f"worst later turn against sparse on of those no other request touched in either arm: "
                     f"{summary['worst_alone_later_turn_vs_on']:.2f}x ({summary['alone_later_turns']} such turns "
                     "over the pairs)")
    if summary["worst_alike_later_turn_vs_on"] is not None:
        lines.append(f"worst later turn against sparse on of those sent when sparse on sent them: "
                     f"{summary['worst_alike_later_turn_vs_on']:.2f}x ({summary['alike_later_turns']} such turns "
                     f"over the pairs, {summary['alike_later_turns_above_1_1']} above 1.1x)")
    if summary["worst_same_queue_vs_on"] is not None:
        lines.append(f"worst queue against sparse on, summed, of those the same turns formed in both arms: "
                     f"{summary['worst_same_queue_vs_on']:.2f}x ({summary['same_queues']} such queues over the "
                     f"pairs, {summary['same_queues_above_1_1']} above 1.1x)")
    kept, settled = summary["committed_share"], summary["settled_committed_share"]
    if kept is not None:
        lines.append(f"committed / run over the pairs: at the end {kept['min']:.2f}-{kept['max']:.2f}"
                     + ("" if settled is None else f", {pairs[0].sparse_recovery.settle_s:g} s after the last answer "
                        f"{settled['min']:.2f}-{settled['max']:.2f}"))
    for p in pairs:
        h = p.host_sparse_ratio()
        lines.append(
            f"  seed {p.seed} ({p.first.replace('_', ' ')} first): sparse on {p.sparse_on.ttft_sum:.2f} s, "
            f"on + recovery {p.sparse_recovery.ttft_sum:.2f} s, {p.ratio():.2f}x"
            + ("" if h is None else f"; host sparse seconds {h:.2f}x")
            + ("" if p.recovered_tokens() is None else f"; recovered {p.recovered_tokens():,} tokens")
        )
    return lines
