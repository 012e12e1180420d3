"""``mlx-recovery status`` and ``mlx-recovery budget``: the control channel's command line.

Each command finds the serving process's socket (``--socket``, the configured path, or
this user's single live one), sends one request and prints the answer.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
from typing import Any

from .recovery import control_paths
from .recovery.control import request
from .recovery.control_paths import CONTROL_SOCKET_OFF, ControlError
from .settings import env_name, validate_budget_pct


def add_parser(subparsers: Any) -> None:
    """Add ``status`` and ``budget`` to an argparse sub-command set. Each sets
    ``func(args) -> int`` (the exit code) as its handler."""
    status = subparsers.add_parser(
        "status", help="show recovery status of the running server (over its control socket)"
    )
    status.add_argument("--socket", help="control socket path (default: find this user's one)")
    status.add_argument("--json", action="store_true", help="print the raw JSON status")
    status.set_defaults(func=status_command)

    budget = subparsers.add_parser(
        "budget", help="change the running server's recovery budget in place (0 = off)"
    )
    budget.add_argument("pct", type=float, help="share of wall time for recovery, 0..100")
    budget.add_argument("--socket", help="control socket path (default: find this user's one)")
    budget.add_argument("--json", action="store_true", help="print the raw JSON answer")
    budget.set_defaults(func=budget_command)


def target_socket(given: str | None) -> str:
    """The socket a command talks to: ``--socket``, else the configured one, else the
    single live socket of this user. Raises :class:`ControlError` when none or several."""
    if given:
        return os.path.expanduser(given)
    configured = os.environ.get(env_name("control_socket"), "").strip()
    if configured.lower() in CONTROL_SOCKET_OFF:
        raise ControlError(
            f"the control channel is off ({env_name('control_socket')}={configured})"
        )
    if configured and control_paths.fits(os.path.expanduser(configured)):
        return os.path.expanduser(configured)
    # Unset, or too long for a socket address: the server fell back to a default place.
    found = control_paths.find_sockets()
    if not found:
        raise ControlError(
            "no running server with mlx-recovery found (looked in "
            + ", ".join(control_paths.socket_dirs())
            + "); pass --socket PATH"
        )
    if len(found) > 1:
        raise ControlError(
            "several servers with mlx-recovery are running; pick one with --socket:\n  "
            + "\n  ".join(found)
        )
    return found[0]


def status_command(args: argparse.Namespace) -> int:
    response = _call(args, {"op": "status"})
    if response is None:
        return 1
    if args.json:
        print(json.dumps(response["status"], indent=2, sort_keys=True))
    else:
        print("\n".join(format_tree(response["status"])))
    return 0


def budget_command(args: argparse.Namespace) -> int:
    try:
        validate_budget_pct(args.pct)
    except ValueError as exc:
        print(f"mlx-recovery: {exc}", file=sys.stderr)
        return 2
    response = _call(args, {"op": "budget", "pct": args.pct})
    if response is None:
        return 1
    if args.json:
        print(json.dumps(response["budget"], indent=2, sort_keys=True))
    elif args.pct == 0:
        print("mlx-recovery: budget set to 0 %: recovery is off from now on")
    else:
        print(f"mlx-recovery: budget set to {args.pct:g} % of wall time, from the next window")
    return 0


def _call(args: argparse.Namespace, payload: dict[str, Any]) -> dict[str, Any] | None:
    try:
        response = request(target_socket(getattr(args, "socket", None)), payload)
    except ControlError as exc:
        print(f"mlx-recovery: {exc}", file=sys.stderr)
        return None
    if not response.get("ok"):
        reason = response.get("error", "no reason given")
        print(f"mlx-recovery: the server refused: {reason}", file=sys.stderr)
        return None
    return response


def format_tree(value: Any, indent: int = 0) -> list[str]:
    """A nested status as indented ``key: value`` lines."""
    pad = "  " * indent
    if isinstance(value, dict):
        lines = []
        for key, item in value.items():
            if isinstance(item, dict) and item:
                lines.append(f"{pad}{key}:")
                lines.extend(format_tree(item, indent + 1))
            elif isinstance(item, list) and any(isinstance(x, dict) for x in item):
                lines.append(f"{pad}{key}:")
                for element in item:
                    sub = format_tree(element, indent + 2)
                    lines.append(f"{pad}  - " + sub[0].lstrip() if sub else f"{pad}  -")
                    lines.extend(sub[1:])
            else:
                lines.append(f"{pad}{key}: {_scalar(item)}")
        return lines
    return [f"{pad}{_scalar(value)}"]


def _scalar(value: Any) -> str:
    if isinstance(value, float):
        return f"{value:.4g}"
    if isinstance(value, list):
        return ", ".join(_scalar(v) for v in value) if value else "-"
    if isinstance(value, dict):
        return "-"
    if value is None:
        return "-"
    return str(value)
