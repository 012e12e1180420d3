"""The recovery plugin: lifecycle hooks in, recovery jobs and slices out.

Registered through the entry point ``recovery``. With recovery off (budget 0, or the
model not opted in) the only work it does is the arrival registry's bookkeeping on
arrival, admission and departure; no job is ever queued and no slice ever runs.

Threads: arrival hooks come from any thread and touch only the registry (whose arrival
count running slices watch); engine hooks run on their engine's thread and go to
that engine's :class:`~.service.EngineRecovery`; shutdown and unload may come from a
control thread and cancel through the service's thread-safe path. ``_engines`` and
``_control`` are guarded by ``_lock``.
"""

from __future__ import annotations

import difflib
import logging
import sys
import threading
import time
from collections.abc import Callable, Iterable
from typing import Any

from ..events import (
    IdleStep,
    LookupDue,
    RequestAdmitted,
    RequestArrived,
    RequestDeparted,
    RequestPrefilled,
    SparseRouteServed,
)
from ..hookspecs import hookimpl
from ..ports import EnginePort, ModelHandle
from ..settings import RecoverySettings, env_name, load_settings
from .budget import Budget
from .control import CONTROL_SOCKET_OFF, ControlError, ControlServer, resolve_socket_path
from .live import AttentionProbe, RunnerFactory, default_runner_factory
from .registry import ArrivalRegistry
from .runnable import RunnableGate, memory_probe
from .service import EngineRecovery
from .status import ProcessStatus, export_counters

log = logging.getLogger(__name__)

# How long an unload or shutdown off the event loop waits for a running slice to stop
# (a slice stops between layers; a host store in flight finishes first).
UNLOAD_WAIT_S = 30.0


def _on_event_loop() -> bool:
    """This thread runs an asyncio event loop (without importing asyncio just to ask)."""
    asyncio = sys.modules.get("asyncio")
    if asyncio is None:
        return False
    try:
        asyncio.get_running_loop()
    except RuntimeError:
        return False
    return True

class RecoveryPlugin:
    """Canonical state recovery as pluggy hook implementations.

    ``RecoveryPlugin()`` reads its settings from the environment. Tests and hosts may
    inject ``settings``, a ``clock`` (budget windows, back-off), a ``runner_factory``
    (``(model, block_size, interruptible) -> runner``), an ``attention_probe`` factory
    (``model -> (context -> seconds per token)``), a ``memory_ok`` probe, and
    ``control_socket``: False for none, a path, or None for the settings' choice.
    """

    def __init__(
        self,
        settings: RecoverySettings | None = None,
        *,
        clock: Callable[[], float] = time.monotonic,
        runner_factory: RunnerFactory | None = None,
        memory_ok: Callable[[], bool] | None = None,
        control_socket: str | bool | None = None,
        registry: ArrivalRegistry | None = None,
        attention_probe: Callable[[ModelHandle], AttentionProbe] | None = None,
    ) -> None:
        self.settings = settings if settings is not None else load_settings()
        self.clock = clock
        self.registry = registry if registry is not None else ArrivalRegistry(clock=clock)
        self.budget = Budget(self.settings.budget_pct, self.settings.budget_window_s, clock=clock)
        self._runner_factory = runner_factory or default_runner_factory
        self._attention_probe = attention_probe
        self._lock = threading.Lock()
        self._engines: dict[str, EngineRecovery] = {}
        # Closed services whose host refused some releases: kept, shown in the status and
        # tried again at every close(), so nothing the plugin took is forgotten.
        self._holding: list[EngineRecovery] = []
        self._control: ControlServer | None = None
        self._control_path = self._control_path_from(control_socket)
        self._control_failed = False
        # Engines whose model is not opted in while others are: said once, shown in status.
        self._not_opted_in: dict[str, dict[str, str | None]] = {}
        self.gate = RunnableGate(
            self.registry,
            self.budget,
            engines=self._ports,
            opted_in=lambda model_id: self.settings.for_model(model_id).enabled,
            idle_steps_for=self.settings.idle_steps_for,
            memory_ok=memory_ok if memory_ok is not None else memory_probe(),
        )

    # -- switches ----------------------------------------------------------------------

    def enabled_for(self, model_id: str) -> bool:
        """Recovery runs for ``model_id``: budget above 0 and the model opted in."""
        return self.budget.pct > 0 and self.settings.for_model(model_id).enabled

    def set_budget(self, pct: float) -> dict[str, Any]:
        """Change the process budget in place (every engine sees it from the next
        window); 0 turns recovery off. Raises ValueError outside [0, 100]."""
        self.budget.set_pct(pct)
        if pct > 0:
            self._start_control()
        return self.budget.snapshot()

    # -- lifecycle hooks -------------------------------------------------------------

    @hookimpl
    def engine_attached(self, engine: EnginePort) -> None:
        try:
            service = EngineRecovery(
                engine,
                settings=self.settings,
                budget=self.budget,
                gate=self.gate,
                arrivals=self.registry.arrivals,
                arrivals_since=self.registry.arrivals_since,
                clock=self.clock,
                runner_factory=self._runner_factory,
                attention_probe=None if self._attention_probe is None else self._attention_probe(engine.model),
            )
        except Exception as exc:  # noqa: BLE001 - a port we cannot read gets no recovery
            log.error("mlx-recovery: engine not attached: %r", exc)
            return
        with self._lock:
            old = self._engines.get(service.engine_id)
            self._engines[service.engine_id] = service
        if old is not None:
            old.cancel("engine attached again", forget=True)
        self._note_opt_in(service.engine_id, service.model_id)
        # Served whatever the budget, so `mlx-recovery budget 10` can turn recovery on.
        self._start_control()

    @hookimpl
    def request_arrived(self, event: RequestArrived) -> None:
        self.registry.arrived(event.engine_id, event.request_id)

    @hookimpl
    def prefix_lookup_due(self, event: LookupDue) -> None:
        self._to_engine(event.engine_id, event.model_id, "judging held blocks at an arrival",
                        lambda service: service.lookup_due(event))

    @hookimpl
    def request_admitted(self, event: RequestAdmitted) -> None:
        self.registry.admitted(event.engine_id, event.request_id)
        service = self._engines.get(event.engine_id)
        if service is not None:
            service.foreground()

    @hookimpl
    def request_departed(self, event: RequestDeparted) -> None:
        self.registry.departed(event.engine_id, event.request_id)

    @hookimpl
    def request_prefilled(self, event: RequestPrefilled) -> None:
        self._to_engine(event.engine_id, event.model_id, "learning from a prefill",
                        lambda service: service.prefilled(event))

    @hookimpl
    def sparse_route_served(self, event: SparseRouteServed) -> None:
        self._to_engine(event.engine_id, event.model_id, "queueing", lambda service: service.served(event))

    @hookimpl
    def engine_idle_step(self, event: IdleStep) -> bool | float | None:
        service = self._engines.get(event.engine_id)
        if service is None:
            return None
        return service.idle_step(event.consecutive)

    # -- cancellation hooks ------------------------------------------------------------

    @hookimpl
    def engine_reset(self, engine_id: str, deep: bool) -> None:
        self._cancel(engine_id, "deep reset" if deep else "reset")

    @hookimpl
    def engine_aborted_all(self, engine_id: str) -> None:
        self._cancel(engine_id, "abort all")

    @hookimpl
    def engine_failed_all(self, engine_id: str, error: str) -> None:
        self._cancel(engine_id, f"fail all: {error}")

    @hookimpl
    def engine_shutdown(self, engine_id: str) -> None:
        self._forget(engine_id, "shutdown")
        with self._lock:
            last = not self._engines
        if last:
            self._stop_control()

    @hookimpl
    def model_unloaded(self, engine_id: str, model_id: str) -> None:
        self._forget(engine_id, f"model {model_id} unloaded")

    # -- status ------------------------------------------------------------------------

    def service(self, engine_id: str) -> EngineRecovery | None:
        """The recovery service of an attached engine (None once it is forgotten)."""
        return self._engines.get(engine_id)

    def status_record(self) -> ProcessStatus:
        with self._lock:
            services = list(self._engines.values()) + [s for s in self._holding if s.engine_id not in self._engines]
            control = self._control.path if self._control is not None else None
        return ProcessStatus(
            enabled=self.budget.pct > 0,
            budget=self.budget.snapshot(),
            registry=self.registry.snapshot(),
            engines=tuple(s.snapshot() for s in services),
            control_socket=control,
        )

    def status(self) -> dict[str, Any]:
        """Per process and per engine: jobs, committed and live boundaries, debt, tokens
        recovered, slices, budget share used, last refusal, faults by kind."""
        status = self.status_record().as_dict()
        with self._lock:
            status["not_opted_in"] = {k: dict(v) for k, v in self._not_opted_in.items()}
        return status

    def counters(self) -> dict[str, float]:
        """Flat counters and gauges for a host's metrics exporter."""
        return export_counters(self.status_record())

    def close(self) -> None:
        """Cancel everything and stop the control channel (tests, process exit)."""
        with self._lock:
            services = list(self._engines.values())
            self._engines.clear()
            holding, self._holding = self._holding, []
        for service in services:
            service.cancel("plugin closed", forget=True)
        self._keep_holding(services + holding)
        self._stop_control()

    # -- private -----------------------------------------------------------------------

    def _to_engine(
        self, engine_id: str, model_id: str, what: str, call: Callable[[EngineRecovery], None]
    ) -> None:
        """Hand an engine-thread event to its engine's recovery, when recovery is on for
        the model; a bookkeeping bug is logged here, never raised into the host."""
        if not self.enabled_for(model_id):
            return
        service = self._engines.get(engine_id)
        if service is None:
            return
        try:
            call(service)
        except Exception as exc:  # noqa: BLE001 - bookkeeping bugs stay here
            log.error("mlx-recovery: engine %s: %s failed: %r", engine_id, what, exc)

    def _ports(self) -> Iterable[EnginePort]:
        with self._lock:
            return [s.port for s in self._engines.values() if not s.closed]

    def _cancel(self, engine_id: str, reason: str) -> None:
        service = self._engines.get(engine_id)
        if service is not None:
            service.cancel(reason)

    def _forget(self, engine_id: str, reason: str) -> None:
        with self._lock:
            service = self._engines.pop(engine_id, None)
            self._not_opted_in.pop(engine_id, None)
        if service is not None:
            # Never block a host's event loop: there the running slice is left to stop by
            # itself (it publishes nothing once cancelled); elsewhere wait for it, so that
            # nothing of recovery's reaches the engine after the hook returns.
            service.cancel(reason, forget=True, wait_s=0.0 if _on_event_loop() else UNLOAD_WAIT_S)
            self._keep_holding([service])
        self.registry.forget_engine(engine_id)

    def _keep_holding(self, services: Iterable[EngineRecovery]) -> None:
        """Keep the closed services that still hold host references (their releases
        failed), and say so: the status lists them until a later close() gives them back."""
        still = [s for s in services if s.release_pending() > 0]
        for service in still:
            log.error(
                "mlx-recovery: engine %s closed with %d holder(s) whose release the host refused; "
                "kept and tried again at the next close()", service.engine_id, service.snapshot().unreleased_holders,
            )
        if still:
            with self._lock:
                self._holding.extend(s for s in still if s not in self._holding)

    def _note_opt_in(self, engine_id: str, model_id: str) -> None:
        """A model id that misses its opt-in by a typo (``"Tiny"`` for ``"tiny"``) would
        leave recovery silently off for it: say so once per engine, with the near match."""
        opted = [name for name, entry in self.settings.models.items() if entry.enabled]
        if not opted or self.settings.for_model(model_id).enabled:
            return
        with self._lock:
            if engine_id in self._not_opted_in:
                return
            near = _near_match(model_id, opted)
            self._not_opted_in[engine_id] = {"model_id": model_id, "near_match": near}
        log.warning(
            "mlx-recovery: engine %s serves model %r, which is not opted in (%s opts in %s)%s",
            engine_id, model_id, env_name("models"), ", ".join(map(repr, sorted(opted)[:5])),
            f"; did you mean {near!r}?" if near else "",
        )

    def _control_path_from(self, control_socket: str | bool | None) -> str | None:
        if control_socket is False:
            return None
        if control_socket is True:
            return resolve_socket_path("")
        if isinstance(control_socket, str):
            return resolve_socket_path(control_socket)
        configured = self.settings.control_socket.strip()
        if configured.lower() in CONTROL_SOCKET_OFF:
            return None
        return resolve_socket_path(configured)

    def _start_control(self) -> None:
        with self._lock:
            if self._control_path is None or self._control is not None:
                return
            server = ControlServer(self._control_path, self.status, self.set_budget)
            try:
                server.start()
            except (ControlError, OSError) as exc:
                # Tried again at the next engine attach or budget change; said once.
                if not self._control_failed:
                    log.warning("mlx-recovery: control channel not started: %s", exc)
                self._control_failed = True
                return
            self._control_failed = False
            self._control = server

    def _stop_control(self) -> None:
        with self._lock:
            server, self._control = self._control, None
        if server is not None:
            server.stop()


def _near_match(model_id: str, names: list[str]) -> str | None:
    """The opted-in name ``model_id`` most likely meant: equal but for case, else the
    closest by :mod:`difflib`."""
    folded = [n for n in names if n.casefold() == model_id.casefold()]
    if folded:
        return folded[0]
    close = difflib.get_close_matches(model_id, names, n=1, cutoff=0.6)
    return close[0] if close else None
