"""What a command's options need, checked before the command does any work.

A bench that runs ten minutes and then finds ``--plot`` cannot be drawn, or a demo that
builds models and then finds ``--host omlx`` is not installed, wastes the run. ``main``
calls :func:`check_options` on the parsed arguments of every command, before its
handler; each check here looks at an option by its name, whichever command has it:

- ``--plot FILE``: matplotlib is importable, and FILE's directory exists;
- ``--json FILE`` (where it names a file) and ``--out FILE``: FILE's directory exists;
- ``--model``, ``--draft``, ``--model-dir``: the directory exists (``--model`` and
  ``--draft`` may also name a known trained model: it is fetched, or the command to fetch
  it is said); ``bench server``: the options that choose its models go together
  (``--model`` not with ``--model-dir`` or ``--target``, see ``model_option_problems``);
- ``--host``: the host the command would drive is installed (``demo`` and ``bench
  faults``: the ``omlx`` package; ``bench server``: the server's console script);
  ``bench adopter``'s ``--plot`` and ``--long-run`` need ``--host mlx_lm``.

Nothing here imports a host or MLX; it runs on the main thread before anything starts.
"""

from __future__ import annotations

import argparse
import importlib.util
import sys
from collections.abc import Callable
from pathlib import Path

PLOT_HINT = "--plot needs matplotlib: pip install 'mlx-recovery-plugin[plot]'"
MODEL_DIR_OPTIONS = {"model": "--model", "draft": "--draft", "model_dir": "--model-dir"}
OUTPUT_OPTIONS = {"plot": "--plot", "json": "--json", "out": "--out"}


def module_available(name: str) -> bool:
    """``name`` can be imported here (found, not imported)."""
    try:
        return importlib.util.find_spec(name) is not None
    except (ImportError, ValueError):
        return False


def refuse_bad_options(prog: str, args: argparse.Namespace) -> bool:
    """Print every problem with ``args``' options (one line each, to stderr); True if
    there was any, so the command must not start."""
    problems = check_options(args)
    for problem in problems:
        print(f"{prog}: {problem}", file=sys.stderr)
    return bool(problems)


def check_options(args: argparse.Namespace) -> list[str]:
    """Every problem with the options of ``args``, each one line naming its option."""
    problems: list[str] = []
    for check in CHECKS:
        problems.extend(check(args))
    return problems


def _plot(args: argparse.Namespace) -> list[str]:
    if isinstance(getattr(args, "plot", None), str) and not module_available("matplotlib"):
        return [PLOT_HINT]
    return []


def _outputs(args: argparse.Namespace) -> list[str]:
    problems = []
    for attr, flag in OUTPUT_OPTIONS.items():
        value = getattr(args, attr, None)
        if isinstance(value, str) and value:
            parent = Path(value).expanduser().parent
            if not parent.is_dir():
                problems.append(f"{flag} {value}: directory {parent} does not exist")
    return problems


def _model_dirs(args: argparse.Namespace) -> list[str]:
    problems = []
    for attr, flag in MODEL_DIR_OPTIONS.items():
        value = getattr(args, attr, None)
        if not isinstance(value, (str, Path)) or not str(value) or Path(value).expanduser().is_dir():
            continue
        if attr in ("model", "draft") and isinstance(value, str):
            from .models.catalog import KNOWN
            from .models.library import ModelNotFetched, resolve_model

            if value in KNOWN:  # a trained model by name: fetched, or say how to fetch it
                try:
                    resolve_model(value)
                except ModelNotFetched as exc:
                    problems.append(str(exc))
                continue
            problems.append(f"{flag} {value}: no such directory (nor a known model name: {', '.join(KNOWN)})")
            continue
        problems.append(f"{flag} {value}: no such directory")
    return problems


def _model_choice(args: argparse.Namespace) -> list[str]:
    if (getattr(args, "command", None), getattr(args, "suite", None)) != ("bench", "server"):
        return []
    from .bench.server.cli import model_option_problems

    return model_option_problems(args)


def _host(args: argparse.Namespace) -> list[str]:
    host = getattr(args, "host", None)
    command = (getattr(args, "command", None), getattr(args, "suite", None))
    if command in (("demo", None), ("bench", "faults")) and host == "omlx" and not module_available("omlx"):
        return ["--host omlx needs oMLX installed (pip install flyto-mlx; see tests/omlx-requirements.txt)"]
    if command == ("bench", "adopter") and host != "mlx_lm":
        asked = [flag for flag, value in (("--plot", getattr(args, "plot", None)),
                                          ("--long-run", getattr(args, "long_run", 0))) if value]
        if asked:
            return [f"{' and '.join(asked)} need --host mlx_lm (the mock host's bench has neither)"]
    if command == ("bench", "server") and isinstance(host, str):
        from .bench.server.hosts import HOSTS
        from .bench.server.process import host_command

        try:
            host_command(HOSTS[host])
        except Exception as exc:  # noqa: BLE001 - said as the option's problem
            return [f"--host {host}: {exc}"]
    return []


CHECKS: tuple[Callable[[argparse.Namespace], list[str]], ...] = (_plot, _outputs, _model_dirs, _model_choice, _host)
