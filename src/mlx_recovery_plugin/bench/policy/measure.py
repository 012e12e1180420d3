"""One cell of ``bench policy``: the truth and the verdict, on the real oMLX scheduler.

* **Truth**, on a quiet machine: the ``sparse_off`` arm serves the first turn densely and
  then the next turn (``append`` new tokens over the cached prefix): the host's cached
  dense append; the ``sparse_on`` arm serves the same next turn with nothing cached, on its
  sparse route: the sparse rerun. Each is measured ``repeats`` times (the next turn forks
  from the same prefix with other appended tokens), the two arms alternating.
* **Verdict**: the ``sparse_recovery`` arm serves the first turn on the sparse route and
  then has as much idle time as recovery asks for (a virtual clock skips the budget's
  waits; slices run for real). In a loaded cell a competing load runs through the first
  turn and the first stretch of idle time, then stops: the policy sees both a loaded and
  a quiet machine before the next turn arrives on a quiet one. Loaded at the next turn
  (``load_at`` ``next``), the other way round: a quiet first turn and first stretch, then
  the load through the rest of the idle time and the next turn, whose truth (the pairs
  and the rerun after it) is measured loaded too; as one loaded turn is one draw from a
  wide spread, the route the policy left (its plugin closed) then serves the other next
  prompts as well, and the turn counts at the median. What it got (cached tokens, time
  to first token) is what the policy decided; the policy's last decision and its
  estimates come from the plugin's status.
"""

from __future__ import annotations

import random
import statistics
import tempfile
import time
from contextlib import nullcontext
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from ...demo.arms import ServeConfig
from ...demo.omlx import OmlxArm
from .cells import Cell, Matrix
from .load import CompetingLoad

# Idle time the recovery arm may have at most (virtual seconds): enough for any cell.
IDLE_CAP_S = 7200.0
# A loaded cell keeps the load on through the first turn and this share of the time a
# quiet dense read of the whole prefix takes.
LOADED_SHARE_OF_READ = 0.5
# Virtual idle seconds per look while the load is on.
IDLE_STEP_S = 2.0
# Idle time after a turn without recovery: the host finishes its own work (cache writes).
SETTLE_S = 1.0
# Wall seconds a load started before a turn runs first (the busy processes up and the
# machine seen busy, as a build that started a while before the turn).
LOAD_SETTLE_S = 1.0
# A later turn at most this much slower than the sparse route is not a loss.
SLOWER_MARGIN = 1.1
# A fully recovered prefix that makes the next turn at least this much faster must be
# published.
PAYS_BY = 1.3


@dataclass(slots=True)
class CellResult:
    cell: Cell
    dense_append_s: list[float]
    sparse_rerun_s: list[float]
    dense_cached: int
    recovery_turn_s: float
    recovery_cached: int
    verdict: str  # published | partial | paused | held | stood_down | nothing
    policy: dict[str, Any] = field(default_factory=dict)
    tokens_run: int = 0
    tokens_recovered: int = 0
    #: Of the turn's time, the publication taken at its arrival (0: published before).
    arrival_publish_s: float = 0.0
    idle_s: float = 0.0
    #: The sparse rerun measured again right after the turn with recovery (None: not).
    sparse_after_s: float | None = None
    #: And right before it, after the recovery arm's idle time (None: not): the reruns
    #: of the truth were taken minutes earlier, before that idle time.
    sparse_before_s: float | None = None
    #: Whether the competing load ran when the recovery arm served its first turn, and
    #: its next one.
    load_at_turns: tuple[bool, bool] = (False, False)
    #: The next turn with recovery and, where that turn ran under load, the same route
    #: served again (the turn's arrival publication added): ``recovery_turn_s`` is the
    #: median of those that restored as much as the turn did. Cached tokens of each beside.
    recovery_turns_s: list[float] = field(default_factory=list)
    recovery_turns_cached: list[int] = field(default_factory=list)

    @property
    def dense_s(self) -> float:
        return statistics.median(self.dense_append_s)

    @property
    def sparse_s(self) -> float:
        return statistics.median(self.sparse_rerun_s)

    @property
    def pays(self) -> float:
        """How much faster the next turn is with the whole prefix cached (sparse / dense)."""
        return self.sparse_s / max(self.dense_s, 1e-9)

    @property
    def spread(self) -> tuple[float, float]:
        """The pays ratio's range over the pairs measured (each dense append with the
        sparse rerun measured beside it)."""
        ratios = [s / max(d, 1e-9) for d, s in zip(self.dense_append_s, self.sparse_rerun_s, strict=True)]
        return min(ratios), max(ratios)

    @property
    def truth(self) -> str:
        """``pays`` (publish: by PAYS_BY or more), ``loses`` (do not: the dense append is
        more than SLOWER_MARGIN of the sparse rerun) or ``close`` (either is fine)."""
        if self.pays >= PAYS_BY:
            return "pays"
        if self.dense_s > SLOWER_MARGIN * self.sparse_s:
            return "loses"
        return "close"

    @property
    def published(self) -> bool:
        return self.verdict == "published"

    @property
    def wrong(self) -> bool:
        """Not publishing where the whole prefix pays; publishing (any of it) where it loses
        or where the turn it served came out slower than the sparse rerun."""
        published_any = self.recovery_cached > 0
        if self.truth == "pays" and not self.published:
            return True
        if self.truth == "loses" and published_any:
            return True
        return published_any and self.turn_ratio > SLOWER_MARGIN

    @property
    def slow_turn(self) -> bool:
        """The next turn with recovery attached took over SLOWER_MARGIN of the sparse
        rerun, whatever the verdict (with nothing published, the host's own sparse turn)."""
        return self.turn_ratio > SLOWER_MARGIN

    @property
    def turn_ratio(self) -> float:
        """The next turn with recovery against the sparse rerun: the mean of the reruns
        right before and right after it where both were measured (the machine's speed
        drifts over a cell: on 2048x4 the truth's reruns took 13.6-13.8 s and the one
        after the turn 15.5 s, examples/policy-bench-close-shapes-12288-result.json),
        else the median of the truth's reruns and the one after."""
        around = self.sparse_around_s
        if around is not None:
            return self.recovery_turn_s / max(around, 1e-9)
        reruns = self.sparse_rerun_s + ([self.sparse_after_s] if self.sparse_after_s is not None else [])
        return self.recovery_turn_s / max(statistics.median(reruns), 1e-9)

    @property
    def sparse_around_s(self) -> float | None:
        """The mean of the reruns right before and right after the turn with recovery
        (None where either was not measured)."""
        if self.sparse_before_s is None or self.sparse_after_s is None:
            return None
        return (self.sparse_before_s + self.sparse_after_s) / 2.0

    @property
    def drift(self) -> float | None:
        """The reruns around the turn against the truth's (1.0: the machine kept its speed
        over the cell; None where they were not measured)."""
        around = self.sparse_around_s
        return None if around is None else around / max(self.sparse_s, 1e-9)

    @property
    def cost_s(self) -> float:
        """Seconds the verdict cost the next turn against the better route (0 if right)."""
        return max(0.0, self.recovery_turn_s - min(self.dense_s, self.sparse_s)) if self.wrong else 0.0

    @property
    def committed_share(self) -> float | None:
        return self.tokens_recovered / self.tokens_run if self.tokens_run else None

    def as_dict(self) -> dict[str, Any]:
        s = self.cell.shape
        return {
            "shape": {"hidden": s.hidden_size, "layers": s.num_layers, "ffn": s.intermediate_size,
                      "heads": s.num_heads, "kv_heads": s.num_kv_heads, "seed": s.seed},
            "context": self.cell.context, "append": self.cell.append, "loaded": self.cell.loaded,
            "load_at": self.cell.load_at,
            "dense_append_s": self.dense_append_s, "sparse_rerun_s": self.sparse_rerun_s,
            "dense_cached": self.dense_cached, "pays": self.pays, "pays_range": list(self.spread),
            "truth": self.truth, "verdict": self.verdict, "wrong": self.wrong, "cost_s": self.cost_s,
            "slow_turn": self.slow_turn, "sparse_after_s": self.sparse_after_s,
            "sparse_before_s": self.sparse_before_s, "drift": self.drift,
            "load_at_turns": list(self.load_at_turns),
            "recovery_turn_s": self.recovery_turn_s, "recovery_cached": self.recovery_cached,
            "recovery_turns_s": self.recovery_turns_s, "recovery_turns_cached": self.recovery_turns_cached,
            "turn_ratio": self.turn_ratio, "tokens_run": self.tokens_run,
            "tokens_recovered": self.tokens_recovered, "committed_share": self.committed_share,
            "arrival_publish_s": self.arrival_publish_s,
            "idle_s": self.idle_s, "policy": self.policy,
        }


def tokens(n: int, seed: int) -> list[int]:
    rng = random.Random(seed)
    return [rng.randrange(256) for _ in range(n)]


def serve_config(matrix: Matrix, budget_pct: float) -> ServeConfig:
    return ServeConfig(
        model_id="policy-target", block_size=matrix.block, prefill_step=matrix.prefill_step,
        sparse_threshold=matrix.threshold, max_tokens=2, budget_pct=budget_pct,
        pool_blocks=max(4096, 8 * (max(c.context for c in matrix.cells) // matrix.block + 8)),
    )


def measure_cell(
    models: tuple[Any, Any, Any], cell: Cell, matrix: Matrix, *, budget_pct: float = 50.0,
    repeats: int = 2, seed: int = 0, load_processes: int | None = None, cache_root: Path | None = None,
) -> CellResult:
    model, tokenizer, draft = models
    config = serve_config(matrix, budget_pct)
    base = tokens(cell.context, seed)
    nexts = [base + tokens(cell.append, seed + 1 + k) for k in range(max(1, repeats))]
    with tempfile.TemporaryDirectory(prefix="bench-policy-", dir=cache_root) as root:
        off = OmlxArm("sparse_off", model, tokenizer, draft, config, Path(root) / "off")
        on = OmlxArm("sparse_on", model, tokenizer, draft, config, Path(root) / "on")
        arms = [off, on]
        # Loaded at the next turn: the truth is that of a loaded machine too.
        late = CompetingLoad(load_processes) if cell.loaded and cell.load_at == "next" else None
        try:
            off_first_s = off.serve(base, 0).row.ttft_s
            off.think(SETTLE_S)
            on.serve(base, 0)
            on.think(SETTLE_S)
            dense, sparse, cached = [], [], 0
            if late is not None:
                late.start()
                time.sleep(LOAD_SETTLE_S)
            for k, prompt in enumerate(nexts):
                first, second = (off, on) if k % 2 == 0 else (on, off)
                for arm in (first, second):
                    row = arm.serve(prompt, k + 1).row
                    arm.think(SETTLE_S)
                    if arm is off:
                        dense.append(row.ttft_s)
                        cached = row.cached_tokens
                    else:
                        sparse.append(row.ttft_s)
            if late is not None:
                late.stop()
            rec = OmlxArm("sparse_recovery", model, tokenizer, draft, config, Path(root) / "rec")
            arms.append(rec)
            # Loaded first: the first turn and the first stretch of idle time (half what
            # a quiet dense read of the prefix takes), then a quiet machine for the rest
            # and the next turn, as when a user's build or another model ends. Loaded at
            # the next turn: the other way round, as when one starts.
            load_s = LOADED_SHARE_OF_READ * off_first_s
            early = cell.loaded and late is None
            with CompetingLoad(load_processes) if early else nullcontext() as load:
                loaded_first = any(x is not None and x.running for x in (load, late))
                rec.serve(base, 0)
                started = time.perf_counter()
                while cell.loaded and time.perf_counter() - started < load_s and _offering(rec):
                    rec.think(IDLE_STEP_S)
                if load is not None:
                    load.stop()
                if late is not None:
                    late.start()
                    time.sleep(LOAD_SETTLE_S)
                rec.think(IDLE_CAP_S)
            # The sparse rerun right before the turn with recovery, and once more right
            # after it: the turn is judged against the two (see ``turn_ratio``).
            before_s = on.serve(base + tokens(cell.append, seed + 1 + len(nexts)), len(nexts) + 1).row.ttft_s
            on.think(SETTLE_S)
            assert rec.plugin is not None
            before = _engine_status(rec.plugin.status())
            loaded_next = late is not None and late.running
            row = rec.serve(nexts[0], 1).row
            rec.think(SETTLE_S)
            after_turn = _engine_status(rec.plugin.status())
            turned = after_turn.get("policy", {})
            arrival_s = float(after_turn.get("counters", {}).get("arrival_publish_seconds", 0.0))
            turns = [(row.ttft_s, row.cached_tokens)]
            if loaded_next:
                # Under load one turn is one draw from a wide spread (1024x2's cached dense
                # append took 0.9-3.2 s, examples/loaded-turn-spread-result.json): the route
                # the policy left is served again with the other next prompts, the plugin
                # closed first so that nothing it does changes that route.
                rec.plugin.close()
                for k, prompt in enumerate(nexts[1:], start=2):
                    again = rec.serve(prompt, k).row
                    rec.think(SETTLE_S)
                    turns.append((again.ttft_s + arrival_s, again.cached_tokens))
            after = on.serve(base + tokens(cell.append, seed + 2 + len(nexts)), len(nexts) + 2).row.ttft_s
            on.think(SETTLE_S)
        finally:
            if late is not None:
                late.stop()
            for arm in arms:
                arm.close()
    jobs = before.get("jobs", [])
    # After the turn: a publication may wait for the turn's arrival (its real length).
    counters = after_turn.get("counters", {})
    return CellResult(
        cell=cell, dense_append_s=dense, sparse_rerun_s=sparse, dense_cached=cached,
        sparse_before_s=before_s, sparse_after_s=after,
        load_at_turns=(loaded_first, loaded_next),
        # A repeat that restored another prefix (the host stored a partly recovered turn's
        # dense prefill) served another route: it is kept in the record, not in the median.
        recovery_turn_s=statistics.median(t for t, c in turns if c == row.cached_tokens),
        recovery_cached=row.cached_tokens,
        recovery_turns_s=[t for t, _ in turns], recovery_turns_cached=[c for _, c in turns],
        verdict=_verdict(row.cached_tokens, cached, matrix.block, jobs, counters),
        policy={k: before.get("policy", {}).get(k) for k in
                ("verdict", "reason", "dense_append_s", "sparse_rerun_s", "dense_cost_samples")}
        | {"job_reason": job_reason(jobs), **host_factor_after(turned),
           "at_request": turned.get("at_last_request"), "carried": turned.get("sparse_carried_over"),
           "regime_at_turn": turned.get("load_regime")},
        tokens_run=int(counters.get("tokens_run", 0)), tokens_recovered=int(counters.get("tokens_recovered", 0)),
        idle_s=rec.result.recovery_seconds,
        arrival_publish_s=arrival_s,
    )


def _offering(arm: OmlxArm) -> bool:
    """The recovery arm's plugin still wants idle time."""
    idle = arm.instrumentor.idle_snapshot(arm.scheduler) if arm.instrumentor is not None else None
    return bool(idle and idle.get("offering"))


def _engine_status(status: dict[str, Any]) -> dict[str, Any]:
    engines = status.get("engines") or {}
    values = list(engines.values()) if isinstance(engines, dict) else list(engines)
    return dict(values[0]) if values else {}


def host_factor_after(policy: dict[str, Any]) -> dict[str, Any]:
    """The host's dense append over the slices' estimate as the policy measured it on the
    next turn (its real length; None where that turn was not a dense append over a
    prefix), and how many such turns it has seen."""
    measured = int(policy.get("host_append_measured") or 0)
    return {"host_append_factor_after": policy.get("host_append_factor") if measured else None,
            "host_append_measured_after": measured}


def job_reason(jobs: list[dict[str, Any]]) -> str | None:
    """Why a job stood down or paused, in its own words: the policy's last reason is that of
    its latest verdict, which may be a later hold of another prefix."""
    for key in ("stood_down", "paused"):
        reason = next((job[key] for job in jobs if job.get(key)), None)
        if reason:
            return str(reason)
    return None


def _verdict(cached: int, dense_cached: int, block: int, jobs: list[dict[str, Any]], counters: dict[str, Any]) -> str:
    if cached > 0 and cached >= dense_cached - block:
        return "published"
    if any(job.get("stood_down") for job in jobs) or counters.get("jobs_stood_down", 0):
        return "stood_down"
    if cached > 0:
        return "partial"
    if any(job.get("paused") for job in jobs):
        return "paused"
    if any(job.get("held_tokens") for job in jobs):
        return "held"
    return "nothing"
