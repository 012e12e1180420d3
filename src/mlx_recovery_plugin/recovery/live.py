"""The live dense state of one engine: the job being prefilled, its runner and its cache.

At most one job per engine is live. It starts at the whole-block prefix the host restores
now (fetch through the host, begin the runner on those blocks, release the fetch's
references whatever happens), advances one slice at a time, and is retired (its memory
given back) for foreground work, a fault, or a job switch; a retired job resumes later
from its committed block, fetched back from the host.

Threads: owned by one engine's recovery service and used on its engine thread only, under
the service's work lock. :attr:`LiveDense.offset` is a status figure that any thread may
read (an int replaced whole).
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from dataclasses import dataclass
from enum import Enum
from typing import TYPE_CHECKING

from ..ports import EnginePort, FetchedPrefix, ModelHandle
from ..state import BlockState, floor_block
from .jobs import RecoveryJob
from .ledger import ReleaseLedger
from .outcomes import FaultKind

if TYPE_CHECKING:
    from ..runner import LiveState, SliceOutcome, SliceRunner

log = logging.getLogger(__name__)

RunnerFactory = Callable[[ModelHandle, int, bool], "SliceRunner"]
"""``(model, block_size, interruptible) -> runner``."""


def default_runner_factory(model: ModelHandle, block_size: int, interruptible: bool) -> SliceRunner:
    from ..runner import SliceRunner

    return SliceRunner(model, block_size, interruptible=interruptible)


AttentionProbe = Callable[[int], "float | None"]
"""``context -> seconds per token`` of the model's attention at that depth (None: this
model cannot be timed so); see :mod:`..runner.attention_probe`."""


def default_attention_probe(model: ModelHandle) -> AttentionProbe:
    """Times ``model``'s own attention (MLX is imported at the first call, not when the
    start-up hook loads us)."""
    probe: list[AttentionProbe] = []

    def timed(context: int) -> float | None:
        if not probe:
            from ..runner.attention_probe import probe_for

            probe.append(probe_for(model))
        return probe[0](context)

    return timed


class Start(Enum):
    """What :meth:`LiveDense.start` did."""

    STARTED = "started"
    NOTHING_TO_RUN = "nothing_to_run"  # the host restores the whole job already
    FETCH_FAILED = "fetch_failed"
    RUNNER_FAILED = "runner_failed"


@dataclass(slots=True, frozen=True)
class Started:
    outcome: Start
    error: Exception | None = None


Settle = Callable[[int], "tuple[BlockState, ...] | None"]
"""Given the tokens the host restores of a job now: the held blocks to run on top of
them, or None when nothing is left to run (the service updates the job under its lock)."""


class LiveDense:
    """The live job of one engine (see the module docstring)."""

    def __init__(
        self,
        port: EnginePort,
        block_size: int,
        *,
        runner_factory: RunnerFactory,
        interruptible: bool,
        ledger: ReleaseLedger,
        count_fault: Callable[[FaultKind], None],
    ) -> None:
        self._port = port
        self._block_size = block_size
        self._runner_factory = runner_factory
        self._interruptible = interruptible
        self._ledger = ledger
        self._count_fault = count_fault
        self._runner: SliceRunner | None = None
        self._state: LiveState | None = None
        self.job: RecoveryJob | None = None
        self._end = 0
        #: Tokens in the live cache (None: nothing live). Replaced whole; any thread reads.
        self.offset: int | None = None

    @property
    def active(self) -> bool:
        return self._state is not None

    def runner(self) -> SliceRunner:
        """The engine's runner, made on first use (raises when the model is unusable)."""
        if self._runner is None:
            self._runner = self._runner_factory(self._port.model, self._block_size, self._interruptible)
        return self._runner

    def drop_runner(self) -> None:
        """No slice will run here again: give the runner's memory back."""
        self._runner = None

    def is_for(self, job: RecoveryJob, end_target: int) -> bool:
        """The live state is ``job``'s, prefilling towards ``end_target``."""
        return self._state is not None and self.job is job and self._end == end_target

    def start(self, job: RecoveryJob, end_target: int, settle: Settle) -> Started:
        """Begin ``job``'s live state at the whole-block prefix the host has now (fetch,
        begin, release)."""
        lineage = job.tokens[:end_target]
        holder = self._ledger.holder("start")
        cache = self._port.prefix_cache
        try:
            try:
                prefix = cache.fetch(holder, lineage)
            except Exception as exc:  # noqa: BLE001 - the host's fetch failed
                return Started(Start.FETCH_FAILED, exc)
            restorable = floor_block(min(int(prefix.tokens), end_target), self._block_size)
            held = settle(restorable)
            if held is None:
                return Started(Start.NOTHING_TO_RUN)
            blocks = tuple(prefix.blocks[: restorable // self._block_size]) + held
            on = FetchedPrefix(len(blocks) * self._block_size, blocks)
            try:
                state = self.runner().begin(lineage, on if on.tokens else None)
            except Exception as exc:  # noqa: BLE001 - runner faults park the job
                return Started(Start.RUNNER_FAILED, exc)
        finally:
            self._ledger.release(cache, holder)
        self._state, self.job, self._end = state, job, end_target
        self.offset = int(state.offset)
        return Started(Start.STARTED)

    @property
    def start_offset(self) -> int:
        assert self._state is not None, "no live state"
        return int(self._state.offset)

    @property
    def layers(self) -> int:
        """Layers of the live job's cache (0 with none)."""
        return len(self._state.cache) if self._state is not None else 0

    def advance(self, end: int, should_stop: Callable[[], bool], stop_grain: int | None = None) -> SliceOutcome:
        """Run the live job up to ``end`` in passes of ``stop_grain`` tokens (None: the
        runner's own); raises what the runner raises."""
        assert self._state is not None, "no live state"
        outcome = self.runner().advance(self._state, end, should_stop, stop_grain)
        self.offset = int(self._state.offset)
        return outcome

    def retire(self) -> bool:
        """Give the live state's memory back; True if there was one."""
        state, runner = self._state, self._runner
        self._state, self.job, self._end = None, None, 0
        self.offset = None
        if state is None:
            return False
        if runner is not None:
            try:
                runner.discard(state)
            except Exception as exc:  # noqa: BLE001 - the state is dropped either way
                log.warning("mlx-recovery: engine %s: discard failed: %r", self._port.engine_id, exc)
                self._count_fault(FaultKind.INTERNAL_ERROR)
        return True

