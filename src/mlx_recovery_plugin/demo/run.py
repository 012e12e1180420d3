"""The three-arm demo: prepare models, build the session, serve it every way, report."""

from __future__ import annotations

import sys
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from ..testing.tiny_model import BENCH_DRAFT, BENCH_TARGET, TinyModelSpec, cached_model_dir, load_tiny_model
from .arms import ArmSession, Models, ServeConfig
from .recall import RecallSpec, build_recall_session
from .report import ARM_TITLES, ARMS, DemoReport
from .session import ChatFormat, SessionSpec, Turn, build_session


@dataclass(slots=True)
class DemoConfig:
    session: SessionSpec = field(default_factory=SessionSpec)
    serve: ServeConfig = field(default_factory=lambda: ServeConfig(model_id=BENCH_TARGET.label))
    target: TinyModelSpec = BENCH_TARGET
    draft: TinyModelSpec = BENCH_DRAFT
    model_path: str | None = None
    draft_path: str | None = None
    repeats: int = 1
    host: str = "mock"
    # A recall session instead of the agent session: facts in the first turn, questions
    # about them after, each arm's greedy answers compared (demo/answers.py).
    answers: bool = False


def prepare_models(config: DemoConfig) -> Models:
    """Load the target and draft: given directories or known model names (``smollm2``), or
    tiny ones written once to the cache."""
    if config.model_path:
        from ..models.library import resolve_model

        model, tokenizer = load_tiny_model(resolve_model(config.model_path))
        draft = load_tiny_model(resolve_model(config.draft_path))[0] if config.draft_path else model
        return Models(model, tokenizer, draft)
    model, tokenizer = load_tiny_model(cached_model_dir(config.target))
    draft, _ = load_tiny_model(cached_model_dir(config.draft))
    return Models(model, tokenizer, draft)


def text_encoder(tokenizer) -> Callable[[str], list[int]]:
    return lambda text: list(tokenizer.encode(text, add_special_tokens=False))


def session_turns(spec: SessionSpec, tokenizer: Any) -> list[Turn]:
    """The demo's session in ``tokenizer``'s tokens, with its chat template's markup."""
    return build_session(spec, text_encoder(tokenizer), ChatFormat.of(tokenizer))


def demo_turns(config: DemoConfig, tokenizer: Any) -> tuple[list[Turn], list[str]]:
    """The turns to serve and, for a recall session, the answer each later turn expects."""
    if not config.answers:
        return session_turns(config.session, tokenizer), []
    spec = RecallSpec(system_tokens=config.session.system_tokens, turns=config.session.turns)
    recall = build_recall_session(spec, text_encoder(tokenizer), ChatFormat.of(tokenizer))
    return [r.turn for r in recall], [r.expected for r in recall]


def context_note(model: Any, turns: list[Turn]) -> str:
    """A line when the session's longest prompt is beyond the context the model was
    trained for (mlx-lm does not refuse such prompts; the model's answers degrade)."""
    limit = getattr(getattr(model, "args", None), "max_position_embeddings", None)
    longest = max(len(t.prompt) for t in turns)
    if not isinstance(limit, int) or longest <= limit:
        return ""
    return (
        f"note: the longest prompt ({longest:,} tokens) is beyond the model's context ({limit:,}); "
        f"use --system-tokens and --sparse-threshold to fit it"
    )


def decode_answers(report: DemoReport, tokenizer: Any) -> None:
    """Cut each turn's greedy answer after its first end-of-turn token (the mock host
    generates ``max_tokens`` regardless) and keep its text."""
    eos = set(getattr(tokenizer, "eos_token_ids", ()) or ())
    for run in report.repeats:
        for result in run.values():
            for row in result.turns:
                cut = next((i + 1 for i, t in enumerate(row.output_tokens) if t in eos), len(row.output_tokens))
                row.output_tokens = row.output_tokens[:cut]
                row.answer = tokenizer.decode([t for t in row.output_tokens if t not in eos])


def run_demo(config: DemoConfig, progress: Callable[[str], None] | None = None) -> DemoReport:
    """Serve the session in every arm, alternating arms turn by turn, ``repeats`` times."""
    from ..runner.blas import describe, warn_once_if_slow

    warn_once_if_slow()
    say = progress or (lambda line: None)
    models = prepare_models(config)
    turns, expected = demo_turns(config, models.tokenizer)
    report = DemoReport(
        model=config.model_path or config.serve.model_id,
        host=config.host,
        blas=describe(),
        block_size=config.serve.block_size,
        sparse_threshold=config.serve.sparse_threshold,
        think_time_s=config.session.think_time_s,
        budget_pct=config.serve.budget_pct,
        expected=expected,
    )
    if note := context_note(models.model, turns):
        say(note)
    say(f"session: {len(turns)} turns, {len(turns[0].prompt)} to {len(turns[-1].prompt)} tokens; BLAS: {report.blas}")
    attach_balance(report, models.model, len(turns[-1].prompt), say)
    for repeat in range(config.repeats):
        arms = {arm: ArmSession(arm, models, config.serve) for arm in ARMS}
        try:
            for turn in turns:
                for arm in ARMS:
                    row = arms[arm].serve(turn)
                    say(
                        f"[{repeat + 1}/{config.repeats}] turn {turn.index + 1} {ARM_TITLES[arm]:<21} "
                        f"tokens {row.prompt_tokens:>6} cached {row.cached_tokens:>6} "
                        f"ttft {row.ttft_s:7.3f}s route {row.route}"
                    )
                if turn is not turns[-1]:
                    for arm in ARMS:
                        arms[arm].think(config.session.think_time_s)
        finally:
            for session in arms.values():
                session.close()
        report.repeats.append({arm: s.result for arm, s in arms.items()})
    decode_answers(report, models.tokenizer)
    return report


def attach_balance(report: DemoReport, model: Any, context: int, say: Callable[[str], None] | None = None) -> None:
    """Measure the target's cost balance at the session's longest context into ``report``."""
    from ..bench.balance import measure_or_say_why

    (say or (lambda line: None))(f"measuring the target's cost balance at {context:,} tokens of context ...")
    balance, report.balance_line = measure_or_say_why(model, context, repeats=5)
    report.balance = balance.as_dict() if balance is not None else None
    if say:
        say(report.balance_line)


def progress_to_stderr(line: str) -> None:
    print(line, file=sys.stderr, flush=True)
