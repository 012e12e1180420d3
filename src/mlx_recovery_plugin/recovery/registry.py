"""The process-global arrival registry: which requests exist anywhere in the process.

A request counts as foreground work from its arrival until its departure, on whichever
engine it arrived. Recovery may only run while no such request exists, so this is the one
piece that runs on every request even with recovery off, and it stays a few dict
operations under one lock.

A host that loses a departure (a request refused on a path the adapter does not see)
would keep the whole process "busy" for ever, and recovery would never run again. So an
arrival older than ``max_age_s`` is dropped the next time anyone asks, counted as
``stale_arrival`` and logged once: the engines' own checks (queues, busy) still keep a
slice away from a request that is really running.

Threads: arrivals may come from any thread (the host's request threads); admissions and
departures from engine threads; readers from anywhere. All mutable state below is owned
by ``_lock``.
"""

from __future__ import annotations

import logging
import threading
import time
from collections import Counter, OrderedDict, deque
from collections.abc import Callable
from typing import Any

log = logging.getLogger(__name__)

# Kinds of bad input; each is logged once per registry and then only counted.
DUPLICATE_ARRIVAL = "duplicate_arrival"
ADMISSION_UNKNOWN = "admission_unknown"
DEPARTURE_UNKNOWN = "departure_unknown"
SECOND_DEPARTURE = "second_departure"
STALE_ARRIVAL = "stale_arrival"

#: Seconds after which an arrival that never departed stops counting as foreground work.
ARRIVAL_MAX_AGE_S = 900.0

# How many departed ids are remembered to tell a second departure from an unknown one.
_RECENT_DEPARTURES = 4096
# Arrival times kept: the waits of the requests that came in during one idle step.
RECENT_ARRIVAL_TIMES = 64


class ArrivalRegistry:
    """Arrival, admission and departure of every request on every engine."""

    def __init__(self, *, max_age_s: float = ARRIVAL_MAX_AGE_S, clock: Callable[[], float] = time.monotonic) -> None:
        if not max_age_s > 0:
            raise ValueError(f"max_age_s must be positive, got {max_age_s!r}")
        self._max_age_s = float(max_age_s)
        self._clock = clock
        self._lock = threading.Lock()
        # (engine id, request id) -> arrival time, oldest first.
        self._arrived_at: dict[tuple[str, str], float] = {}
        # engine id -> request id -> admitted?
        self._live: dict[str, dict[str, bool]] = {}
        self._active = 0
        self._arrivals = 0
        self._arrival_times: deque[float] = deque(maxlen=RECENT_ARRIVAL_TIMES)
        self._departures = 0
        self._recent: OrderedDict[tuple[str, str], None] = OrderedDict()
        self._bad: Counter[str] = Counter()

    # -- updates ---------------------------------------------------------------------

    def arrived(self, engine_id: str, request_id: str) -> None:
        """A request entered ``engine_id``'s waiting queue. Any thread."""
        key = (engine_id, request_id)
        with self._lock:
            requests = self._live.setdefault(engine_id, {})
            if request_id in requests:
                first = self._note_bad_locked(DUPLICATE_ARRIVAL)
            else:
                first = False
                requests[request_id] = False
                self._arrived_at[key] = now = self._clock()
                self._arrival_times.append(now)
                self._recent.pop(key, None)
                self._active += 1
                self._arrivals += 1
        if first:
            log.debug(
                "mlx-recovery: request %r arrived twice on %r; ignored", request_id, engine_id
            )

    def admitted(self, engine_id: str, request_id: str) -> None:
        """The engine moved the request from waiting to running. Engine thread."""
        with self._lock:
            requests = self._live.get(engine_id)
            if requests is not None and request_id in requests:
                requests[request_id] = True
                return
            first = self._note_bad_locked(ADMISSION_UNKNOWN)
        if first:
            log.warning(
                "mlx-recovery: admission of unknown request %r on %r ignored "
                "(further ones are only counted)",
                request_id,
                engine_id,
            )

    def departed(self, engine_id: str, request_id: str) -> None:
        """The request left its engine for good. Engine thread. Idempotent."""
        key = (engine_id, request_id)
        with self._lock:
            requests = self._live.get(engine_id)
            if requests is not None and request_id in requests:
                self._remove_locked(engine_id, request_id)
                self._departures += 1
                return
            kind = SECOND_DEPARTURE if key in self._recent else DEPARTURE_UNKNOWN
            first = self._note_bad_locked(kind)
        if first:
            log.warning(
                "mlx-recovery: %s of request %r on %r ignored (further ones are only counted)",
                "second departure" if kind == SECOND_DEPARTURE else "departure before arrival",
                request_id,
                engine_id,
            )

    def forget_engine(self, engine_id: str) -> int:
        """Treat every request still live on ``engine_id`` as departed (the engine shut
        down or its model was unloaded without reporting each departure). Returns how
        many were dropped."""
        with self._lock:
            requests = list(self._live.get(engine_id, ()))
            for request_id in requests:
                self._remove_locked(engine_id, request_id)
            self._departures += len(requests)
            return len(requests)

    # -- queries ---------------------------------------------------------------------

    def foreground_active(self) -> bool:
        """True while any request has arrived and not departed (nor gone stale), on any engine."""
        with self._lock:
            stale = self._drop_stale_locked()
            active = self._active > 0
        for engine_id, request_id, age in stale:
            log.warning(
                "mlx-recovery: request %r on %r arrived %.0f s ago and never departed; it no "
                "longer counts as foreground work (the host lost its departure?)", request_id, engine_id, age,
            )
        return active

    def arrivals(self) -> int:
        """Arrivals so far, ever increasing: a running slice that sees it change knows a
        request came in (duplicates of a live request do not count)."""
        with self._lock:
            return self._arrivals

    def arrivals_since(self, count: int) -> tuple[int, tuple[float, ...]]:
        """Arrivals so far, and when each arrival after the first ``count`` came in (the
        registry's clock; the latest :data:`RECENT_ARRIVAL_TIMES` of them), read together."""
        with self._lock:
            new = min(max(0, self._arrivals - count), len(self._arrival_times))
            return self._arrivals, tuple(self._arrival_times)[len(self._arrival_times) - new:]

    def snapshot(self) -> dict[str, Any]:
        with self._lock:
            return {
                "active": self._active,
                "arrivals": self._arrivals,
                "departures": self._departures,
                "engines": {
                    engine_id: {
                        "active": len(requests),
                        "admitted": sum(requests.values()),
                    }
                    for engine_id, requests in self._live.items()
                },
                "bad_input": dict(self._bad),
            }

    # -- private ---------------------------------------------------------------------

    def _remove_locked(self, engine_id: str, request_id: str) -> None:
        requests = self._live[engine_id]
        del requests[request_id]
        if not requests:
            del self._live[engine_id]
        self._arrived_at.pop((engine_id, request_id), None)
        self._active -= 1
        self._remember_departed_locked((engine_id, request_id))

    def _drop_stale_locked(self) -> list[tuple[str, str, float]]:
        """Drop arrivals older than the bound; those logged for the first time."""
        if not self._arrived_at:
            return []
        now = self._clock()
        dropped = []
        while self._arrived_at:
            (engine_id, request_id), at = next(iter(self._arrived_at.items()))
            if now - at <= self._max_age_s:
                break
            self._remove_locked(engine_id, request_id)
            if self._note_bad_locked(STALE_ARRIVAL):
                dropped.append((engine_id, request_id, now - at))
        return dropped

    def _note_bad_locked(self, kind: str) -> bool:
        """Count one bad input; True the first time this kind is seen."""
        self._bad[kind] += 1
        return self._bad[kind] == 1

    def _remember_departed_locked(self, key: tuple[str, str]) -> None:
        self._recent[key] = None
        self._recent.move_to_end(key)
        while len(self._recent) > _RECENT_DEPARTURES:
            self._recent.popitem(last=False)
