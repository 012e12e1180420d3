"""The mock engine and host: real tiny models behind an oMLX-shaped scheduler."""

from __future__ import annotations

import logging
import math
import threading
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import mlx.core as mx
import pytest
from mlx_lm.models.cache import make_prompt_cache

from mlx_recovery_plugin.events import DepartureReason, IdleStep, RequestAdmitted
from mlx_recovery_plugin.hookspecs import hookimpl
from mlx_recovery_plugin.plugins import make_plugin_manager
from mlx_recovery_plugin.ports import EnginePort, ModelHandle
from mlx_recovery_plugin.testing import MockHost, load_tiny_model
from mlx_recovery_plugin.testing.contract import EventRecorder, contract_tokens
from mlx_recovery_plugin.testing.engine import SPARSE_TAIL_TOKENS

B = 16


@pytest.fixture(scope="module")
def llama(tiny_llama_dir: Path) -> tuple[Any, Any]:
    return load_tiny_model(tiny_llama_dir)


@pytest.fixture(scope="module")
def qwen3(tiny_qwen3_dir: Path) -> tuple[Any, Any]:
    return load_tiny_model(tiny_qwen3_dir)


@pytest.fixture(scope="module")
def draft(tiny_draft_dir: Path) -> Any:
    return load_tiny_model(tiny_draft_dir)[0]


@pytest.fixture
def recorder() -> EventRecorder:
    return EventRecorder()


def make_host(*plugins: object) -> MockHost:
    return MockHost(make_plugin_manager(plugins, entry_points_too=False))


def add(host: MockHost, engine_id: str, loaded: tuple[Any, Any], **kwargs: Any) -> Any:
    kwargs.setdefault("block_size", B)
    kwargs.setdefault("prefill_step", 32)
    return host.add_engine(engine_id, model=loaded[0], tokenizer=loaded[1], **kwargs)


def serve(host: MockHost, engine_id: str, prompt: list[int], **kwargs: Any) -> Any:
    rid = host.submit(engine_id, prompt, **kwargs)
    host.run_until_idle()
    return host.result(rid)


def plain_greedy(model: Any, prompt: list[int], n: int) -> tuple[list[int], mx.array]:
    """Reference: plain mlx-lm, whole prompt in one call, greedy decoding."""
    cache = make_prompt_cache(model)
    first = model(mx.array(prompt)[None], cache=cache)[0, -1]
    tokens = [int(mx.argmax(first).item())]
    while len(tokens) < n:
        logits = model(mx.array([[tokens[-1]]]), cache=cache)[0, -1]
        tokens.append(int(mx.argmax(logits).item()))
    return tokens, first


# -- ports ---------------------------------------------------------------------------


def test_engine_is_an_engine_port_and_attaches_on_creation(llama: Any, recorder: EventRecorder) -> None:
    host = make_host(recorder)
    engine = add(host, "e1", llama, model_id="org/tiny-llama-1.0")
    assert isinstance(engine, EnginePort) and engine.port is engine
    assert isinstance(engine.model, ModelHandle)
    assert engine.model_id == "org/tiny-llama-1.0" and engine.model.stream is None
    assert [e.hook for e in recorder.snapshot()] == ["engine_attached"]
    assert recorder.engines["e1"] is engine
    assert len(engine.model.make_cache()) == 2


def test_model_id_defaults_to_engine_id(llama: Any) -> None:
    assert add(make_host(), "alpha", llama).model_id == "alpha"


# -- dense route ---------------------------------------------------------------------


@pytest.mark.parametrize("arch", ["llama", "qwen3"])
def test_restored_prefix_gives_the_cold_runs_greedy_output_and_logits(
    arch: str, llama: Any, qwen3: Any
) -> None:
    loaded = llama if arch == "llama" else qwen3
    prompt = contract_tokens(5 * B + 7, seed=1)
    follow_up = prompt + contract_tokens(23, seed=2)

    warm = make_host()
    add(warm, "e", loaded)
    serve(warm, "e", prompt)
    restored = serve(warm, "e", follow_up, max_tokens=6)

    cold_host = make_host()
    add(cold_host, "e", loaded)
    cold = serve(cold_host, "e", follow_up, max_tokens=6)
    reference, reference_logits = plain_greedy(loaded[0], follow_up, 6)

    assert restored.cached_tokens == 5 * B and cold.cached_tokens == 0
    assert restored.output_tokens == cold.output_tokens == tuple(reference)
    assert mx.abs(restored.first_logits - cold.first_logits).max().item() < 1e-4
    assert mx.abs(cold.first_logits - reference_logits).max().item() < 1e-4


def test_dense_request_stores_exactly_its_prompts_whole_blocks(llama: Any) -> None:
    host = make_host()
    engine = add(host, "e", llama)
    prompt = contract_tokens(3 * B + 5, seed=3)
    serve(host, "e", prompt)
    assert len(engine.prefix_cache) == 3
    assert engine.prefix_cache.stored_tokens(prompt) == 3 * B
    assert host.leaked() == {}


def test_whole_block_prompt_served_twice_still_prefills_its_last_token(llama: Any) -> None:
    host = make_host()
    add(host, "e", llama)
    prompt = contract_tokens(4 * B, seed=4)
    first = serve(host, "e", prompt)
    second = serve(host, "e", prompt)
    assert second.cached_tokens == 3 * B
    assert second.prefilled_tokens == B
    assert second.output_tokens == first.output_tokens
    assert mx.abs(second.first_logits - first.first_logits).max().item() < 1e-4


def test_results_report_route_and_prefill_work(llama: Any) -> None:
    host = make_host()
    add(host, "e", llama)
    result = serve(host, "e", contract_tokens(50, seed=5), max_tokens=3)
    assert result.route == "dense" and result.reason == DepartureReason.FINISHED
    assert result.prefilled_tokens == 50 and result.draft_tokens == 0
    assert len(result.output_tokens) == 3 and result.first_logits.shape == (llama[0].args.vocab_size,)


# -- sparse route --------------------------------------------------------------------


def test_sparse_route_never_reuses_state_across_a_growing_conversation(
    llama: Any, draft: Any
) -> None:
    """Four turns of one conversation: the sparse route restores nothing on any turn,
    the dense route restores the earlier turns from turn 2 on (like the real host)."""
    host = make_host()
    add(host, "sparse", llama, draft_model=draft, sparse_threshold=2 * B)
    add(host, "dense", llama, draft_model=draft, sparse_threshold=2 * B)
    cached: dict[str, list[int]] = {"sparse": [], "dense": []}
    routes: list[str] = []
    for engine_id in ("sparse", "dense"):
        conversation = contract_tokens(6 * B, seed=6)
        for turn in range(4):
            result = serve(host, engine_id, conversation, max_tokens=4, sparse=engine_id == "sparse")
            cached[engine_id].append(result.cached_tokens)
            if engine_id == "sparse":
                routes.append(result.route)
            conversation = conversation + list(result.output_tokens) + contract_tokens(40, seed=7 + turn)
    assert cached["sparse"] == [0, 0, 0, 0]
    assert routes == ["sparse"] * 4
    assert cached["dense"][0] == 0 and all(c > 0 for c in cached["dense"][1:])
    assert len(host.engines["sparse"].prefix_cache) == 0
    assert host.leaked() == {}


def test_sparse_route_reads_the_uncached_range_with_the_draft_and_prefills_the_kept_share(
    llama: Any, draft: Any, recorder: EventRecorder
) -> None:
    host = make_host(recorder)
    add(host, "e", llama, draft_model=draft, sparse_threshold=2 * B, sparse_keep=0.25)
    prefix = contract_tokens(4 * B + 3, seed=8)
    serve(host, "e", prefix)  # dense: stores 4 blocks
    prompt = prefix + contract_tokens(150, seed=9)
    result = serve(host, "e", prompt, sparse=True)
    uncached = len(prompt) - 4 * B
    assert result.route == "sparse" and result.cached_tokens == 4 * B
    assert result.draft_tokens == uncached
    assert result.prefilled_tokens == max(SPARSE_TAIL_TOKENS, math.ceil(0.25 * uncached))
    served = recorder.one("sparse_route_served", result.request_id)
    assert (served.served_start, served.served_end) == (4 * B, len(prompt))
    assert host.engines["e"].prefix_cache.stored_tokens(prompt) == 4 * B


@pytest.mark.parametrize("case", ["below_threshold", "no_draft", "not_asked"])
def test_sparse_route_applies_only_when_asked_above_threshold_with_a_draft(
    case: str, llama: Any, draft: Any
) -> None:
    host = make_host()
    add(host, "e", llama, draft_model=None if case == "no_draft" else draft, sparse_threshold=3 * B)
    length = 3 * B if case == "below_threshold" else 6 * B
    result = serve(host, "e", contract_tokens(length, seed=10), sparse=case != "not_asked")
    assert result.route == "dense" and result.draft_tokens == 0


def test_sparse_request_runs_alone(llama: Any, draft: Any, recorder: EventRecorder) -> None:
    host = make_host(recorder)
    engine = add(host, "e", llama, draft_model=draft, sparse_threshold=2 * B)
    live_at_admission: dict[str, bool] = {}

    class Probe:
        @hookimpl
        def request_admitted(self, event: RequestAdmitted) -> None:
            live_at_admission[event.request_id] = engine.sparse_route_live()

    host.pm.register(Probe())
    first = host.submit("e", contract_tokens(40, seed=11), max_tokens=6)
    sparse = host.submit("e", contract_tokens(5 * B, seed=12), sparse=True)
    after = host.submit("e", contract_tokens(40, seed=13))
    host.run_until_idle()
    order = [(e.hook, e.request_id) for e in recorder.snapshot() if e.request_id]
    assert order.index(("request_departed", first)) < order.index(("request_admitted", sparse))
    assert order.index(("request_departed", sparse)) < order.index(("request_admitted", after))
    assert live_at_admission == {first: False, sparse: True, after: False}
    assert not engine.sparse_route_live()


# -- queues, aborts, departures --------------------------------------------------------


def test_abort_is_applied_by_the_next_step_and_departure_by_a_later_one(
    llama: Any, recorder: EventRecorder
) -> None:
    host = make_host(recorder)
    engine = add(host, "e", llama)
    rid = host.submit("e", contract_tokens(40, seed=14))
    host.abort(rid)
    assert recorder.hooks_for(rid) == ["request_arrived"]
    engine.step()
    assert recorder.hooks_for(rid) == ["request_arrived", "request_aborted"]
    assert rid in engine.in_flight()
    engine.step()
    assert recorder.hooks_for(rid) == ["request_arrived", "request_aborted", "request_departed"]
    result = host.result(rid)
    assert result.reason == DepartureReason.ABORTED and result.route == "none"
    assert not engine.has_requests()


def test_finished_request_departs_one_step_later_and_keeps_its_references_until_then(
    llama: Any, recorder: EventRecorder
) -> None:
    host = make_host(recorder)
    engine = add(host, "e", llama)
    prompt = contract_tokens(3 * B, seed=15)
    serve(host, "e", prompt)
    rid = host.submit("e", prompt + [1, 2], max_tokens=1)
    engine.step()  # admitted, prefilled, first token: finished
    assert "request_departed" not in recorder.hooks_for(rid)
    assert set(host.outstanding_refs()["e"]) == {rid}
    with pytest.raises(KeyError):
        host.result(rid)
    engine.step()
    assert recorder.hooks_for(rid)[-1] == "request_departed"
    assert host.outstanding_refs()["e"] == {}
    assert host.result(rid).cached_tokens == 3 * B


def test_request_aborted_mid_prefill_gives_back_its_references(llama: Any) -> None:
    host = make_host()
    engine = add(host, "e", llama, prefill_step=16)
    prompt = contract_tokens(3 * B, seed=16)
    serve(host, "e", prompt)
    rid = host.submit("e", prompt + contract_tokens(100, seed=17), max_tokens=4)
    engine.step()
    engine.step()
    assert host.leaked() == {"e": {rid: {0: 1, 1: 1, 2: 1}}}
    host.abort(rid)
    host.run_until_idle()
    result = host.result(rid)
    assert result.reason == DepartureReason.ABORTED and result.output_tokens == ()
    assert result.route == "dense" and 0 < result.prefilled_tokens < 100
    assert host.leaked() == {}


def test_unknown_or_repeated_aborts_are_logged_once_and_ignored(
    llama: Any, caplog: pytest.LogCaptureFixture, recorder: EventRecorder
) -> None:
    host = make_host(recorder)
    add(host, "e", llama)
    rid = serve(host, "e", contract_tokens(20, seed=18)).request_id
    with caplog.at_level(logging.WARNING):
        for _ in range(3):
            host.abort("no-such-request")
            host.engines["e"].abort("also-unknown")
            host.abort(rid)  # already departed
        host.run_until_idle()
    messages = [r.getMessage() for r in caplog.records]
    assert sum("no-such-request" in m for m in messages) == 1
    assert sum("also-unknown" in m for m in messages) == 1
    assert recorder.named("request_aborted") == []
    assert len(recorder.named("request_departed")) == 1


def test_abort_all_and_fail_all_end_every_request_with_their_reason(
    llama: Any, recorder: EventRecorder
) -> None:
    host = make_host(recorder)
    engine = add(host, "e", llama)
    aborted = [host.submit("e", contract_tokens(40, seed=s), max_tokens=20) for s in (19, 20)]
    engine.step()
    host.abort_all("e")
    host.run_until_idle()
    failed = [host.submit("e", contract_tokens(40, seed=s), max_tokens=20) for s in (21, 22)]
    host.fail_all("e", error="device lost")
    host.run_until_idle()
    assert [host.result(r).reason for r in aborted] == [DepartureReason.ABORTED] * 2
    assert [host.result(r).reason for r in failed] == [DepartureReason.FAILED] * 2
    assert [e.payload for e in recorder.named("engine_failed_all")] == ["device lost"]
    assert len(recorder.named("engine_aborted_all")) == 1
    assert host.leaked() == {}


def test_an_error_in_model_work_fails_the_requests_instead_of_raising(
    llama: Any, recorder: EventRecorder
) -> None:
    host = make_host(recorder)
    engine = add(host, "e", llama)
    prompt = contract_tokens(3 * B, seed=23)
    serve(host, "e", prompt)

    class Broken:
        layers = llama[0].layers  # builds caches, fails in the forward pass

        def __call__(self, *args: Any, **kwargs: Any) -> Any:
            raise RuntimeError("kernel fault")

    engine.model.model = Broken()
    rid = host.submit("e", prompt + [5])
    host.run_until_idle()
    assert host.result(rid).reason == DepartureReason.FAILED
    assert "kernel fault" in recorder.named("engine_failed_all")[0].payload
    assert host.leaked() == {}
    engine.model.model = llama[0]
    assert serve(host, "e", prompt + [5]).cached_tokens == 3 * B


def test_a_failing_plugin_never_breaks_serving(llama: Any) -> None:
    class Broken:
        @hookimpl
        def request_arrived(self, event: Any) -> None:
            raise ValueError("plugin bug")

        @hookimpl
        def request_departed(self, event: Any) -> None:
            raise ValueError("plugin bug")

        @hookimpl
        def engine_idle_step(self, event: IdleStep) -> bool:
            raise ValueError("plugin bug")

    host = make_host(Broken())
    add(host, "e", llama)
    assert len(serve(host, "e", contract_tokens(30, seed=24)).output_tokens) == 8
    assert host.drive_idle() == 1
    assert host.emitter.errors == 3


def test_bad_submissions_are_refused_up_front(llama: Any) -> None:
    host = make_host()
    add(host, "e", llama)
    with pytest.raises(ValueError):
        host.submit("e", [])
    host.submit("e", [1, 2, 3], request_id="dup")
    with pytest.raises(ValueError):
        host.submit("e", [1, 2, 3], request_id="dup")
    with pytest.raises(KeyError):
        host.submit("nope", [1, 2, 3])
    host.run_until_idle()
    assert host.leaked() == {}


# -- reset, shutdown, unload -----------------------------------------------------------


def test_reset_drops_requests_and_only_a_deep_reset_empties_the_cache(
    llama: Any, recorder: EventRecorder
) -> None:
    host = make_host(recorder)
    engine = add(host, "e", llama)
    prompt = contract_tokens(3 * B + 1, seed=25)
    serve(host, "e", prompt)
    rid = host.submit("e", prompt + [9], max_tokens=20)
    engine.step()
    host.reset("e")
    assert host.result(rid).reason == DepartureReason.ABORTED
    assert engine.prefix_cache.stored_tokens(prompt) == 3 * B
    host.reset("e", deep=True)
    assert engine.prefix_cache.stored_tokens(prompt) == 0 and engine.pool.used_blocks == 0
    assert [e.payload for e in recorder.named("engine_reset")] == [False, True]
    assert not engine.has_requests() and host.leaked() == {}


def test_shutdown_departs_requests_refuses_new_ones_and_unload_frees_the_cache(
    llama: Any, recorder: EventRecorder
) -> None:
    host = make_host(recorder)
    engine = add(host, "e", llama, model_id="m/1")
    serve(host, "e", contract_tokens(3 * B, seed=26))
    rid = host.submit("e", contract_tokens(40, seed=27))
    host.shutdown("e")
    assert host.result(rid).reason == DepartureReason.ABORTED
    with pytest.raises(RuntimeError):
        host.submit("e", [1, 2, 3])
    host.unload("e")
    host.unload("e")
    hooks = [e.hook for e in recorder.snapshot() if e.request_id is None]
    assert hooks == ["engine_attached", "engine_shutdown", "model_unloaded"]
    assert recorder.named("model_unloaded")[0].payload == "m/1"
    assert engine.pool.used_blocks == 0 and engine.model.model is None
    assert host.run_until_idle() == 0 and host.drive_idle() == 0


def test_control_calls_for_unknown_engines_are_ignored(llama: Any) -> None:
    host = make_host()
    for call in (host.abort_all, host.reset, host.shutdown, host.unload):
        call("nope")
    host.fail_all("nope", error="x")


# -- clock, idle ---------------------------------------------------------------------------


def test_time_to_first_token_uses_the_injected_clock(llama: Any) -> None:
    ticks = iter(range(100))
    host = make_host()
    add(host, "e", llama, clock=lambda: float(next(ticks)))
    # The clock is read at submission (0), admission (1) and the first token (2).
    assert serve(host, "e", contract_tokens(100, seed=28)).ttft_s == 2.0


def test_idle_steps_count_up_per_engine_and_reset_after_work(llama: Any) -> None:
    seen: list[tuple[str, int]] = []

    class Idle:
        @hookimpl
        def engine_idle_step(self, event: IdleStep) -> bool | float | None:
            seen.append((event.engine_id, event.consecutive))
            if event.engine_id == "a":
                return event.consecutive < 3 or 2.5
            return 0.75

    host = make_host(Idle())
    a, b = add(host, "a", llama), add(host, "b", llama)
    assert host.drive_idle() == 4
    assert sorted(seen) == [("a", 1), ("a", 2), ("a", 3), ("b", 1)]
    assert host.last_idle_retry_after == 0.75
    assert (a.step_count, b.step_count) == (0, 0)
    serve(host, "a", [1, 2, 3])
    seen.clear()
    host.drive_idle()
    assert sorted(seen) == [("a", 1), ("a", 2), ("a", 3), ("b", 2)]


def test_drive_idle_skips_engines_with_work_and_respects_max_steps(llama: Any) -> None:
    class Always:
        @hookimpl
        def engine_idle_step(self, event: IdleStep) -> bool:
            return True

    host = make_host(Always())
    add(host, "a", llama)
    add(host, "b", llama)
    host.submit("b", [1, 2, 3])
    assert host.drive_idle(max_steps=7) == 7
    assert host.engines["a"].idle_steps_offered == 7
    assert host.engines["b"].idle_steps_offered == 0


# -- several engines, threads ---------------------------------------------------------------


def test_engines_share_a_loaded_model_but_not_their_caches(tiny_llama_dir: Path) -> None:
    host = make_host()
    a = host.add_engine("a", tiny_llama_dir, block_size=B)
    b = host.add_engine("b", tiny_llama_dir, block_size=B)
    assert a.model.model is b.model.model
    prompt = contract_tokens(3 * B, seed=29)
    serve(host, "a", prompt)
    assert serve(host, "b", prompt + [1]).cached_tokens == 0
    assert serve(host, "a", prompt + [1]).cached_tokens == 3 * B
    assert host.outstanding_refs() == {"a": {}, "b": {}}


@pytest.fixture
def threaded_host(llama: Any) -> Iterator[MockHost]:
    host = make_host()
    add(host, "a", llama)
    add(host, "b", llama)
    yield host
    host.stop()


def test_threaded_engines_serve_what_the_synchronous_host_serves(
    threaded_host: MockHost, llama: Any
) -> None:
    prompts = [contract_tokens(60 + 10 * i, seed=30 + i) for i in range(4)]
    sync = make_host()
    add(sync, "a", llama)
    expected = [serve(sync, "a", p).output_tokens for p in prompts]
    threaded_host.start()
    rids = [threaded_host.submit("ab"[i % 2], p) for i, p in enumerate(prompts)]
    got = [threaded_host.wait(r, timeout=60).output_tokens for r in rids]
    threaded_host.stop()
    assert got == expected
    assert threaded_host.leaked() == {}


def test_threaded_control_calls_run_on_the_engine_thread(threaded_host: MockHost) -> None:
    threads: list[str] = []

    class Where:
        @hookimpl
        def engine_reset(self, engine_id: str, deep: bool) -> None:
            threads.append(threading.current_thread().name)

        @hookimpl
        def engine_shutdown(self, engine_id: str) -> None:
            threads.append(threading.current_thread().name)

    threaded_host.pm.register(Where())
    threaded_host.start()
    threaded_host.reset("a", deep=True)
    threaded_host.shutdown("b")
    assert threads == ["mock-engine-a", "mock-engine-b"]
    with pytest.raises(RuntimeError):
        threaded_host.run_until_idle()
    threaded_host.stop()
    assert threaded_host.run_until_idle() == 0


def test_threaded_loop_offers_idle_steps_again_after_the_asked_delay(threaded_host: MockHost) -> None:
    offered: list[int] = []
    again = threading.Event()

    class Later:
        @hookimpl
        def engine_idle_step(self, event: IdleStep) -> float | None:
            if event.engine_id != "a":
                return None
            offered.append(event.consecutive)
            if len(offered) == 1:
                return 0.01
            again.set()
            return None

    threaded_host.pm.register(Later())
    threaded_host.start()
    assert again.wait(30)
    threaded_host.stop()
    assert offered == [1, 2]
    assert threaded_host.engines["a"].step_count == 0
