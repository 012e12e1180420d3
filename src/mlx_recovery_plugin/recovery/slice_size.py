"""How many tokens the next slice runs: the configured slice, fitted to the budget.

A slice that overspends the window's allowance is paid back by the next windows, so on a
slow machine one whole configured slice could overshoot many windows at once. The sizer
cuts the next slice to what the window's remaining allowance pays for, but never below
one block: a slice that finishes no block publishes nothing. Nor does it leave a job one
block short: a slice that would stops at the job's end instead (:meth:`SliceSizer.end`).

What a slice costs comes from the publish policy's dense cost model (one model for both:
:class:`~.costs.DenseCostModel`), so a slice deep in a long context, where attention costs
more per token, is cut shorter than one near its start. The sizer itself learns only the
ratio of the charged time (the whole idle step: fetch, slice, publication) to the model's
prediction. Until the model is fitted it goes by the recovered tokens per charged second.

Threads: owned by one engine's recovery service and used on its engine thread only.
"""

from __future__ import annotations

import math
from collections.abc import Callable

from ..runner.runner import STOP_GRAIN
from ..state import floor_block

# An arriving request waits for the layer of the pass running then (runner/layer_stop.py).
# One layer of a STOP_GRAIN-token pass takes 0.9-1.7 s at 9-10k context on a 3072-wide,
# 2-layer target, and a turn reached the host 1.8 s late behind it (bench server): where a layer of the
# slice's last pass would take longer than this, its passes are cut finer, down to
# MIN_STOP_GRAIN tokens. Not to 32: at 7,680 context a 512-token slice in passes of 32
# took 1.17-1.25x its time in passes of 256 (2048x4 and 3072x2, 3 alternating pairs
# each), in passes of 64 a median 1.04-1.10x, in passes of 128 1.00-1.01x.
ARRIVAL_WAIT_S = 0.25
MIN_STOP_GRAIN = 64
# A product of two measured floats that should land on a block boundary may land an ulp
# under it (0.7 s at 192 tokens per 0.7 s: 191.99999999999997), and flooring it lost the
# whole block.
ROUNDING_SLACK = 1e-9

Predict = Callable[[int, int], "float | None"]
"""``(tokens, context) -> seconds`` of a dense pass, or None while not known."""


class SliceSizer:
    """The next slice's end, from the cost model, the measured overhead and the budget."""

    def __init__(
        self, slice_tokens: int, block_size: int, remaining_s: Callable[[], float], predict: Predict | None = None,
        layer_predict: Predict | None = None,
    ) -> None:
        self.slice_tokens = slice_tokens
        self._block_size = block_size
        self._remaining_s = remaining_s
        self._predict = predict
        # For the passes' grain only: may answer where ``predict`` does not yet (another
        # load regime's cost), as an arrival's wait is bounded by any cost known.
        self._layer_predict = layer_predict or predict
        self._tokens_per_s: float | None = None
        self._overhead: float | None = None  # charged seconds per predicted second

    def learn(self, tokens: int, seconds: float, context: int = 0) -> None:
        """A slice of ``tokens`` from ``context`` was charged ``seconds`` (0 tokens: it did
        not run whole, and says nothing)."""
        if tokens <= 0:
            return
        # A slice the clock did not see (a clock coarser than the slice) cost nothing.
        rate = tokens / seconds if seconds > 0 else math.inf
        old = self._tokens_per_s
        self._tokens_per_s = rate if old is None else 0.5 * old + 0.5 * rate
        predicted = self._predict(tokens, context) if self._predict is not None else None
        if predicted and predicted > 0 and seconds > 0:
            ratio = seconds / predicted
            self._overhead = ratio if self._overhead is None else 0.5 * self._overhead + 0.5 * ratio

    def tokens_now(self, context: int = 0) -> int:
        """The configured slice from ``context``, fitted to what the window's remaining
        allowance pays for. The first slice, whose cost is not known yet, is one block at
        most."""
        if self._tokens_per_s is None:
            return min(self.slice_tokens, self._block_size)
        if math.isinf(self._tokens_per_s):
            return self.slice_tokens
        remaining = self._remaining_s()
        if self._predict is not None and self._overhead is not None:
            return self._by_model(context, remaining, self._overhead)
        affordable = floor_block(int(self._tokens_per_s * remaining * (1.0 + ROUNDING_SLACK)), self._block_size)
        return min(self.slice_tokens, max(self._block_size, affordable))

    def stop_grain(self, end: int, layers: int) -> int | None:
        """Tokens per pass of a slice ending at ``end`` where the runner's own passes
        (``STOP_GRAIN``) are too coarse: halved while one layer of its last pass would
        take over ``ARRIVAL_WAIT_S`` (the model's cost of the forward alone). None (the
        runner's own) where a layer is short enough, or while the cost is not known."""
        if self._layer_predict is None or layers <= 0:
            return None
        seconds = self._layer_predict(STOP_GRAIN, max(0, end - STOP_GRAIN))
        if seconds is None:
            return None
        per_layer = seconds / layers
        grain = STOP_GRAIN
        while grain > MIN_STOP_GRAIN and per_layer * grain / STOP_GRAIN > ARRIVAL_WAIT_S:
            grain //= 2
        return grain if grain < STOP_GRAIN else None

    def end(self, start: int, end_target: int) -> int:
        """Where a slice from ``start`` stops: its size from :meth:`tokens_now`, cut back to
        a block boundary when it would otherwise leave a block half done, or stretched to
        ``end_target`` when it would otherwise leave one block or less of it (within the
        configured slice, once the cost is known).

        The stretch moves the job's last block forward, never adds work: the budget
        charges it to this window and the next windows pay it back. Left for the next
        window, it kept the prefix one block short of whole for up to a window, and a
        turn arriving then found a partial prefix that did not pay (bench server, 2048x4,
        100 s think: the first gap ended at 8,448 of 8,704 tokens, waiting on the
        budget)."""
        end = min(start + self.tokens_now(start), end_target)
        if (
            self._tokens_per_s is not None
            and 0 < end_target - end <= self._block_size
            and end_target - start <= self.slice_tokens
        ):
            return end_target
        whole = floor_block(end, self._block_size)
        return whole if end < end_target and whole > start else end

    def _by_model(self, context: int, remaining: float, overhead: float) -> int:
        """The most whole blocks (up to the configured slice) the model says fit in
        ``remaining`` seconds from ``context``: a binary search over block counts."""
        assert self._predict is not None
        block = self._block_size
        low, high = 1, max(1, self.slice_tokens // block)
        if (self._predict(high * block, context) or 0.0) * overhead <= remaining:
            return min(self.slice_tokens, high * block)
        while low < high:
            mid = (low + high + 1) // 2
            if (self._predict(mid * block, context) or 0.0) * overhead <= remaining:
                low = mid
            else:
                high = mid - 1
        return min(self.slice_tokens, low * block)
