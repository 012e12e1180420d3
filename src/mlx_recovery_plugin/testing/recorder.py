"""A plugin that records every lifecycle hook call, and token helpers for contract tests.

Threads: hooks may arrive from any thread; the recorder appends under its own lock.
"""

from __future__ import annotations

import threading
from collections.abc import Callable, Iterator, Sequence
from contextlib import contextmanager
from dataclasses import dataclass, field
from typing import Any

import pluggy

from ..events import (
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
from ..hookspecs import hookimpl
from ..ports import EnginePort
from .contract_host_protocol import ContractHost

IdleAnswer = bool | float | None

@dataclass(slots=True, frozen=True)
class RecordedEvent:
    """One hook call: its name, engine, request (if any) and the record or arguments."""

    seq: int
    hook: str
    engine_id: str
    request_id: str | None
    payload: Any = field(compare=False)


class EventRecorder:
    """A plugin that records every lifecycle hook call, thread-safely, and answers idle
    steps from ``idle_answer`` (None by default: nothing to do).

    ``idle_answer`` is called with the :class:`IdleStep`; ``queues_empty_at_idle`` records,
    for every idle step, whether the attached engine's queues were empty then.
    """

    def __init__(self, idle_answer: Callable[[IdleStep], IdleAnswer] | None = None) -> None:
        self.idle_answer = idle_answer
        self.events: list[RecordedEvent] = []
        self.engines: dict[str, EnginePort] = {}
        self.queues_empty_at_idle: list[bool] = []
        #: ``request_prefilled`` events, kept apart: the order checks are about the
        #: lifecycle, and a host reports a prefill between admission and departure.
        self.prefills: list[RequestPrefilled] = []
        #: ``prefix_lookup`` calls, kept apart too (the recorder never decides one).
        self.lookups: list[PrefixLookup] = []
        #: ``prefix_lookup_due`` calls, kept apart: (how many events were recorded before
        #: it, the event, the prompt tokens it gave).
        self.lookups_due: list[tuple[int, LookupDue, tuple[int, ...]]] = []
        self._lock = threading.Lock()

    def _add(self, hook: str, engine_id: str, request_id: str | None, payload: Any) -> None:
        with self._lock:
            seq = len(self.events)
            self.events.append(RecordedEvent(seq, hook, engine_id, request_id, payload))

    # hooks
    @hookimpl
    def engine_attached(self, engine: EnginePort) -> None:
        self.engines[engine.engine_id] = engine
        self._add("engine_attached", engine.engine_id, None, engine)

    @hookimpl
    def request_arrived(self, event: RequestArrived) -> None:
        self._add("request_arrived", event.engine_id, event.request_id, event)

    @hookimpl
    def request_admitted(self, event: RequestAdmitted) -> None:
        self._add("request_admitted", event.engine_id, event.request_id, event)

    @hookimpl
    def request_departed(self, event: RequestDeparted) -> None:
        self._add("request_departed", event.engine_id, event.request_id, event)

    @hookimpl
    def request_aborted(self, engine_id: str, request_id: str) -> None:
        self._add("request_aborted", engine_id, request_id, None)

    @hookimpl
    def engine_aborted_all(self, engine_id: str) -> None:
        self._add("engine_aborted_all", engine_id, None, None)

    @hookimpl
    def engine_failed_all(self, engine_id: str, error: str) -> None:
        self._add("engine_failed_all", engine_id, None, error)

    @hookimpl
    def engine_reset(self, engine_id: str, deep: bool) -> None:
        self._add("engine_reset", engine_id, None, deep)

    @hookimpl
    def engine_shutdown(self, engine_id: str) -> None:
        self._add("engine_shutdown", engine_id, None, None)

    @hookimpl
    def model_unloaded(self, engine_id: str, model_id: str) -> None:
        self._add("model_unloaded", engine_id, None, model_id)

    @hookimpl
    def request_prefilled(self, event: RequestPrefilled) -> None:
        with self._lock:
            self.prefills.append(event)

    @hookimpl
    def prefix_lookup(self, lookup: PrefixLookup) -> AdoptionDecision | None:
        with self._lock:
            self.lookups.append(lookup)
        return None

    @hookimpl
    def prefix_lookup_due(self, event: LookupDue) -> None:
        tokens = event.prompt_tokens()
        with self._lock:
            self.lookups_due.append((len(self.events), event, tokens))

    @hookimpl
    def sparse_route_served(self, event: SparseRouteServed) -> None:
        self._add("sparse_route_served", event.engine_id, event.request_id, event)

    @hookimpl
    def engine_idle_step(self, event: IdleStep) -> IdleAnswer:
        engine = self.engines.get(event.engine_id)
        if engine is not None:
            self.queues_empty_at_idle.append(engine.queues_empty())
        self._add("engine_idle_step", event.engine_id, None, event)
        return self.idle_answer(event) if self.idle_answer is not None else None

    # queries
    def snapshot(self) -> list[RecordedEvent]:
        with self._lock:
            return list(self.events)

    def hooks_for(self, request_id: str) -> list[str]:
        """Hook names that carried ``request_id``, in order."""
        return [e.hook for e in self.snapshot() if e.request_id == request_id]

    def named(self, hook: str) -> list[RecordedEvent]:
        return [e for e in self.snapshot() if e.hook == hook]

    def one(self, hook: str, request_id: str) -> Any:
        """The payload of the single ``hook`` event of ``request_id`` (asserts it is one)."""
        found = [e for e in self.named(hook) if e.request_id == request_id]
        assert len(found) == 1, f"{hook} for {request_id}: {len(found)} events"
        return found[0].payload

    def idle_steps(self) -> list[IdleStep]:
        return [e.payload for e in self.named("engine_idle_step")]


@contextmanager
def registered(pm: pluggy.PluginManager, plugin: object) -> Iterator[object]:
    """Register ``plugin`` on ``pm`` for the duration of a ``with`` block."""
    pm.register(plugin)
    try:
        yield plugin
    finally:
        pm.unregister(plugin)


def contract_tokens(n: int, seed: int = 0) -> list[int]:
    """``n`` deterministic token ids below 256; different seeds share no first block."""
    return [(seed * 97 + 13 + i * 31 + (i * i) % 7) % 256 for i in range(n)]


def byte_tokens(n: int, seed: int = 0) -> list[int]:
    """``n`` deterministic byte token ids (a stand-in for text)."""
    return [(seed * 131 + i * 37 + (i * i) % 11) % 256 for i in range(n)]


def stored_tokens(host: ContractHost, tokens: Sequence[int]) -> int:
    """How much of ``tokens`` the host's prefix cache restores, through its own fetch and
    release (the references of the probe are given back)."""
    cache = host.engine.prefix_cache
    try:
        return cache.fetch("contract-probe", tokens).tokens
    finally:
        cache.release("contract-probe")
