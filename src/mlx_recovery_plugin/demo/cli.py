"""``mlx-recovery demo``."""

from __future__ import annotations

import argparse
import dataclasses

from ..bench.openblas import add_openblas_flag, maybe_reexec
from ..testing.tiny_model import TinyModelSpec
from .session import SessionSpec


def add_parser(subparsers: argparse._SubParsersAction) -> None:
    p = subparsers.add_parser(
        "demo",
        help="serve one agent session with the sparse route off, on, and on with recovery",
        description="Serve one append-heavy agent session three ways on the same host and "
        "compare per-turn cached tokens and time to first token.",
    )
    p.add_argument("--json", metavar="FILE", help="write the numbers as JSON")
    p.add_argument("--plot", metavar="FILE", help="draw per-turn TTFT and cached tokens as a PNG")
    p.add_argument("--model", metavar="NAME|PATH",
                   help="a fetched model's name (smollm2: see `mlx-recovery models`) or an mlx-lm model directory "
                   "(default: the random-weight bench model)")
    p.add_argument("--draft", metavar="NAME|PATH", help="draft model for the sparse route (default: the model itself)")
    p.add_argument("--host", choices=("mock", "omlx"), default="mock", help="mock host, or the real oMLX scheduler")
    p.add_argument("--turns", type=int, default=5, help="turns in the session (default 5: the real-server measurement's session)")
    p.add_argument("--repeats", type=int, default=1, help="serve the session this many times (spread of ratios)")
    p.add_argument("--budget", type=float, default=50.0, help="recovery budget, %% of wall time (default 50)")
    p.add_argument("--think-time", type=float, default=30.0, help="idle seconds between turns (simulated; default 30)")
    p.add_argument(
        "--sparse-threshold", type=int, default=None,
        help="uncached tokens above which a turn takes the sparse route (default 8192, the real server's: "
        "a turn whose uncached part is smaller is prefilled densely over the cached prefix)",
    )
    p.add_argument("--slice-tokens", type=int, default=None, help="tokens per recovery slice (default: the prefill step)")
    p.add_argument(
        "--answers", action="store_true",
        help="a recall session instead: facts in the first turn, later turns asking about them; print each "
        "arm's greedy answer per turn, whether it equals sparse off's, and the share of later turns that do",
    )
    p.add_argument("--max-tokens", type=int, default=None, help="tokens generated per turn (default 4; 12 with --answers)")
    p.add_argument("--system-tokens", type=int, default=None, help="tokens of the first turn's system message (default 8,500)")
    p.add_argument("--quick", action="store_true", help="a small model and a short session (a smoke run)")
    add_openblas_flag(p)
    p.set_defaults(func=_run)


def _run(args: argparse.Namespace) -> int:
    from ..models.library import resolve_model

    # Before any work: a model asked for by name and not fetched says what to run.
    for value in (args.model, args.draft):
        if value:
            resolve_model(value)
    maybe_reexec(args)  # float32 prefill is 15-20x faster on OpenBLAS than on MLX's bundled BLAS
    from .report import format_table, write_plot
    from .run import DemoConfig, progress_to_stderr, run_demo

    config = DemoConfig(
        session=SessionSpec(turns=args.turns, think_time_s=args.think_time),
        model_path=args.model,
        draft_path=args.draft,
        repeats=args.repeats,
        host=args.host,
        answers=args.answers,
    )
    config.serve = dataclasses.replace(
        config.serve, budget_pct=args.budget, slice_tokens=args.slice_tokens
    )
    if args.quick:
        config.target = TinyModelSpec(hidden_size=128, num_layers=2, num_heads=4, num_kv_heads=2, intermediate_size=256, seed=21)
        config.draft = TinyModelSpec(hidden_size=64, num_layers=1, num_heads=4, num_kv_heads=2, intermediate_size=128, seed=22)
        config.session = dataclasses.replace(config.session, system_tokens=1500, tool_tokens=200, question_tokens=40, reply_tokens=40)
        config.serve = dataclasses.replace(config.serve, model_id="tiny-llama-128x2", block_size=64, prefill_step=128, sparse_threshold=256)
    if args.model:
        config.serve = dataclasses.replace(config.serve, model_id=args.model)
    if args.system_tokens is not None:
        config.session = dataclasses.replace(config.session, system_tokens=args.system_tokens)
    max_tokens = args.max_tokens if args.max_tokens is not None else (12 if args.answers else None)
    if max_tokens is not None:
        config.serve = dataclasses.replace(config.serve, max_tokens=max_tokens)
    if args.sparse_threshold is not None:
        config.serve = dataclasses.replace(config.serve, sparse_threshold=args.sparse_threshold)
    if args.host == "omlx":
        from .omlx import run_omlx_demo

        report = run_omlx_demo(config, progress=progress_to_stderr)
        from .report import ARMS
        from .run import attach_balance, prepare_models

        longest = report.repeats[0][ARMS[0]].turns[-1].prompt_tokens
        attach_balance(report, prepare_models(config).model, longest, progress_to_stderr)
    else:
        report = run_demo(config, progress=progress_to_stderr)
    print(format_table(report))
    if args.answers:
        from .answers import format_answers

        print(format_answers(report))
    if args.json:
        report.write_json(args.json)
    if args.plot:
        write_plot(report, args.plot)
    return 0
