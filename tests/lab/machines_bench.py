"""``python tests/lab machines``: the two state machines, wider and with fresh cases.

CI runs the recovery and adopter state machines derandomized (the same 25 and 50 cases
every time), so a kill never depends on luck. This runs them with many more examples and
steps, on fresh random cases each time, and exits 1 if an invariant fails; hypothesis
then prints the shrunk steps and a ``@reproduce_failure`` blob that replays them.
"""

from __future__ import annotations

import argparse
import logging
import sys
import time
import traceback
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from hypothesis import HealthCheck, settings

from mlx_recovery_plugin.testing.tiny_model import TinyModelSpec, cached_model_dir, load_tiny_model

from .machines.adopter import AdopterMachine, run_adopter_machine
from .machines.recovery import RecoveryMachine, run_recovery_machine

# The models the tests' fixtures write (tests/conftest.py): target and sparse draft.
TARGET = TinyModelSpec(arch="llama", seed=0)
DRAFT = TinyModelSpec(arch="llama", num_layers=1, seed=7)
MACHINES = ("recovery", "adopter")


@dataclass(slots=True)
class MachineResult:
    name: str
    examples: int
    seconds: float
    failure: str | None


def _counted(machine: type[Any], counter: list[int]) -> type[Any]:
    class Counted(machine):  # type: ignore[misc, valid-type]
        def __init__(self) -> None:
            super().__init__()
            counter[0] += 1

    Counted.__name__ = machine.__name__
    return Counted


def run_machine(name: str, examples: int, steps: int) -> MachineResult:
    counter = [0]
    wide = settings(
        max_examples=examples,
        stateful_step_count=steps,
        deadline=None,
        derandomize=False,
        database=None,
        print_blob=True,
        suppress_health_check=list(HealthCheck),
    )
    run: Callable[[], None]
    if name == "recovery":
        model, tokenizer = load_tiny_model(cached_model_dir(TARGET))
        draft, _ = load_tiny_model(cached_model_dir(DRAFT))
        machine = _counted(RecoveryMachine, counter)
        run = lambda: run_recovery_machine((model, tokenizer, draft), wide, machine)  # noqa: E731
    else:
        machine = _counted(AdopterMachine, counter)
        run = lambda: run_adopter_machine(wide, machine)  # noqa: E731
    started = time.perf_counter()
    failure = None
    try:
        run()
    except Exception:  # noqa: BLE001 - a falsified invariant is this bench's finding
        failure = traceback.format_exc(limit=3)
    return MachineResult(name, counter[0], time.perf_counter() - started, failure)


def _run(args: argparse.Namespace) -> int:
    # The machines inject faults on purpose; the plugin's warnings about them are noise here.
    plugin_log = logging.getLogger("mlx_recovery_plugin")
    level = plugin_log.level
    plugin_log.setLevel(logging.INFO if args.verbose else logging.ERROR)
    try:
        results = [run_machine(name, args.examples, args.steps) for name in args.machine]
    finally:
        plugin_log.setLevel(level)
    for result in results:
        verdict = "FAILED" if result.failure else "held"
        print(
            f"{result.name:<9} {result.examples} machines run (up to {args.steps} steps each) in "
            f"{result.seconds:.1f} s: invariants {verdict}"
        )
        if result.failure:
            print(result.failure, file=sys.stderr)
    return 1 if any(result.failure for result in results) else 0


def add_parser(subparsers: argparse._SubParsersAction) -> None:
    p = subparsers.add_parser("machines", help="the recovery and adopter state machines, wide and randomized")
    p.add_argument("--machine", nargs="+", choices=MACHINES, default=list(MACHINES))
    p.add_argument("--examples", type=int, default=200, help="hypothesis examples per machine (CI: 25 / 50)")
    p.add_argument("--steps", type=int, default=30, help="most steps per example (CI: 12 / 20)")
    p.set_defaults(func=_run)
