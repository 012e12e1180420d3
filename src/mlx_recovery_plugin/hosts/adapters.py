"""Loading host adapters: the entry-point group ``mlx_recovery_plugin.hosts``.

An adapter is found through the entry-point group ``mlx_recovery_plugin.hosts``, so
another server can ship one without changing this package. The entry point names a
class (instantiated with no arguments) or an object that satisfies :class:`HostAdapter`.
:func:`instrument_installed_hosts` loads every adapter and instruments those whose host
is importable; an adapter that fails to load, or whose host is missing or of an
unsupported version, is logged and skipped.
"""

from __future__ import annotations

import logging
from collections.abc import Iterable
from dataclasses import dataclass, field
from importlib.metadata import EntryPoint, entry_points
from typing import Protocol, runtime_checkable

import pluggy

from .entry_scan import HOSTS_ENTRY_POINT_GROUP

log = logging.getLogger(__name__)


@runtime_checkable
class HostAdapter(Protocol):
    """What every host adapter provides (the OpenTelemetry instrumentor shape)."""

    #: Short name of the host, for logs.
    name: str
    #: Module whose import means the host is being loaded (the startup hook waits for it).
    trigger_module: str

    def host_importable(self) -> bool:
        """True when the host's package is installed (found without importing it)."""

    def instrument(self, pm: pluggy.PluginManager | None = None) -> bool:
        """Attach to the host; idempotent. False (and nothing changed) when refused."""

    def uninstrument(self) -> None:
        """Put back exactly what :meth:`instrument` replaced; idempotent."""

    @property
    def is_instrumented(self) -> bool: ...


@dataclass(slots=True)
class HostsReport:
    """What :func:`instrument_installed_hosts` did, by adapter entry-point name."""

    instrumented: list[str] = field(default_factory=list)
    not_installed: list[str] = field(default_factory=list)
    refused: list[str] = field(default_factory=list)
    failed: dict[str, str] = field(default_factory=dict)


_adapters: dict[str, HostAdapter] = {}


def load_host_adapters(
    eps: Iterable[EntryPoint] | None = None, names: Iterable[str] | None = None
) -> dict[str, HostAdapter]:
    """The adapters of ``eps`` (default: the entry-point group), or of those named
    ``names``, loaded once per process and name.

    Adapters are kept, so a later call returns the same instance (``uninstrument`` must
    reach the instance that instrumented). Load errors are logged and skipped.
    """
    found = list(entry_points(group=HOSTS_ENTRY_POINT_GROUP) if eps is None else eps)
    if names is not None:
        wanted = set(names)
        found = [ep for ep in found if ep.name in wanted]
    loaded: dict[str, HostAdapter] = {}
    for ep in sorted(found, key=lambda e: e.name):
        if ep.name in _adapters:
            loaded[ep.name] = _adapters[ep.name]
            continue
        try:
            obj = ep.load()
            adapter = obj() if isinstance(obj, type) else obj
            if not isinstance(adapter, HostAdapter):
                raise TypeError(f"{ep.value} is not a host adapter")
        except Exception as exc:  # noqa: BLE001 - one broken adapter must not stop the rest
            log.warning("mlx-recovery: host adapter %r not loaded: %s", ep.name, exc)
            continue
        _adapters[ep.name] = loaded[ep.name] = adapter
    return loaded


def instrument_installed_hosts(
    pm: pluggy.PluginManager | None = None, eps: Iterable[EntryPoint] | None = None
) -> HostsReport:
    """Instrument every installed host; ``pm`` defaults to the process plugin manager."""
    report = HostsReport()
    for name, adapter in load_host_adapters(eps).items():
        try:
            if not adapter.host_importable():
                report.not_installed.append(name)
                continue
            if adapter.instrument(pm=pm):
                report.instrumented.append(name)
            else:
                report.refused.append(name)
        except Exception as exc:  # noqa: BLE001 - never let an adapter break the host's start
            log.warning("mlx-recovery: instrumenting %r failed: %s", name, exc)
            report.failed[name] = f"{type(exc).__name__}: {exc}"
    return report


def uninstrument_all_hosts() -> None:
    """Detach every adapter loaded so far."""
    for name, adapter in list(_adapters.items()):
        try:
            adapter.uninstrument()
        except Exception as exc:  # noqa: BLE001
            log.warning("mlx-recovery: uninstrumenting %r failed: %s", name, exc)
