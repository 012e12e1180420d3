"""Recovery status: plain records per job, per engine and per process, and flat counters a
host can export.

Everything here is a snapshot (copied values, no live references), safe to hand to another
thread, serialise as JSON, or print with ``mlx-recovery status``.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import asdict, dataclass, field, replace
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from .jobs import RecoveryJob

COUNTER_PREFIX = "mlx_recovery_"


def dense_fit(policy: Mapping[str, Any]) -> tuple[float, float] | None:
    """The dense cost's coefficients ``(a, b)`` as a publish policy's status reports them
    (``dense_s_per_token``, ``dense_s_per_token_per_context``); None where none is fitted."""
    a, b = policy.get("dense_s_per_token"), policy.get("dense_s_per_token_per_context")
    if isinstance(a, (int, float)) and isinstance(b, (int, float)):
        return float(a), float(b)
    return None


@dataclass(slots=True, frozen=True)
class JobStatus:
    job_id: int
    tokens: int
    committed: int
    target_end: int
    publish_end: int
    debt: int
    attempts: int
    parked_for_s: float | None
    tokens_recovered: int
    held_tokens: int = 0
    stood_down: str | None = None
    paused: str | None = None
    #: Seconds until the conversation is expected back (negative: it is late); None
    #: before a gap between two turns was seen (:mod:`.returns`).
    due_in_s: float | None = None
    #: Wall seconds the rest of the job takes at the budget's share, by the dense cost
    #: model the order of the jobs goes by; None while that cost is not known. Beside
    #: ``due_in_s`` it says whether the idle time keeps up: a job whose work outlasts its
    #: conversation's return is not whole for that turn.
    work_left_s: float | None = None

    @classmethod
    def of(cls, job: RecoveryJob, block_size: int, now: float, due: float | None = None,
           work_left_s: float | None = None) -> JobStatus:
        """A copy of ``job``'s figures (under the lock that guards the job); ``due``: when
        its conversation is expected back; ``work_left_s``: see the field."""
        return cls(
            job_id=job.job_id,
            tokens=len(job.tokens),
            committed=job.committed,
            target_end=job.target_end,
            publish_end=job.publish_end(block_size),
            debt=job.debt,
            attempts=job.attempts,
            parked_for_s=(job.parked_until - now) if job.parked_until is not None and job.parked(now) else None,
            tokens_recovered=job.tokens_recovered,
            held_tokens=len(job.held) * block_size,
            stood_down=job.stood_down,
            paused=job.paused,
            due_in_s=None if due is None else round(due - now, 3),
            work_left_s=None if work_left_s is None else round(work_left_s, 3),
        )


@dataclass(slots=True)
class EngineCounters:
    """Monotonic counters of one engine's recovery. Owned by its service's lock."""

    slices: int = 0
    slices_interrupted: int = 0
    tokens_run: int = 0
    tokens_recovered: int = 0
    blocks_published: int = 0
    jobs_queued: int = 0
    jobs_extended: int = 0
    jobs_completed: int = 0
    jobs_dropped: int = 0
    jobs_cancelled: int = 0
    jobs_stood_down: int = 0
    jobs_paused: int = 0
    slices_held: int = 0
    held_blocks_dropped: int = 0
    live_retired: int = 0
    ground_lost_tokens: int = 0
    #: Publications taken at a request's arrival, before the host's lookup, and the
    #: seconds they added to those requests.
    arrival_publications: int = 0
    arrival_publish_seconds: float = 0.0
    slice_seconds: float = 0.0
    slice_seconds_max: float = 0.0
    #: Times the model's attention was timed deeper than the slices had reached.
    attention_probes: int = 0
    #: Requests that arrived (anywhere in the process) during an idle step, and the
    #: seconds from each one's arrival to the step's end: what it waited behind recovery.
    arrival_waits: int = 0
    arrival_wait_seconds: float = 0.0
    arrival_wait_seconds_max: float = 0.0
    #: Per part of the idle step (:mod:`.step_phases`: step, probe, verdict, start,
    #: slice, settle), the longest time a waiting request spent behind it.
    arrival_wait_seconds_max_by_phase: dict[str, float] = field(default_factory=dict)
    faults: dict[str, int] = field(default_factory=dict)
    refusals: dict[str, int] = field(default_factory=dict)

    def waited(self, behind: dict[str, float]) -> None:
        """A request waited for the end of an idle step: ``behind`` each of its parts, the
        seconds of that part between its arrival and the step's end."""
        seconds = sum(behind.values())
        self.arrival_waits += 1
        self.arrival_wait_seconds += seconds
        self.arrival_wait_seconds_max = max(self.arrival_wait_seconds_max, seconds)
        by_phase = self.arrival_wait_seconds_max_by_phase
        for phase, part in behind.items():
            by_phase[phase] = max(by_phase.get(phase, 0.0), part)

    def fault(self, kind: str) -> None:
        self.faults[kind] = self.faults.get(kind, 0) + 1

    def refused(self, reason: str) -> None:
        self.refusals[reason] = self.refusals.get(reason, 0) + 1

    def copy(self) -> EngineCounters:
        # The dict fields are copied too, so the snapshot shares nothing with the counters.
        dicts: dict[str, Any] = {
            name: dict(value) for name in self.__dataclass_fields__ if isinstance(value := getattr(self, name), dict)
        }
        return replace(self, **dicts)


@dataclass(slots=True, frozen=True)
class EngineStatus:
    engine_id: str
    model_id: str
    block_size: int
    slice_tokens: int
    closed: bool
    jobs: tuple[JobStatus, ...]
    live_job_id: int | None
    live_offset: int | None
    last_refusal: str | None
    counters: EngineCounters
    policy: dict[str, Any] = field(default_factory=dict)
    unreleased_holders: int = 0
    #: Why recovery stopped taking jobs on this engine for good (the host restores
    #: nothing it publishes), or None.
    host_refuses: str | None = None
    #: What finished blocks held back may take on this engine (MLX_RECOVERY_MAX_HELD_MIB,
    #: or the default it comes to on this machine), MiB.
    held_bound_mib: float = 0.0
    #: Tokens per pass of the last slice (an arriving request waits for one layer of one
    #: pass); None before any slice, or where the runner kept its own.
    stop_grain: int | None = None

    @property
    def debt(self) -> int:
        return sum(job.debt for job in self.jobs)

    @property
    def held_tokens(self) -> int:
        """Finished tokens the publish policy holds back: neither committed nor lost."""
        return sum(job.held_tokens for job in self.jobs)

    def as_dict(self) -> dict[str, Any]:
        out = asdict(self)
        out["jobs"] = [asdict(job) for job in self.jobs]
        out["debt"] = self.debt
        out["committed"] = {job.job_id: job.committed for job in self.jobs}
        return out


@dataclass(slots=True, frozen=True)
class ProcessStatus:
    enabled: bool
    budget: dict[str, Any]
    registry: dict[str, Any]
    engines: tuple[EngineStatus, ...]
    control_socket: str | None = None

    @property
    def debt(self) -> int:
        return sum(engine.debt for engine in self.engines)

    def totals(self) -> dict[str, Any]:
        faults: dict[str, int] = {}
        for engine in self.engines:
            for kind, n in engine.counters.faults.items():
                faults[kind] = faults.get(kind, 0) + n
        return {
            "jobs": sum(len(e.jobs) for e in self.engines),
            "debt": self.debt,
            "tokens_recovered": sum(e.counters.tokens_recovered for e in self.engines),
            "tokens_run": sum(e.counters.tokens_run for e in self.engines),
            "tokens_held": sum(e.held_tokens for e in self.engines),
            "slices": sum(e.counters.slices for e in self.engines),
            "faults": faults,
            "budget_share_used": self.budget.get("share_used", 0.0),
        }

    def as_dict(self) -> dict[str, Any]:
        return {
            "enabled": self.enabled,
            "budget": dict(self.budget),
            "registry": dict(self.registry),
            "control_socket": self.control_socket,
            "process": self.totals(),
            "engines": {e.engine_id: e.as_dict() for e in self.engines},
        }


def export_counters(status: ProcessStatus) -> dict[str, float]:
    """Flat ``name -> value`` counters and gauges (Prometheus-style names, with the
    engine and fault kind folded into the name after ``:``)."""
    out: dict[str, float] = {
        f"{COUNTER_PREFIX}budget_pct": float(status.budget.get("pct", 0.0)),
        f"{COUNTER_PREFIX}budget_share_used": float(status.budget.get("share_used", 0.0)),
        f"{COUNTER_PREFIX}debt_tokens": float(status.debt),
    }
    for engine in status.engines:
        c = engine.counters
        tag = f":{engine.engine_id}"
        for name in (
            "slices",
            "slices_interrupted",
            "tokens_run",
            "tokens_recovered",
            "blocks_published",
            "jobs_queued",
            "jobs_completed",
            "jobs_dropped",
            "jobs_cancelled",
            "arrival_waits",
        ):
            out[f"{COUNTER_PREFIX}{name}_total{tag}"] = float(getattr(c, name))
        out[f"{COUNTER_PREFIX}slice_seconds_total{tag}"] = c.slice_seconds
        out[f"{COUNTER_PREFIX}arrival_wait_seconds_total{tag}"] = c.arrival_wait_seconds
        out[f"{COUNTER_PREFIX}jobs{tag}"] = float(len(engine.jobs))
        out[f"{COUNTER_PREFIX}debt_tokens{tag}"] = float(engine.debt)
        out[f"{COUNTER_PREFIX}held_tokens{tag}"] = float(engine.held_tokens)
        for kind, n in c.faults.items():
            out[f"{COUNTER_PREFIX}faults_total{tag}:{kind}"] = float(n)
    return out
