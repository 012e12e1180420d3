"""How many tokens the next slice runs: the configured slice, fitted to the budget.

A slice that overspends the window's allowance is paid back by the next windows, so on a
slow machine one whole configured slice could overshoot many windows at once. The sizer
learns the recovered tokens per charged second from whole slices and cuts the next one to
what the window's remaining allowance pays for, but never below one block: a slice that
finishes no block publishes nothing.

Threads: owned by one engine's recovery service and used on its engine thread only.
"""

from __future__ import annotations

import math
from collections.abc import Callable

from ..state import floor_block


class SliceSizer:
    """The next slice's end, from the measured rate and the budget's remaining allowance."""

    def __init__(self, slice_tokens: int, block_size: int, remaining_s: Callable[[], float]) -> None:
        self.slice_tokens = slice_tokens
        self._block_size = block_size
        self._remaining_s = remaining_s
        self._tokens_per_s: float | None = None

    def learn(self, tokens: int, seconds: float) -> None:
        """A slice recovered ``tokens`` for ``seconds`` of charged time (0 tokens: it did
        not run whole, and says nothing of the rate)."""
        if tokens <= 0:
            return
        # A slice the clock did not see (a clock coarser than the slice) cost nothing.
        rate = tokens / seconds if seconds > 0 else math.inf
        old = self._tokens_per_s
        self._tokens_per_s = rate if old is None else 0.5 * old + 0.5 * rate

    def tokens_now(self) -> int:
        """The configured slice, fitted to what the window's remaining allowance pays for.
        The first slice, whose rate is not known yet, is one block at most."""
        if self._tokens_per_s is None:
            return min(self.slice_tokens, self._block_size)
        if math.isinf(self._tokens_per_s):
            return self.slice_tokens
        affordable = floor_block(int(self._tokens_per_s * self._remaining_s()), self._block_size)
        return min(self.slice_tokens, max(self._block_size, affordable))

    def end(self, start: int, end_target: int) -> int:
        """Where a slice from ``start`` stops: its size from :meth:`tokens_now`, cut back to
        a block boundary when it would otherwise leave a block half done."""
        end = min(start + self.tokens_now(), end_target)
        whole = floor_block(end, self._block_size)
        return whole if end < end_target and whole > start else end
