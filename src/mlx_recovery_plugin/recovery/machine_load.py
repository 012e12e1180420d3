"""How much of the machine other processes take: the publish policy's load regime.

A slice timed while a build, an indexer or another model keeps the cores busy is slower
than the same slice on a quiet machine, and a sparse turn timed then is slower too; a
verdict must not mix the two (a loaded dense sample against a quiet sparse one stands down
where recovery pays; the other way round it publishes where it loses). So every sample is
tagged with the load regime it was taken in: the share of the machine's CPU time that
other processes used since the policy last looked, from the system's counters (Linux
``/proc/stat``; ``psutil`` where installed elsewhere) less this process's own CPU time.

How much a busy machine slows this process's passes is read apart from the regime, two
ways (:class:`LoadReading`), because the others' share says little of it: over a window in
which this process's passes competed for the cores, others who would saturate the machine
show a share of 0.5-0.8 (they got what this process left). Their **demand** is the share
they took of what this process left; and the **contention** is how long this process's
threads waited for a core beside their time on one (Linux ``/proc/self/task/*/schedstat``).
On this project's 2-core CPU under two busy processes a 2,048-token pass ran 1.9-2.0x
slower: the demand said 2x, the threads 2.4-2.7x, the fair share of the others' 0.65
1.65x; a 256-token pass ran 6.9-7.7x slower and its threads read 9.4-10.0x
(``examples/thread_waits_under_load.py``). Short passes wait longest, and
under load a recovery's slices are short, so the threads overstate what a host's long
turn meets; the demand counts a pass as wanting every core, which a pass on a GPU, or one
that the others yield to (a ``nice`` build), does not.

Threads: a :class:`MachineLoad` belongs to one engine's publish policy (its engine thread).
"""

from __future__ import annotations

import math
import os
import time
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from enum import Enum

# Other processes using at least this share of all cores make the machine busy.
BUSY_SHARE = 0.25
# Shorter windows (seconds of one core) say nothing: the counters tick at 100 Hz.
MIN_WINDOW_S = 0.2

# Less CPU time than this of this process's threads in a window says nothing of how long
# they waited (a short window's waits are mostly wake-ups).
MIN_RUN_S = 0.05

#: ``(busy CPU seconds of the whole machine, all CPU seconds, this process's CPU seconds)``
#: as monotonic counters, or None where the system does not say.
Reader = Callable[[], tuple[float, float, float] | None]
#: Per thread of this process, ``(seconds on a core, seconds runnable but waiting for one)``
#: as monotonic counters, or None where the system does not say.
ThreadReader = Callable[[], Mapping[int, tuple[float, float]] | None]


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


def read_thread_times() -> dict[int, tuple[float, float]] | None:
    """Linux's scheduler statistics of this process's threads (nanoseconds on a core and
    waiting on a run queue); None where the system keeps none."""
    times: dict[int, tuple[float, float]] = {}
    try:
        tids = os.listdir("/proc/self/task")
    except OSError:
        return None
    for tid in tids:
        try:
            with open(f"/proc/self/task/{tid}/schedstat", encoding="ascii") as f:
                on_cpu, waiting = f.read().split()[:2]
            times[int(tid)] = (int(on_cpu) / 1e9, int(waiting) / 1e9)
        except (OSError, ValueError):
            continue  # a thread that ended between the listing and the read
    return times or None


@dataclass(frozen=True, slots=True)
class LoadReading:
    """How loaded the machine was (see the module docstring)."""

    #: Other processes' share of the machine's CPU time over the last window.
    share: float
    #: What they would take of a machine to themselves, since the regime began: in a busy
    #: regime, their share of what this process left; in a quiet one, their share (they
    #: were not held back, and this process taking most of a quiet machine must not turn
    #: the few per cent of its daemons into a demand).
    demand: float
    #: How many times longer this process's passes took than on a machine to themselves,
    #: since the regime began: its threads' time on a core and waiting for one over their
    #: time on one; where they hardly ran (or the system does not say), ``1 + demand``.
    contention: float


class MachineLoad:
    """The load regime since the last look, and how much it slows this process's passes
    (see the module docstring)."""

    def __init__(self, reader: Reader | None = None, threads: ThreadReader | None = None) -> None:
        # Looked up at construction, so a test suite can swap the module's readers.
        self._reader = reader if reader is not None else read_counters
        self._threads = threads if threads is not None else read_thread_times
        self._mark = self._read()
        self._threads_mark = self._read_threads()
        #: The others' share of the machine over the last window judged, if any.
        self.last_share: float | None = None
        # Summed over the windows since the regime last changed (and that regime): the
        # machine's CPU seconds, the others' and this process's; this process's threads'
        # seconds on a core and waiting for one.
        self._total_s = self._others_s = self._own_s = 0.0
        self._run_s = self._wait_s = 0.0
        self._regime: Regime | None = None

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
        others = max(0.0, busy - own)
        share = others / total
        self.last_share = share
        regime = Regime.BUSY if share >= BUSY_SHARE else Regime.QUIET
        if regime is not self._regime:
            self._regime = regime
            self._total_s = self._others_s = self._own_s = self._run_s = self._wait_s = 0.0
        self._total_s += total
        self._others_s += others
        self._own_s += max(0.0, own)
        threads = self._read_threads()
        if threads is not None and self._threads_mark is not None:
            for tid, (on_cpu, waiting) in threads.items():
                before = self._threads_mark.get(tid)
                if before is not None:  # a thread born in the window counts from the next
                    self._run_s += max(0.0, on_cpu - before[0])
                    self._wait_s += max(0.0, waiting - before[1])
        self._threads_mark = threads
        return regime

    @property
    def reading(self) -> LoadReading | None:
        """The load as of the last window judged (None before one was)."""
        if self.last_share is None or self._total_s <= 0:
            return None
        if self._regime is Regime.BUSY:
            demand = min(1.0, self._others_s / max(self._total_s - self._own_s, 1e-9))
        else:
            demand = self._others_s / self._total_s
        if self._run_s >= MIN_RUN_S:
            contention = (self._run_s + self._wait_s) / self._run_s
        else:
            contention = 1.0 + demand
        return LoadReading(self.last_share, demand, contention)

    def _read(self) -> tuple[float, float, float] | None:
        try:
            return self._reader()
        except Exception:  # noqa: BLE001 - a counter that cannot be read is "not known"
            return None

    def _read_threads(self) -> Mapping[int, tuple[float, float]] | None:
        try:
            return self._threads()
        except Exception:  # noqa: BLE001 - as above
            return None


def demand_factor(then: LoadReading | None, now: LoadReading | None) -> float | None:
    """What a pass timed at load ``then`` costs at ``now``, if it wanted every core and the
    cores were shared fairly among what ran: with ``n`` cores, others wanting ``n * d`` of
    them leave it ``n / (n + n * d)`` of the machine (None where either is not known)."""
    if then is None or now is None:
        return None
    return (1.0 + now.demand) / (1.0 + then.demand)


def contention_factor(then: LoadReading | None, now: LoadReading | None) -> float | None:
    """What a pass timed at load ``then`` costs at ``now``, by how long this process's
    threads waited for a core in each (None where either is not known)."""
    if then is None or now is None or then.contention <= 0 or now.contention <= 0:
        return None
    return now.contention / then.contention


def carry_factor(*estimates: float | None) -> float | None:
    """The factor that carries a host's sparse turn from one load regime to the other: of
    the ``estimates`` known (the two regimes' dense costs compared where both have
    evidence, :func:`demand_factor`, :func:`contention_factor`), the one nearer 1. Each
    overstates somewhere: the dense costs read beyond their evidence differed from what the
    load did by 0.3-2.7x (``bench policy``), and the slices under load are short passes,
    which contention slows more than a turn's long ones; the threads' waits read 3.1-4.1x
    where the host's loaded reruns took 2.4-3.3x the quiet ones; the demand counts a pass
    as wanting every core, which on a GPU it does not."""
    known = [f for f in estimates if f is not None and f > 0 and math.isfinite(f)]
    if not known:
        return None
    return min(known, key=lambda f: abs(math.log(f)))
