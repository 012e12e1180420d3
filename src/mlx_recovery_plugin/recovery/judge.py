"""One engine's publish policy: what it has learned of the dense cost, and its verdicts.

The arithmetic is :mod:`.costs`; this is the state around it for one engine: the dense
cost model fitted to that engine's slices, the policy setting, and the last decision, which
the status shows. It judges a job with what the host said of the job's conversation
(threshold, keep share, measured sparse prefill, last growth; see :func:`note_route`).

Threads: the engine thread observes and judges; :meth:`PublishJudge.status` may be called
from any thread under the service's lock, and reads only values replaced whole.
"""

from __future__ import annotations

from typing import Any

from ..events import SparseRouteServed
from ..settings import PublishPolicy
from .costs import DEFAULT_APPEND_TOKENS, Decision, DenseCostModel, SparseSample, Verdict, decide
from .jobs import RecoveryJob

# The keep share assumed when the host does not say (oMLX's default).
DEFAULT_KEEP = 0.2


class PublishJudge:
    """Publish, hold or stand down, for one engine's jobs."""

    def __init__(self, policy: PublishPolicy, block_size: int) -> None:
        self.policy = policy
        self.block_size = block_size
        self.costs = DenseCostModel()
        self.last: Decision | None = None

    def observe(self, context: int, tokens: int, seconds: float) -> None:
        """A whole slice of ``tokens`` on top of ``context`` took ``seconds``."""
        self.costs.observe(context, tokens, seconds)

    def judge(self, job: RecoveryJob, boundary: int) -> Decision:
        """What to do with ``job``'s finished blocks up to ``boundary``."""
        if self.policy is PublishPolicy.ALWAYS:
            decision = Decision(Verdict.PUBLISH, "policy: always")
        else:
            decision = decide(
                self.costs,
                boundary=boundary,
                full_boundary=job.publish_end(self.block_size),
                next_tokens=len(job.tokens) + (job.last_append or DEFAULT_APPEND_TOKENS),
                threshold=job.threshold,
                keep=job.keep if job.keep is not None else DEFAULT_KEEP,
                measured=job.sparse,
            )
        self.last = decision
        return decision

    def stand_down_reason(self, job: RecoveryJob) -> str | None:
        """Why ``job`` should not be worked on at all (not even its whole prefix would pay),
        or None. Judged only once the dense cost is known."""
        if self.policy is not PublishPolicy.AUTO or not self.costs.fitted:
            return None
        decision = self.judge(job, job.publish_end(self.block_size))
        return decision.reason if decision.verdict is Verdict.STAND_DOWN else None

    def status(self) -> dict[str, Any]:
        coefficients = self.costs.coefficients()
        decision = self.last
        return {
            "mode": self.policy.value,
            "dense_cost_samples": self.costs.samples,
            "dense_s_per_token": coefficients[0] if coefficients else None,
            "dense_s_per_token_per_context": coefficients[1] if coefficients else None,
            "verdict": decision.verdict.value if decision else None,
            "reason": decision.reason if decision else None,
            "dense_append_s": decision.dense_s if decision else None,
            "sparse_rerun_s": decision.sparse_s if decision else None,
        }


def note_route(job: RecoveryJob, event: SparseRouteServed) -> None:
    """Keep what the host said of its sparse route on the job it served."""
    if event.threshold is not None:
        job.threshold = int(event.threshold)
    if event.keep is not None:
        job.keep = float(event.keep)
    if event.prefill_s is not None and event.prefill_s > 0:
        job.sparse = SparseSample(len(event.tokens) - event.served_start, float(event.prefill_s))
