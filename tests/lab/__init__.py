"""The project's own lab: benches and randomized state machines that only this project's
development runs (the interference, budget, efficiency, runner, start-up and fault
benches; the recovery and adopter state machines). They are not in the wheel; users'
benches (`mlx-recovery bench server`, `bench adopter`) and the demo are.

Run them from a checkout, in an environment with this package installed (the test extra
for the state machines): ``python tests/lab SUITE [options]`` (``python tests/lab -h``
lists the suites). The tests import them as ``lab.<module>`` (pytest puts ``tests/`` on
the path).
"""
