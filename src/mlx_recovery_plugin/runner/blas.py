"""Which BLAS serves MLX's float32 matrix work on the CPU, and the fix when it is the slow one.

The Linux CPU wheel of MLX bundles a reference BLAS (about 5 GFLOP/s on one thread).
Preloading the system OpenBLAS makes float32 matrix products 15-20x faster; MLX resolves
``cblas_sgemm`` through the process's global symbol scope first, so a preloaded library
wins over the bundled one. bfloat16/float16 do not go through BLAS on the CPU, and on
macOS MLX uses Accelerate (and Metal), so only Linux float32 on the CPU is affected.

This module only tells (the runner warns once when a host runs float32 on the slow
BLAS); re-running a command on OpenBLAS, from the system or from pip, is the tools'
business (:mod:`mlx_recovery_plugin.bench.openblas`).
"""

from __future__ import annotations

import ctypes
import logging
import os
import platform
from collections.abc import Iterable
from dataclasses import dataclass
from pathlib import Path

import mlx.core as mx

log = logging.getLogger(__name__)

OPENBLAS_CANDIDATES = (
    "/usr/lib/x86_64-linux-gnu/openblas-pthread/libopenblas.so.0",
    "/usr/lib/aarch64-linux-gnu/openblas-pthread/libopenblas.so.0",
    "/usr/lib64/libopenblasp.so.0",
    "/usr/lib64/libopenblas.so.0",
    "/usr/lib/libopenblas.so.0",
)

FIX_HINT = (
    "install the system OpenBLAS (Debian/Ubuntu: apt install libopenblas0-pthread) and "
    "start the process with LD_PRELOAD={path}, or pip install 'mlx-recovery-plugin[openblas]' "
    "and let the demo and benches re-run themselves on it"
)


@dataclass(slots=True, frozen=True)
class BlasInfo:
    """``kind``: ``"openblas"``, ``"reference"`` (MLX's bundled BLAS), ``"accelerate"``,
    ``"gpu"`` or ``"unknown"``; ``library``: the file that serves ``cblas_sgemm``, if known."""

    kind: str
    library: str | None = None

    @property
    def slow_for_float32(self) -> bool:
        return self.kind == "reference"


def _global_sgemm_library() -> str | None:
    """The shared object ``cblas_sgemm`` resolves to in the global scope, if any."""
    try:
        process = ctypes.CDLL(None)
        symbol = process.cblas_sgemm
    except (OSError, AttributeError):
        return None

    class _DlInfo(ctypes.Structure):
        _fields_ = [
            ("dli_fname", ctypes.c_char_p),
            ("dli_fbase", ctypes.c_void_p),
            ("dli_sname", ctypes.c_char_p),
            ("dli_saddr", ctypes.c_void_p),
        ]

    info = _DlInfo()
    try:
        found = process.dladdr(ctypes.cast(symbol, ctypes.c_void_p), ctypes.byref(info))
    except AttributeError:
        return None
    if not found or not info.dli_fname:
        return None
    return os.fsdecode(info.dli_fname)


def _loaded_libraries(maps: Path = Path("/proc/self/maps")) -> list[str]:
    try:
        text = maps.read_text()
    except OSError:
        return []
    return sorted({line.split()[-1] for line in text.splitlines() if ".so" in line})


def classify(
    system: str, device_is_gpu: bool, sgemm_library: str | None, loaded: Iterable[str]
) -> BlasInfo:
    """Pure decision from what was observed (separated out so it can be tested)."""
    if device_is_gpu:
        return BlasInfo("gpu")
    if system == "Darwin":
        return BlasInfo("accelerate")
    if sgemm_library and "openblas" in Path(sgemm_library).name.lower():
        return BlasInfo("openblas", sgemm_library)
    for lib in loaded:
        name = Path(lib).name.lower()
        if "mlx" in lib.lower() and name.startswith("libblas"):
            return BlasInfo("reference", lib)
    if sgemm_library:
        return BlasInfo("unknown", sgemm_library)
    return BlasInfo("unknown")


def detect() -> BlasInfo:
    """What serves float32 matrix products for MLX in this process right now."""
    return classify(
        platform.system(),
        mx.default_device() == mx.gpu,
        _global_sgemm_library() if platform.system() == "Linux" else None,
        _loaded_libraries() if platform.system() == "Linux" else (),
    )


def describe() -> str:
    """One short line, e.g. ``"openblas (/usr/lib/.../libopenblas.so.0)"``."""
    info = detect()
    labels = {
        "openblas": "openblas",
        "reference": "reference BLAS bundled with MLX (slow for float32)",
        "accelerate": "accelerate",
        "gpu": "gpu (no CPU BLAS)",
        "unknown": "unknown BLAS",
    }
    label = labels.get(info.kind, info.kind)
    return f"{label} ({info.library})" if info.library and info.kind == "openblas" else label


def openblas_preload_path(candidates: Iterable[str] = OPENBLAS_CANDIDATES) -> str | None:
    """The system OpenBLAS to put in ``LD_PRELOAD``, if one is installed (Linux only)."""
    if platform.system() != "Linux":
        return None
    for candidate in candidates:
        if Path(candidate).is_file():
            return candidate
    return None


_warned = False


def warn_once_if_slow(dtype: mx.Dtype | None = mx.float32, info: BlasInfo | None = None) -> bool:
    """Log one warning per process, with the fix, when float32 runs on the slow BLAS.

    Returns True when it warned on this call.
    """
    global _warned
    if _warned or (dtype is not None and dtype != mx.float32):
        return False
    info = detect() if info is None else info
    if not info.slow_for_float32:
        return False
    _warned = True
    path = openblas_preload_path() or OPENBLAS_CANDIDATES[0]
    log.warning(
        "MLX uses its bundled reference BLAS: float32 prefill is 15-20x slower than it "
        "could be; " + FIX_HINT.format(path=path)
    )
    return True
