"""``python tests/lab startup``: what ``MLX_RECOVERY_ENABLE=1`` costs a process that
never imports a host.

The start-up hook runs in every Python process of the environment once the variable is
exported. Alternating in one loop, this starts the same interpreter with and without the
variable (``-c pass``, or ``--code``) and reports the wall-time difference per pair and
the modules each start loaded. The interpreter must have the hook installed (a
non-editable install, or the ``.pth`` copied into site-packages).
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time
from dataclasses import dataclass

from .stats import Spread, spread

PROBE = "import sys, json; print(json.dumps(sorted(sys.modules)))"
HEAVY = ("pluggy", "importlib.metadata", "asyncio", "mlx.core", "pydantic")


@dataclass(slots=True, frozen=True)
class StartupResult:
    off_ms: Spread
    on_ms: Spread
    added_ms: Spread  # on minus off, per alternating pair
    modules_off: int
    modules_on: int
    heavy_on: list[str]
    hook_active: bool


def _environ(enabled: bool) -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if k != "MLX_RECOVERY_ENABLE"}
    if enabled:
        env["MLX_RECOVERY_ENABLE"] = "1"
    return env


def _modules(python: str, enabled: bool) -> list[str]:
    done = subprocess.run([python, "-c", PROBE], env=_environ(enabled), capture_output=True, text=True, check=True)
    loaded: list[str] = json.loads(done.stdout)
    return loaded


def measure_startup(python: str, pairs: int, code: str = "pass") -> StartupResult:
    off: list[float] = []
    on: list[float] = []
    for i in range(pairs):
        # Alternate which variant goes first, so a drift in the machine's load hits both.
        order = (False, True) if i % 2 == 0 else (True, False)
        for enabled in order:
            started = time.perf_counter()
            subprocess.run([python, "-c", code], env=_environ(enabled), check=True)
            (on if enabled else off).append((time.perf_counter() - started) * 1e3)
    loaded_off, loaded_on = _modules(python, False), _modules(python, True)
    return StartupResult(
        off_ms=spread(off),
        on_ms=spread(on),
        added_ms=spread([b - a for a, b in zip(off, on)]),
        modules_off=len(loaded_off),
        modules_on=len(loaded_on),
        heavy_on=[m for m in HEAVY if m in loaded_on],
        hook_active="mlx_recovery_plugin.hosts.startup" in loaded_on,
    )


def _run(args: argparse.Namespace) -> int:
    result = measure_startup(args.python, args.pairs, args.code)
    if not result.hook_active:
        print(f"the start-up hook did not run in {args.python}: is the .pth file installed?", file=sys.stderr)
        return 2
    print(f"interpreter {args.python}, {args.pairs} alternating pairs, code {args.code!r}")
    print(f"  variable unset  {result.off_ms} ms, {result.modules_off} modules")
    print(f"  MLX_RECOVERY_ENABLE=1  {result.on_ms} ms, {result.modules_on} modules")
    print(f"  added by the hook  {result.added_ms} ms; heavy modules loaded: {', '.join(result.heavy_on) or 'none'}")
    return 0


def add_parser(subparsers: argparse._SubParsersAction) -> None:
    p = subparsers.add_parser("startup", help="what the enabled start-up hook costs a process with no host")
    p.add_argument("--python", default=sys.executable, help="interpreter to start (default: this one)")
    p.add_argument("--pairs", type=int, default=30, help="alternating runs with and without the variable")
    p.add_argument("--code", default="pass", help="what each interpreter runs (default: pass)")
    p.set_defaults(func=_run)

