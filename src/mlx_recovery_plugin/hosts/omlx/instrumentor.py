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
``Scheduler._cleanup_finished``        ``request_prefilled`` for a request that finished in
                                       its prefill step, ``sparse_route_served`` for
                                       sparse-route requests, then ``request_departed``
                                       finished (engine thread)
``Scheduler._do_abort_request``        ``request_aborted`` + ``request_departed`` aborted
``EngineCore.abort_all_requests``      ``engine_aborted_all`` (engine thread, next step)
``Scheduler.fail_all_requests``        ``engine_failed_all`` with the step's error +
                                       ``request_departed`` failed (engine thread)
``Scheduler.reset`` / ``deep_reset``   ``engine_reset``, before the cache is cleared
/ ``_recover_from_cache_error``        (engine thread)
``EngineCore.stop``,                   ``engine_shutdown`` (stop: on a worker thread it awaits)
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
from collections.abc import Callable, Mapping
from typing import TYPE_CHECKING, Any

from ..instrumenting import Factories, HostInstrumentor, VersionRange
from ..instrumenting import iter_wrapped as iter_wrapped  # callers import it from here
from .lifecycle import Lifecycle
from .members import FLYTO_MLX, Member
from .wrappers import FACTORIES

if TYPE_CHECKING:
    from ...plugins import HookEmitter

log = logging.getLogger(__name__)

SCHEDULER_METHODS = tuple(name for cls, name in FACTORIES if cls == "Scheduler")
ENGINE_CORE_METHODS = tuple(name for cls, name in FACTORIES if cls == "EngineCore")
# Used by the ports, not wrapped: their absence means an oMLX this adapter does not know.
SCHEDULER_NEEDS = ("_extract_cache_states", "set_specprefill_draft_model", "abort_request")

def version_supported(version: str, member: Member = FLYTO_MLX) -> bool:
    return member.versions.admits(version)


class OmlxInstrumentor(HostInstrumentor):
    """The oMLX family's host adapter, bound to one member (:mod:`.members`); the entry
    points ``omlx`` and ``fusion_mlx`` of ``mlx_recovery_plugin.hosts`` are instances.
    ``instrument()``, uninstrumenting and the per-engine look-ups are
    :class:`~..instrumenting.HostInstrumentor`'s; this class says what is oMLX's."""

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

    # -- the template's parts (:class:`~..instrumenting.HostInstrumentor`) ---------------

    def _host_version(self) -> str:
        return self.member.version()

    def _host_versions(self) -> VersionRange:
        return self.member.versions

    def _host_classes(self) -> dict[str, type]:
        return {"Scheduler": self.member.scheduler_class(), "EngineCore": self.member.engine_core_class()}

    def _host_factories(self) -> Factories:
        return FACTORIES

    def _host_missing(self, classes: Mapping[str, type]) -> list[str]:
        member = self.member
        missing = [f"Scheduler.{n}" for n in SCHEDULER_NEEDS if not hasattr(classes["Scheduler"], n)]
        return missing + [name for name in (member.scheduler_output, member.buffer_lock) if not _resolves(member, name)]

    def _new_lifecycle(self, emitter: HookEmitter) -> Lifecycle:
        return Lifecycle(emitter, self._clock, self._accept, member=self.member)

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


def _resolves(member: Member, dotted: str) -> bool:
    try:
        member.resolve(dotted)
    except (ImportError, AttributeError):
        return False
    return True

