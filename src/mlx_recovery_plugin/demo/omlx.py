"""One append-only session served by the real oMLX scheduler, three ways.

The arms of the demo, on oMLX instead of the mock host: ``sparse_off`` (the dense route),
``sparse_on`` (SpecPrefill) and ``sparse_recovery`` (SpecPrefill plus the recovery plugin
through :class:`OmlxInstrumentor`). Each arm has its own ``Scheduler`` and prefix cache
over the same loaded models; only the recovery arm's scheduler is instrumented, so the
other two are oMLX exactly as shipped. Turns alternate between arms.

The engine loop is driven the way oMLX's ``EngineCore`` drives it (``step()`` while
``has_requests()``), on the calling thread. Think time is simulated with a virtual clock:
it jumps over waits the plugin asks for, and slices that run count their real duration.
Time to first token is measured on the real clock, from ``add_request`` (prefix fetch and
SpecPrefill scoring included) to the first generated token.
"""

from __future__ import annotations

import concurrent.futures
import tempfile
import time
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from ..hosts.omlx.instrumentor import OmlxInstrumentor
from ..hosts.omlx.members import FLYTO_MLX, Member
from ..plugins import make_plugin_manager
from ..recovery.plugin import RecoveryPlugin
from ..settings import RecoverySettings
from ..testing.omlx_host import make_request
from .arms import ServeConfig, VirtualClock, arm_recovery_plugin, note_recovered
from .report import ARMS, ArmResult, TurnResult

# Steps one turn may take before the session gives up on it (a stuck host).
_MAX_STEPS_PER_TURN = 100_000


def make_scheduler(
    model: Any,
    tokenizer: Any,
    cache_dir: str | Path,
    config: ServeConfig,
    draft: Any | None = None,
    member: Member = FLYTO_MLX,
) -> Any:
    """A real scheduler of ``member`` with its prefix cache on (in ``cache_dir`` where the
    member keeps it on disk)."""
    module = member.resolve(member.scheduler_module)
    Scheduler, SchedulerConfig = module.Scheduler, module.SchedulerConfig

    scheduler = Scheduler(
        model,
        tokenizer,
        SchedulerConfig(
            model_name=config.model_id,
            paged_cache_block_size=config.block_size,
            **member.scheduler_cache_config(str(cache_dir)),
            prefill_step_size=config.prefill_step,
            max_cache_blocks=config.pool_blocks,
            initial_cache_blocks=min(256, config.pool_blocks),
        ),
    )
    if draft is not None:
        scheduler.set_specprefill_draft_model(draft)
    return scheduler


@dataclass(slots=True)
class ServedTurn:
    """What one request got: its generated tokens, and the row for the report."""

    output_tokens: list[int]
    row: TurnResult


def serve(scheduler: Any, request: Any, turn: int = 0, debt: int = 0) -> ServedTurn:
    """Add ``request`` and step until it finishes, as oMLX's engine loop would."""
    rid = request.request_id
    started = time.perf_counter()
    first: float | None = None
    tokens: list[int] = []
    scheduler.add_request(request)
    for _ in range(_MAX_STEPS_PER_TURN):
        output = scheduler.step()
        done = False
        for out in output.outputs:
            if out.request_id != rid:
                continue
            if out.new_token_ids and first is None:
                first = time.perf_counter() - started
            tokens.extend(out.new_token_ids)
            if out.error:
                raise RuntimeError(f"oMLX failed {rid}: {out.error}")
            done = done or out.finished
        if done:
            break
    else:
        raise RuntimeError(f"{rid} did not finish in {_MAX_STEPS_PER_TURN} steps")
    row = TurnResult(
        turn=turn,
        prompt_tokens=len(request.prompt_token_ids),
        cached_tokens=int(request.cached_tokens),
        ttft_s=float(first if first is not None else time.perf_counter() - started),
        debt_tokens=debt,
        route="sparse" if request.specprefill_indices is not None else "dense",
        output_tokens=list(tokens),
    )
    return ServedTurn(tokens, row)


def wait_for_cache_writes(scheduler: Any) -> None:
    """oMLX stores a finished request's blocks on a worker thread; wait for them."""
    futures = list(getattr(scheduler, "_inflight_store_futures", {}).values())
    if futures:
        concurrent.futures.wait(futures, timeout=60.0)


def stored_prefix(scheduler: Any, tokens: Sequence[int]) -> int:
    """Leading tokens of ``tokens`` the scheduler's prefix cache holds (no reference taken)."""
    cache = scheduler.block_aware_cache
    if cache is None:
        return 0
    _, count = cache.paged_cache.get_computed_blocks(list(tokens))
    return int(count)


def held_references(scheduler: Any) -> dict[int, int]:
    """Blocks someone holds a reference on (the null block excluded): block id -> count."""
    cache = scheduler.block_aware_cache
    if cache is None:
        return {}
    pool = cache.paged_cache
    return {
        block.block_id: block.ref_count
        for block in list(pool.allocated_blocks.values())
        if block.ref_count > 0 and not block.is_null
    }


class OmlxArm:
    """One arm: a scheduler, and for the recovery arm the plugin and its instrumentor."""

    def __init__(
        self,
        arm: str,
        model: Any,
        tokenizer: Any,
        draft: Any,
        config: ServeConfig,
        cache_dir: str | Path,
        member: Member = FLYTO_MLX,
    ) -> None:
        if arm not in ARMS:
            raise ValueError(f"unknown arm {arm!r}; valid: {', '.join(ARMS)}")
        self.arm = arm
        self.config = config
        self.member = member
        self.clock = VirtualClock()
        self.scheduler = make_scheduler(
            model, tokenizer, cache_dir, config, draft=None if arm == "sparse_off" else draft, member=member
        )
        self.plugin: RecoveryPlugin | None = None
        self.instrumentor: OmlxInstrumentor | None = None
        if arm == "sparse_recovery":
            self.plugin = arm_recovery_plugin(config, self.clock)
            pm = make_plugin_manager([self.plugin], settings=RecoverySettings(), entry_points_too=False)
            own = self.scheduler
            self.instrumentor = OmlxInstrumentor(member, clock=self.clock, accept=lambda s: s is own)
            if not self.instrumentor.instrument(pm=pm):
                raise RuntimeError(f"this {member.label} cannot be instrumented")
        self.result = ArmResult(arm)
        #: Generated tokens of every turn served, in order.
        self.outputs: list[list[int]] = []
        self._previous: tuple[int, ...] = ()

    def serve(self, prompt: Sequence[int], turn: int) -> ServedTurn:
        request = make_request(
            f"{self.arm}-{turn}",
            prompt,
            max_tokens=self.config.max_tokens,
            sparse=self.arm != "sparse_off",
            threshold=self.config.sparse_threshold,
            keep_pct=self.config.sparse_keep,
            member=self.member,
        )
        served = serve(self.scheduler, request, turn=turn)
        # After the turn: recovery may publish at the turn's arrival, before its lookup.
        if self._previous:
            served.row.debt_tokens = len(self._previous) - stored_prefix(self.scheduler, self._previous)
        note_recovered(self.result, self.plugin)
        self.result.turns.append(served.row)
        self.outputs.append(served.output_tokens)
        self._previous = tuple(prompt)
        return served

    def think(self, seconds: float) -> None:
        """Let ``seconds`` of idle time pass: step while oMLX (or an idle offer) wants it,
        skipping the clock over the waits the plugin asks for."""
        end = self.clock() + seconds
        started = time.perf_counter()
        wait_for_cache_writes(self.scheduler)
        while self.clock() < end:
            if self.scheduler.has_requests():
                self.scheduler.step()
                continue
            idle = self.instrumentor.idle_snapshot(self.scheduler) if self.instrumentor else None
            wait = idle["wait_s"] if idle and idle["offering"] else None
            if wait is None or self.clock() + wait >= end:
                break
            self.clock.advance(wait)
        self.result.recovery_seconds += time.perf_counter() - started
        note_recovered(self.result, self.plugin)

    def close(self) -> None:
        try:
            if self.plugin is not None:
                self.plugin.close()
        finally:
            if self.instrumentor is not None:
                self.instrumentor.uninstrument()
        leaked = held_references(self.scheduler)
        self.scheduler.shutdown()
        if leaked:
            raise RuntimeError(f"block references left behind in the {self.arm} arm: {leaked}")


def run_omlx_session(
    model: Any,
    tokenizer: Any,
    draft: Any,
    prompts: Sequence[Sequence[int]],
    *,
    config: ServeConfig,
    think_time_s: float,
    arms: Sequence[str] = ARMS,
    cache_root: str | Path | None = None,
) -> dict[str, ArmResult]:
    """Serve ``prompts`` (an append-only session, one prompt per turn) in every arm,
    alternating arms turn by turn, with ``think_time_s`` of idle time after each turn.
    Returns each arm's per-turn cached tokens and time to first token."""
    with tempfile.TemporaryDirectory(prefix="omlx-session-", dir=cache_root) as root:
        sessions = [
            OmlxArm(arm, model, tokenizer, draft, config, Path(root) / arm) for arm in arms
        ]
        try:
            for turn, prompt in enumerate(prompts):
                for session in sessions:
                    session.serve(prompt, turn)
                for session in sessions:
                    session.think(think_time_s)
        finally:
            errors = []
            for session in sessions:
                try:
                    session.close()
                except Exception as exc:  # noqa: BLE001 - close every arm, then report
                    errors.append(exc)
            if errors:
                raise errors[0]
        return {session.arm: session.result for session in sessions}


def run_omlx_demo(demo_config: Any, progress: Any = None) -> Any:
    """``mlx-recovery demo --host omlx``: the demo's session and report, on real oMLX."""
    from ..runner.blas import describe
    from .report import DemoReport
    from .run import context_note, decode_answers, demo_turns, prepare_models

    say = progress or (lambda line: None)
    models = prepare_models(demo_config)
    turns, expected = demo_turns(demo_config, models.tokenizer)
    if note := context_note(models.model, turns):
        say(note)
    config = demo_config.serve
    think_time_s = demo_config.session.think_time_s
    report = DemoReport(
        model=demo_config.model_path or demo_config.serve.model_id,
        host="omlx",
        blas=describe(),
        block_size=config.block_size,
        sparse_threshold=config.sparse_threshold,
        think_time_s=think_time_s,
        budget_pct=config.budget_pct,
        expected=expected,
    )
    for repeat in range(demo_config.repeats):
        say(f"[{repeat + 1}/{demo_config.repeats}] serving {len(turns)} turns on the oMLX scheduler, three arms")
        results = run_omlx_session(
            models.model, models.tokenizer, models.draft, [t.prompt for t in turns],
            config=config, think_time_s=think_time_s,
        )
        report.repeats.append(results)
    decode_answers(report, models.tokenizer)
    return report
