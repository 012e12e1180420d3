"""Prefix-state recovery and partial-prefix adoption for MLX inference servers."""

from .hookspecs import hookimpl

__version__ = "0.1.0"
__all__ = ["__version__", "hookimpl"]
