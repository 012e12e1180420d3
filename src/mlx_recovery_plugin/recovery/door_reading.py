"""What the host's door costs when a conversation comes back on the sparse route.

oMLX scores a prompt with its draft model at its door before the sparse prefill, and
keeps that reading for the conversation's next turn. A rerun is then not free at the
door: the new tokens are read as on a first turn, and the tokens read before still cost
something (on the real server, re-scoring a 13,961-token prompt whose first 11,264 tokens
the draft had read took 2.7 s, where a first turn's 8,594 took 3.4 s: a token read before
cost 0.32-0.40 of a new one over four turns). Counting only the new tokens made the rerun
look up to ~1.5 s cheaper than it was, which only ever held publications back.

* A conversation's first sparse turn with a door time gives its door's rate per new token
  (:attr:`RouteMemory.fresh_door_rate <.judge.RouteMemory>`).
* Each later sparse turn of it says what a token read before cost, as a share of a new
  one; :class:`DoorReread` keeps the server's recent shares, and their median speaks for
  every conversation (0 until one is seen: the lower bound recovery used before).
* :func:`rerun_door_seconds` is the door's time on the next turn from those two.

Threads: one :class:`DoorReread` belongs to one engine's judge, on its engine thread.
"""

from __future__ import annotations

import statistics
from collections import deque

# Shares remembered (their median speaks).
REREAD_SAMPLES = 8


def rerun_door_seconds(fresh_rate: float, appended: int, read_before: int, reread: float) -> float:
    """The door's seconds for a turn that adds ``appended`` tokens to ``read_before``
    tokens the door has read: new tokens at ``fresh_rate`` seconds each, the others at
    ``reread`` of that."""
    return fresh_rate * (max(0, appended) + reread * max(0, read_before))


def reread_share(fresh_rate: float, door_s: float, tokens: int, appended: int) -> float | None:
    """What a token read before cost at the door, as a share of a new one, from a turn of
    ``tokens`` that grew by ``appended`` and spent ``door_s`` there (clamped to 0-1; None
    where the turn says nothing of it)."""
    read_before = tokens - appended
    if fresh_rate <= 0 or door_s <= 0 or appended <= 0 or read_before <= 0:
        return None
    share = (door_s - fresh_rate * appended) / (fresh_rate * read_before)
    return min(1.0, max(0.0, share))


class DoorReread:
    """The server's recent re-read shares: their median, else 0."""

    def __init__(self, samples: int = REREAD_SAMPLES) -> None:
        self._shares: deque[float] = deque(maxlen=samples)

    def observe(self, share: float | None) -> None:
        if share is not None:
            self._shares.append(share)

    @property
    def measured(self) -> int:
        return len(self._shares)

    @property
    def value(self) -> float:
        return statistics.median(self._shares) if self._shares else 0.0
