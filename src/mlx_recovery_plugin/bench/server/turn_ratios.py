"""Later turns with recovery against the same turns with sparse on, and which of them a
queue did not touch.

In a concurrent session a turn's time to first token measures the host's queue as much
as the turn: two turns that arrive together are served in either order, and the second
waits for the first whichever arm it is. A turn that **ran alone** had no other request
in flight from its sending to its first token; where the same turn ran alone in both
arms, the ratio of the two times is the turn's own, with no queue in it. In a session of
one conversation every turn runs alone.

Where the recovery arm took sparse on's arrivals (``--arrivals sparse-on``), a turn it
sent when sparse on sent it **arrived alike**: the same requests were in flight at its
arrival in both arms, save what either arm's own speed changed. Its ratio may include a
queue, but one both arms were dealt the same way.

Turns that **queued together** (each in flight while another waited for its first
token, directly or through a third) are one queue; the host serves a queue's turns in
an order of its own, so a turn's place in it is not recovery's doing. Where the same
turns formed a queue in both arms, the ratio of the queue's summed times to first token
is recovery's effect on them with the order taken out (a queue of one is a turn that
ran alone).

A later turn the recovery arm restored **as far as sparse off** (the same cached tokens)
ran the same dense append over the same prefix in both arms, over blocks recovery
published in one and over the host's own in the other: the ratio of the two is what
restoring published blocks costs the host, beside everything else the arms differ in.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Protocol


class Turn(Protocol):
    turn: int
    label: str
    cached_tokens: int
    ttft_s: float
    sent_s: float | None
    done_s: float | None


def timed_on_one_clock(steps: Sequence[Turn]) -> bool:
    """Whether every step says when it was sent and when it ended (concurrent sessions)."""
    return all(s.sent_s is not None and s.done_s is not None for s in steps)


def in_flight_while_waiting(steps: Sequence[Turn]) -> list[list[int]] | None:
    """Per step: the other steps (by index) in flight between its sending and its first
    token (None for a session whose requests were not timed on one clock)."""
    if not timed_on_one_clock(steps):
        return None
    beside = []
    for i, s in enumerate(steps):
        start, first = float(s.sent_s or 0.0), float(s.sent_s or 0.0) + s.ttft_s
        beside.append([j for j, o in enumerate(steps)
                       if j != i and float(o.sent_s or 0.0) < first and float(o.done_s or 0.0) > start])
    return beside


def ran_alone(steps: Sequence[Turn]) -> list[bool]:
    """Per step: no other request was in flight between its sending and its first token
    (True for every step of a session whose requests were not timed on one clock)."""
    beside = in_flight_while_waiting(steps)
    return [True] * len(steps) if beside is None else [not others for others in beside]


# A turn sent within this of the other arm's sending arrived alike (the threads wake on
# time to a few milliseconds; an answer that came later moves a turn by seconds).
SAME_ARRIVAL_S = 0.5


def arrived_alike(on: Sequence[Turn], rec: Sequence[Turn]) -> list[bool]:
    """Per step: recovery sent it within :data:`SAME_ARRIVAL_S` of sparse on's sending
    (False for every step of a session whose requests were not timed on one clock)."""
    return [a.sent_s is not None and b.sent_s is not None and abs(b.sent_s - a.sent_s) <= SAME_ARRIVAL_S
            for a, b in zip(on, rec)]


def later_turn_ratios(on: Sequence[Turn], rec: Sequence[Turn], alone_only: bool = False,
                      alike_only: bool = False) -> list[float]:
    """Each later turn's time with recovery over its time with sparse on (the same turn of
    the same conversation); ``alone_only``: only turns that ran alone in both arms;
    ``alike_only``: only turns that arrived alike."""
    keep = [a and b for a, b in zip(ran_alone(on), ran_alone(rec))] if alone_only else [True] * len(rec)
    if alike_only:
        keep = [k and a for k, a in zip(keep, arrived_alike(on, rec))]
    return [c.ttft_s / max(b.ttft_s, 1e-9) for b, c, k in zip(on, rec, keep) if k and (c.turn > 1 or c.label)]


def first_turn_ratios(on: Sequence[Turn], rec: Sequence[Turn]) -> list[float]:
    """Each conversation's first turn with recovery over its time with sparse on. Nothing
    of the conversation could be restored yet (other conversations' slices may have run
    before it), so these ratios spread by what the two arms differ in besides recovery:
    the machine's drift, which arm ran first. A later turn's ratio is read against them."""
    return [c.ttft_s / max(b.ttft_s, 1e-9) for b, c in zip(on, rec) if c.turn == 1 and not c.label]


def restored_vs_off_ratios(off: Sequence[Turn], rec: Sequence[Turn]) -> list[float]:
    """Each later turn the recovery arm restored as far as sparse off did (the same
    cached tokens, some): its time over sparse off's. Over 126 such turns in the oMLX
    runs under ``examples/`` the median read 1.01, the quartiles 0.96 and 1.09."""
    return [c.ttft_s / max(b.ttft_s, 1e-9) for b, c in zip(off, rec)
            if (c.turn > 1 or c.label) and c.cached_tokens > 0 and c.cached_tokens == b.cached_tokens]


def queues(steps: Sequence[Turn]) -> list[frozenset[int]]:
    """The steps (by index) that queued together, one set per queue, each step in one
    (a step of a session whose requests were not timed on one clock is a queue alone)."""
    beside = in_flight_while_waiting(steps)
    if beside is None:
        return [frozenset([i]) for i in range(len(steps))]
    owner = list(range(len(steps)))

    def root(i: int) -> int:
        while owner[i] != i:
            owner[i] = owner[owner[i]]
            i = owner[i]
        return i

    for i, others in enumerate(beside):
        for j in others:
            owner[root(i)] = root(j)
    groups: dict[int, set[int]] = {}
    for i in range(len(steps)):
        groups.setdefault(root(i), set()).add(i)
    return [frozenset(g) for g in groups.values()]


def same_queue_ratios(on: Sequence[Turn], rec: Sequence[Turn]) -> list[tuple[int, float]]:
    """Per queue of later turns that the same turns formed in both arms (and the first
    turns queued with them): its size and its summed time with recovery over sparse
    on's (none for a session whose requests were not timed on one clock)."""
    if not (timed_on_one_clock(on) and timed_on_one_clock(rec)):
        return []
    theirs = set(queues(on))
    out = []
    for group in queues(rec):
        if group in theirs and any(rec[i].turn > 1 or rec[i].label for i in group):
            out.append((len(group), sum(rec[i].ttft_s for i in group)
                        / max(sum(on[i].ttft_s for i in group), 1e-9)))
    return out


def count_later_turns(rec: Sequence[Turn]) -> int:
    return sum(1 for c in rec if c.turn > 1 or c.label)
