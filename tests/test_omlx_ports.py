"""The host ports over the real scheduler of each oMLX family member: fetch, release and
store through the host's own prefix cache, with every reference given back."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path
from typing import Any

import mlx.core as mx
import pytest
from mlx_lm.models.cache import make_prompt_cache

from mlx_recovery_plugin.demo.arms import ServeConfig
from mlx_recovery_plugin.demo.omlx import (
    held_references,
    make_scheduler,
    serve,
    wait_for_cache_writes,
)
from mlx_recovery_plugin.hosts.omlx.members import Member
from mlx_recovery_plugin.hosts.omlx.ports import OmlxEngine, model_id_of
from mlx_recovery_plugin.kvcodec import blocks_from_cache
from mlx_recovery_plugin.ports import EnginePort, ModelHandle, PrefixCachePort
from mlx_recovery_plugin.state import BlockState, KVBlock
from mlx_recovery_plugin.testing.contract import contract_tokens
from mlx_recovery_plugin.testing.omlx_host import make_request
from mlx_recovery_plugin.testing.tiny_model import load_tiny_model

BLOCK = 64
CONFIG = ServeConfig(model_id="tiny", block_size=BLOCK, prefill_step=128, sparse_threshold=1024, pool_blocks=512)


@pytest.fixture(scope="module")
def models(tiny_llama_dir: Path) -> tuple[Any, Any]:
    return load_tiny_model(tiny_llama_dir)


@pytest.fixture
def scheduler(models: tuple[Any, Any], tmp_path: Path, omlx_member: Member) -> Iterator[Any]:
    model, tokenizer = models
    sched = make_scheduler(model, tokenizer, tmp_path / "cache", CONFIG, member=omlx_member)
    yield sched
    sched.shutdown()


@pytest.fixture
def engine(scheduler: Any) -> OmlxEngine:
    return OmlxEngine(scheduler, "engine-under-test")


def dense_blocks(model: Any, tokens: list[int], n_blocks: int) -> list[BlockState]:
    """Blocks 0..n-1 of a plain mlx-lm prefill of ``tokens``."""
    cache = make_prompt_cache(model)
    end = n_blocks * BLOCK
    for start in range(0, end, 96):
        model(mx.array(tokens[start : min(start + 96, end)])[None], cache=cache)
    mx.eval([layer.keys for layer in cache])
    return blocks_from_cache(cache, 0, n_blocks, BLOCK, origin="recovery")


def test_ports_satisfy_the_host_protocols(engine: OmlxEngine) -> None:
    assert isinstance(engine, EnginePort)
    assert isinstance(engine.prefix_cache, PrefixCachePort)
    assert isinstance(engine.model, ModelHandle)
    assert (engine.model_id, engine.block_size, engine.prefill_step) == ("tiny", BLOCK, 128)
    assert engine.queues_empty() and not engine.is_busy() and not engine.sparse_route_live()


def test_stored_blocks_come_back_through_fetch_with_the_same_keys_and_values(
    engine: OmlxEngine, scheduler: Any, models: tuple[Any, Any]
) -> None:
    tokens = contract_tokens(3 * BLOCK + 20, seed=1)
    blocks = dense_blocks(models[0], tokens, 3)
    assert engine.prefix_cache.store("job", tokens, blocks) == 3 * BLOCK
    assert held_references(scheduler) == {}

    fetched = engine.prefix_cache.fetch("probe", tokens)
    try:
        assert fetched.tokens == 3 * BLOCK
        assert [b.index for b in fetched.blocks] == [0, 1, 2]
        for got, want in zip(fetched.blocks, blocks):
            for got_layer, want_layer in zip(got.layers, want.layers):
                assert isinstance(got_layer, KVBlock) and isinstance(want_layer, KVBlock)
                assert mx.allclose(got_layer.keys, want_layer.keys).item()
                assert mx.allclose(got_layer.values, want_layer.values).item()
        assert held_references(scheduler)  # the probe holds its blocks until released
    finally:
        engine.prefix_cache.release("probe")
    assert held_references(scheduler) == {}
    assert engine.prefix_cache.holders() == []


class _CountingLock:
    """Stands in for the host's re-entrant buffer lock and says whether it is held."""

    def __init__(self) -> None:
        self.depth = 0

    def __enter__(self) -> None:
        self.depth += 1

    def __exit__(self, *exc: object) -> None:
        self.depth -= 1


def test_a_store_writes_every_block_under_the_host_buffer_lock(
    engine: OmlxEngine, scheduler: Any, models: tuple[Any, Any], omlx_member: Member,
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """The host's cache writer reads MLX buffers under its own lock (fusion-mlx keeps it in
    ``scheduler.types``, not beside the methods that use it); the port's writes take it too."""
    lock = _CountingLock()
    module_name, _, attr = omlx_member.buffer_lock.partition(":")
    monkeypatch.setattr(omlx_member.resolve(module_name), attr, lock)
    cache = scheduler.block_aware_cache
    depths: list[int] = []
    original = cache.store_cache
    monkeypatch.setattr(cache, "store_cache", lambda *a, **k: (depths.append(lock.depth), original(*a, **k))[1])
    tokens = contract_tokens(2 * BLOCK, seed=11)
    assert engine.prefix_cache.store("job", tokens, dense_blocks(models[0], tokens, 2)) == 2 * BLOCK
    assert depths == [1, 1] and lock.depth == 0


def test_a_store_waits_for_room_in_the_hosts_ssd_write_queue_instead_of_losing_a_block(
    engine: OmlxEngine, scheduler: Any, models: tuple[Any, Any], tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
) -> None:
    """oMLX drops a block that finds its SSD write queue full and rolls the store back to
    before it: a whole prefix published at once came back one block short on the real
    server. Here the queue is one deep and full when the store begins; its writer thread
    takes the item off within a second (it waits on the queue it had for up to 1 s)."""
    import queue

    from mlx_recovery_plugin.hosts.omlx import ports as ports_mod

    ssd = scheduler.block_aware_cache.paged_ssd_cache
    pending: queue.Queue[Any] = queue.Queue(maxsize=1)
    pending.put_nowait(("unlink", str(tmp_path / "no-such-block.safetensors")))
    monkeypatch.setattr(ssd, "_write_queue", pending)
    monkeypatch.setattr(ports_mod, "SSD_QUEUE_WAIT_S", 10.0)  # the writer's own poll is 1 s
    tokens = contract_tokens(3 * BLOCK + 20, seed=12)
    assert engine.prefix_cache.store("job", tokens, dense_blocks(models[0], tokens, 3)) == 3 * BLOCK
    assert engine.prefix_cache.stored_tokens(tokens) == 3 * BLOCK
    assert held_references(scheduler) == {}


def test_tail_blocks_are_refused_until_the_blocks_before_them_are_stored(
    engine: OmlxEngine, scheduler: Any, models: tuple[Any, Any]
) -> None:
    tokens = contract_tokens(4 * BLOCK, seed=2)
    blocks = dense_blocks(models[0], tokens, 4)
    assert engine.prefix_cache.store("job", tokens, blocks[2:]) == 0
    assert engine.prefix_cache.stored_tokens(tokens) == 0

    assert engine.prefix_cache.store("job", tokens[: 2 * BLOCK], blocks[:2]) == 2 * BLOCK
    assert engine.prefix_cache.store("job", tokens, blocks[2:]) == 4 * BLOCK
    assert engine.prefix_cache.stored_tokens(tokens) == 4 * BLOCK
    assert held_references(scheduler) == {}


def test_store_floors_to_whole_blocks_and_rejects_misnumbered_blocks(
    engine: OmlxEngine, models: tuple[Any, Any]
) -> None:
    tokens = contract_tokens(2 * BLOCK + 30, seed=3)
    blocks = dense_blocks(models[0], tokens, 2)
    with pytest.raises(ValueError):
        engine.prefix_cache.store("job", tokens, blocks[1:] + blocks[:1])
    assert engine.prefix_cache.store("job", tokens, blocks) == 2 * BLOCK


def test_a_request_after_a_port_store_restores_it_and_generates_like_a_cold_run(
    engine: OmlxEngine, scheduler: Any, models: tuple[Any, Any], tmp_path: Path, omlx_member: Member
) -> None:
    model, tokenizer = models
    prompt = contract_tokens(5 * BLOCK + 17, seed=4)
    cold_scheduler = make_scheduler(model, tokenizer, tmp_path / "cold", CONFIG, member=omlx_member)
    try:
        cold = serve(cold_scheduler, make_request("cold", prompt, max_tokens=8, sparse=False, member=omlx_member))
        wait_for_cache_writes(cold_scheduler)
    finally:
        cold_scheduler.shutdown()

    assert engine.prefix_cache.store("job", prompt, dense_blocks(model, prompt, 5)) == 5 * BLOCK
    warm = serve(scheduler, make_request("warm", prompt, max_tokens=8, sparse=False, member=omlx_member))
    wait_for_cache_writes(scheduler)

    assert cold.row.cached_tokens == 0
    assert warm.row.cached_tokens == 5 * BLOCK
    assert warm.output_tokens == cold.output_tokens
    assert held_references(scheduler) == {}


def test_release_gives_back_every_fetch_of_a_holder_and_is_idempotent(
    engine: OmlxEngine, scheduler: Any, models: tuple[Any, Any]
) -> None:
    tokens = contract_tokens(2 * BLOCK, seed=5)
    engine.prefix_cache.store("job", tokens, dense_blocks(models[0], tokens, 2))
    engine.prefix_cache.fetch("holder", tokens)
    engine.prefix_cache.fetch("holder", tokens[:BLOCK])
    assert set(held_references(scheduler).values()) == {1, 2}
    engine.prefix_cache.release("holder")
    engine.prefix_cache.release("holder")
    assert held_references(scheduler) == {}
    assert not [t for t in scheduler.block_aware_cache.paged_cache.request_tables if "holder" in t]


def test_a_release_that_fails_part_way_keeps_the_rest_for_the_next_call(
    engine: OmlxEngine, scheduler: Any, models: tuple[Any, Any], monkeypatch: pytest.MonkeyPatch
) -> None:
    tokens = contract_tokens(2 * BLOCK, seed=6)
    engine.prefix_cache.store("job", tokens, dense_blocks(models[0], tokens, 2))
    engine.prefix_cache.fetch("holder", tokens)
    engine.prefix_cache.fetch("holder", tokens[:BLOCK])
    pool = scheduler.block_aware_cache.paged_cache
    real = pool.release_for_eviction
    calls = []

    def fail_second(block_ids: Any) -> Any:
        calls.append(list(block_ids))
        if len(calls) == 2:
            raise RuntimeError("injected release failure")
        return real(block_ids)

    monkeypatch.setattr(pool, "release_for_eviction", fail_second)
    with pytest.raises(RuntimeError, match="injected"):
        engine.prefix_cache.release("holder")
    assert held_references(scheduler) != {}, "the second fetch's blocks are still held"
    assert engine.prefix_cache.holders() == ["holder"]
    engine.prefix_cache.release("holder")  # the retry gives back only what is left
    assert held_references(scheduler) == {}
    assert engine.prefix_cache.holders() == []


def test_a_release_after_a_reset_leaves_the_new_cache_alone(
    engine: OmlxEngine, scheduler: Any, models: tuple[Any, Any]
) -> None:
    tokens = contract_tokens(2 * BLOCK, seed=6)
    blocks = dense_blocks(models[0], tokens, 2)
    engine.prefix_cache.store("job", tokens, blocks)
    engine.prefix_cache.fetch("old", tokens)
    scheduler.reset()  # oMLX clears its prefix cache: block ids start over

    engine.prefix_cache.store("job", tokens, blocks)
    engine.prefix_cache.fetch("new", tokens)
    held = held_references(scheduler)
    engine.prefix_cache.release("old")
    assert held_references(scheduler) == held
    engine.prefix_cache.release("new")
    assert held_references(scheduler) == {}


def test_without_the_oMLX_prefix_cache_fetch_and_store_do_nothing(
    models: tuple[Any, Any], tmp_path: Path, omlx_member: Member
) -> None:
    module = omlx_member.resolve(omlx_member.scheduler_module)
    model, tokenizer = models
    bare = module.Scheduler(
        model, tokenizer, module.SchedulerConfig(model_name="/models/org/tiny-1B/", **omlx_member.cache_off_config)
    )
    engine = OmlxEngine(bare, "no-cache")
    tokens = contract_tokens(2 * BLOCK, seed=7)
    assert engine.model_id == model_id_of(bare) == "tiny-1B"
    assert not engine.prefix_cache.enabled
    assert engine.prefix_cache.fetch("probe", tokens).tokens == 0
    assert engine.prefix_cache.store("job", tokens, dense_blocks(model, tokens, 2)) == 0
    engine.prefix_cache.release("probe")


def test_ports_hold_the_scheduler_weakly(models: tuple[Any, Any], tmp_path: Path, omlx_member: Member) -> None:
    import gc

    model, tokenizer = models
    sched = make_scheduler(model, tokenizer, tmp_path / "weak", CONFIG, member=omlx_member)
    engine = OmlxEngine(sched, "weak")
    sched.shutdown()
    del sched
    gc.collect()
    assert engine.scheduler is None
    assert engine.queues_empty() and not engine.is_busy()
    assert engine.prefix_cache.fetch("probe", [1, 2, 3]).tokens == 0
    assert engine.model.model is None
