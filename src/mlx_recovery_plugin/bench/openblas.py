"""Re-running a tool's command line on OpenBLAS: from the system, or from pip.

The demo and every bench call :func:`maybe_reexec` first. When MLX uses its slow bundled
BLAS (:mod:`mlx_recovery_plugin.runner.blas` tells), :func:`reexec_with_openblas` re-runs
the command under the system OpenBLAS or, without a system package, under the
cmeel-openblas wheel that the ``openblas`` extra installs.
"""

from __future__ import annotations

import argparse
import hashlib
import os
import platform
import sys
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

from ..runner.blas import FIX_HINT, OPENBLAS_CANDIDATES, BlasInfo, describe, detect, openblas_preload_path
from ..settings import OPENBLAS_REEXEC_VARIABLE, OPENBLAS_VARIABLE

__all__ = [
    "OPENBLAS_ENV",
    "REEXEC_MARKER",
    "OpenblasChoice",
    "OpenblasPlan",
    "add_openblas_flag",
    "choose_openblas",
    "maybe_reexec",
    "openblas_preload_path",
    "preload_env",
    "reexec_with_openblas",
    "wheel_files",
]


def preload_env(path: str, env: dict[str, str] | None = None) -> dict[str, str]:
    """A copy of ``env`` (default: this process's) with ``path`` first in ``LD_PRELOAD``."""
    out = dict(os.environ if env is None else env)
    current = [p for p in out.get("LD_PRELOAD", "").split(":") if p and p != path]
    out["LD_PRELOAD"] = ":".join([path, *current])
    return out


# -- OpenBLAS from the system, or from pip --------------------------------------------
#
# The cmeel-openblas wheel ships libopenblas.so.0 with the standard CBLAS symbols. It needs
# libgfortran.so.5 (which needs libquadmath), and MLX's Linux CPU wheel bundles both under
# hashed names in mlx_cpu.libs/. A private directory of links under the names the loader
# asks for, on LD_LIBRARY_PATH, lets the wheel's OpenBLAS be preloaded with no system
# package at all.

REEXEC_MARKER = OPENBLAS_REEXEC_VARIABLE
OPENBLAS_ENV = OPENBLAS_VARIABLE
OPENBLAS_MODES = ("auto", "system", "wheel", "off")
WHEEL_HINT = "pip install 'mlx-recovery-plugin[openblas]'"


@dataclass(slots=True, frozen=True)
class OpenblasPlan:
    """How to start a process on OpenBLAS: preload ``library`` (from ``source``,
    ``"system"`` or ``"wheel"``) with ``library_dirs`` first on ``LD_LIBRARY_PATH``."""

    source: str
    library: str
    library_dirs: tuple[str, ...] = ()

    def env(self, base: dict[str, str] | None = None) -> dict[str, str]:
        out = preload_env(self.library, base)
        if self.library_dirs:
            rest = [p for p in out.get("LD_LIBRARY_PATH", "").split(":") if p and p not in self.library_dirs]
            out["LD_LIBRARY_PATH"] = ":".join([*self.library_dirs, *rest])
        return out


@dataclass(slots=True, frozen=True)
class OpenblasChoice:
    """``plan``: what to re-run under, or None; ``reason``: one line saying which, or why not."""

    plan: OpenblasPlan | None
    reason: str


def _distribution_path(dist: str, relative: str) -> Path | None:
    from importlib.metadata import PackageNotFoundError, distribution

    try:
        return Path(str(distribution(dist).locate_file(relative)))
    except PackageNotFoundError:
        return None


def wheel_files() -> tuple[Path | None, Path | None]:
    """cmeel-openblas's ``libopenblas.so.0`` and MLX's ``mlx_cpu.libs`` directory, where installed."""
    return (
        _distribution_path("cmeel-openblas", "cmeel.prefix/lib/libopenblas.so.0"),
        _distribution_path("mlx-cpu", "mlx_cpu.libs"),
    )


def _link_dir(bundled: Path) -> Path:
    base = os.environ.get("XDG_CACHE_HOME") or str(Path.home() / ".cache")
    key = hashlib.sha1(str(bundled.resolve()).encode()).hexdigest()[:12]
    return Path(base) / "mlx-recovery" / "openblas-libs" / key


def _link(target: Path, link: Path) -> None:
    if link.is_symlink() and Path(os.readlink(link)) == target:
        return
    tmp = link.with_name(f".{link.name}.{os.getpid()}")
    tmp.unlink(missing_ok=True)
    tmp.symlink_to(target)
    tmp.replace(link)  # atomic: a concurrent run sees the old link or the new one


def wheel_plan(library: Path | None, bundled: Path | None, link_dir: Path | None = None) -> OpenblasChoice:
    """Preload the wheel's OpenBLAS, its Fortran runtime linked from MLX's bundled copies."""
    if library is None or not library.is_file():
        return OpenblasChoice(None, f"the cmeel-openblas wheel is not installed ({WHEEL_HINT})")
    if bundled is None or not bundled.is_dir():
        return OpenblasChoice(None, "MLX's CPU wheel (mlx_cpu.libs) is not installed: no libgfortran for the wheel's OpenBLAS")
    needed = {"libgfortran.so.5": "libgfortran*.so.5*", "libquadmath.so.0": "libquadmath*.so.0*"}
    found = {name: sorted(bundled.glob(pattern)) for name, pattern in needed.items()}
    missing = [name for name, files in found.items() if not files]
    if missing:
        return OpenblasChoice(None, f"{bundled} has no {' or '.join(missing)} for the wheel's OpenBLAS")
    link_dir = _link_dir(bundled) if link_dir is None else link_dir
    try:
        link_dir.mkdir(parents=True, exist_ok=True)
        for name, (file, *_) in found.items():
            _link(file.resolve(), link_dir / name)  # the name libopenblas asks for
            _link(file.resolve(), link_dir / file.name)  # the hashed name libgfortran asks for
    except OSError as exc:
        return OpenblasChoice(None, f"cannot link the Fortran runtime for the wheel's OpenBLAS into {link_dir}: {exc}")
    plan = OpenblasPlan("wheel", str(library), (str(link_dir),))
    return OpenblasChoice(plan, f"OpenBLAS from the cmeel-openblas wheel ({library})")


def choose_openblas(
    mode: str | None = None,
    *,
    system: str | None = None,
    info: BlasInfo | None = None,
    system_library: str | bool | None = False,
    wheel: tuple[Path | None, Path | None] | None = None,
) -> OpenblasChoice:
    """What to re-run under: the system OpenBLAS first, else the wheel's, else nothing and
    why. ``mode`` (default: ``$MLX_RECOVERY_OPENBLAS`` or ``auto``) restricts the sources;
    the other arguments default to what this process observes (overridable for tests)."""
    mode = (mode or os.environ.get(OPENBLAS_ENV) or "auto").strip().lower()
    if mode not in OPENBLAS_MODES:
        return OpenblasChoice(None, f"{OPENBLAS_ENV}={mode!r} is not one of {', '.join(OPENBLAS_MODES)}")
    if mode == "off":
        return OpenblasChoice(None, f"OpenBLAS re-run off ({OPENBLAS_ENV}=off)")
    system = platform.system() if system is None else system
    if system == "Darwin":
        return OpenblasChoice(None, "not needed on macOS: MLX uses Accelerate and Metal")
    if system != "Linux":
        return OpenblasChoice(None, f"no OpenBLAS re-run on {system}")
    info = detect() if info is None else info
    if info.kind == "gpu":
        return OpenblasChoice(None, "not needed: MLX runs on the GPU, not a CPU BLAS")
    if info.kind == "openblas":
        return OpenblasChoice(None, f"already on OpenBLAS ({info.library})")
    if not info.slow_for_float32:
        return OpenblasChoice(None, f"MLX's float32 products are served by {info.library or 'an unknown BLAS'}; left as is")
    if mode in ("auto", "system"):
        path = openblas_preload_path() if system_library is False else system_library
        if path:
            return OpenblasChoice(OpenblasPlan("system", str(path)), f"the system OpenBLAS ({path})")
        if mode == "system":
            return OpenblasChoice(None, f"no system OpenBLAS ({OPENBLAS_ENV}=system); {FIX_HINT.format(path=OPENBLAS_CANDIDATES[0])}")
    choice = wheel_plan(*(wheel_files() if wheel is None else wheel))
    if choice.plan is None and mode == "auto":
        return OpenblasChoice(None, f"no system OpenBLAS, and {choice.reason}")
    return choice


def reexec_with_openblas(command: Sequence[str] | None = None, *, mode: str | None = None) -> OpenblasChoice:
    """Re-run this process's command line (default ``sys.orig_argv``) under OpenBLAS when
    MLX uses its slow bundled BLAS: the system library first, else the cmeel-openblas
    wheel's. Otherwise print one line saying why not (stderr) and return the choice.

    Never loops: the child is marked and does not re-execute again.
    """
    if os.environ.get(REEXEC_MARKER):
        info = detect()
        if info.kind != "openblas" and platform.system() == "Linux" and info.kind != "gpu":
            line = f"the OpenBLAS preload did not take effect (LD_PRELOAD={os.environ.get('LD_PRELOAD', '')}); running on {describe()}"
            print(f"OpenBLAS: {line}", file=sys.stderr, flush=True)
            return OpenblasChoice(None, line)
        return OpenblasChoice(None, f"re-run on {describe()}")
    choice = choose_openblas(mode)
    if choice.plan is None:
        print(f"OpenBLAS: {choice.reason}", file=sys.stderr, flush=True)
        return choice
    argv = list(command) if command else [sys.executable, *sys.orig_argv[1:]]
    env = choice.plan.env()
    env[REEXEC_MARKER] = "1"
    print(f"re-running under {choice.reason}", file=sys.stderr, flush=True)
    os.execve(argv[0], argv, env)
    return choice  # only reached when execve is replaced (tests)


def add_openblas_flag(parser: argparse.ArgumentParser) -> None:
    """The ``--no-openblas`` flag every command that calls :func:`maybe_reexec` offers."""
    parser.add_argument(
        "--no-openblas", action="store_true",
        help=f"do not re-run under OpenBLAS (system, else the cmeel-openblas wheel) when MLX "
        f"uses its slow bundled BLAS; {OPENBLAS_ENV}=system|wheel|off picks the source",
    )


def maybe_reexec(args: argparse.Namespace) -> None:
    """The demo's and benches' first step: re-run under OpenBLAS unless ``--no-openblas``."""
    if not getattr(args, "no_openblas", False):
        reexec_with_openblas()
