"""Parity on a tiny real model: a request that adopts a partial prefix from a stored entry
and prefills the rest decodes exactly like a cold run, with logits within 1e-4."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import mlx.core as mx
import pytest
from mlx_lm.models.cache import make_prompt_cache

from mlx_recovery_plugin.adopter.plugin import AdopterPlugin
from mlx_recovery_plugin.plugins import make_plugin_manager
from mlx_recovery_plugin.settings import RecoverySettings
from mlx_recovery_plugin.testing.block_pool import BlockPool
from mlx_recovery_plugin.testing.detached_store import DetachedStore
from mlx_recovery_plugin.testing.tiny_model import (
    BYTE_VOCAB,
    SPECIAL_TOKENS,
    TinyModelSpec,
    load_tiny_model,
    write_tiny_model,
)

B = 16
TOL = 1e-4
SYSTEM = "You are a careful assistant; answer briefly and plainly. " * 2


def _model_dir(request: pytest.FixtureRequest, shared: str, tmp_path_factory: Any, arch: str) -> Path:
    # Prefer the suite-wide fixture from conftest.py; make our own if it is not there.
    try:
        return Path(request.getfixturevalue(shared))
    except pytest.FixtureLookupError:
        return write_tiny_model(tmp_path_factory.mktemp(f"adopter-{arch}"), TinyModelSpec(arch=arch))


@pytest.fixture(scope="session", params=["llama", "qwen3"])
def adopter_model(request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory) -> Any:
    arch = request.param
    model, _ = load_tiny_model(_model_dir(request, f"tiny_{arch}_dir", tmp_path_factory, arch))
    return model


def role(name: str) -> int:
    return BYTE_VOCAB + SPECIAL_TOKENS.index(f"<|{name}|>")


def chat(system: str, user: str) -> list[int]:
    return [role("system"), *system.encode(), role("user"), *user.encode(), role("assistant")]


def prefill(model: Any, cache: list[Any], tokens: list[int]) -> mx.array:
    logits = model(mx.array(tokens)[None], cache=cache)[0, -1]
    mx.eval(logits)
    return logits


def greedy(model: Any, cache: list[Any], first_logits: mx.array, n: int = 8) -> list[int]:
    out = [int(mx.argmax(first_logits))]
    for _ in range(n - 1):
        out.append(int(mx.argmax(prefill(model, cache, [out[-1]]))))
    return out


def run_cold(model: Any, prompt: list[int]) -> tuple[mx.array, list[int]]:
    cache = make_prompt_cache(model)
    logits = prefill(model, cache, prompt)
    return logits, greedy(model, cache, logits)


def make_store(mode: str) -> DetachedStore:
    settings = RecoverySettings(adopter_enabled=True, adopter_mode=mode)  # type: ignore[arg-type]
    pm = make_plugin_manager([AdopterPlugin(settings=settings)], settings=RecoverySettings(), entry_points_too=False)
    return DetachedStore(BlockPool(256, B), pm=pm)


def store_served(store: DetachedStore, model: Any, prompt: list[int]) -> None:
    cache = make_prompt_cache(model)
    prefill(model, cache, prompt)
    store.store_cache(prompt, cache)


def run_adopted(store: DetachedStore, model: Any, prompt: list[int]) -> tuple[int, mx.array, list[int]]:
    admission = store.admit("sibling", prompt)
    assert admission.handle is not None
    cache = store.restore(admission.handle, lambda: make_prompt_cache(model))
    logits = prefill(model, cache, prompt[admission.cached_tokens :])
    tokens = greedy(model, cache, logits)
    store.release(admission.handle)
    return admission.cached_tokens, logits, tokens


@pytest.mark.parametrize("mode", ["clone", "trim"])
def test_partial_adoption_decodes_like_a_cold_run(adopter_model: Any, mode: str) -> None:
    store = make_store(mode)
    store_served(store, adopter_model, chat(SYSTEM, "Tell me about rivers."))
    sibling = chat(SYSTEM, "Tell me about mountains, please.")

    cached, logits, tokens = run_adopted(store, adopter_model, sibling)
    cold_logits, cold_tokens = run_cold(adopter_model, sibling)

    shared = len(chat(SYSTEM, "Tell me about ")) - 1
    assert cached == shared - shared % B > 0
    assert tokens == cold_tokens
    assert float(mx.max(mx.abs(logits - cold_logits))) < TOL


def test_multi_turn_continuation_past_a_fed_eos_decodes_like_a_cold_run(adopter_model: Any) -> None:
    store = make_store("clone")
    turn1 = chat(SYSTEM, "First question?")
    reply = [*b"First answer.", BYTE_VOCAB + 1]  # the server fed the final EOS
    store_served(store, adopter_model, [*turn1, *reply])
    turn2 = [*turn1, *reply[:-1], role("user"), *b"And the second?", role("assistant")]

    cached, logits, tokens = run_adopted(store, adopter_model, turn2)
    cold_logits, cold_tokens = run_cold(adopter_model, turn2)

    boundary = len(turn1) + len(reply) - 1
    assert cached == boundary - boundary % B > 0
    assert tokens == cold_tokens
    assert float(mx.max(mx.abs(logits - cold_logits))) < TOL


def test_whole_entry_adoption_with_a_partial_tail_block_decodes_like_a_cold_run(adopter_model: Any) -> None:
    store = make_store("clone")
    first = chat(SYSTEM, "Count to three.")
    assert len(first) % B != 0
    store_served(store, adopter_model, first)
    follow = [*first, *b"One, two, three."]

    cached, logits, tokens = run_adopted(store, adopter_model, follow)
    cold_logits, cold_tokens = run_cold(adopter_model, follow)

    assert cached == len(first)
    assert tokens == cold_tokens
    assert float(mx.max(mx.abs(logits - cold_logits))) < TOL
