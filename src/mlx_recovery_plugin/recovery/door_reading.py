"""What the host's door costs when a conversation comes back on the sparse route.

oMLX scores a prompt with its draft model at its door before the sparse prefill, and
keeps that reading for the conversation's next turn. A rerun is then not free at the
door: its new tokens are read, and each attends to every token read before, so a new
token costs more the longer the conversation. On the real server (the draft of the bench
targets) a new token's door time grew by 0.09-0.15 of a first turn's rate per 1,000
tokens read before, at growths of 665-2,830 tokens: a rerun of 2,697 new tokens on 11,264
read before took 2.7 s at the door, where its new tokens at the first turn's rate come
to 1.1 s. Counting only the new tokens at that rate made the rerun look up to ~1.5 s
cheaper than it was, which only ever held publications back.

* A conversation's first sparse turn gives its door's rate per token
  (``RouteMemory.fresh_door_rate`` in :mod:`.judge`).
* Each later sparse turn says by how much a new token's cost grew per token read before
  (:func:`door_growth`); :class:`DoorGrowth` keeps the server's recent figures, and
  their median speaks for every conversation (0 until one is seen: the lower bound
  recovery used before).
* :func:`rerun_door_seconds` is the door's time on the next turn from those two.

Threads: one :class:`DoorGrowth` belongs to one engine's judge, on its engine thread.
"""

from __future__ import annotations

import statistics
from collections import deque

# Figures remembered (their median speaks).
GROWTH_SAMPLES = 8


def rerun_door_seconds(fresh_rate: float, appended: int, read_before: int, growth: float) -> float:
    """The door's seconds for a turn that adds ``appended`` tokens to ``read_before``
    tokens the door has read: each new token at ``fresh_rate`` seconds, raised by
    ``growth`` of that per token read before."""
    return fresh_rate * max(0, appended) * (1.0 + max(0.0, growth) * max(0, read_before))


def door_growth(fresh_rate: float, door_s: float, tokens: int, appended: int) -> float | None:
    """By how much a new token's door time grew per token read before, as a share of
    ``fresh_rate``, from a turn of ``tokens`` that grew by ``appended`` and spent
    ``door_s`` at the door (0 at least; None where the turn says nothing of it)."""
    read_before = tokens - appended
    if fresh_rate <= 0 or door_s <= 0 or appended <= 0 or read_before <= 0:
        return None
    return max(0.0, (door_s / (fresh_rate * appended) - 1.0) / read_before)


class DoorGrowth:
    """The server's recent door growth figures: their median, else 0."""

    def __init__(self, samples: int = GROWTH_SAMPLES) -> None:
        self._figures: deque[float] = deque(maxlen=samples)

    def observe(self, growth: float | None) -> None:
        if growth is not None:
            self._figures.append(growth)

    @property
    def measured(self) -> int:
        return len(self._figures)

    @property
    def value(self) -> float:
        return statistics.median(self._figures) if self._figures else 0.0
