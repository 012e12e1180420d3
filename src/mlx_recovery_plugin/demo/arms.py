"""Serving one session three ways on the mock host, turn by turn, alternating arms.

Each arm has its own host (its own prefix cache) over the same loaded models, so the only
difference between arms is the route and the plugin. Think time between turns is
simulated: a virtual clock jumps over the wait, and the recovery arm gets exactly the idle
time its budget allows within that wait (slices run for real and their real duration
counts against the wait). Time to first token is measured on the real clock.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from ..plugins import make_plugin_manager
from ..recovery.plugin import RecoveryPlugin
from ..settings import ModelSettings, PublishPolicy, RecoverySettings
from ..testing.engine import MockEngine
from ..testing.host import MockHost
from .report import ArmResult, TurnResult
from .session import Turn

ENGINE_ID = "demo"


class VirtualClock:
    """Real monotonic time plus the think time skipped so far. One owner: the demo thread."""

    def __init__(self, real: Callable[[], float] = time.perf_counter) -> None:
        self._real = real
        self._skipped = 0.0

    def __call__(self) -> float:
        return self._real() + self._skipped

    def advance(self, seconds: float) -> None:
        self._skipped += max(0.0, seconds)


@dataclass(slots=True, frozen=True)
class ServeConfig:
    model_id: str
    block_size: int = 256
    prefill_step: int = 256
    # The real server's: oMLX applies the sparse route only above 8,192 uncached tokens
    # (flyto-mlx 0.7.0 does not pass a lower setting through), so a later turn whose
    # uncached part is smaller is prefilled densely over whatever prefix is cached.
    sparse_threshold: int = 8192
    sparse_keep: float = 0.2
    max_tokens: int = 4
    budget_pct: float = 50.0
    budget_window_s: float = 10.0
    slice_tokens: int | None = None
    pool_blocks: int = 4096
    publish_policy: PublishPolicy = PublishPolicy.AUTO


@dataclass(slots=True)
class Models:
    model: Any
    tokenizer: Any
    draft: Any


def arm_recovery_plugin(config: ServeConfig | Any, clock: Callable[[], float]) -> RecoveryPlugin:
    """The recovery arm's plugin: the demo's budget, the model opted in, no control socket.
    ``config`` is any record with the budget, window, slice and model id fields."""
    return RecoveryPlugin(
        settings=RecoverySettings(
            budget_pct=config.budget_pct,
            budget_window_s=config.budget_window_s,
            slice_tokens=config.slice_tokens,
            models={config.model_id: ModelSettings(enabled=True)},
            publish_policy=getattr(config, "publish_policy", PublishPolicy.AUTO),
        ),
        clock=clock,
        control_socket=False,
    )


def note_recovered(result: ArmResult, plugin: RecoveryPlugin | None) -> None:
    """Put the tokens the recovery arm's plugin has published so far into ``result`` (an
    arm without the plugin keeps its 0)."""
    if plugin is not None:
        result.recovered_tokens = int(plugin.status()["process"].get("tokens_recovered", 0))


class ArmSession:
    """One arm: a host, an engine, and (for the recovery arm) the recovery plugin."""

    def __init__(self, arm: str, models: Models, config: ServeConfig) -> None:
        self.arm = arm
        self.config = config
        self.clock = VirtualClock()
        self.plugin: RecoveryPlugin | None = None
        plugins: list[object] = []
        if arm == "sparse_recovery":
            self.plugin = arm_recovery_plugin(config, self.clock)
            plugins.append(self.plugin)
        pm = make_plugin_manager(plugins, settings=RecoverySettings(), entry_points_too=False)
        self.host = MockHost(pm)
        self.engine: MockEngine = self.host.add_engine(
            ENGINE_ID,
            model=models.model,
            tokenizer=models.tokenizer,
            draft_model=models.draft,
            model_id=config.model_id,
            block_size=config.block_size,
            prefill_step=config.prefill_step,
            sparse_threshold=config.sparse_threshold,
            sparse_keep=config.sparse_keep,
            pool_blocks=config.pool_blocks,
        )
        self.result = ArmResult(arm)
        self._previous: tuple[int, ...] = ()

    def serve(self, turn: Turn) -> TurnResult:
        rid = self.host.submit(
            ENGINE_ID,
            turn.prompt,
            max_tokens=self.config.max_tokens,
            sparse=self.arm != "sparse_off",
        )
        self.host.run_until_idle()
        got = self.host.result(rid)
        # After the turn: recovery may publish at the turn's arrival, before its lookup.
        debt = self._debt(self._previous)
        note_recovered(self.result, self.plugin)
        row = TurnResult(
            turn=turn.index,
            prompt_tokens=len(turn.prompt),
            cached_tokens=got.cached_tokens,
            ttft_s=float(got.ttft_s or 0.0),
            debt_tokens=debt,
            route=got.route,
            output_tokens=list(got.output_tokens),
        )
        self.result.turns.append(row)
        self._previous = turn.prompt
        return row

    def think(self, seconds: float) -> None:
        """Let ``seconds`` of idle time pass: offer idle steps while the plugin has work,
        and skip the clock over waits it asks for, never past the end of the think time."""
        end = self.clock() + seconds
        started = time.perf_counter()
        while self.clock() < end:
            answers = self.engine.offer_idle_step()
            if any(a is True for a in answers):
                continue
            delays = [a for a in answers if isinstance(a, float) and a > 0]
            if not delays or self.clock() + min(delays) >= end:
                break
            self.clock.advance(min(delays))
        self.result.recovery_seconds += time.perf_counter() - started
        note_recovered(self.result, self.plugin)

    def _debt(self, prompt: tuple[int, ...]) -> int:
        """Tokens of the last prompt that the host holds no reusable prefix state for."""
        if not prompt:
            return 0
        cache = self.engine.prefix_cache
        probe = f"{ENGINE_ID}-debt-probe"
        try:
            return len(prompt) - cache.fetch(probe, prompt).tokens
        finally:
            cache.release(probe)

    def close(self) -> None:
        if self.plugin is not None:
            self.plugin.close()
        leaked = self.host.outstanding_refs()
        if any(leaked.values()):
            raise RuntimeError(f"block references left behind in the {self.arm} arm: {leaked}")
