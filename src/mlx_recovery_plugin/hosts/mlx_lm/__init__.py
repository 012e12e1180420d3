"""The mlx-lm server adapter: partial-prefix adoption for models whose prompt cache
mlx-lm cannot trim (hybrids with recurrent layers, sliding-window models past their
window), by boundary snapshots of those layers taken during the host's own prefill.

Importing this package imports neither mlx-lm, MLX nor pluggy (beyond what the parent
packages import); :meth:`MlxLmInstrumentor.instrument` does the heavy work.
"""

from .instrumentor import HOST_PACKAGE, VERSIONS, MlxLmInstrumentor, version_supported

__all__ = ["HOST_PACKAGE", "VERSIONS", "MlxLmInstrumentor", "version_supported"]
