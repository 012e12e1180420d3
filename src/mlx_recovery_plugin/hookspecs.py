"""The lifecycle contract between a host scheduler and plugins.

A host (or a host adapter acting for it) calls these hooks through the plugin manager;
plugins implement any subset with ``@hookimpl``. Threads:

* the **engine thread** is the one thread that runs an engine's ``step()``; hooks called
  there may do MLX work on the engine's stream, but must return quickly unless they are
  the idle hook;
* **any thread** means the host may call the hook from its request-handling thread while
  the engine thread is inside ``step()``: implementations only touch their own
  lock-protected bookkeeping there.

Every hook must be idempotent (a host may report an event twice, for example a departure
seen both by cleanup and by an abort) and must never raise into the host: the plugin
manager logs and swallows implementation errors (see :mod:`mlx_recovery_plugin.plugins`).
Only plain values, :mod:`~mlx_recovery_plugin.events` records and the
:mod:`~mlx_recovery_plugin.ports` protocols cross this boundary; never host objects.
"""

from __future__ import annotations

import pluggy

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
from .ports import EnginePort

PROJECT_NAME = "mlx_recovery"

hookspec = pluggy.HookspecMarker(PROJECT_NAME)
hookimpl = pluggy.HookimplMarker(PROJECT_NAME)


@hookspec
def engine_attached(engine: EnginePort) -> None:
    """An engine (one model with its scheduler) came up or was first seen.

    Thread: the engine thread or the thread that built the engine, before its first step.
    May keep ``engine`` for later hooks of the same ``engine_id``. Idempotent: attaching
    the same engine id again replaces the port.
    """


@hookspec
def request_arrived(event: RequestArrived) -> None:
    """A request entered an engine's waiting queue.

    Thread: any thread (the host's request thread). From this moment the process has
    foreground work: plugins must not start background work until the request departs.
    Must be cheap: it runs on every request, even with recovery off.
    """


@hookspec
def prefix_lookup_due(event: LookupDue) -> None:
    """The host is about to look the request's prompt up in its prefix cache: what is
    stored now is what the request restores.

    Thread: the engine thread, serialized with ``step()`` and the idle hook, before the
    host's lookup (oMLX's and rapid-mlx's ``Scheduler.add_request``). A plugin may store
    prefix state now, through the engine's port; the request waits for it, so only work
    that the request itself gains from belongs here. Must be cheap otherwise: it runs on
    every request. A host that cannot call it at that moment does not call it at all.
    """


@hookspec
def request_admitted(event: RequestAdmitted) -> None:
    """The engine took the request from waiting to running. Thread: the engine thread."""


@hookspec
def request_prefilled(event: RequestPrefilled) -> None:
    """A request's prefill ended (its first token came): by which route, over how many
    cached tokens, in how many seconds (see :class:`~.events.RequestPrefilled`).

    Thread: the engine thread, after the step that produced the token. Must be cheap.
    Recovery compares what a turn really cost with what its publish policy predicted,
    and learns the host's own dense appends from it. Idempotent per request.
    """


@hookspec
def request_departed(event: RequestDeparted) -> None:
    """The request left its engine (finished, aborted or failed), for good.

    Thread: the engine thread. Called once the host has returned the request's resources;
    a second call for the same request is ignored.
    """


@hookspec
def request_aborted(engine_id: str, request_id: str) -> None:
    """An abort of one request was applied by the engine. Thread: the engine thread.

    A departure with reason ``aborted`` follows.
    """


@hookspec
def engine_aborted_all(engine_id: str) -> None:
    """Every request of the engine was aborted. Thread: the engine thread.

    Plugins cancel the engine's background work at once and return what it holds.
    """


@hookspec
def engine_failed_all(engine_id: str, error: str) -> None:
    """The engine failed every request after an error. Thread: the engine thread.

    Plugins cancel the engine's background work at once and return what it holds.
    """


@hookspec
def engine_reset(engine_id: str, deep: bool) -> None:
    """The engine's scheduler state was reset (``deep``: its prefix cache too).

    Thread: the engine thread. Plugins cancel the engine's work and return what it holds;
    after a deep reset, nothing published earlier exists any more.
    """


@hookspec
def engine_shutdown(engine_id: str) -> None:
    """The engine is stopping. Thread: the engine thread, the host's control thread, or a
    worker thread the adapter hands it to so the host's event loop is not blocked (oMLX's
    ``EngineCore.stop``: the host's own stop waits for the hook to return).

    Plugins cancel at once and forget the engine; they may wait for their own running
    work to stop (never on an event loop), and must write nothing to the engine after
    they return.
    """


@hookspec
def model_unloaded(engine_id: str, model_id: str) -> None:
    """The engine's model is being unloaded. Thread: the host's control thread.

    Plugins drop every reference to the model and its cache state before returning.
    """


@hookspec
def engine_idle_step(event: IdleStep) -> bool | float | None:
    """The engine has no requests and offers one idle step.

    Thread: the engine thread, on the engine's MLX stream, never concurrently with
    ``step()``. The only hook allowed to run model work; it must return soon after
    foreground work arrives. Return True to ask for another idle step now, a positive
    float to ask again after that many seconds (for example when a budget window must
    refill), False or None when there is nothing to do. The host keeps offering idle
    steps while any implementation asks, and stops at once when a request arrives.
    """


@hookspec
def sparse_route_served(event: SparseRouteServed) -> None:
    """A request's uncached range was served by the sparse route; the host stored no
    reusable prefix state for it. Thread: the engine thread, after the sparse request
    finished its prefill.
    """


@hookspec(firstresult=True)
def prefix_lookup(lookup: PrefixLookup) -> AdoptionDecision | None:
    """Decide how much of a matching stored prefix entry to adopt for a new request.

    Thread: the engine thread, during admission. Return None to leave the decision to
    the host (its plain behaviour); the first non-None decision wins. An adopted
    decision's ``handle`` is owned by the host afterwards, which releases it.
    """
