"""``python tests/lab SUITE``: the lab's benches, each module offering ``add_parser``."""

from __future__ import annotations

import argparse
import importlib
import logging
from collections.abc import Sequence

from mlx_recovery_plugin.cli_checks import refuse_bad_options

SUITES = (
    "lab.runner",
    "lab.interference",
    "lab.budget",
    "lab.efficiency",
    "lab.faults",
    "lab.machines_bench",
    "lab.startup",
    "lab.order",
)


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="python tests/lab",
        description="The project's own benches (not shipped): side by side, ratios with their spread.",
    )
    parser.add_argument("-v", "--verbose", action="store_true", help="log progress details")
    sub = parser.add_subparsers(dest="suite", required=True)
    for name in SUITES:
        importlib.import_module(name).add_parser(sub)
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    logging.basicConfig(
        level=logging.INFO if args.verbose else logging.WARNING,
        format="%(levelname)s %(name)s: %(message)s",
    )
    args.command = "bench"  # the lab's suites are checked like the package's benches
    if refuse_bad_options("python tests/lab", args):
        return 2
    return int(args.func(args) or 0)
