"""The workloads the adopter exists for, on the mock host's detached-set store:
divergent siblings, multi-turn continuation, a short chat-template match against a long
entry, and a concurrent burst of siblings."""

from __future__ import annotations

import threading

import pytest

from mlx_recovery_plugin.adopter.plugin import AdopterPlugin
from mlx_recovery_plugin.plugins import make_plugin_manager
from mlx_recovery_plugin.settings import RecoverySettings
from mlx_recovery_plugin.testing.block_pool import BlockPool
from mlx_recovery_plugin.testing.detached_store import Admission, DetachedStore
from mlx_recovery_plugin.testing.tiny_model import BYTE_VOCAB, SPECIAL_TOKENS

B = 16
EOS = BYTE_VOCAB + 1
SYSTEM = "You are a careful assistant. Answer in one short paragraph, cite nothing. " * 3


def role(name: str) -> int:
    return BYTE_VOCAB + SPECIAL_TOKENS.index(f"<|{name}|>")


def chat(*messages: tuple[str, str], generation_prompt: bool = True) -> list[int]:
    """Tokens of the tiny models' chat template (one token per byte)."""
    tokens: list[int] = []
    for who, text in messages:
        tokens += [role(who), *text.encode()]
    return tokens + ([role("assistant")] if generation_prompt else [])


def make_store(adopter: bool, mode: str = "clone", blocks: int = 512) -> tuple[DetachedStore, AdopterPlugin]:
    settings = RecoverySettings(adopter_enabled=adopter, adopter_mode=mode)  # type: ignore[arg-type]
    plugin = AdopterPlugin(settings=settings)
    pm = make_plugin_manager([plugin], settings=RecoverySettings(), entry_points_too=False)
    return DetachedStore(BlockPool(blocks, B), pm=pm), plugin


def floor(n: int) -> int:
    return n - n % B


def finish(store: DetachedStore, admission: Admission, prompt: list[int], reply: list[int]) -> None:
    """What the server does when a request ends: give back what it restored from and
    detach its own state (prompt, reply and the fed final token) as a new entry."""
    if admission.handle is not None:
        store.release(admission.handle)
    store.store([*prompt, *reply])


SIBLING_QUESTIONS = ["What is a cache?", "Why is the sky blue?", "Name three rivers.", "Define entropy."]


@pytest.mark.parametrize("adopter", [False, True], ids=["plain", "adopter"])
def test_divergent_siblings_reuse_the_shared_system_prompt(adopter: bool) -> None:
    store, _ = make_store(adopter)
    shared = len(chat(("system", SYSTEM), ("user", ""), generation_prompt=False))
    cached = []
    for i, question in enumerate(SIBLING_QUESTIONS):
        prompt = chat(("system", SYSTEM), ("user", question))
        admission = store.admit(f"r{i}", prompt)
        cached.append(admission.cached_tokens)
        finish(store, admission, prompt, [*b"Sure.", EOS])
    if adopter:
        assert cached[0] == 0 and all(c == floor(shared) and c > 0 for c in cached[1:])
    else:
        assert cached == [0, 0, 0, 0]


@pytest.mark.parametrize("adopter", [False, True], ids=["plain", "adopter"])
def test_multi_turn_continuation_reuses_the_conversation(adopter: bool) -> None:
    store, _ = make_store(adopter)
    messages: list[tuple[str, str]] = [("system", SYSTEM)]
    previous_entry = 0
    cached = []
    for turn in range(4):
        messages.append(("user", f"Question number {turn}, please?"))
        prompt = chat(*messages)
        admission = store.admit(f"t{turn}", prompt)
        cached.append((admission.cached_tokens, previous_entry))
        reply = f"Answer {turn}."
        # The server fed the final EOS; the next prompt renders the turn without it.
        finish(store, admission, prompt, [*reply.encode(), EOS])
        previous_entry = len(prompt) + len(reply) + 1
        messages.append(("assistant", reply))
    for got, entry_len in cached[1:]:
        assert got == (floor(entry_len - 1) if adopter else 0)
    assert cached[0][0] == 0


@pytest.mark.parametrize("mode", ["clone", "trim"])
def test_a_short_chat_template_match_does_not_gut_a_long_entry(mode: str) -> None:
    store, plugin = make_store(True, mode)
    document = "The quick brown fox jumps over the lazy dog. " * 12
    long_prompt = chat(("system", SYSTEM[:40]), ("user", document))
    entry = store.store(long_prompt)
    before = (entry.tokens, list(entry.block_ids))

    short = chat(("system", SYSTEM[:40]), ("user", "hi"))
    first = store.admit("short", short)
    assert first.matched_tokens < 3 * B
    # Clone mode adopts the shared template blocks; trim mode refuses rather than cut.
    assert first.cached_tokens == (floor(first.matched_tokens) if mode == "clone" else 0)
    assert (entry.tokens, entry.block_ids, entry.indexed) == (*before, True)

    sibling = [*long_prompt[:-5], *b"What does it say?"]
    second = store.admit("long sibling", sibling)
    assert second.cached_tokens == floor(len(long_prompt) - 5)
    if mode == "trim":
        assert plugin.status()["reasons"]["trim_would_gut"] == 1


def _burst_prompts() -> list[list[int]]:
    return [chat(("system", SYSTEM), ("user", f"{i}: sibling question")) for i in range(8)]


def _seed(store: DetachedStore) -> None:
    store.store([*chat(("system", SYSTEM), ("user", "seed question")), *b"ok", EOS])


def _run_sequential(store: DetachedStore) -> list[Admission]:
    return [store.admit(f"s{i}", p) for i, p in enumerate(_burst_prompts())]


def _run_burst(store: DetachedStore) -> list[Admission]:
    prompts = _burst_prompts()
    results: list[Admission | None] = [None] * len(prompts)
    barrier = threading.Barrier(len(prompts))

    def one(i: int) -> None:
        barrier.wait()
        results[i] = store.admit(f"b{i}", prompts[i])

    threads = [threading.Thread(target=one, args=(i,)) for i in range(len(prompts))]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert all(r is not None for r in results)
    return results  # type: ignore[return-value]


def test_an_8_way_burst_of_siblings_adopts_as_much_as_running_them_one_by_one() -> None:
    seq_store, _ = make_store(True)
    _seed(seq_store)
    sequential = _run_sequential(seq_store)
    burst_store, plugin = make_store(True)
    _seed(burst_store)
    burst = _run_burst(burst_store)

    shared = len(chat(("system", SYSTEM), ("user", ""), generation_prompt=False))
    total = sum(a.cached_tokens for a in sequential)
    assert total == 8 * floor(shared) > 0
    assert sum(a.cached_tokens for a in burst) == total
    assert plugin.status()["adoptions"] == 8
    for admission in burst:
        burst_store.release(admission.handle)
    for entry in burst_store.entries():
        burst_store.evict(entry)
    assert burst_store.pool.outstanding(ignore=()) == {}


def test_a_one_shot_take_lets_only_one_burst_sibling_adopt() -> None:
    store, _ = make_store(True, "trim")
    _seed(store)
    burst = _run_burst(store)
    adopted = [a for a in burst if a.cached_tokens]
    assert len(adopted) == 1
    assert {a.reason for a in burst if not a.cached_tokens} <= {"no_match", "pins_not_owned"}
    store.release(adopted[0].handle)
    assert store.pool.outstanding(ignore=()) == {}
