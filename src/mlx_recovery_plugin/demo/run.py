"""The three-arm demo: prepare models, build the session, serve it every way, report."""

from __future__ import annotations

import hashlib
import json
import os
import sys
from collections.abc import Callable
from dataclasses import asdict, dataclass, field
from pathlib import Path

from ..testing.tiny_model import TinyModelSpec, load_tiny_model, write_tiny_model
from .arms import ArmSession, Models, ServeConfig
from .report import ARM_TITLES, ARMS, DemoReport
from .session import SessionSpec, build_session

# The embedded default: a float32 target big enough for prefill to dominate, and a draft
# that scores a token for about a tenth of the target's cost.
DEFAULT_TARGET = TinyModelSpec(
    arch="llama", hidden_size=512, num_layers=8, num_heads=8, num_kv_heads=4,
    intermediate_size=1408, seed=11,
)
DEFAULT_DRAFT = TinyModelSpec(
    arch="llama", hidden_size=128, num_layers=2, num_heads=4, num_kv_heads=2,
    intermediate_size=256, seed=12,
)


@dataclass(slots=True)
class DemoConfig:
    session: SessionSpec = field(default_factory=SessionSpec)
    serve: ServeConfig = field(default_factory=lambda: ServeConfig(model_id="tiny-llama-512x8"))
    target: TinyModelSpec = DEFAULT_TARGET
    draft: TinyModelSpec = DEFAULT_DRAFT
    model_path: str | None = None
    draft_path: str | None = None
    repeats: int = 1
    host: str = "mock"


def model_cache_dir() -> Path:
    base = os.environ.get("XDG_CACHE_HOME") or str(Path.home() / ".cache")
    return Path(base) / "mlx-recovery" / "models"


def _spec_dir(spec: TinyModelSpec) -> Path:
    digest = hashlib.sha1(json.dumps(asdict(spec), sort_keys=True, default=str).encode()).hexdigest()[:12]
    return model_cache_dir() / f"{spec.arch}-{spec.hidden_size}x{spec.num_layers}-{digest}"


def prepare_models(config: DemoConfig) -> Models:
    """Load the target and draft: given directories, or tiny ones written once to the cache."""
    if config.model_path:
        model, tokenizer = load_tiny_model(config.model_path)
        draft = load_tiny_model(config.draft_path)[0] if config.draft_path else model
        return Models(model, tokenizer, draft)
    paths = []
    for spec in (config.target, config.draft):
        path = _spec_dir(spec)
        if not (path / "model.safetensors").exists():
            write_tiny_model(path, spec)
        paths.append(path)
    model, tokenizer = load_tiny_model(paths[0])
    draft, _ = load_tiny_model(paths[1])
    return Models(model, tokenizer, draft)


def _encoder(tokenizer) -> Callable[[str], list[int]]:
    return lambda text: list(tokenizer.encode(text, add_special_tokens=False))


def run_demo(config: DemoConfig, progress: Callable[[str], None] | None = None) -> DemoReport:
    """Serve the session in every arm, alternating arms turn by turn, ``repeats`` times."""
    from ..runner.blas import describe, warn_once_if_slow

    warn_once_if_slow()
    say = progress or (lambda line: None)
    models = prepare_models(config)
    turns = build_session(config.session, _encoder(models.tokenizer))
    report = DemoReport(
        model=config.model_path or config.serve.model_id,
        host=config.host,
        blas=describe(),
        block_size=config.serve.block_size,
        sparse_threshold=config.serve.sparse_threshold,
        think_time_s=config.session.think_time_s,
        budget_pct=config.serve.budget_pct,
    )
    say(f"session: {len(turns)} turns, {len(turns[0].prompt)} to {len(turns[-1].prompt)} tokens; BLAS: {report.blas}")
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
    return report


def progress_to_stderr(line: str) -> None:
    print(line, file=sys.stderr, flush=True)
