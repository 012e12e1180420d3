"""A clock a test moves by hand, for budget, gate and idle logic tested without sleeping.

One owner: the test's thread (or whichever thread the test lets advance it)."""

from __future__ import annotations

import random


class FakeClock:
    """Returns ``now``; :meth:`advance` moves it. Pass it wherever a ``clock`` is taken."""

    def __init__(self, now: float = 0.0) -> None:
        self.now = now

    def __call__(self) -> float:
        return self.now

    def advance(self, seconds: float) -> None:
        self.now += seconds


class TickingClock:
    """Moves ``step`` seconds on every read: a host timed with it reports the same
    seconds for the same work, so a test about order is not decided by timing noise."""

    def __init__(self, now: float = 0.0, step: float = 0.01) -> None:
        self.now, self.step = now, step

    def __call__(self) -> float:
        self.now += self.step
        return self.now


def random_tokens(seed: int, n: int) -> list[int]:
    """``n`` reproducible token ids below 256 (the tiny models' byte vocabulary)."""
    rng = random.Random(seed)
    return [rng.randrange(256) for _ in range(n)]
