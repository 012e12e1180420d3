"""A waiting request's time split over the parts of the idle step that ran meanwhile."""

from __future__ import annotations

import pytest

from mlx_recovery_plugin.recovery.step_phases import PROBE, SETTLE, SLICE, STEP, StepPhases


def test_a_wait_is_split_over_the_parts_that_ran_between_the_arrival_and_the_steps_end() -> None:
    phases = StepPhases()
    phases.begin(10.0)
    phases.mark(PROBE, 10.5)
    phases.mark(SLICE, 11.0)
    phases.mark(SETTLE, 13.0)
    # Came in late in the slice: the rest of its layer, then the whole publication.
    assert phases.behind(12.8, 13.4) == {SLICE: pytest.approx(0.2), SETTLE: pytest.approx(0.4)}
    # Came in before the step began: it waited behind every part.
    assert phases.behind(9.0, 13.4) == {STEP: 0.5, PROBE: 0.5, SLICE: 2.0, SETTLE: pytest.approx(0.4)}
    # The next step's marks replace these.
    phases.begin(20.0)
    assert phases.behind(20.1, 20.3) == {STEP: pytest.approx(0.2)}
