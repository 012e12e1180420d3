"""Partial-prefix adoption on mlx-lm's prompt cache, in process: the real (instrumented)
``LRUPromptCache`` and ``_tokenize`` of mlx-lm's server, real tiny models of each cache
kind, driven as the server drives them (tests/mlx_lm_driver.py). The HTTP tests run the
real server (tests/test_mlx_lm_server.py)."""

from __future__ import annotations

import copy
import random
from collections.abc import Iterator
from types import SimpleNamespace
from typing import Any

import mlx.core as mx
import pytest
from mlx.utils import tree_flatten

from mlx_recovery_plugin.adopter.plugin import AdopterPlugin
from mlx_recovery_plugin.bench.mlx_lm_long_run import snapshot_bytes
from mlx_recovery_plugin.hosts.mlx_lm import MlxLmInstrumentor, version_supported
from mlx_recovery_plugin.hosts.mlx_lm.instrumentor import mlx_lm_version
from mlx_recovery_plugin.plugins import new_plugin_manager
from mlx_recovery_plugin.settings import RecoverySettings
from mlx_recovery_plugin.testing.mlx_lm_models import SPECS
from mlx_recovery_plugin.testing.tiny_model import cached_model_dir, load_tiny_model

if not version_supported(mlx_lm_version()):
    pytest.skip("an mlx-lm version the adapter refuses", allow_module_level=True)

from mlx_lm.models.cache import LRUPromptCache

from mlx_lm_driver import cold, serve

BLOCK = 32


@pytest.fixture(scope="module")
def models() -> dict[str, Any]:
    return {kind: load_tiny_model(cached_model_dir(spec))[0] for kind, spec in SPECS.items()}


def attach(budget: int = 1 << 30, enabled: bool = True) -> tuple[MlxLmInstrumentor, AdopterPlugin]:
    settings = RecoverySettings(adopter_enabled=enabled, mlxlm_block_tokens=BLOCK, mlxlm_snapshot_bytes=budget)
    pm = new_plugin_manager()
    adopter = AdopterPlugin(settings)
    pm.register(adopter, name="adopter")
    instrumentor = MlxLmInstrumentor(settings)
    assert instrumentor.instrument(pm=pm)
    return instrumentor, adopter


@pytest.fixture
def attached() -> Iterator[tuple[MlxLmInstrumentor, AdopterPlugin]]:
    instrumentor, adopter = attach()
    try:
        yield instrumentor, adopter
    finally:
        instrumentor.uninstrument()


def tokens(n: int, seed: int) -> list[int]:
    rng = random.Random(seed)
    return [rng.randrange(0, 256) for _ in range(n)]


def layer_arrays(cache: list[Any]) -> list[Any]:
    return [v for layer in cache for _, v in tree_flatten(list(layer.state)) if isinstance(v, mx.array)]


def max_diff(a: Any, b: Any) -> float:
    return float(mx.max(mx.abs(a - b)).item())


@pytest.mark.parametrize("kind", ["hybrid", "sliding"])
def test_partial_match_restores_the_block_floor_with_a_cold_runs_output(
    kind: str, models: dict[str, Any], attached: tuple[MlxLmInstrumentor, AdopterPlugin]
) -> None:
    model = models[kind]
    shared = tokens(150, seed=1)  # past the sliding window (48), inside one segment
    first, second = shared + tokens(30, seed=2), shared + tokens(25, seed=3)
    lru = LRUPromptCache(max_size=10)
    serve(lru, model, first)
    adopted = serve(lru, model, second)
    reference = cold(model, second)
    assert adopted.cached_tokens == (150 // BLOCK) * BLOCK
    assert adopted.tokens == reference.tokens
    assert max_diff(adopted.logits, reference.logits) < 1e-4
    assert attached[1].status()["reasons"] == {"partial": 1}


def test_a_sliding_window_snapshot_keeps_only_the_window(
    models: dict[str, Any], attached: tuple[MlxLmInstrumentor, AdopterPlugin]
) -> None:
    from mlx_recovery_plugin.testing.mlx_lm_models import SLIDING_WINDOW

    serve(LRUPromptCache(max_size=10), models["sliding"], tokens(200, seed=27))
    held = list(attached[0]._life.snapshots._snapshots.values())
    assert [s.boundary for s in held] == [32, 64, 96, 128, 160, 192]
    past = [s for s in held if s.boundary >= SLIDING_WINDOW]
    assert past and all(s.layers[0].keys.shape[2] == SLIDING_WINDOW for s in past)
    assert all(1 not in s.layers for s in held)  # the global-attention layer is trimmed instead


@pytest.mark.parametrize("kind", ["hybrid", "sliding"])
def test_without_the_plugin_the_host_reuses_nothing_of_that_match(kind: str, models: dict[str, Any]) -> None:
    # The baseline the adapter is for: a longer, non-trimmable entry is not reused.
    model = models[kind]
    shared = tokens(150, seed=1)
    lru = LRUPromptCache(max_size=10)
    serve(lru, model, shared + tokens(30, seed=2))
    assert serve(lru, model, shared + tokens(25, seed=3)).cached_tokens == 0


def test_the_stored_entry_stays_whole_for_its_siblings(
    models: dict[str, Any], attached: tuple[MlxLmInstrumentor, AdopterPlugin]
) -> None:
    model = models["hybrid"]
    shared = tokens(140, seed=4)
    first = shared + tokens(20, seed=5)
    lru = LRUPromptCache(max_size=10)
    serve(lru, model, first)
    entry = lru._trie.get(("tiny", None, None), lru._trie.search(("tiny", None, None), first + [0]).shorter)
    offsets = [c.offset if hasattr(c, "offset") else None for c in entry.prompt_cache]
    states = copy.deepcopy(layer_arrays(entry.prompt_cache))
    for seed in (6, 7):
        sibling = shared + tokens(20, seed=seed)
        served = serve(lru, model, sibling)
        assert served.cached_tokens == 128
        assert served.tokens == cold(model, sibling).tokens
    assert [c.offset if hasattr(c, "offset") else None for c in entry.prompt_cache] == offsets
    now = layer_arrays(entry.prompt_cache)
    assert len(now) == len(states) > 0
    assert all(mx.array_equal(a, b).item() for a, b in zip(states, now))


def test_a_match_without_a_snapshot_is_refused_counted_and_prefilled_cold(models: dict[str, Any]) -> None:
    instrumentor, adopter = attach(budget=1)  # no snapshot fits
    try:
        model = models["hybrid"]
        shared = tokens(150, seed=8)
        lru = LRUPromptCache(max_size=10)
        serve(lru, model, shared + tokens(30, seed=9))
        second = shared + tokens(30, seed=10)
        served = serve(lru, model, second)
        assert served.cached_tokens == 0
        assert served.tokens == cold(model, second).tokens
        assert adopter.status()["reasons"] == {"no_recurrent_snapshot": 1}
        assert instrumentor.status()["snapshots"]["over_budget"] > 0
    finally:
        instrumentor.uninstrument()


def test_a_pure_attention_model_gets_no_cuts_no_snapshot_and_the_hosts_own_trim(
    models: dict[str, Any], attached: tuple[MlxLmInstrumentor, AdopterPlugin]
) -> None:
    model = models["reference"]
    shared = tokens(150, seed=11)
    lru = LRUPromptCache(max_size=10)
    serve(lru, model, shared + tokens(30, seed=12))
    served = serve(lru, model, shared + tokens(25, seed=13))
    assert served.cached_tokens == 150  # mlx-lm trims a copy itself, to the token
    status = attached[0].status()
    assert (status["cuts"], status["snapshots"]["bytes"], status["snapshots"]["stored"]) == (0, 0, 0)
    assert status["lookups_asked"] == 0


def test_pure_attention_segments_are_the_hosts_own_object(
    models: dict[str, Any], attached: tuple[MlxLmInstrumentor, AdopterPlugin]
) -> None:
    from mlx_lm import server

    result = ([1, 2, 3], [[1, 2, 3]], ["assistant"], "normal", None)
    generator = type("G", (), {})()
    generator.model_provider = type("P", (), {"model": models["reference"], "model_key": ("k",)})()
    original = server.ResponseGenerator._tokenize.__wrapped__
    assert attached[0]._life.segments(generator, result) is result
    assert original is not server.ResponseGenerator._tokenize


def test_a_request_the_server_cannot_batch_is_not_cut(
    models: dict[str, Any], attached: tuple[MlxLmInstrumentor, AdopterPlugin]
) -> None:
    from mlx_lm import server

    prompt = tokens(200, seed=26)
    generator = SimpleNamespace(
        model_provider=SimpleNamespace(model=models["hybrid"], model_key=("k",)),
        _is_batchable=lambda args: args.seed is None,
    )
    tokenizer = SimpleNamespace(encode=lambda _text: list(prompt))
    request = SimpleNamespace(request_type="text", prompt="")
    seeded = server.ResponseGenerator._tokenize(generator, tokenizer, request, SimpleNamespace(seed=1))
    batched = server.ResponseGenerator._tokenize(generator, tokenizer, request, SimpleNamespace(seed=None))
    assert seeded[1] == [prompt]
    assert [len(s) for s in batched[1]] == [32] * 6 + [8]
    assert attached[0].status()["cuts"] == 6


def test_a_prompt_extending_a_stored_entry_is_left_to_the_host(
    models: dict[str, Any], attached: tuple[MlxLmInstrumentor, AdopterPlugin]
) -> None:
    # A divergence at a stored entry's end (a segment end, or a follow-up turn): the host
    # reuses the whole entry itself; the adopter is not asked and copies nothing.
    model = models["hybrid"]
    first = tokens(100, seed=14)
    lru = LRUPromptCache(max_size=10)
    done = serve(lru, model, first)
    follow_up = first + done.tokens[:-1] + tokens(40, seed=15)
    served = serve(lru, model, follow_up)
    assert served.cached_tokens == len(first) + len(done.tokens) - 1
    assert attached[0].status()["lookups_asked"] == 0
    assert attached[1].status()["lookups"] == 0


def test_a_divergence_within_a_block_past_a_stored_segment_end_is_left_to_the_host(
    models: dict[str, Any], attached: tuple[MlxLmInstrumentor, AdopterPlugin]
) -> None:
    # The server stored the prompt less its last token (99) and the finished answer (104);
    # a prompt diverging at 103 floors to 96, below what the server reuses itself.
    model = models["hybrid"]
    first = tokens(100, seed=24)
    lru = LRUPromptCache(max_size=10)
    done = serve(lru, model, first)
    other = (done.tokens[3] + 1) % 256
    served = serve(lru, model, first + done.tokens[:3] + [other] + tokens(20, seed=25))
    assert served.cached_tokens == 99
    assert attached[0].status()["lookups_asked"] == 0 and attached[1].status()["lookups"] == 0


def test_a_prompt_shorter_than_a_block_is_not_cut(
    models: dict[str, Any], attached: tuple[MlxLmInstrumentor, AdopterPlugin]
) -> None:
    lru = LRUPromptCache(max_size=10)
    serve(lru, models["hybrid"], tokens(BLOCK + 1, seed=16))
    status = attached[0].status()
    assert (status["cuts"], status["snapshots"]["bytes"]) == (0, 0)


def test_snapshots_go_with_the_last_entry_that_extends_them(
    models: dict[str, Any], attached: tuple[MlxLmInstrumentor, AdopterPlugin]
) -> None:
    model = models["hybrid"]
    lru = LRUPromptCache(max_size=1)  # each new entry evicts the one before
    serve(lru, model, tokens(100, seed=17))
    held = attached[0].status()["snapshots"]
    assert held["snapshots"] == 3 and held["bytes"] > 0
    serve(lru, model, tokens(40, seed=18))  # unrelated, no cut past 32 (40 - 2 < 64)
    after = attached[0].status()["snapshots"]
    assert after["dropped_orphan"] == 3
    assert after["snapshots"] == 1  # only the new prompt's own cut at 32


def test_a_fault_in_the_adapter_leaves_the_server_its_own_answer(
    models: dict[str, Any], attached: tuple[MlxLmInstrumentor, AdopterPlugin], monkeypatch: pytest.MonkeyPatch
) -> None:
    instrumentor, adopter = attached
    model = models["hybrid"]
    shared = tokens(150, seed=21)
    lru = LRUPromptCache(max_size=10)
    serve(lru, model, shared + tokens(30, seed=22))

    def broken(*_args: Any, **_kwargs: Any) -> Any:
        raise RuntimeError("injected")

    monkeypatch.setattr(instrumentor._life.snapshots, "boundaries", broken)
    second = shared + tokens(30, seed=23)
    served = serve(lru, model, second)
    assert served.cached_tokens == 0 and served.tokens == cold(model, second).tokens
    assert instrumentor.status()["faults"] == 1
    assert adopter.status()["lookups"] == 0


def test_the_budget_evicts_the_least_recently_used_snapshot(models: dict[str, Any]) -> None:
    instrumentor, _ = attach()
    try:
        serve(LRUPromptCache(max_size=10), models["hybrid"], tokens(100, seed=19))
        one = instrumentor.status()["snapshots"]
        per_snapshot = one["bytes"] // one["snapshots"]
    finally:
        instrumentor.uninstrument()
    instrumentor, _ = attach(budget=2 * per_snapshot)
    try:
        lru = LRUPromptCache(max_size=10)
        prompt = tokens(200, seed=20)  # cuts at 32, 64, ..., 192: six snapshots offered
        serve(lru, models["hybrid"], prompt)
        status = instrumentor.status()["snapshots"]
        assert status["bytes"] <= 2 * per_snapshot
        assert (status["snapshots"], status["stored"], status["evicted_budget"]) == (2, 6, 4)
        store = instrumentor._life.snapshots
        assert store.boundaries(("tiny", None, None), prompt, BLOCK, 200) == [192, 160]
    finally:
        instrumentor.uninstrument()


@pytest.mark.parametrize("kind", ["hybrid", "sliding"])
def test_the_budget_holds_over_a_long_run_and_the_newest_documents_siblings_are_still_adopted(
    kind: str, models: dict[str, Any]
) -> None:
    budget = 2 * snapshot_bytes(kind, BLOCK)  # the bench's own sizing: two snapshots of the model
    instrumentor, _ = attach(budget=budget)
    try:
        lru, held, restored = LRUPromptCache(max_size=10), [], []
        for k in range(24):  # the host keeps ten entries: old documents leave its cache too
            document = tokens(200, seed=1000 + k)  # six snapshots offered (32 ... 192), two kept
            for question in (0, 1):
                served = serve(lru, models[kind], document + tokens(12, seed=2000 + 2 * k + question))
                held.append(instrumentor.status()["snapshots"]["bytes"])
            restored.append(served.cached_tokens)  # the sibling's floor: 192 of the 200 shared tokens
        status = instrumentor.status()
        assert max(held) <= budget and held[-1] > 0
        assert status["snapshots"]["evicted_budget"] >= 24 * 4
        assert restored[-6:] == [192] * 6  # the newest documents' siblings still get their floor
        assert status["adopted"] == 24 and status["faults"] == 0
    finally:
        instrumentor.uninstrument()
