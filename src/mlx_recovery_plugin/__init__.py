"""Prefix-state recovery and partial-prefix adoption for MLX inference servers."""

from __future__ import annotations

TYPE_CHECKING = False  # typing's own costs ms to import; mypy reads this name the same
if TYPE_CHECKING:
    from typing import Any

    from .hookspecs import hookimpl

__version__ = "0.1.0"
__all__ = ["__version__", "hookimpl"]


def __getattr__(name: str) -> Any:
    # Lazy, so the start-up hook's import of a subpackage does not pull in pluggy.
    if name == "hookimpl":
        from .hookspecs import hookimpl

        return hookimpl
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
