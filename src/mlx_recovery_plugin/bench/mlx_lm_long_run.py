"""The snapshot byte budget under a long run on mlx-lm's own server (``--long-run N``).

One server with the plugin attached and ``MLX_RECOVERY_MLXLM_SNAPSHOT_BYTES`` set to a
few snapshots' worth serves ``N`` distinct documents, each followed by a sibling that
shares it and asks another question (the ``shared_document`` workload, one pair per
document). Every document offers more snapshots than the budget holds, so the store
evicts from the first document on, and the host's own prompt cache (ten entries by
default) drops old documents' entries, whose snapshots go with them. After every request
the client reads ``GET /v1/mlx-recovery/status``: the bytes held, never more than the
budget; at the end, the evictions (for the budget, and with the host's entries) and the
share of each sibling's block floor the server reported as cached, over the whole run and
over the last quarter of it (the newest documents' siblings must still be adopted).

One snapshot's bytes are measured in process with the adapter's own copy
(:func:`~mlx_recovery_plugin.hosts.mlx_lm.layers.copy_layer`), the largest over the
model's first boundaries (a rotating cache's snapshot grows to its window), so the budget
is a whole number of snapshots; the run reports what the server stored per snapshot
beside it. No timing here.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import asdict, dataclass, field
from typing import Any

from ..testing.mlx_lm_models import SPECS
from ..testing.mlx_lm_server import Reply, ServerClient, plugin_environment, serving
from ..testing.tiny_model import cached_model_dir
from .mlx_lm_workloads import Request, floor_tokens, sdk_sender, urllib_sender, workload

#: Share of the floor the newest documents' siblings must get back.
GOAL_LATE_SHARE = 0.9


@dataclass(slots=True)
class LongRun:
    model: str
    documents: int
    doc_chars: int
    block: int
    budget_snapshots: int
    budget_bytes: int
    #: One snapshot's bytes as measured in process (what the budget was sized by).
    snapshot_bytes_each: int
    #: Snapshot bytes held, read from the status after every request, in order.
    held_bytes: list[int] = field(default_factory=list)
    #: Per sibling: the tokens the server reported cached, and its block floor.
    sibling_cached: list[int] = field(default_factory=list)
    sibling_floor: list[int] = field(default_factory=list)
    stored: int = 0
    bytes_stored: int = 0
    evicted_budget: int = 0
    #: Snapshots dropped because the host evicted the last entry that extended them.
    dropped_orphan: int = 0
    adopted: int = 0
    faults: int = 0

    @property
    def peak_bytes(self) -> int:
        return max(self.held_bytes, default=0)

    @property
    def within_budget(self) -> bool:
        return self.peak_bytes <= self.budget_bytes

    @property
    def late_documents(self) -> int:
        """How many of the newest documents count as late: the last quarter, at least one."""
        return max(1, self.documents // 4)

    @property
    def adopted_share(self) -> float:
        return _share(self.sibling_cached, self.sibling_floor)

    @property
    def late_share(self) -> float:
        n = self.late_documents
        return _share(self.sibling_cached[-n:], self.sibling_floor[-n:])

    @property
    def goal_met(self) -> bool:
        return self.within_budget and self.evicted_budget > 0 and self.late_share >= GOAL_LATE_SHARE

    def to_dict(self) -> dict[str, Any]:
        return {
            **asdict(self), "peak_bytes": self.peak_bytes, "within_budget": self.within_budget,
            "stored_bytes_each": self.bytes_stored // self.stored if self.stored else None,
            "adopted_share": round(self.adopted_share, 4), "late_documents": self.late_documents,
            "late_share": round(self.late_share, 4), "goal_met": self.goal_met,
        }

    def describe(self) -> str:
        return (
            f"long run, {self.model}: {self.documents} documents + siblings, budget {self.budget_snapshots} snapshots "
            f"({self.budget_bytes:,} B): peak held {self.peak_bytes:,} B "
            f"({'within' if self.within_budget else 'OVER'} budget), {self.stored} stored, evicted "
            f"{self.evicted_budget} for the budget + {self.dropped_orphan} with the host's entries; floor restored "
            f"{self.adopted_share:.0%} over the run, {self.late_share:.0%} over the last {self.late_documents} siblings"
            f"{f'; {self.faults} faults' if self.faults else ''}"
        )


def _status(client: ServerClient) -> dict[str, Any]:
    status = client.status()
    if status is None:
        raise RuntimeError("the server has no status route: the plugin did not attach (is the start-up hook installed?)")
    return status


def _share(cached: list[int], floor: list[int]) -> float:
    return sum(cached) / sum(floor) if sum(floor) else 1.0


def snapshot_bytes(model: str, block: int, boundaries: int = 8) -> int:
    """One boundary snapshot's bytes for ``model``: the adapter's copy of its
    non-trimmable layers, prefilled a block at a time as the server's cuts do; the
    largest over the first ``boundaries``."""
    import mlx.core as mx
    from mlx_lm.models.cache import make_prompt_cache

    from ..hosts.mlx_lm import layers
    from ..testing.tiny_model import load_tiny_model

    loaded, _ = load_tiny_model(cached_model_dir(SPECS[model]))
    cache = make_prompt_cache(loaded)
    largest = 0
    for _ in range(boundaries):
        mx.eval(loaded(mx.array([[1] * block]), cache=cache))
        largest = max(largest, sum(layers.layer_bytes(layers.copy_layer(cache[i])) for i in layers.stateful_layers(cache)))
    return largest


def run_long_run(
    model: str, *, documents: int, doc_chars: int, block: int, budget_snapshots: int = 4, seed: int = 0,
    use_sdk: bool = True,
) -> LongRun:
    if documents < 1 or budget_snapshots < 1:
        raise ValueError(f"documents and budget_snapshots must be >= 1, got {documents}, {budget_snapshots}")
    each = snapshot_bytes(model, block)
    run = LongRun(model, documents, doc_chars, block, budget_snapshots, budget_snapshots * each, each)
    env = plugin_environment(True, block, snapshot_bytes=run.budget_bytes)
    with serving(cached_model_dir(SPECS[model]), env) as client:
        sender: Callable[[Request], Reply] = (sdk_sender(client) if use_sdk else None) or urllib_sender(client)
        status: dict[str, Any] = {}
        for k in range(documents):
            pair = workload("shared_document", doc_chars, 2, seed=seed * 100_000 + k)
            for request in pair:
                reply = sender(request)
                status = _status(client)
                run.held_bytes.append(int(status.get("snapshots", {}).get("bytes", 0)))
            run.sibling_cached.append(reply.cached_tokens)
            run.sibling_floor.append(floor_tokens(pair, block))
        snaps = status.get("snapshots", {})
        run.stored, run.bytes_stored = int(snaps.get("stored", 0)), int(snaps.get("bytes_stored", 0))
        run.evicted_budget, run.dropped_orphan = int(snaps.get("evicted_budget", 0)), int(snaps.get("dropped_orphan", 0))
        run.adopted, run.faults = int(status.get("adopted", 0)), int(status.get("faults", 0))
    return run
