"""The oMLX family's host adapter: lifecycle hooks, host ports and idle driving for
servers built on oMLX's scheduler (flyto-mlx 0.7, fusion-mlx 0.10; see :mod:`.members`).

Importing this package does not import a host; :meth:`OmlxInstrumentor.instrument` does.
``omlx_adapter`` and ``fusion_mlx_adapter`` are the entry points' adapters.
"""

from .instrumentor import OmlxInstrumentor, version_supported
from .members import FLYTO_MLX, FUSION_MLX, MEMBERS, Member, member_of

omlx_adapter = OmlxInstrumentor(FLYTO_MLX)
fusion_mlx_adapter = OmlxInstrumentor(FUSION_MLX)

__all__ = [
    "FLYTO_MLX",
    "FUSION_MLX",
    "MEMBERS",
    "Member",
    "OmlxInstrumentor",
    "fusion_mlx_adapter",
    "member_of",
    "omlx_adapter",
    "version_supported",
]
