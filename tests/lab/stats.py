"""Small summaries for benchmark samples."""

from __future__ import annotations

import statistics
from collections.abc import Sequence
from dataclasses import dataclass


@dataclass(slots=True, frozen=True)
class Spread:
    median: float
    low: float
    high: float
    n: int

    def __str__(self) -> str:
        return f"{self.median:.3f} [{self.low:.3f}, {self.high:.3f}] (n={self.n})"


def spread(samples: Sequence[float]) -> Spread:
    """Median with min and max: with few noisy samples, the range says more than a sigma."""
    if not samples:
        raise ValueError("no samples")
    return Spread(statistics.median(samples), min(samples), max(samples), len(samples))


def describe(samples: Sequence[float], fmt: str = "{:.3f}") -> str:
    """``median M [min A, max B]``, or ``n/a`` with no samples."""
    if not samples:
        return "n/a"
    s = spread(samples)
    return f"median {fmt.format(s.median)} [min {fmt.format(s.low)}, max {fmt.format(s.high)}]"
