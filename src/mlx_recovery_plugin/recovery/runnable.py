"""The runnable gate: may a recovery slice start on this engine now, and if not, why.

One predicate over the whole process, so that foreground work anywhere stops the next
slice. It only reads: the caller takes the execution claim after a yes, so a refusal has
no side effect. It never raises: a host port that fails counts as a refusal.

Threads: called on the engine thread that would run the slice; everything it reads is
either lock-protected (registry, budget) or documented as safe from any thread (the
engine ports' ``queues_empty`` / ``is_busy`` / ``sparse_route_live``).
"""

from __future__ import annotations

import logging
import os
from collections.abc import Callable, Iterable
from dataclasses import dataclass

from ..ports import EnginePort
from .budget import Budget
from .outcomes import Refusal
from .registry import ArrivalRegistry

log = logging.getLogger(__name__)

# Share of the device's memory above which recovery stays out of the way.
DEFAULT_MEMORY_FRACTION = 0.85
# Unset MLX_RECOVERY_MAX_HELD_MIB: an eighth of the device's memory, at least 256 MiB.
DEFAULT_HELD_SHARE_DIVISOR = 8
MIN_DEFAULT_HELD_MIB = 256.0


@dataclass(slots=True, frozen=True)
class GateDecision:
    runnable: bool
    reason: Refusal | None = None

    def __bool__(self) -> bool:
        return self.runnable


RUNNABLE = GateDecision(True, None)


class RunnableGate:
    """Checks, in order: the model opted in, this engine's queues empty, no sparse-route
    request live, enough consecutive idle steps, no other engine working, no request
    arrived and not departed anywhere, budget available, claim free, memory below the
    probe's limit. The first failing check is the reason; a port of this engine that
    raises gives :attr:`Refusal.HOST_ERROR`.

    ``opted_in`` and ``idle_steps_for`` take the engine's **model id** (as
    :meth:`RecoverySettings.for_model` and ``idle_steps_for`` do).
    """

    def __init__(
        self,
        registry: ArrivalRegistry,
        budget: Budget,
        *,
        engines: Callable[[], Iterable[EnginePort]],
        opted_in: Callable[[str], bool],
        idle_steps_for: Callable[[str], int],
        memory_ok: Callable[[], bool] = lambda: True,
    ) -> None:
        self.registry = registry
        self.budget = budget
        self._engines = engines
        self._opted_in = opted_in
        self._idle_steps_for = idle_steps_for
        self._memory_ok = memory_ok

    def check(self, engine: EnginePort, consecutive_idle: int) -> GateDecision:
        try:
            return self._check(engine, consecutive_idle)
        except Exception as exc:  # noqa: BLE001 - a failing port must not reach the host
            log.warning("mlx-recovery: runnable gate could not ask the host: %r", exc)
            return GateDecision(False, Refusal.HOST_ERROR)

    def _check(self, engine: EnginePort, consecutive_idle: int) -> GateDecision:
        model_id = engine.model_id
        if not self._opted_in(model_id):
            return GateDecision(False, Refusal.MODEL_NOT_OPTED_IN)
        if not engine.queues_empty():
            return GateDecision(False, Refusal.QUEUES_BUSY)
        if engine.sparse_route_live():
            return GateDecision(False, Refusal.SPARSE_ROUTE_LIVE)
        if consecutive_idle < self._idle_steps_for(model_id):
            return GateDecision(False, Refusal.NOT_ENOUGH_IDLE_STEPS)
        for other in self._engines():
            if other.engine_id != engine.engine_id and _working(other):
                return GateDecision(False, Refusal.OTHER_ENGINE_BUSY)
        if self.registry.foreground_active():
            return GateDecision(False, Refusal.FOREGROUND_ACTIVE)
        if not self.budget.available():
            return GateDecision(False, Refusal.BUDGET_OFF if self.budget.pct == 0 else Refusal.BUDGET_SPENT)
        claim = self.budget.claimed_by
        if claim is not None and claim != engine.engine_id:
            return GateDecision(False, Refusal.CLAIM_TAKEN)
        if not self._memory_ok():
            return GateDecision(False, Refusal.MEMORY_PRESSURE)
        return RUNNABLE


def _working(engine: EnginePort) -> bool:
    """Another engine prefills, decodes or has queued work. One whose port fails (it is
    going away, say) counts as working: that is its host's trouble, not this engine's."""
    try:
        return engine.is_busy() or not engine.queues_empty()
    except Exception as exc:  # noqa: BLE001
        log.debug("mlx-recovery: engine %r did not answer the gate: %r", engine, exc)
        return True


def device_memory_limit() -> int | None:
    """Bytes of memory MLX may use on the default device, or None when MLX does not say
    (the CPU build reports no memory size)."""
    import mlx.core as mx

    info_fn = getattr(mx, "device_info", None)
    if info_fn is None:  # older MLX kept it under mx.metal
        metal = getattr(mx, "metal", None)
        info_fn = getattr(metal, "device_info", None) if metal is not None else None
    if info_fn is None:
        return None
    try:
        info = info_fn()
    except Exception:  # noqa: BLE001 - no device information is not an error
        return None
    for key in ("max_recommended_working_set_size", "memory_size"):
        value = info.get(key) if isinstance(info, dict) else None
        if isinstance(value, int) and value > 0:
            return value
    return None


def machine_memory_bytes() -> int | None:
    """The device's memory limit where MLX reports one (Metal), else the machine's
    physical memory, else None."""
    limit = device_memory_limit()
    if limit:
        return limit
    try:
        pages, page = os.sysconf("SC_PHYS_PAGES"), os.sysconf("SC_PAGE_SIZE")
    except (AttributeError, OSError, ValueError):
        return None
    return pages * page if pages > 0 and page > 0 else None


def held_memory_bound(max_held_mib: float | None, machine_bytes: int | None) -> int:
    """Bytes that finished blocks held back may take on one engine: ``max_held_mib`` when
    set, else an eighth of ``machine_bytes``, at least ``MIN_DEFAULT_HELD_MIB``. The live
    state a job is recovered in is as large as the prefix, and the host holds as much for
    a dense turn of it, so a bound far below that only forces publications the policy
    would have waited on (a 7B-class float32 model holds up to 256 KiB a token)."""
    if max_held_mib is not None:
        return int(max_held_mib * 2**20)
    floor = int(MIN_DEFAULT_HELD_MIB * 2**20)
    return max(floor, (machine_bytes or 0) // DEFAULT_HELD_SHARE_DIVISOR)


def memory_probe(
    fraction: float = DEFAULT_MEMORY_FRACTION,
    *,
    limit_bytes: int | None = None,
    active_bytes: Callable[[], int] | None = None,
) -> Callable[[], bool]:
    """A ``memory_ok`` probe for :class:`RunnableGate`: False while MLX's active memory is
    above ``fraction`` of the device's limit. Where no limit is known (CPU), always True.
    ``limit_bytes`` and ``active_bytes`` override what MLX reports (tests, hosts that
    know better)."""
    if not 0.0 < fraction <= 1.0:
        raise ValueError(f"memory fraction must be in (0, 1], got {fraction!r}")
    limit = limit_bytes if limit_bytes is not None else device_memory_limit()
    if active_bytes is None:
        import mlx.core as mx

        active_bytes = mx.get_active_memory
    read_active = active_bytes

    def memory_ok() -> bool:
        if not limit:
            return True
        try:
            return read_active() <= fraction * limit
        except Exception:  # noqa: BLE001 - an unreadable probe must not block forever
            return True

    return memory_ok
