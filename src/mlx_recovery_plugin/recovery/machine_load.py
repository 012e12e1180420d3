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

import math
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


def cpu_share_factor(others_then: float | None, others_now: float | None) -> float | None:
    """What a pass timed while other processes took ``others_then`` of the machine's CPU
    time costs now that they take ``others_now``, if it wanted every core and the cores
    were shared fairly among what ran: with ``n`` cores, others keeping ``n * s`` of them
    busy leave a pass ``n / (n + n * s)`` of the machine, so the factor is
    ``(1 + s_now) / (1 + s_then)`` (None where either share is not known). A pass that
    wants fewer cores, or runs elsewhere (a GPU), is slowed less."""
    if others_then is None or others_now is None:
        return None
    return (1.0 + max(0.0, others_now)) / (1.0 + max(0.0, others_then))


def carry_factor(by_dense_costs: float | None, by_cpu_share: float | None) -> float | None:
    """The factor that carries a host's sparse turn from one load regime to the other: of
    the two regimes' dense costs compared (``by_dense_costs``, where both have evidence)
    and the CPU's fair share (:func:`cpu_share_factor`), the one nearer 1, or whichever is
    known. On oMLX's scheduler in process (``bench policy``), from a loaded first turn to a
    quiet machine, the fair share read 0.59-0.67 where the host's sparse turn had changed
    by 0.52-0.81, and the dense costs, read beyond their evidence, 0.22-0.51: the slices
    under load are short passes, which contention slows more than a turn's long ones (on
    this 2-core CPU under two busy processes, a 256-token pass 2.6x, a 2,048-token one
    1.75x). The fair share counts a pass as CPU-bound, which on a GPU it is not: there
    the dense costs, where comparable, say less."""
    known = [f for f in (by_dense_costs, by_cpu_share) if f is not None and f > 0 and math.isfinite(f)]
    if not known:
        return None
    return min(known, key=lambda f: abs(math.log(f)))

