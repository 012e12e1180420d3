"""The host's own time to first token on requests the adopter does not adopt, with the
mlx-lm adapter attached and not, alternating in one process.

One in-process ``mlx_lm.server`` (its ``ModelProvider``, ``LRUPromptCache`` and
``ResponseGenerator`` with its generation thread; requests through
``ResponseGenerator.generate``, what its HTTP handler calls) per model kind. Each pair
sends one fresh prompt (no prefix shared with anything sent before) with the adapter
attached and one without (``instrument()`` / ``uninstrument()`` between them), the order
alternating from pair to pair so drift is shared by both arms. On the reference
(pure-attention) model the adapter must leave the request entirely alone; on the hybrid
and the sliding-window model it adds its prefill cuts and snapshots (a fresh prompt may
be shared later), and nothing else.

Reported per model: each pair's ratio (with / without), their median, interquartile
range, min and max, the median first-token seconds of each arm, and the share of the
attached arm's time the adapter spent copying boundary state (its own clock). Timing: take it alone on the machine.
"""

from __future__ import annotations

import random
import statistics
import time
from collections.abc import Sequence
from dataclasses import asdict, dataclass, field
from typing import Any

from ..testing.mlx_lm_models import SPECS
from ..testing.tiny_model import cached_model_dir

#: The goal: the host's own first token within this factor of the host without the plugin.
GOAL_RATIO = 1.05


@dataclass(slots=True)
class UntouchedRow:
    model: str
    prompt_tokens: int
    pairs: int
    with_s: list[float] = field(default_factory=list)
    without_s: list[float] = field(default_factory=list)
    cuts: int = 0
    adopted: int = 0
    #: Seconds the adapter spent copying boundary state, over the measured requests.
    capture_s: float = 0.0

    @property
    def ratios(self) -> list[float]:
        return [a / b for a, b in zip(self.with_s, self.without_s) if b > 0]

    @property
    def median_ratio(self) -> float:
        return statistics.median(self.ratios) if self.ratios else float("nan")

    def quartiles(self) -> tuple[float, float] | None:
        """The ratios' first and third quartiles (None below two pairs)."""
        if len(self.ratios) < 2:
            return None
        q = statistics.quantiles(self.ratios, n=4, method="inclusive")
        return q[0], q[2]

    def to_dict(self) -> dict[str, Any]:
        ratios = self.ratios
        quartiles = self.quartiles()
        return {
            **asdict(self),
            "ratios": [round(r, 4) for r in ratios],
            "median_ratio": round(self.median_ratio, 4) if ratios else None,
            "min_ratio": round(min(ratios), 4) if ratios else None,
            "max_ratio": round(max(ratios), 4) if ratios else None,
            "iqr_ratio": [round(q, 4) for q in quartiles] if quartiles else None,
            "median_with_s": statistics.median(self.with_s) if self.with_s else None,
            "median_without_s": statistics.median(self.without_s) if self.without_s else None,
            "capture_share": (self.capture_s / sum(self.with_s)) if self.with_s else None,
            "within_goal": bool(ratios) and self.median_ratio <= GOAL_RATIO,
        }


def _text(rng: random.Random, n: int) -> str:
    # ASCII only: the tiny models' byte-level tokenizer gives one token per character.
    return "".join(rng.choice("abcdefghijklmnopqrstuvwxyz ") for _ in range(n))


def _args(server: Any, max_tokens: int) -> Any:
    return server.GenerationArguments(
        model=server.ModelDescription(model="default_model", draft="default_model", adapter=None),
        sampling=server.SamplingArguments(0.0, 1.0, 0, 0.0, 0.0, 0.0),
        logits=server.LogitsProcessorArguments(None, 1.0, 20, 0.0, 20, 0.0, 20),
        stop_words=[], max_tokens=max_tokens, num_draft_tokens=3, logprobs=False,
        top_logprobs=0, seed=None, chat_template_kwargs=None,
    )


def first_token_seconds(generator: Any, server: Any, prompt: str, max_tokens: int = 2) -> float:
    """Seconds from ``generate()`` to the first token, then the rest drained."""
    request = server.CompletionRequest("text", prompt, [], None, None)
    start = time.perf_counter()
    _ctx, responses = generator.generate(request, _args(server, max_tokens))
    next(responses)
    elapsed = time.perf_counter() - start
    for _ in responses:
        pass
    return elapsed


def measure_model(
    model: str, *, block: int, pairs: int = 7, prompt_tokens: int = 1500, seed: int = 0, warmup: int = 2,
) -> UntouchedRow:
    from mlx_lm import server

    from ..adopter.plugin import AdopterPlugin
    from ..hosts.mlx_lm.instrumentor import MlxLmInstrumentor
    from ..plugins import make_plugin_manager
    from ..settings import RecoverySettings
    from ..testing.mlx_lm_host import cli_args

    settings = RecoverySettings(adopter_enabled=True, mlxlm_block_tokens=block)
    pm = make_plugin_manager([AdopterPlugin(settings)], settings=settings, entry_points_too=False)
    instrumentor = MlxLmInstrumentor(settings)
    provider = server.ModelProvider(cli_args(cached_model_dir(SPECS[model])))
    generator = server.ResponseGenerator(provider, server.LRUPromptCache(provider.cli_args.prompt_cache_size))
    rng = random.Random(seed)
    row = UntouchedRow(model, prompt_tokens, pairs)
    try:
        for i in range(warmup + pairs):
            arms: Sequence[bool] = (True, False) if i % 2 == 0 else (False, True)
            for attached in arms:
                if attached:
                    instrumentor.instrument(pm)
                else:
                    life = instrumentor._life
                    if life is not None:
                        status = life.status()
                        if i >= warmup:
                            row.cuts += int(status["cuts"])
                            row.adopted += int(status["adopted"])
                            row.capture_s += int(status["snapshot_us"]) / 1e6
                    instrumentor.uninstrument()
                seconds = first_token_seconds(generator, server, _text(rng, prompt_tokens))
                if i >= warmup:
                    (row.with_s if attached else row.without_s).append(seconds)
    finally:
        instrumentor.uninstrument()
        generator.stop_and_join()
    return row


def measure(
    models: Sequence[str] = ("reference", "hybrid", "sliding"), *, block: int, pairs: int = 7,
    prompt_tokens: int = 1500, seed: int = 0,
) -> list[UntouchedRow]:
    return [measure_model(m, block=block, pairs=pairs, prompt_tokens=prompt_tokens, seed=seed) for m in models]


def format_rows(rows: Sequence[UntouchedRow]) -> str:
    lines = [f"untouched requests: time to first token, adapter attached / not (fresh {rows[0].prompt_tokens}-token "
             f"prompts, alternating pairs in one process; goal <= {GOAL_RATIO:.2f}x)" if rows else "untouched: -",
             f"  {'model':<9} {'pairs':>5} {'median':>7} {'IQR':>13} {'min':>6} {'max':>6} {'with s':>8} "
             f"{'without s':>9} {'cuts':>5} {'capture':>8}"]
    for row in rows:
        d = row.to_dict()
        if not row.ratios:
            continue
        quartiles = row.quartiles()
        iqr = f"{quartiles[0]:.3f}-{quartiles[1]:.3f}" if quartiles else "-"
        lines.append(f"  {row.model:<9} {len(row.ratios):>5} {d['median_ratio']:>6.3f}x {iqr:>13} {d['min_ratio']:>5.3f}x "
                     f"{d['max_ratio']:>5.3f}x {d['median_with_s']:>8.4f} {d['median_without_s']:>9.4f} {row.cuts:>5} "
                     f"{d['capture_share']:>8.2%}")
    return "\n".join(lines)
