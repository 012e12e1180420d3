"""One publication at a time to measure what the host's dense append costs.

Until the host has served a dense turn over a published prefix, the policy weighs a
publication at :data:`~.costs.HOST_APPEND_PRIOR` times the slices' estimate. A prior is
a cautious guess (measured on oMLX: 0.93-1.06x on the real server, 1.01x in process;
see the constant for why the prior is higher). Where the prior alone holds a whole prefix
back (the slices' own estimate pays by the margin), holding it forever means the host
never serves a dense turn and the prior is never corrected: a wrong verdict no evidence
can change (bench server, three conversations, a shape that pays 1.6-1.9x: six turns
lost). So one such prefix is published to measure the host, the probe; while it is out,
no other is. The probe is over when the host's factor is measured, or, if the
conversation has not come back within :data:`PROBE_WAIT_S`, another may be tried: the
wait running out counts as new evidence (:attr:`HostCostProbe.lapsed`), so a prefix held
or paused on the prior is judged again then, not only at its conversation's next turn.

A probe is only taken where, at the prior's own expected cost, the dense turn is no
slower than the sparse rerun (:func:`~.costs.decide`): if the prior is right, the probe
costs nothing on average; if the host is cheaper, every later turn gains. A published
conversation stays dense, so the turns after it must pay by the margin at the slices'
own cost too: if the prior is right they are then at most 1.08x the rerun each.

Threads: owned by one engine's :class:`~.judge.PublishJudge`, on its engine thread.
"""

from __future__ import annotations

from collections.abc import Callable

# How long a probe waits for its conversation's next turn before another may be tried
# (a production chat trace: p90 gap to the next turn 480 s).
PROBE_WAIT_S = 600.0


class HostCostProbe:
    """Which job, if any, is the one published to measure the host's dense append."""

    def __init__(self, clock: Callable[[], float], wait_s: float = PROBE_WAIT_S) -> None:
        self._clock = clock
        self._wait_s = wait_s
        #: The probe out (its job, and when it began), or None.
        self._out: tuple[int, float] | None = None
        #: Probes begun (status).
        self.taken = 0
        # Probes replaced after their wait ran out.
        self._lapsed_before = 0

    def may_probe(self, job_id: int, measured: int) -> bool:
        """``job_id`` may be published as the probe: the host's factor is not measured
        (``measured`` dense turns seen), and no other probe is out, or the one out has
        waited its time."""
        if measured:
            return False
        if self._out is None or self._out[0] == job_id:
            return True
        return self._waited(self._out[1])

    def _waited(self, since: float) -> bool:
        return self._clock() - since >= self._wait_s

    @property
    def lapsed(self) -> int:
        """Probes whose wait has run out, the one out included: grows (never falls) when a
        wait runs out, so that what was held on the prior is judged again."""
        return self._lapsed_before + (self._out is not None and self._waited(self._out[1]))

    def begin(self, job_id: int) -> None:
        """``job_id`` is the probe from now (a verdict to publish it as one was given)."""
        if self._out is None or self._out[0] != job_id:
            if self._out is not None and self._waited(self._out[1]):
                self._lapsed_before += 1
            self._out = (job_id, self._clock())
            self.taken += 1

    def status(self) -> dict[str, object]:
        return {"job_id": None if self._out is None else self._out[0], "taken": self.taken, "lapsed": self.lapsed}
