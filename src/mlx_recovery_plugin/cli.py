"""``mlx-recovery``: the command line.

Subcommands live next to what they drive; each module offers ``add_parser(subparsers)``
and sets ``func`` on its parser. A module whose optional third-party dependency is
missing costs only its own subcommand (and says so with ``-v``); any other import error,
a bug in this package included, is raised. What the chosen options need (matplotlib for
``--plot``, a model directory, an installed host) is checked before the command starts
(:mod:`.cli_checks`).
"""

from __future__ import annotations

import argparse
import importlib
import json
import logging
import sys
from collections.abc import Sequence

from .cli_checks import refuse_bad_options
from .settings import SettingsError, describe_settings, load_settings

COMMAND_MODULES = (
    "mlx_recovery_plugin.demo.cli",
    "mlx_recovery_plugin.control_cli",
    "mlx_recovery_plugin.models.cli",
)
# The benches users run; the project's own lab benches live in tests/lab (not shipped).
BENCH_MODULES = (
    "mlx_recovery_plugin.bench.adopter",
    "mlx_recovery_plugin.bench.server.cli",
    "mlx_recovery_plugin.bench.policy.cli",
)

log = logging.getLogger(__name__)


def _cmd_config(args: argparse.Namespace) -> int:
    try:
        settings = load_settings()
    except SettingsError as exc:
        print(exc, file=sys.stderr)
        return 2
    rows = describe_settings(settings)
    if args.json:
        print(json.dumps({r.variable: {"value": r.value, "source": r.source} for r in rows}, indent=1))
        return 0
    width = max(len(r.variable) for r in rows)
    for r in rows:
        value = json.dumps(r.value) if isinstance(r.value, dict) else r.value
        print(f"{r.variable:<{width}}  {value!s:<14} ({r.source})  {r.description}")
    return 0


def _add_modules(subparsers: argparse._SubParsersAction, modules: Sequence[str]) -> None:
    for name in modules:
        try:
            module = importlib.import_module(name)
        except ModuleNotFoundError as exc:
            if not exc.name or exc.name.split(".")[0] == __package__:
                raise
            log.info("subcommands of %s unavailable: %s is not installed", name, exc.name)
            continue
        module.add_parser(subparsers)


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="mlx-recovery",
        description="Prefix-state recovery and partial-prefix adoption for MLX servers.",
    )
    parser.add_argument("-v", "--verbose", action="store_true", help="log progress details")
    sub = parser.add_subparsers(dest="command", required=True)

    config = sub.add_parser("config", help="print the effective settings and where each came from")
    config.add_argument("--json", action="store_true", help="machine-readable output")
    config.set_defaults(func=_cmd_config)

    _add_modules(sub, COMMAND_MODULES)

    bench = sub.add_parser("bench", help="side-by-side benchmarks (ratios with their spread)")
    bench_sub = bench.add_subparsers(dest="suite", required=True)
    _add_modules(bench_sub, BENCH_MODULES)
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    logging.basicConfig(
        level=logging.INFO if args.verbose else logging.WARNING,
        format="%(levelname)s %(name)s: %(message)s",
    )
    if refuse_bad_options("mlx-recovery", args):  # before any work: a run must not end on a bad option
        return 2
    from .models.library import ModelNotFetched

    try:
        return int(args.func(args) or 0)
    except ModelNotFetched as exc:  # a model by name that is not fetched: say what to run
        print(f"mlx-recovery {args.command}: {exc}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
