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
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Protocol


class Turn(Protocol):
    turn: int
    label: str
    ttft_s: float
    sent_s: float | None
    done_s: float | None


def ran_alone(steps: Sequence[Turn]) -> list[bool]:
    """Per step: no other request was in flight between its sending and its first token
    (True for every step of a session whose requests were not timed on one clock)."""
    if any(s.sent_s is None or s.done_s is None for s in steps):
        return [True] * len(steps)
    alone = []
    for i, s in enumerate(steps):
        start, first = float(s.sent_s or 0.0), float(s.sent_s or 0.0) + s.ttft_s
        alone.append(not any(
            j != i and float(o.sent_s or 0.0) < first and float(o.done_s or 0.0) > start
            for j, o in enumerate(steps)
        ))
    return alone


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


def count_later_turns(rec: Sequence[Turn]) -> int:
    return sum(1 for c in rec if c.turn > 1 or c.label)
