"""``mlx-recovery bench policy``."""

from __future__ import annotations

import argparse
import sys
import tempfile
from pathlib import Path

from ..openblas import add_openblas_flag, maybe_reexec
from ..server.models import shape_text
from .cells import APPEND, CONTEXTS, SHAPES, THRESHOLD, full_matrix, parse_shape, quick_matrix


def add_parser(subparsers: argparse._SubParsersAction) -> None:
    p = subparsers.add_parser(
        "policy",
        help="the publish policy's verdicts against the truth over target shapes, contexts and load",
        description="For each cell (target shape x context x competing CPU load), measure on the real oMLX "
        "scheduler in process the next turn's cached dense append against its sparse rerun (the truth), "
        "and what the recovery plugin decided for that turn after the first one was served on the sparse "
        "route; print the confusion matrix and what each wrong verdict cost.",
    )
    p.add_argument("--quick", action="store_true", help="tiny models at contexts scaled to a 256-token threshold (CI)")
    p.add_argument("--shapes", nargs="+", metavar="HxLxFFNxQxKV",
                   help="target shapes (default: " + " ".join(shape_text(s) for s in SHAPES) + ")")
    p.add_argument("--contexts", nargs="+", type=int, help=f"first-turn tokens (default {' '.join(map(str, CONTEXTS))})")
    p.add_argument("--append", type=int, default=APPEND,
                   help=f"tokens the next turn appends (default {APPEND}; an agent reading files appends thousands, "
                   "and the policy judges a conversation that has not grown yet at 512)")
    p.add_argument("--load", choices=("both", "off", "on"), default="both", help="cells with a competing CPU load "
                   "(default both)")
    p.add_argument("--load-at", choices=("first", "next"), default="first", help="when a loaded cell's load runs: "
                   "first (default): through the first turn and the first stretch of recovery's idle time, the next "
                   "turn on a quiet machine; next: from the second stretch of idle time through the next turn, "
                   "whose dense append and sparse rerun are then measured loaded too")
    p.add_argument("--load-processes", type=int, default=None, help="busy processes of the load (default: one per core)")
    p.add_argument("--repeats", type=int, default=2, help="dense/sparse pairs per cell (default 2)")
    p.add_argument("--budget", type=float, default=50.0, help="recovery budget, %% of wall time (default 50)")
    p.add_argument("--model-dir", metavar="DIR", help="where the random-weight models are written (default: a temp dir)")
    p.add_argument("--json", metavar="FILE", help="write the numbers as JSON")
    p.add_argument("--from-json", metavar="FILE", help="measure nothing: print the report of an earlier run's JSON")
    add_openblas_flag(p)
    p.set_defaults(func=_run)


def _run(args: argparse.Namespace) -> int:
    from .report import PolicyReport, format_report

    if args.from_json:
        print(format_report(PolicyReport.read_json(args.from_json)))
        return 0
    maybe_reexec(args)
    from .run import run_matrix

    loads = {"both": (False, True), "off": (False,), "on": (True,)}[args.load]
    try:
        if args.quick:
            matrix = quick_matrix(loads, args.load_at)
        else:
            shapes = tuple(parse_shape(s, seed=30 + i) for i, s in enumerate(args.shapes)) if args.shapes else SHAPES
            if not 0 < args.append < THRESHOLD:
                raise ValueError(f"--append must be between 1 and {THRESHOLD - 1} (the host's sparse threshold: a "
                                 f"longer turn goes sparse whatever is cached); got {args.append}")
            matrix = full_matrix(shapes, tuple(args.contexts) if args.contexts else CONTEXTS, loads, args.append,
                                 args.load_at)
        if args.repeats < 1:
            raise ValueError("--repeats must be at least 1")
    except ValueError as exc:
        print(f"mlx-recovery bench policy: {exc}", file=sys.stderr)
        return 2
    model_dir = Path(args.model_dir) if args.model_dir else Path(tempfile.mkdtemp(prefix="mlx-recovery-bench-policy-"))
    model_dir.mkdir(parents=True, exist_ok=True)
    report = run_matrix(matrix, model_dir, budget_pct=args.budget, repeats=args.repeats,
                        load_processes=args.load_processes,
                        progress=lambda line: print(line, file=sys.stderr, flush=True))
    print(format_report(report))
    if args.json:
        report.write_json(args.json)
    return 0
