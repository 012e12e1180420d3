"""``mlx-recovery bench server``."""

from __future__ import annotations

import argparse
import dataclasses
import sys
import tempfile
from pathlib import Path
from typing import TYPE_CHECKING

from ..openblas import add_openblas_flag, maybe_reexec
from .hosts import HOSTS, ServerHost
from .models import DEFAULT_TARGET, QUICK_DRAFT, QUICK_TARGET, ModelPair, check_models, link_models, parse_target
from .sessions import DEFAULT_CONVERSATIONS, DEFAULT_CURVE, SESSION_NAMES

if TYPE_CHECKING:
    from .run import BenchConfig


def add_parser(subparsers: argparse._SubParsersAction) -> None:
    p = subparsers.add_parser(
        "server",
        help="the three arms on a real server (oMLX family, rapid-mlx), driven by the OpenAI SDK",
        description="Start the server (`omlx serve`; `fusion-mlx serve` with --host fusion_mlx; `rapid-mlx serve` "
        "with --host rapid) on a loopback port per arm (sparse off, sparse on, sparse "
        "on + recovery attached by environment variables), drive agent sessions with the OpenAI "
        "SDK, and report per-turn cached tokens and time to first token.",
    )
    p.add_argument("--host", choices=sorted(HOSTS), default="omlx",
                   help="the server: omlx (flyto-mlx, SpecPrefill), fusion_mlx (fusion-mlx, SpecPrefill) or "
                   "rapid (rapid-mlx, PFlash on the uncached basis); default omlx")
    p.add_argument("--pflash-threshold", type=int, default=None,
                   help="rapid: PFlash threshold in uncached tokens (default 4096: the first turn crosses it, "
                   "an appended turn does not)")
    p.add_argument("--quick", action="store_true", help="smoke run: a tiny model, the agent session, 3 turns, 10 s think")
    p.add_argument("--sessions", nargs="+", choices=SESSION_NAMES, help="sessions to run (default: all; --quick: agent)")
    p.add_argument("--think-time", type=float, default=None, help="idle seconds between turns (default 30; --quick 10)")
    p.add_argument("--curve", type=float, nargs="+", default=None, help=f"think times of the curve (default {' '.join(f'{x:g}' for x in DEFAULT_CURVE)})")
    p.add_argument("--turns", type=int, default=None, help="turns per conversation (default 5; --quick 3)")
    p.add_argument("--conversations", type=int, default=None,
                   help=f"conversations of the concurrent session, each on its own schedule (default {DEFAULT_CONVERSATIONS})")
    p.add_argument("--repeats", type=int, default=None,
                   help="serve sparse on and sparse on + recovery this many times per session, alternating which "
                   "goes first, each concurrent repeat on another schedule; the ratios' median and range are "
                   "reported (sparse off runs once; default 1)")
    p.add_argument("--one-schedule", action="store_true",
                   help="with --repeats: every concurrent repeat on the first schedule, so that each later turn's "
                   "median ratio over the pairs is reported (default: each repeat on another schedule)")
    p.add_argument("--arrivals", choices=("own", "sparse-on"), default="own",
                   help="concurrent session: own (every arm sends each next turn the think time after its own "
                   "answer; default) or sparse-on (the recovery arm also waits until sparse on sent that turn, "
                   "sparse on served first in every pair: both arms see the same arrivals wherever recovery "
                   "was not slower, turns sparse on sent within 0.5 s of each other go in its order, and the "
                   "report gives the worst of those turns)")
    p.add_argument("--context-tokens", type=int, default=None,
                   help="tokens of each conversation's long first user message, in the target's tokens (default 8500)")
    p.add_argument("--tool-tokens", type=int, default=None,
                   help="tokens of the tool output each later turn appends, in the target's tokens (default 420: "
                   "with the reply and the question a turn grows by ~600; an agent reading files appends thousands)")
    p.add_argument("--max-tokens", type=int, default=None,
                   help="tokens each turn generates (default 2); the answers are compared with sparse off's")
    p.add_argument("--budget", type=float, default=50.0, help="recovery budget, %% of wall time (default 50)")
    p.add_argument("--target", metavar="HIDDENxLAYERS[xFFN[xHEADSxKV[xHEAD_DIM]]]", help="target shape (default: the bench target, "
                   f"{DEFAULT_TARGET.hidden_size}x{DEFAULT_TARGET.num_layers}x{DEFAULT_TARGET.intermediate_size})")
    p.add_argument("--model", metavar="NAME|PATH",
                   help="the target: a fetched model's name (smollm2, gemma3-270m: see `mlx-recovery models`) or an "
                   "mlx-lm model directory, served where it lies (default: the random-weight bench target)")
    p.add_argument("--draft", metavar="NAME|PATH", help="with --model: SpecPrefill's draft (oMLX family; default: the "
                   "model itself; it must share the target's tokenizer); not used with --host rapid")
    p.add_argument("--model-dir", metavar="DIR", help="serve an existing models directory instead (needs --target-id, --draft-id)")
    p.add_argument("--target-id", help="target model id (directory name) in --model-dir")
    p.add_argument("--draft-id", help="draft model id (directory name) in --model-dir (not needed with "
                   "--host rapid: PFlash needs no draft)")
    p.add_argument("--port", type=int, default=None, help="loopback port (default: a free one per server)")
    p.add_argument("--load-first-turn", action="store_true",
                   help="a competing CPU load (a busy loop per core) from each arm's first turn until its second is "
                   "sent, every arm waiting that first think time out: every arm's first turn and gap run on a loaded "
                   "machine, the later turns on a quiet one; in a concurrent session, from its start until its first "
                   "conversation's second turn is sent")
    p.add_argument("--settle", type=float, default=0.0, metavar="S",
                   help="the recovery arm stays idle S seconds after its last answer and the plugin's status is "
                   "read again: committed / run once that time has passed, beside the figure at the session's "
                   "end (default 0: not read again)")
    p.add_argument("--equal-idle", action="store_true",
                   help="sparse off and sparse on wait the real think time between turns too (default: 1 s, as "
                   "they do nothing while idle): every arm's turns arrive at a machine idle as long")
    p.add_argument("--publish-policy", help="MLX_RECOVERY_PUBLISH_POLICY for the recovery arm (default: the plugin's)")
    p.add_argument("--workdir", metavar="DIR", help="where models, caches and server logs go (default: a temp dir)")
    p.add_argument("--json", metavar="FILE", help="write the numbers as JSON")
    p.add_argument("--plot", metavar="FILE", help="draw per-step TTFT and cached tokens as a PNG")
    add_openblas_flag(p)
    p.set_defaults(func=_run)


def progress_to_stderr(line: str) -> None:
    print(line, file=sys.stderr, flush=True)


def _config(args: argparse.Namespace, workdir: Path) -> BenchConfig:
    from .run import BenchConfig

    if problems := model_option_problems(args):
        raise ValueError("; ".join(problems))
    config = BenchConfig(
        workdir=workdir, budget_pct=args.budget, port=args.port, publish_policy=args.publish_policy,
        load_first_turn=bool(getattr(args, "load_first_turn", False)),
        arrivals=getattr(args, "arrivals", None) or "own",
        equal_idle=bool(getattr(args, "equal_idle", False)),
    )
    if args.quick:
        config.target, config.draft = QUICK_TARGET, QUICK_DRAFT
        config.sessions, config.think_s, config.curve_turns = ("agent",), 10.0, 2
        config.shape = dataclasses.replace(config.shape, turns=3)
        config.curve = (5.0, 10.0)
        config.balance_repeats = 1
    host = HOSTS[getattr(args, "host", "omlx")]
    threshold = getattr(args, "pflash_threshold", None)
    config.host = host if threshold is None else dataclasses.replace(host, pflash_threshold=threshold)
    if args.target:
        config.target = parse_target(args.target)
    if getattr(args, "model", None):
        config.pair = named_pair(args.model, getattr(args, "draft", None), workdir, config.host)
    elif args.model_dir:
        if not args.target_id or (config.host.needs_draft and not args.draft_id):
            raise ValueError("--model-dir needs --target-id and --draft-id"
                             + ("" if config.host.needs_draft else " (--draft-id is optional with this host)"))
        config.pair = ModelPair(Path(args.model_dir), args.target_id, args.draft_id or "")
    if args.sessions:
        config.sessions = tuple(args.sessions)
    if args.think_time is not None:
        config.think_s = args.think_time
    if args.curve:
        config.curve = tuple(args.curve)
    if args.turns is not None:
        config.shape = dataclasses.replace(config.shape, turns=args.turns)
    if getattr(args, "context_tokens", None) is not None:
        if args.context_tokens <= 0:
            raise ValueError(f"--context-tokens must be positive; got {args.context_tokens}")
        config.shape = dataclasses.replace(config.shape, context_chars=args.context_tokens)
    if getattr(args, "tool_tokens", None) is not None:
        if args.tool_tokens < 0:
            raise ValueError(f"--tool-tokens must be 0 or more; got {args.tool_tokens}")
        config.shape = dataclasses.replace(config.shape, tool_chars=args.tool_tokens)
    if getattr(args, "conversations", None) is not None:
        if args.conversations < 1:
            raise ValueError(f"--conversations must be at least 1; got {args.conversations}")
        config.conversations = args.conversations
    if getattr(args, "repeats", None) is not None:
        if args.repeats < 1:
            raise ValueError(f"--repeats must be at least 1; got {args.repeats}")
        config.repeats = args.repeats
    config.one_schedule = bool(getattr(args, "one_schedule", False))
    if config.one_schedule and config.repeats < 2:
        raise ValueError("--one-schedule needs --repeats 2 or more")
    settle_s = float(getattr(args, "settle", 0.0) or 0.0)
    if settle_s < 0:
        raise ValueError(f"--settle must be 0 or more seconds; got {settle_s:g}")
    config.settle_s = settle_s
    if getattr(args, "max_tokens", None) is not None:
        config.max_tokens = args.max_tokens
    return config


# Options that say where the target comes from; --model is one of them on its own.
TARGET_OPTIONS = {"model_dir": "--model-dir", "target_id": "--target-id", "draft_id": "--draft-id",
                  "target": "--target"}
LINKED_MODELS = "linked-models"  # under the work directory: the links to --model and --draft


def model_option_problems(args: argparse.Namespace) -> list[str]:
    """What is wrong with how ``args`` choose the models (one line each; checked before
    any work by :mod:`mlx_recovery_plugin.cli_checks`, and again by :func:`_config`)."""
    model, draft = getattr(args, "model", None), getattr(args, "draft", None)
    problems = []
    if model:
        given = [flag for attr, flag in TARGET_OPTIONS.items() if getattr(args, attr, None)]
        if given:
            problems.append(f"--model names the target and serves it where it lies: it does not go with "
                            f"{', '.join(given)} (those serve a models directory, or the bench's own target)")
    elif draft:
        problems.append("--draft goes with --model (with --model-dir, the draft is --draft-id)")
    host = getattr(args, "host", "omlx")
    if draft and not HOSTS[host].needs_draft:
        problems.append(f"--draft is not used with --host {host}: its sparse route (PFlash) needs no draft")
    return problems


def named_pair(model: str, draft: str | None, workdir: Path, host: ServerHost) -> ModelPair:
    """``--model`` (and ``--draft``; default the model itself, where the host needs a
    draft) resolved and linked under ``workdir``, checked as the servers will need them."""
    from ...models.library import resolve_model

    target = resolve_model(model)
    draft_path = (resolve_model(draft) if draft else target) if host.needs_draft else None
    pair = link_models(workdir / LINKED_MODELS, target, draft_path)
    check_models(pair, needs_draft=host.needs_draft)
    return pair


def _run(args: argparse.Namespace) -> int:
    maybe_reexec(args)
    from .client import MissingMeasurementError
    from .models import ModelDirError
    from .process import ServerError, stop_all, stop_all_on_sigterm
    from .report import format_report, write_plot
    from .run import run_bench

    stop_all_on_sigterm()
    workdir = Path(args.workdir) if args.workdir else Path(tempfile.mkdtemp(prefix="mlx-recovery-bench-server-"))
    try:
        config = _config(args, workdir)
        progress_to_stderr(f"bench server: work directory {workdir} (server logs under runs/)")
        report = run_bench(config, progress=progress_to_stderr)
    except (ServerError, ModelDirError, MissingMeasurementError, ValueError) as exc:
        print(f"mlx-recovery bench server: {type(exc).__name__}: {exc}", file=sys.stderr)
        return 2
    except ImportError as exc:
        print(f"mlx-recovery bench server needs the server's packages: {exc} "
              "(pip install flyto-mlx uvicorn python-multipart psutil tabulate openai; see .ci/run)", file=sys.stderr)
        return 2
    finally:
        stop_all()
    print(format_report(report))
    if args.json:
        report.write_json(args.json)
    if args.plot:
        write_plot(report, args.plot)
    return 1 if report.tracebacks() else 0
