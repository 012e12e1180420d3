"""When publishing pays: what the next turn costs on each route, from what recovery measures.

Recovery only helps if the turn that restores its prefix is cheaper than the route the
host would otherwise take. A host with a sparse route sends a turn down it only when the
turn's *uncached* part exceeds the host's threshold, so a partly recovered prefix can
flip the next turn to a dense prefill of the rest, over a long context: on a model whose
cost grows steeply with context (attention-bound), that is slower than the sparse rerun
it replaced. This module estimates both sides and says whether to publish, hold the
finished blocks back, or stand down:

* :class:`DenseCostModel` learns the seconds of a dense pass of ``n`` tokens on top of
  ``c`` cached ones, ``a*n + b*(n*c + n*n/2)`` (matrix products per token, plus attention
  per token per attended position), by least squares over the recovery slices themselves:
  the same model, on the same machine, as the host's dense route.
* :func:`sparse_rerun_seconds`: the host's measured sparse prefill time, scaled to the
  next turn's length; without a measurement, the target's share of it (the kept tokens'
  dense prefill), which leaves out the draft and so errs towards the sparse route.
* :func:`decide` compares the next turn's dense append over the prefix that publication
  would leave with the sparse rerun.

Threads: a :class:`DenseCostModel` belongs to one engine's recovery service and is used on
its engine thread only (the status copies its coefficients under the service's lock).
"""

from __future__ import annotations

import math
from collections import deque
from dataclasses import dataclass
from enum import Enum

# Publish only when the dense append is estimated at no more than this share of the
# sparse rerun: estimates are noisy, and a wrong "yes" makes a turn slower than sparse.
PAYS_MARGIN = 0.9
# The next turn's growth when a conversation has not yet shown one (agents append a
# reply, a tool's output and a question: a few hundred tokens).
DEFAULT_APPEND_TOKENS = 512
# Slices the model needs, at this many distinct contexts, before its answer is trusted.
MIN_SAMPLES = 3
# Slices remembered; old ones fall out as the machine's load changes.
MAX_SAMPLES = 64


class Verdict(str, Enum):
    PUBLISH = "publish"
    HOLD = "hold"  # keep finished blocks back until a longer prefix pays
    STAND_DOWN = "stand_down"  # even a full prefix would not pay: stop recovering


@dataclass(slots=True, frozen=True)
class Decision:
    verdict: Verdict
    reason: str
    dense_s: float | None = None
    sparse_s: float | None = None


@dataclass(slots=True, frozen=True)
class SparseSample:
    """The host's sparse prefill of a ``tokens``-token prompt took ``seconds``."""

    tokens: int
    seconds: float


class DenseCostModel:
    """Seconds of a dense pass, fitted to slices: ``a*n + b*(n*c + n*n/2)``."""

    def __init__(self, max_samples: int = MAX_SAMPLES) -> None:
        self._samples: deque[tuple[int, int, float]] = deque(maxlen=max_samples)
        self._coefficients: tuple[float, float] | None = None

    def observe(self, context: int, tokens: int, seconds: float) -> None:
        """A dense pass of ``tokens`` on top of ``context`` cached tokens took ``seconds``."""
        if tokens <= 0 or context < 0 or not (math.isfinite(seconds) and seconds > 0):
            return
        self._samples.append((int(context), int(tokens), float(seconds)))
        self._coefficients = None

    @property
    def samples(self) -> int:
        return len(self._samples)

    @property
    def fitted(self) -> bool:
        contexts = {c for c, _, _ in self._samples}
        return len(self._samples) >= MIN_SAMPLES and len(contexts) >= MIN_SAMPLES

    def coefficients(self) -> tuple[float, float] | None:
        """``(a, b)``: seconds per token, and per token per attended position; None until
        :attr:`fitted`. Both are kept non-negative."""
        if not self.fitted:
            return None
        if self._coefficients is None:
            self._coefficients = _fit(self._samples)
        return self._coefficients

    def seconds(self, tokens: int, context: int) -> float | None:
        coefficients = self.coefficients()
        if coefficients is None:
            return None
        return _pass_seconds(coefficients, tokens, context)


def _features(tokens: int, context: int) -> tuple[float, float]:
    return float(tokens), tokens * context + tokens * tokens / 2.0


def _pass_seconds(coefficients: tuple[float, float], tokens: int, context: int) -> float:
    if tokens <= 0:
        return 0.0
    x1, x2 = _features(tokens, context)
    return coefficients[0] * x1 + coefficients[1] * x2


def _fit(samples: deque[tuple[int, int, float]]) -> tuple[float, float]:
    """Least squares for two non-negative coefficients (a tiny active-set solve)."""
    s11 = s12 = s22 = t1 = t2 = 0.0
    for context, tokens, seconds in samples:
        x1, x2 = _features(tokens, context)
        s11 += x1 * x1
        s12 += x1 * x2
        s22 += x2 * x2
        t1 += x1 * seconds
        t2 += x2 * seconds
    det = s11 * s22 - s12 * s12
    if det > 1e-12 * s11 * s22:
        a = (t1 * s22 - t2 * s12) / det
        b = (t2 * s11 - t1 * s12) / det
        if a >= 0 and b >= 0:
            return a, b
    # One coefficient at 0: keep whichever single-term fit explains more.
    a_only = t1 / s11 if s11 else 0.0
    b_only = t2 / s22 if s22 else 0.0
    resid_a = -(t1 * a_only)  # residual sum of squares minus the constant sum(t^2)
    resid_b = -(t2 * b_only)
    return (max(a_only, 0.0), 0.0) if resid_a <= resid_b else (0.0, max(b_only, 0.0))


def sparse_rerun_seconds(
    model: DenseCostModel,
    prompt_tokens: int,
    keep: float,
    measured: SparseSample | None,
) -> float | None:
    """Estimated seconds of the host's sparse prefill of a ``prompt_tokens``-token prompt
    with nothing cached: a measured sample scaled by the target's share, else the target's
    share alone (kept tokens prefilled densely over one another)."""
    estimate = model.seconds(math.ceil(keep * prompt_tokens), 0)
    if measured is None:
        return estimate
    if estimate is None:
        return measured.seconds * prompt_tokens / max(1, measured.tokens)
    at_sample = model.seconds(math.ceil(keep * measured.tokens), 0) or 0.0
    if at_sample <= 0:
        return measured.seconds * prompt_tokens / max(1, measured.tokens)
    return measured.seconds * estimate / at_sample


def decide(
    model: DenseCostModel,
    *,
    boundary: int,
    full_boundary: int,
    next_tokens: int,
    threshold: int | None,
    keep: float,
    measured: SparseSample | None,
    margin: float = PAYS_MARGIN,
) -> Decision:
    """Publish a prefix of ``boundary`` tokens now, hold it back, or stand down.

    ``next_tokens`` is the expected length of the conversation's next prompt,
    ``full_boundary`` the longest prefix recovery can reach, ``threshold`` the host's
    sparse threshold on uncached tokens (None: unknown, so assume the next turn is
    prefilled densely over whatever is cached)."""
    uncached = next_tokens - boundary
    if threshold is not None and uncached > threshold:
        return Decision(Verdict.PUBLISH, f"next turn stays sparse ({uncached} uncached > {threshold})")
    dense = model.seconds(uncached, boundary)
    sparse = sparse_rerun_seconds(model, next_tokens, keep, measured)
    if dense is None or sparse is None:
        if boundary >= full_boundary:
            return Decision(Verdict.PUBLISH, "full prefix; dense cost not yet learned")
        return Decision(Verdict.HOLD, "learning the dense cost before a partial prefix is published")
    if dense <= margin * sparse:
        return Decision(
            Verdict.PUBLISH, f"dense append {dense:.2f} s < sparse rerun {sparse:.2f} s", dense, sparse
        )
    full_dense = model.seconds(max(0, next_tokens - full_boundary), full_boundary) or 0.0
    if boundary < full_boundary and full_dense <= margin * sparse:
        return Decision(
            Verdict.HOLD,
            f"a {boundary}-token prefix would make the next turn dense ({dense:.2f} s) and slower "
            f"than sparse ({sparse:.2f} s); holding until {full_boundary}",
            dense,
            sparse,
        )
    return Decision(
        Verdict.STAND_DOWN,
        f"a cached dense append ({full_dense:.2f} s) costs more than a sparse rerun "
        f"({sparse:.2f} s) on this model and machine",
        full_dense,
        sparse,
    )
