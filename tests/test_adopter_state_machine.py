"""The adopter state machine (testing/machines/adopter.py), derandomized: the same cases on
every run, so a kill never depends on luck. `python tests/lab machines` runs it wider
with fresh random cases."""

from __future__ import annotations

from hypothesis import HealthCheck, settings

from lab.machines.adopter import AdopterMachine


class CiAdopterMachine(AdopterMachine):
    pass


CiAdopterMachine.TestCase.settings = settings(
    max_examples=50,
    stateful_step_count=20,
    deadline=None,
    derandomize=True,
    suppress_health_check=[HealthCheck.too_slow],
)
TestAdopterStateMachine = CiAdopterMachine.TestCase
