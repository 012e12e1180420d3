"""The oMLX host adapter: lifecycle hooks, host ports and idle driving for oMLX 0.7.

Importing this package does not import oMLX; :meth:`OmlxInstrumentor.instrument` does.
"""

from .instrumentor import SUPPORTED_VERSIONS, OmlxInstrumentor, version_supported

__all__ = ["SUPPORTED_VERSIONS", "OmlxInstrumentor", "version_supported"]
