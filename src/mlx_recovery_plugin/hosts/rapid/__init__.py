"""The rapid-mlx host adapter: lifecycle hooks, whole-entry prefix-cache port and idle
driving for rapid-mlx 0.16, whose PFlash route compresses long prompts and keeps nothing.

Importing this package imports neither rapid-mlx, MLX, asyncio nor pluggy (beyond what
the parent packages import); :meth:`RapidInstrumentor.instrument` does the heavy work.
"""

from .instrumentor import HOST_PACKAGE, VERSIONS, RapidInstrumentor, version_supported

__all__ = ["HOST_PACKAGE", "VERSIONS", "RapidInstrumentor", "version_supported"]
