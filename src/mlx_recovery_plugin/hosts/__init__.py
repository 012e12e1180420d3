"""Host adapters: attach the lifecycle hooks to servers that have no plugin loader.

The names below live in :mod:`.adapters`; they are loaded on first use, so that the
start-up hook (:mod:`.startup`), which imports this package in every Python process
where recovery is enabled, pays for none of it (pluggy, ``importlib.metadata``).
"""

from __future__ import annotations

TYPE_CHECKING = False  # typing's own costs ms to import; mypy reads this name the same
if TYPE_CHECKING:
    from typing import Any

    from .adapters import (
        HOSTS_ENTRY_POINT_GROUP,
        HostAdapter,
        HostsReport,
        instrument_installed_hosts,
        load_host_adapters,
        uninstrument_all_hosts,
    )

__all__ = [
    "HOSTS_ENTRY_POINT_GROUP",
    "HostAdapter",
    "HostsReport",
    "instrument_installed_hosts",
    "load_host_adapters",
    "uninstrument_all_hosts",
]


def __getattr__(name: str) -> Any:
    if name in __all__:
        from . import adapters

        return getattr(adapters, name)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
