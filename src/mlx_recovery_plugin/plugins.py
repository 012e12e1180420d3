"""Finding, loading and calling plugins.

Plugins are found through the entry-point group ``mlx_recovery_plugin``; the project's own
recovery and adopter register themselves there like any third party. An entry point names
an object carrying ``@hookimpl`` functions (a module or an instance) or a class, which is
instantiated with no arguments. A plugin that fails to import, or that implements a hook
with no spec, is logged and skipped; the rest load.

Hosts call hooks through :class:`HookEmitter`, which isolates each implementation: one
that raises (``SystemExit`` included; ``KeyboardInterrupt`` too, except on the main
thread, where it is the user's Ctrl-C) is logged once and skipped, the others still run,
and the host's step never sees the exception.
Because it calls implementations one at a time, it cannot run pluggy hook wrappers: a
plugin that brings one is refused at registration, never silently left uncalled.
"""

from __future__ import annotations

import functools
import logging
import threading
from collections.abc import Iterable
from dataclasses import dataclass, field
from importlib.metadata import EntryPoint, entry_points
from typing import Any

import pluggy

from . import hookspecs
from .events import (
    AdoptionDecision,
    IdleStep,
    LookupDue,
    PrefixLookup,
    RequestAdmitted,
    RequestArrived,
    RequestDeparted,
    RequestPrefilled,
    SparseRouteServed,
)
from .hookspecs import PROJECT_NAME
from .ports import EnginePort
from .settings import RecoverySettings, env_name, load_settings

log = logging.getLogger(__name__)

ENTRY_POINT_GROUP = "mlx_recovery_plugin"


class PluginLoadError(RuntimeError):
    """A plugin given explicitly could not be registered."""


@dataclass(slots=True)
class LoadReport:
    """What plugin loading did: names loaded, skipped on purpose, and failed with why."""

    loaded: list[str] = field(default_factory=list)
    skipped: list[str] = field(default_factory=list)
    failed: dict[str, str] = field(default_factory=dict)


def new_plugin_manager() -> pluggy.PluginManager:
    """A plugin manager that knows the lifecycle hookspecs and nothing else."""
    pm = pluggy.PluginManager(PROJECT_NAME)
    pm.add_hookspecs(hookspecs)
    return pm


def register_checked(pm: pluggy.PluginManager, plugin: object, name: str | None = None) -> str:
    """Register ``plugin``, refusing it (unregistered again) if it implements a hook
    that has no spec, calls a spec with wrong arguments, or is a hook wrapper."""
    try:
        registered = pm.register(plugin, name=name)
    except (pluggy.PluginValidationError, ValueError) as exc:
        raise PluginLoadError(f"plugin {name or plugin!r} refused: {exc}") from exc
    if registered is None:
        raise PluginLoadError(f"plugin {name or plugin!r} is blocked or already registered")
    try:
        pm.check_pending()
    except pluggy.PluginValidationError as exc:
        pm.unregister(plugin)
        raise PluginLoadError(f"plugin {registered} refused: {exc}") from exc
    wrappers = sorted(
        caller.name
        for caller in pm.get_hookcallers(plugin) or ()
        for impl in caller.get_hookimpls()
        if impl.plugin is plugin and (impl.hookwrapper or impl.wrapper)
    )
    if wrappers:
        pm.unregister(plugin)
        raise PluginLoadError(
            f"plugin {registered} refused: hook wrappers are not supported (hooks are called "
            f"one implementation at a time so a failing plugin is isolated): {', '.join(wrappers)}"
        )
    return registered


def _instantiate(obj: Any) -> object:
    return obj() if isinstance(obj, type) else obj


def load_entry_point_plugins(
    pm: pluggy.PluginManager,
    settings: RecoverySettings,
    eps: Iterable[EntryPoint] | None = None,
) -> LoadReport:
    """Register every plugin of the entry-point group that the allow / block lists let in."""
    report = LoadReport()
    allow, block = settings.plugin_allow_list, settings.plugin_block_list
    found = list(entry_points(group=ENTRY_POINT_GROUP) if eps is None else eps)
    names = {ep.name for ep in found}
    for listed, variable in ((allow, env_name("plugins")), (block, env_name("disable_plugins"))):
        for name in sorted(listed - names):
            log.warning(
                "mlx-recovery: %s names %r, which is no installed plugin (installed: %s)",
                variable, name, ", ".join(sorted(names)) or "none",
            )
    for ep in sorted(found, key=lambda e: e.name):
        if ep.name in block or (allow and ep.name not in allow):
            report.skipped.append(ep.name)
            continue
        try:
            register_checked(pm, _instantiate(ep.load()), name=ep.name)
        except KeyboardInterrupt:
            raise
        except BaseException as exc:  # noqa: BLE001 - a plugin's SystemExit too must stay contained
            log.warning("mlx-recovery: plugin %r not loaded: %s", ep.name, exc)
            report.failed[ep.name] = f"{type(exc).__name__}: {exc}"
            continue
        report.loaded.append(ep.name)
    return report


def make_plugin_manager(
    plugins: Iterable[object] = (),
    *,
    settings: RecoverySettings | None = None,
    entry_points_too: bool = True,
) -> pluggy.PluginManager:
    """A fresh plugin manager with the entry-point plugins (unless told not to) and then
    ``plugins``, each registered and checked. The load report is ``pm.load_report``."""
    settings = settings or load_settings()
    pm = new_plugin_manager()
    report = load_entry_point_plugins(pm, settings) if entry_points_too else LoadReport()
    for plugin in plugins:
        report.loaded.append(register_checked(pm, plugin))
    pm.load_report = report  # type: ignore[attr-defined]
    return pm


@functools.cache
def get_plugin_manager() -> pluggy.PluginManager:
    """The process's plugin manager, built once from the environment."""
    return make_plugin_manager()


class HookEmitter:
    """Calls hooks for a host, one implementation at a time, so a failing plugin costs
    only its own work. Thread-safe: errors are counted under a lock."""

    def __init__(self, pm: pluggy.PluginManager) -> None:
        self.pm = pm
        self._lock = threading.Lock()
        self._reported: set[tuple[str, str, str]] = set()
        self.errors = 0

    # -- typed calls, one per hook: what hosts use ----------------------------------

    def engine_attached(self, engine: EnginePort) -> None:
        self.emit("engine_attached", engine=engine)

    def request_arrived(self, event: RequestArrived) -> None:
        self.emit("request_arrived", event=event)

    def prefix_lookup_due(self, event: LookupDue) -> None:
        self.emit("prefix_lookup_due", event=event)

    def request_admitted(self, event: RequestAdmitted) -> None:
        self.emit("request_admitted", event=event)

    def request_departed(self, event: RequestDeparted) -> None:
        self.emit("request_departed", event=event)

    def request_prefilled(self, event: RequestPrefilled) -> None:
        self.emit("request_prefilled", event=event)

    def request_aborted(self, engine_id: str, request_id: str) -> None:
        self.emit("request_aborted", engine_id=engine_id, request_id=request_id)

    def engine_aborted_all(self, engine_id: str) -> None:
        self.emit("engine_aborted_all", engine_id=engine_id)

    def engine_failed_all(self, engine_id: str, error: str) -> None:
        self.emit("engine_failed_all", engine_id=engine_id, error=error)

    def engine_reset(self, engine_id: str, deep: bool) -> None:
        self.emit("engine_reset", engine_id=engine_id, deep=deep)

    def engine_shutdown(self, engine_id: str) -> None:
        self.emit("engine_shutdown", engine_id=engine_id)

    def model_unloaded(self, engine_id: str, model_id: str) -> None:
        self.emit("model_unloaded", engine_id=engine_id, model_id=model_id)

    def engine_idle_step(self, event: IdleStep) -> list[bool | float]:
        """Every plugin's answer (True: step again now; seconds: look again then)."""
        return self.emit("engine_idle_step", event=event)

    def sparse_route_served(self, event: SparseRouteServed) -> None:
        self.emit("sparse_route_served", event=event)

    def prefix_lookup(self, lookup: PrefixLookup) -> AdoptionDecision | None:
        decision = self.first("prefix_lookup", lookup=lookup)
        return decision if isinstance(decision, AdoptionDecision) else None

    # -- by name ---------------------------------------------------------------------

    def emit(self, hook_name: str, **kwargs: Any) -> list[Any]:
        """Call every implementation of ``hook_name`` (last registered first, as pluggy
        does); return their non-None results (only the first, for a firstresult hook).
        A name with no hook is logged once and calls nothing."""
        caller = getattr(self.pm.hook, hook_name, None)
        if caller is None:
            self._report("<emitter>", hook_name, LookupError(f"no hook named {hook_name!r}"))
            return []
        firstresult = bool(caller.spec and caller.spec.opts.get("firstresult"))
        results: list[Any] = []
        for impl in reversed(caller.get_hookimpls()):
            try:
                result = impl.function(*(kwargs[name] for name in impl.argnames))
            except KeyboardInterrupt as exc:
                # Python delivers Ctrl-C to the main thread only: there it stops the
                # process; raised on a host's engine or request thread it is a plugin's fault.
                if threading.current_thread() is threading.main_thread():
                    raise
                self._report(impl.plugin_name, hook_name, exc)
                continue
            except BaseException as exc:  # noqa: BLE001 - never into the host's step, SystemExit included
                self._report(impl.plugin_name, hook_name, exc)
                continue
            if result is not None:
                results.append(result)
                if firstresult:
                    break
        return results

    def first(self, hook_name: str, **kwargs: Any) -> Any:
        results = self.emit(hook_name, **kwargs)
        return results[0] if results else None

    def _report(self, plugin: str, hook: str, exc: BaseException) -> None:
        key = (plugin, hook, type(exc).__name__)
        with self._lock:
            self.errors += 1
            first_time = key not in self._reported
            self._reported.add(key)
        if first_time:
            log.error("mlx-recovery: plugin %r failed in %s: %r", plugin, hook, exc, exc_info=exc)
