"""When each conversation is expected back, for the order the jobs are worked in.

Agents on one server come back after a think time: the gap from one turn of a
conversation to its next. The engine keeps the last gaps of every conversation it served
and expects each conversation back the median gap after its last turn. Of the jobs whose
recovery can still be finished before their conversation is due back, the one due first
is worked first (earliest deadline first): the conversation served least recently
returns first when agents think alike, where the most recently served job, worked first
before, finished the conversation due last (bench server, three conversations at once:
C's job got 1,024 tokens while B's was finished, and C came back 9 s before B with its
prefix 5,376 of 10,102 tokens done). A job that cannot be finished in time is left for
the rest of the idle time: the order then falls back to the job in hand and the
expected saving (:meth:`~.service.EngineRecovery._most_worth_it`).

The median across conversations, not each one's own: a conversation has one or two gaps
at most when it matters, and agents with the same task think alike. A turn is taken when
the host tells of it first: its prefill for a conversation the engine knows (a dense turn
over a restored prefix too; before, only sparse turns counted, and a conversation whose
prefix was restored taught nothing), else its sparse route for a new one. A gap so runs
from one turn's first token to the next one's, and includes the next turn's own
prefill: a conversation is expected back that much late, which errs towards a job
looking feasible when it is not quite (it is then finished soon after the turn, for the
next).

Threads: owned by one engine's recovery service and changed on its engine thread (the
host's hooks, the idle steps); read and changed under the service's lock, as the status
reads it from any thread.
"""

from __future__ import annotations

import statistics
from collections import deque
from collections.abc import Callable, Iterable

from .jobs import RecoveryJob

# Gaps remembered across the engine's conversations.
SEEN_GAPS = 16


class ReturnTimes:
    """The last turn of each job's conversation and the gaps seen between turns."""

    def __init__(self) -> None:
        self._last: dict[int, tuple[float, str | None]] = {}
        self._gaps: deque[float] = deque(maxlen=SEEN_GAPS)

    def turn(self, job_id: int, now: float, request_id: str | None = None) -> None:
        """``job_id``'s conversation was served at ``now``, by ``request_id``: a request the
        host tells of twice (at its first token, then with its door's share) is one turn."""
        before = self._last.get(job_id)
        if before is not None and request_id is not None and before[1] == request_id:
            return
        if before is not None and now > before[0]:
            self._gaps.append(now - before[0])
        self._last[job_id] = (now, request_id)

    def expected_gap(self) -> float | None:
        """The median gap between two turns of a conversation; None before any was seen."""
        return statistics.median(self._gaps) if self._gaps else None

    def due(self, job_id: int) -> float | None:
        """When ``job_id``'s conversation is expected back (the service's clock); None
        before any gap was seen, or for a conversation not served since this engine
        knew it."""
        gap = self.expected_gap()
        last = self._last.get(job_id)
        if gap is None or last is None:
            return None
        return last[0] + gap

    def keep_only(self, job_ids: Iterable[int]) -> None:
        """Forget the conversations whose jobs have left the book (the gaps stay)."""
        live = set(job_ids)
        for job_id in [j for j in self._last if j not in live]:
            del self._last[job_id]


def due_first(
    jobs: Iterable[RecoveryJob],
    *,
    now: float,
    due: Callable[[RecoveryJob], float | None],
    work_s: Callable[[RecoveryJob], float | None],
) -> RecoveryJob | None:
    """Of ``jobs``, the one whose conversation is due back first among those whose
    remaining work (``work_s``: wall seconds at the budget) ends before it is due; None
    where none is known to (due time or cost unknown, or none fits)."""
    fitting: list[tuple[float, RecoveryJob]] = []
    for job in jobs:
        when = due(job)
        if when is None:
            continue
        work = work_s(job)
        if work is not None and now + work <= when:
            fitting.append((when, job))
    if not fitting:
        return None
    return min(fitting, key=lambda pair: pair[0])[1]
