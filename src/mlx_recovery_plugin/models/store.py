"""Model directories in the user's cache, each written once with a checksum manifest.

A directory is built beside its final place and renamed into it with its
``manifest.json`` (the source it came from, the converter's version, each file's size
and SHA-256) already inside, so a directory under its final name is whole. A later fetch
that finds the manifest and every file matching does nothing; a missing, changed or extra
file, or a manifest from another source or converter, makes it rebuild. The root is the
bench models' (``$XDG_CACHE_HOME/mlx-recovery/models``). One thread: the caller's; two
processes building the same directory each build their own copy and the last rename
wins, which leaves a whole directory either way.
"""

from __future__ import annotations

import enum
import json
import os
import shutil
import tempfile
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from ..testing.tiny_model import model_cache_dir
from .fetch import sha256_file

MANIFEST = "manifest.json"
# Bump when the converter's output changes, so older directories are rebuilt.
CONVERTER_VERSION = 1


class Health(enum.Enum):
    OK = "fetched"
    MISSING = "not fetched"
    DAMAGED = "damaged"  # a file missing, changed or extra, or no manifest
    STALE = "stale"  # built from another source or by another converter


class Action(enum.Enum):
    ALREADY_THERE = "already there"
    BUILT = "built"
    REBUILT = "rebuilt"


@dataclass(slots=True, frozen=True)
class Check:
    health: Health
    reason: str = ""


@dataclass(slots=True, frozen=True)
class Ensured:
    path: Path
    action: Action
    reason: str = ""  # why it was rebuilt


def models_root() -> Path:
    return model_cache_dir()


def describe_files(path: Path) -> dict[str, dict[str, Any]]:
    return {
        f.name: {"size": f.stat().st_size, "sha256": sha256_file(f)}
        for f in sorted(path.iterdir())
        if f.is_file() and f.name != MANIFEST
    }


def check(path: Path, source: dict[str, Any]) -> Check:
    """Whether ``path`` holds a whole directory built from ``source`` by this converter."""
    if not path.is_dir():
        return Check(Health.MISSING)
    try:
        manifest = json.loads((path / MANIFEST).read_text())
    except (OSError, ValueError):
        return Check(Health.DAMAGED, "no readable manifest")
    if manifest.get("source") != source or manifest.get("converter") != CONVERTER_VERSION:
        return Check(Health.STALE, "built from another source or converter version")
    wanted: dict[str, dict[str, Any]] = manifest.get("files", {})
    present = {f.name for f in path.iterdir() if f.is_file() and f.name != MANIFEST}
    if present != set(wanted):
        missing, extra = sorted(set(wanted) - present), sorted(present - set(wanted))
        return Check(Health.DAMAGED, f"files missing {missing} or unexpected {extra}")
    for name, facts in wanted.items():
        f = path / name
        # Size first: a truncated file is found without reading it.
        if f.stat().st_size != facts["size"] or sha256_file(f) != facts["sha256"]:
            return Check(Health.DAMAGED, f"{name} does not match its checksum")
    return Check(Health.OK)


def ensure(path: Path, source: dict[str, Any], build: Callable[[Path], None]) -> Ensured:
    """``path`` whole and built from ``source``: left alone if it already is, else built
    with ``build(tmp_dir)`` beside it and renamed into place."""
    found = check(path, source)
    if found.health is Health.OK:
        return Ensured(path, Action.ALREADY_THERE)
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=f".{path.name}-", dir=path.parent))
    try:
        build(tmp)
        manifest = {"source": source, "converter": CONVERTER_VERSION, "files": describe_files(tmp)}
        (tmp / MANIFEST).write_text(json.dumps(manifest, indent=1))
        if path.exists():
            old = path.with_name(f".{path.name}-old-{os.getpid()}")
            path.rename(old)
            shutil.rmtree(old, ignore_errors=True)
        tmp.rename(path)
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    action = Action.BUILT if found.health is Health.MISSING else Action.REBUILT
    return Ensured(path, action, found.reason or found.health.value)
