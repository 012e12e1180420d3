"""How much of the machine other processes take: the publish policy's load regime.

A slice timed while a build, an indexer or another model keeps the cores busy is slower
than the same slice on a quiet machine, and a sparse turn timed then is slower too; a
verdict must not mix the two (a loaded dense sample against a quiet sparse one stands down
where recovery pays; the other way round it publishes where it loses). So every sample is
tagged with the load regime it was taken in: the share of the machine's CPU time that
other processes used since the policy last looked, from the system's counters (Linux
``/proc/stat``; ``psutil`` where installed elsewhere) less this process's own CPU time.

Threads: a :class:`MachineLoad` belongs to one engine's publish policy (its engine thread).
"""

from __future__ import annotations

import os
import time
from collections.abc import Callable
from enum import Enum

# Other processes using at least this share of all cores make the machine busy.
BUSY_SHARE = 0.25
# Shorter windows (seconds of one core) say nothing: the counters tick at 100 Hz.
MIN_WINDOW_S = 0.2

#: ``(busy CPU seconds of the whole machine, all CPU seconds, this process's CPU seconds)``
#: as monotonic counters, or None where the system does not say.
Reader = Callable[[], tuple[float, float, float] | None]


class Regime(str, Enum):
    QUIET = "quiet"
    BUSY = "busy"


def read_counters() -> tuple[float, float, float] | None:
    own = time.process_time()
    try:
        with open("/proc/stat", encoding="ascii") as f:
            fields = f.readline().split()
        if fields and fields[0] == "cpu":
            ticks = [int(x) for x in fields[1:9]]
            hz = float(os.sysconf("SC_CLK_TCK"))
            user, nice, system, idle, iowait, irq, softirq, steal = ticks
            busy = user + nice + system + irq + softirq + steal
            return busy / hz, (busy + idle + iowait) / hz, own
    except (OSError, ValueError):
        pass
    try:
        import psutil  # type: ignore[import-untyped]
    except ImportError:
        return None
    t = psutil.cpu_times()
    busy = sum(float(getattr(t, name, 0.0)) for name in ("user", "nice", "system", "irq", "softirq", "steal"))
    return busy, busy + float(t.idle) + float(getattr(t, "iowait", 0.0)), own


class MachineLoad:
    """The load regime since the last look (see the module docstring)."""

    def __init__(self, reader: Reader | None = None) -> None:
        # Looked up at construction, so a test suite can swap the module's reader.
        self._reader = reader if reader is not None else read_counters
        self._mark = self._read()
        #: The others' share of the machine over the last window judged, if any.
        self.last_share: float | None = None

    def look(self) -> Regime | None:
        """The regime since the previous look; None where it cannot be told (no counters,
        or too short a window: the window then stays open for the next look)."""
        now = self._read()
        if now is None or self._mark is None:
            self._mark = now
            return None
        busy, total, own = (b - a for a, b in zip(self._mark, now, strict=True))
        if total < MIN_WINDOW_S:
            return None
        self._mark = now
        share = max(0.0, busy - own) / total
        self.last_share = share
        return Regime.BUSY if share >= BUSY_SHARE else Regime.QUIET

    def _read(self) -> tuple[float, float, float] | None:
        try:
            return self._reader()
        except Exception:  # noqa: BLE001 - a counter that cannot be read is "not known"
            return None
