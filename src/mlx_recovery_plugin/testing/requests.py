"""The mock engine's requests: what one request got (:class:`RequestResult`), its state
while the engine serves it (:class:`EngineRequest`), and the model handle the engine and
the plugin's runner share (:class:`LoadedModel`). Request state is the owner thread's."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

import mlx.core as mx
from mlx_lm.models.cache import ArraysCache, make_prompt_cache

from ..events import DepartureReason

# The end of a prompt (usually the question itself) always survives sparse selection.
SPARSE_TAIL_TOKENS = 8

WAITING, SCORING, PREFILL, DECODE, DONE = "waiting", "scoring", "prefill", "decode", "done"


@dataclass(slots=True, frozen=True)
class RequestResult:
    """What one request got. ``ttft_s`` runs from submit to the first token (None if it
    never got one); ``first_logits`` are the next-token logits right after prefill;
    ``route`` is ``"dense"``, ``"sparse"`` or ``"none"`` (left before admission);
    ``prefilled_tokens`` the target model's prefill work, ``draft_tokens`` the draft's."""

    request_id: str
    prompt_tokens: tuple[int, ...]
    output_tokens: tuple[int, ...]
    cached_tokens: int
    ttft_s: float | None
    route: str
    first_logits: mx.array | None = field(default=None, repr=False, compare=False)
    engine_id: str = ""
    reason: DepartureReason = DepartureReason.FINISHED
    prefilled_tokens: int = 0
    draft_tokens: int = 0


@dataclass(slots=True)
class LoadedModel:
    """A loaded mlx-lm model; satisfies :class:`mlx_recovery_plugin.ports.ModelHandle`."""

    model_id: str
    model: Any
    tokenizer: Any = None
    stream: Any = None

    def make_cache(self) -> list[Any]:
        return make_prompt_cache(self.model)


@dataclass(slots=True, eq=False)
class EngineRequest:
    request_id: str
    prompt: tuple[int, ...]
    max_tokens: int
    sparse: bool
    submitted_at: float
    phase: str = WAITING
    route: str = "none"
    cached_tokens: int = 0
    cache: list[Any] | None = None
    feed: list[int] = field(default_factory=list)  # target tokens still to prefill
    fed: int = 0
    draft_cache: list[Any] | None = None
    scored: int = 0
    scores: list[mx.array] = field(default_factory=list)
    output: list[int] = field(default_factory=list)
    first_logits: mx.array | None = None
    ttft_s: float | None = None
    admitted_at: float | None = None
    share_from: float | None = None  # the engine's prefill-share clock at admission
    reason: DepartureReason | None = None
    prefilled_tokens: int = 0
    draft_tokens: int = 0

    def result(self, engine_id: str) -> RequestResult:
        return RequestResult(
            request_id=self.request_id,
            prompt_tokens=self.prompt,
            output_tokens=tuple(self.output),
            cached_tokens=self.cached_tokens,
            ttft_s=self.ttft_s,
            route=self.route,
            first_logits=self.first_logits,
            engine_id=engine_id,
            reason=self.reason or DepartureReason.FINISHED,
            prefilled_tokens=self.prefilled_tokens,
            draft_tokens=self.draft_tokens,
        )


def eval_cache(cache: Sequence[Any], *arrays: mx.array) -> None:
    """Evaluate a chunk's outputs together with every layer's cache buffers."""
    parts: list[Any] = list(arrays)
    for layer in cache:
        if isinstance(layer, ArraysCache):
            parts.extend(a for a in layer.cache if a is not None)
        elif getattr(layer, "keys", None) is not None:
            parts.extend((layer.keys, layer.values))
    mx.eval(parts)
