"""Names for what can happen to recovery: why a slice did not run, and what went wrong.

Both are string enums, so a typo is an error, the status lists what can happen, and a
counter's key is the plain value (``"queues_busy"``), as status readers and exporters
see it.
"""

from __future__ import annotations

from enum import Enum


class Refusal(str, Enum):
    """Why no slice ran, or why a served range got no job."""

    # The runnable gate's checks, in the order it asks them (see :mod:`.runnable`).
    MODEL_NOT_OPTED_IN = "model_not_opted_in"
    QUEUES_BUSY = "queues_busy"
    SPARSE_ROUTE_LIVE = "sparse_route_live"
    NOT_ENOUGH_IDLE_STEPS = "not_enough_idle_steps"
    OTHER_ENGINE_BUSY = "other_engine_busy"
    FOREGROUND_ACTIVE = "foreground_active"
    BUDGET_OFF = "budget_off"
    BUDGET_SPENT = "budget_spent"
    CLAIM_TAKEN = "claim_taken"
    MEMORY_PRESSURE = "memory_pressure"
    HOST_ERROR = "host_error"
    # A running slice stopped for foreground work.
    SLICE_INTERRUPTED = "slice_interrupted"
    # A request whose cache keys hold more than its tokens (an image's hash): no job.
    KEYED_BEYOND_TOKENS = "keyed_beyond_tokens"
    # The host restores none of what recovery publishes (see :mod:`.host_refusal`).
    HOST_RESTORES_NOTHING = "host_restores_nothing"
    # The host's release keeps failing for the plugin's holders (see :mod:`.ledger`): no
    # further references are taken until the pending ones are given back.
    RELEASES_FAILING = "releases_failing"


# Refusals that are not foreground work: the live state is kept through them, so a
# machine whose allowance pays for less than a block per window still finishes blocks.
KEEP_LIVE_THROUGH = frozenset({Refusal.NOT_ENOUGH_IDLE_STEPS, Refusal.BUDGET_SPENT, Refusal.CLAIM_TAKEN})


class FaultKind(str, Enum):
    """A fault recovery caught, counted per kind in the status."""

    RUNNER_ERROR = "runner_error"
    OOM = "oom"
    FETCH_ERROR = "fetch_error"
    HOST_GONE = "host_gone"
    RELEASE_ERROR = "release_error"
    LINEAGE_ERROR = "lineage_error"
    INTERNAL_ERROR = "internal_error"
    # Publication's faults (:mod:`.publication`).
    PUBLICATION_ERROR = "publication_error"
    STORE_ERROR = "store_error"
    STORE_REFUSED = "store_refused"
    PROBE_MISMATCH = "probe_mismatch"


_OOM_MARKERS = ("out of memory", "unable to allocate", "bad_alloc", "outofmemory", "oom")


def runner_fault_kind(exc: BaseException) -> FaultKind:
    """:attr:`FaultKind.OOM` for an out-of-memory error (MLX says so in its message),
    :attr:`FaultKind.RUNNER_ERROR` for anything else."""
    if isinstance(exc, MemoryError):
        return FaultKind.OOM
    text = str(exc).lower()
    return FaultKind.OOM if any(marker in text for marker in _OOM_MARKERS) else FaultKind.RUNNER_ERROR
