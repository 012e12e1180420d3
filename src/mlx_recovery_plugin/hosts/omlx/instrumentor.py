"""Attach the lifecycle hooks to oMLX at run time, without editing any file of it.

:class:`OmlxInstrumentor` follows the OpenTelemetry instrumentor pattern: ``instrument()``
checks oMLX's version and that every method it wraps exists, then replaces those methods
on ``omlx.scheduler.Scheduler`` and ``omlx.engine_core.EngineCore`` with thin wrappers
(:mod:`.wrappers`) that call the original and report what happened as hook calls;
``uninstrument()`` puts back the very objects that were there. Both are idempotent.

=====================================  =====================================================
oMLX                                   hook (thread)
=====================================  =====================================================
``EngineCore.__init__``, first sight   ``engine_attached`` (the building thread)
of a scheduler
``EngineCore.add_request``,            ``request_arrived``, once, at the earlier of the two
``Scheduler.add_request``              (event-loop thread / engine thread)
``Scheduler._schedule_waiting``        ``request_admitted`` (engine thread)
``Scheduler._cleanup_finished``        ``sparse_route_served`` for sparse-route requests,
                                       then ``request_departed`` finished (engine thread)
``Scheduler._do_abort_request``        ``request_aborted`` + ``request_departed`` aborted
``EngineCore.abort_all_requests``      ``engine_aborted_all`` (engine thread, next step)
``Scheduler.fail_all_requests``        ``engine_failed_all`` with the step's error +
                                       ``request_departed`` failed (engine thread)
``Scheduler.reset`` / ``deep_reset``   ``engine_reset``, before the cache is cleared
/ ``_recover_from_cache_error``        (engine thread)
``EngineCore.stop``,                   ``engine_shutdown`` (event-loop / engine thread)
``Scheduler.shutdown``
``EngineCore.close`` (``EnginePool``   ``engine_shutdown`` if not yet, then
unloads reach it)                      ``model_unloaded``, before the model goes
``Scheduler.has_requests`` / ``step``  idle driving: ``engine_idle_step`` (engine thread,
                                       engine stream; see :mod:`.idle_driver`)
=====================================  =====================================================

Threads: see :mod:`.lifecycle`. ``instrument`` / ``uninstrument`` hold ``_lock``.
"""

from __future__ import annotations

import importlib
import importlib.util
import logging
import time
from collections.abc import Callable
from typing import Any

import pluggy

from ..instrumenting import HostInstrumentor, parse_version
from ..instrumenting import iter_wrapped as iter_wrapped  # callers import it from here
from .lifecycle import Lifecycle
from .members import FLYTO_MLX, Member, VersionRange
from .wrappers import FACTORIES

log = logging.getLogger(__name__)

#: flyto-mlx releases this adapter was written against (kept for callers of 0.1).
SUPPORTED_VERSIONS: VersionRange = FLYTO_MLX.versions

SCHEDULER_METHODS = tuple(name for cls, name in FACTORIES if cls == "Scheduler")
ENGINE_CORE_METHODS = tuple(name for cls, name in FACTORIES if cls == "EngineCore")
# Used by the ports, not wrapped: their absence means an oMLX this adapter does not know.
SCHEDULER_NEEDS = ("_extract_cache_states", "set_specprefill_draft_model", "abort_request")

def version_supported(version: str, member: Member = FLYTO_MLX) -> bool:
    parsed = parse_version(version)
    return bool(parsed) and parsed in member.versions


class OmlxInstrumentor(HostInstrumentor):
    """The oMLX family's host adapter, bound to one member (:mod:`.members`); the entry
    points ``omlx`` and ``fusion_mlx`` of ``mlx_recovery_plugin.hosts`` are instances.
    Uninstrumenting and the per-engine look-ups are :class:`~..instrumenting.HostInstrumentor`'s."""

    log = log

    def __init__(
        self,
        member: Member = FLYTO_MLX,
        clock: Callable[[], float] = time.monotonic,
        accept: Callable[[Any], bool] | None = None,
    ) -> None:
        """``clock`` drives idle-step delays; ``accept(scheduler)`` limits the adapter to
        some schedulers (the others run exactly as if it were not there)."""
        super().__init__()
        self.member = member
        #: The adapter protocol's name and the module whose import means the host loads.
        self.name = member.name
        self.trigger_module = member.scheduler_module
        self._clock = clock
        self._accept = accept
        self._life: Lifecycle | None = None

    # -- the adapter protocol --------------------------------------------------------

    def host_importable(self) -> bool:
        try:
            return importlib.util.find_spec(self.member.package) is not None
        except (ImportError, ValueError):
            return False

    def instrument(self, pm: pluggy.PluginManager | None = None) -> bool:
        """Wrap the member's scheduler and engine; True when attached (now or before).
        Hooks go to ``pm``, by default the process plugin manager."""
        member = self.member
        with self._lock:
            if self._patches:
                return True
            classes = {"Scheduler": member.scheduler_class(), "EngineCore": member.engine_core_class()}
            version = member.version()
            if not version_supported(version, member):
                log.warning(
                    "mlx-recovery: %s %s is not supported (this adapter knows %s); "
                    "not attaching", member.label, version, member.versions,
                )
                return False
            wanted = [*FACTORIES, *(("Scheduler", n) for n in SCHEDULER_NEEDS)]
            missing = [f"{c}.{n}" for c, n in wanted if not hasattr(classes[c], n)]
            missing += [name for name in (member.scheduler_output, member.buffer_lock) if not _resolves(member, name)]
            if missing:
                log.warning(
                    "mlx-recovery: %s %s lacks %s; not attaching", member.label, version, ", ".join(missing)
                )
                return False
            from ...plugins import HookEmitter, get_plugin_manager

            emitter = HookEmitter(pm if pm is not None else get_plugin_manager())
            self._life = Lifecycle(emitter, self._clock, self._accept, member=member)
            self.version = version
            self._patches.wrap(classes, FACTORIES, self._life)
            plugins = sorted(_plugin_label(n, p) for n, p in emitter.pm.list_name_plugin())
            log.info(
                "mlx-recovery: attached to %s %s (%d methods wrapped, no file changed); "
                "plugins: %s", member.label, version, len(self._patches), ", ".join(plugins) or "none",
            )
            return True

    def _host_label(self) -> str:
        return self.member.label

    def startup_hooks(self) -> dict[str, Callable[[Any], None]]:
        """What the start-up hook waits for: the scheduler module (attach), and, where the
        member has admin routes, the server module (routes on its app)."""
        hooks: dict[str, Callable[[Any], None]] = {self.member.scheduler_module: lambda _module: self.instrument()}
        if self.member.admin_auth is not None:
            hooks[self.member.server_module] = self.attach_admin
        return hooks

    def attach_admin(self, server_module: Any) -> bool:
        """Add the recovery admin routes to the server module's ``app`` (after
        ``instrument()``), behind the member's admin authentication."""
        life = self._life
        app = getattr(server_module, "app", None)
        if life is None or app is None or self.member.admin_auth is None:
            return False
        from .admin import attach_admin_routes

        return attach_admin_routes(
            app, life.emitter.pm, on_budget_change=lambda _pct: self.wake(),
            auth=self.member.resolve(self.member.admin_auth),
        )

    # -- engines ---------------------------------------------------------------------

    def host_has_work(self, scheduler: Any) -> bool:
        """Would oMLX's engine loop step this scheduler for its own sake (requests,
        deferred clears, a pending abort-all notice), idle offers aside?"""
        originals = (self._patches.own_original(cls, "has_requests") for cls in type(scheduler).__mro__)
        has_requests = next((o for o in originals if callable(o)), type(scheduler).has_requests)
        record = self._life.get(scheduler) if self._life is not None else None
        return bool(has_requests(scheduler)) or (record is not None and record.aborted_all_pending)


def _plugin_label(name: str, plugin: object) -> str:
    # pluggy names an unnamed plugin by its id(); the class name says more.
    return type(plugin).__name__ if name == str(id(plugin)) else name


def _resolves(member: Member, dotted: str) -> bool:
    try:
        member.resolve(dotted)
    except (ImportError, AttributeError):
        return False
    return True

