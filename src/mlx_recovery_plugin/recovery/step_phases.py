"""What a request that came in during an idle step waited behind, part by part.

A request that arrives during an idle step waits for the step's end. The runner stops a
slice between layers, but the other parts of a step cannot be stopped once begun: timing
the model's attention, judging the job, fetching the host's blocks into a live state,
holding or publishing a finished slice's blocks. A step marks each part as it begins, and
a request's wait is split over the parts that ran between its arrival and the step's end,
so the status names what the longest waits sat behind (bench server, 768x6, three
conversations: 0.30 s at the longest against an aim of 0.25 s, with nothing saying where
it went).

Threads: owned by one engine's recovery service; marked and read on its engine thread.
"""

from __future__ import annotations

# The parts of an idle step, in the order they run.
STEP = "step"  # the gate and the choice of job, before any of the below
PROBE = "probe"  # timing the model's attention deeper than the slices reached
VERDICT = "verdict"  # whether the job stands down or pauses before its slice
START = "start"  # giving back another job's live state, fetching the host's blocks
SLICE = "slice"  # the runner's passes (stopped between layers)
SETTLE = "settle"  # holding or publishing the finished blocks, giving the live state back


class StepPhases:
    """The marks of the idle step now running (replaced by the next step's)."""

    def __init__(self) -> None:
        self._times: list[float] = []
        self._names: list[str] = []

    def begin(self, now: float) -> None:
        self._times, self._names = [now], [STEP]

    def mark(self, name: str, now: float) -> None:
        self._times.append(now)
        self._names.append(name)

    def behind(self, arrival: float, end: float) -> dict[str, float]:
        """Seconds of each part of the step that ran between ``arrival`` and ``end`` (a
        request that came in before the step began waited from its beginning)."""
        out: dict[str, float] = {}
        bounds = [*self._times[1:], end]
        for name, began, ended in zip(self._names, self._times, bounds, strict=True):
            seconds = min(ended, end) - max(began, arrival)
            if seconds > 0:
                out[name] = out.get(name, 0.0) + seconds
        return out
