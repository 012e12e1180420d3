"""The host contract suite: what every host (or host adapter) must do for the plugin.

How to use it, in the style of pandas' extension tests or zarr's ``StoreTests``:

1. Write a small adapter that satisfies :class:`ContractHost` for your host: one engine
   under test, driven synchronously from the test's thread (and, if you can, threaded).
2. Subclass :class:`HostContractSuite` (or only the parts you want: :class:`EventOrderTests`,
   :class:`ReferenceBalanceTests`, :class:`WholeBlockStoreTests`, :class:`PublicationTests`,
   :class:`IdleTests`, :class:`ThreadedTests`, :class:`LifecycleBalanceTests`,
   :class:`PrefixLookupTests`) in a test module and give it a
   ``contract_host`` fixture that returns a fresh adapter and closes it afterwards::

       from mlx_recovery_plugin.testing.contract import HostContractSuite

       class TestMyHostContract(HostContractSuite):
           @pytest.fixture
           def contract_host(self, tiny_llama_dir):
               host = MyContractHost(tiny_llama_dir, block_size=64)
               yield host
               host.close()

Capability flags on the adapter skip what a host cannot do, each with its reason
(:data:`FLAG_REASONS`); flags added later default to what every host had before
(:data:`FLAG_DEFAULTS`). The suite registers its own
plugins (an :class:`EventRecorder`) on the adapter's plugin manager and unregisters them
afterwards. Prompts use token ids below 256 (the tiny models' byte vocabulary).

The module is also an opt-in pytest plugin (``pytest -p mlx_recovery_plugin.testing.contract``)
that provides the ``event_recorder`` fixture to any test that has a ``contract_host`` fixture,
and :func:`contract_tokens` for prompts.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Iterator, Sequence
from typing import Any

import pytest

from ..events import DepartureReason, IdleStep, Route
from ..hookspecs import hookimpl
from ..ports import HOLDER_PREFIX, StoreUnit, store_unit
from ..state import BlockState
from .contract_host_protocol import ContractHost, ContractResult, ThreadedContractHost
from .recorder import EventRecorder, IdleAnswer, RecordedEvent, contract_tokens, registered, stored_tokens

#: Flags added after the first adapters were written: a host that does not set one has
#: what it names (the checks ran on every host before the flag existed), except
#: ``supports_prefix_lookup``, which only an adopter's host has.
FLAG_DEFAULTS: dict[str, bool] = {
    "supports_reset": True,
    "supports_publication": True,
    "supports_idle_steps": True,
    "supports_prefix_lookup": False,
    "serves_sparse_one_at_a_time": False,
    "tells_of_lookups": False,
}

#: Why a check is skipped, by the flag it needs.
FLAG_REASONS: dict[str, str] = {
    "supports_sparse_route": "no sparse route: nothing is served sparsely, nothing to recover",
    "supports_abort_all": "the host has no abort of every request",
    "supports_fail_all": "the host has no fail-all path",
    "supports_threads": "the adapter cannot run the host's engine loop on a thread of its own",
    "supports_reset": "the host has no scheduler reset",
    "supports_publication": "the host takes no published blocks (it has no sparse route to recover from)",
    "supports_idle_steps": "the host offers no idle steps (nothing runs in the background there)",
    "supports_prefix_lookup": "the host asks no prefix_lookup (no partial-prefix adopter on it)",
    "serves_sparse_one_at_a_time": "the host batches sparse prefills, so none waits behind another",
    "tells_of_lookups": "the host calls no prefix_lookup_due (recovery publishes without waiting for a return)",
}


# -- pytest plugin fixtures ------------------------------------------------------------


@pytest.fixture
def event_recorder(contract_host: ContractHost) -> Iterator[EventRecorder]:
    """An :class:`EventRecorder` registered on the host under test for one test."""
    # The engine was attached before the recorder existed; give it the port directly.
    recorder = EventRecorder()
    recorder.engines[contract_host.engine.engine_id] = contract_host.engine
    with registered(contract_host.plugin_manager, recorder):
        yield recorder


# -- the suite -------------------------------------------------------------------------


class _ContractBase:
    """Shared fixtures and helpers; implementers supply ``contract_host``."""

    @pytest.fixture
    def contract_host(self) -> ContractHost:  # pragma: no cover - always overridden
        pytest.skip("the implementer supplies a contract_host fixture")

    @pytest.fixture
    def event_recorder(self, contract_host: ContractHost) -> Iterator[EventRecorder]:
        recorder = EventRecorder()
        recorder.engines[contract_host.engine.engine_id] = contract_host.engine
        with registered(contract_host.plugin_manager, recorder):
            yield recorder

    # helpers
    @staticmethod
    def prompt(host: ContractHost, blocks: float, seed: int = 0) -> list[int]:
        """A prompt of ``blocks`` cache blocks (a fraction makes a partial last block)."""
        return contract_tokens(int(blocks * host.block_size), seed)

    @staticmethod
    def serve(
        host: ContractHost, prompt: Sequence[int], **kwargs: Any
    ) -> tuple[str, ContractResult]:
        rid = host.submit(prompt, **kwargs)
        host.run_until_idle()
        return rid, host.result(rid)

    @staticmethod
    def assert_no_leaks(host: ContractHost) -> None:
        assert not host.outstanding_refs(), f"references left behind: {host.outstanding_refs()}"

    @staticmethod
    def whole_entries(host: ContractHost) -> bool:
        """The host's prefix cache keeps whole entries (``StoreUnit.WHOLE_ENTRY``)."""
        return store_unit(host.engine.prefix_cache) is StoreUnit.WHOLE_ENTRY

    @staticmethod
    def has(host: ContractHost, flag: str) -> bool:
        """A capability flag; one the adapter does not set takes its default
        (:data:`FLAG_DEFAULTS`), so adapters written before a flag existed keep their checks."""
        return bool(getattr(host, flag, FLAG_DEFAULTS.get(flag, False)))

    @classmethod
    def require(cls, host: ContractHost, flag: str) -> None:
        if not cls.has(host, flag):
            reason = FLAG_REASONS.get(flag)
            pytest.skip(f"host does not have {flag}" + (f" ({reason})" if reason else ""))


class EventOrderTests(_ContractBase):
    """Every lifecycle event fires once, in the documented order, with the documented
    arguments."""

    def test_dense_request_arrives_is_admitted_then_departs_once_each(
        self, contract_host: ContractHost, event_recorder: EventRecorder
    ) -> None:
        host = contract_host
        prompt = self.prompt(host, 1.5, seed=1)
        rid, result = self.serve(host, prompt)
        assert event_recorder.hooks_for(rid) == [
            "request_arrived", "request_admitted", "request_departed",
        ]
        arrived = event_recorder.one("request_arrived", rid)
        assert arrived.engine_id == host.engine.engine_id
        assert arrived.model_id == host.engine.model_id
        assert tuple(arrived.prompt_tokens) == tuple(prompt)
        admitted = event_recorder.one("request_admitted", rid)
        assert admitted.engine_id == host.engine.engine_id
        assert admitted.cached_tokens == result.cached_tokens
        departed = event_recorder.one("request_departed", rid)
        assert departed.engine_id == host.engine.engine_id
        assert departed.reason == DepartureReason.FINISHED

    def test_sparse_request_reports_its_served_range_between_admission_and_departure(
        self, contract_host: ContractHost, event_recorder: EventRecorder
    ) -> None:
        host = contract_host
        self.require(host, "supports_sparse_route")
        blocks = (host.sparse_threshold + host.block_size) / host.block_size + 1.5
        prompt = self.prompt(host, blocks, seed=2)
        rid, result = self.serve(host, prompt, sparse=True)
        assert event_recorder.hooks_for(rid) == [
            "request_arrived", "request_admitted", "sparse_route_served", "request_departed",
        ]
        served = event_recorder.one("sparse_route_served", rid)
        assert served.engine_id == host.engine.engine_id
        assert served.model_id == host.engine.model_id
        assert tuple(served.tokens) == tuple(prompt)
        assert served.served_start == result.cached_tokens
        assert served.served_end == len(prompt)

    def test_the_host_tells_of_each_lookup_after_arrival_and_before_admission(
        self, contract_host: ContractHost, event_recorder: EventRecorder
    ) -> None:
        """What recovery publishes at that moment is what the request restores."""
        host = contract_host
        self.require(host, "tells_of_lookups")
        prompt = self.prompt(host, 2.5, seed=13)
        rid, _result = self.serve(host, prompt, max_tokens=2)
        due = [(n, event, tokens) for n, event, tokens in event_recorder.lookups_due if event.request_id == rid]
        assert len(due) == 1
        before, event, tokens = due[0]
        assert event.engine_id == host.engine.engine_id and event.model_id == host.engine.model_id
        assert tokens == tuple(prompt)
        seq = {e.hook: e.seq for e in event_recorder.events if e.request_id == rid}
        assert seq["request_arrived"] < before <= seq["request_admitted"]

    def test_each_prefill_is_reported_once_with_its_route_cached_tokens_and_time(
        self, contract_host: ContractHost, event_recorder: EventRecorder
    ) -> None:
        """What recovery's publish policy learns the host's real costs from."""
        host = contract_host
        prompt = self.prompt(host, 2.5, seed=11)
        cold, _ = self.serve(host, prompt, max_tokens=4)
        longer = prompt + contract_tokens(host.block_size, 12)
        warm, warm_result = self.serve(host, longer, max_tokens=4)
        by_id = {event.request_id: event for event in event_recorder.prefills}
        assert sorted(e.request_id for e in event_recorder.prefills if e.request_id in (cold, warm)) == sorted([cold, warm])
        for rid, tokens in ((cold, prompt), (warm, longer)):
            event = by_id[rid]
            assert event.engine_id == host.engine.engine_id and event.model_id == host.engine.model_id
            assert tuple(event.tokens) == tuple(tokens)
            assert event.route is Route.DENSE and event.prefill_s >= 0
        assert by_id[cold].cached_tokens == 0
        assert by_id[warm].cached_tokens == warm_result.cached_tokens
        if host.supports_sparse_route:
            blocks = (host.sparse_threshold + host.block_size) / host.block_size + 1.5
            sparse, _ = self.serve(host, self.prompt(host, blocks, seed=13), sparse=True, max_tokens=4)
            (event,) = [e for e in event_recorder.prefills if e.request_id == sparse]
            assert event.route is Route.SPARSE

    def test_a_request_that_finishes_at_its_first_token_is_still_reported_prefilled(
        self, contract_host: ContractHost, event_recorder: EventRecorder
    ) -> None:
        """One token asked for (or an end of sequence at once): the request finishes in
        the step that prefilled it, and its prefill is reported all the same, once."""
        host = contract_host
        for seed in (31, 32, 33):
            rid, _ = self.serve(host, self.prompt(host, 2.5, seed=seed), max_tokens=1)
            events = [e for e in event_recorder.prefills if e.request_id == rid]
            assert len(events) == 1 and events[0].prefill_s >= 0, (seed, events)

    def test_a_sparse_prefill_is_timed_without_its_wait_behind_another(
        self, contract_host: ContractHost, event_recorder: EventRecorder
    ) -> None:
        """Two long prompts arrive together and the host serves their sparse prefills one
        after the other: each is reported at its own cost, so the two add up to no more
        than the time both took (timed from arrival, the second would count the first)."""
        host = contract_host
        self.require(host, "supports_sparse_route")
        self.require(host, "serves_sparse_one_at_a_time")
        blocks = (host.sparse_threshold + host.block_size) / host.block_size + 1.5
        started = time.perf_counter()
        ids = [host.submit(self.prompt(host, blocks, seed=seed), max_tokens=2, sparse=True) for seed in (21, 22)]
        host.run_until_idle()
        wall = time.perf_counter() - started
        events = [e for e in event_recorder.prefills if e.request_id in ids]
        assert sorted(e.request_id for e in events) == sorted(ids)
        assert all(e.route is Route.SPARSE and e.prefill_s is not None for e in events)
        assert sum(e.prefill_s for e in events) <= wall

    def test_prefills_run_side_by_side_are_each_charged_their_share(
        self, contract_host: ContractHost, event_recorder: EventRecorder
    ) -> None:
        """Three long prompts arrive together and the host prefills them in the same steps
        (oMLX admits them in one call and prefills each in turn; the mock host advances
        each by a chunk per step): each is reported at its share of those steps, so the
        three add up to no more than the time all took. Timed from admission, each would
        count the others' work as its own, and recovery would learn a sparse rerun three
        times as dear as it is."""
        host = contract_host
        started = time.perf_counter()
        ids = [host.submit(self.prompt(host, 6.5, seed=seed), max_tokens=2) for seed in (41, 42, 43)]
        host.run_until_idle()
        wall = time.perf_counter() - started
        events = [e for e in event_recorder.prefills if e.request_id in ids]
        assert sorted(e.request_id for e in events) == sorted(ids)
        assert all(e.route is Route.DENSE and e.prefill_s > 0 for e in events), events
        assert sum(e.prefill_s for e in events) <= wall, ([e.prefill_s for e in events], wall)

    def test_aborted_request_reports_abort_then_departs_aborted(
        self, contract_host: ContractHost, event_recorder: EventRecorder
    ) -> None:
        host = contract_host
        rid = host.submit(self.prompt(host, 2.5, seed=3), max_tokens=32)
        host.abort(rid)
        host.run_until_idle()
        hooks = event_recorder.hooks_for(rid)
        assert hooks[0] == "request_arrived"
        assert hooks[-2:] == ["request_aborted", "request_departed"]
        assert hooks.count("request_admitted") <= 1
        assert event_recorder.one("request_departed", rid).reason == DepartureReason.ABORTED

    def test_abort_of_an_unknown_request_is_ignored(
        self, contract_host: ContractHost, event_recorder: EventRecorder
    ) -> None:
        host = contract_host
        host.abort("no-such-request")
        host.run_until_idle()
        _, result = self.serve(host, self.prompt(host, 1.25, seed=4))
        assert len(result.output_tokens) > 0
        assert event_recorder.named("request_aborted") == []

    def test_abort_all_reports_once_and_every_request_departs_aborted(
        self, contract_host: ContractHost, event_recorder: EventRecorder
    ) -> None:
        host = contract_host
        self.require(host, "supports_abort_all")
        rids = [host.submit(self.prompt(host, 1.5, seed=s), max_tokens=16) for s in (5, 6)]
        host.abort_all()
        host.run_until_idle()
        assert len(event_recorder.named("engine_aborted_all")) == 1
        for rid in rids:
            assert event_recorder.one("request_departed", rid).reason == DepartureReason.ABORTED

    def test_fail_all_reports_the_error_and_every_request_departs_failed(
        self, contract_host: ContractHost, event_recorder: EventRecorder
    ) -> None:
        host = contract_host
        self.require(host, "supports_fail_all")
        rids = [host.submit(self.prompt(host, 1.5, seed=s), max_tokens=16) for s in (7, 8)]
        host.fail_all("injected failure")
        host.run_until_idle()
        failed = event_recorder.named("engine_failed_all")
        assert len(failed) == 1 and "injected failure" in failed[0].payload
        for rid in rids:
            assert event_recorder.one("request_departed", rid).reason == DepartureReason.FAILED

    def test_deep_reset_reports_once_and_forgets_stored_prefixes(
        self, contract_host: ContractHost, event_recorder: EventRecorder
    ) -> None:
        host = contract_host
        self.require(host, "supports_reset")
        prompt = self.prompt(host, 2.5, seed=9)
        self.serve(host, prompt)
        assert stored_tokens(host, prompt) > 0
        host.reset(deep=True)
        resets = event_recorder.named("engine_reset")
        assert [e.payload for e in resets] == [True]
        assert resets[0].engine_id == host.engine.engine_id
        assert stored_tokens(host, prompt) == 0

    def test_shutdown_then_unload_report_once_each_in_that_order(
        self, contract_host: ContractHost, event_recorder: EventRecorder
    ) -> None:
        host = contract_host
        engine_id, model_id = host.engine.engine_id, host.engine.model_id
        self.serve(host, self.prompt(host, 1.5, seed=10))
        host.unload()
        ending = ("engine_shutdown", "model_unloaded")
        hooks = [e.hook for e in event_recorder.snapshot() if e.hook in ending]
        assert hooks == ["engine_shutdown", "model_unloaded"]
        unloaded = event_recorder.named("model_unloaded")[0]
        assert (unloaded.engine_id, unloaded.payload) == (engine_id, model_id)


class ReferenceBalanceTests(_ContractBase):
    """Every block reference a request's fetch takes is given back."""

    def test_no_reference_outstanding_after_requests_sharing_prefixes(
        self, contract_host: ContractHost
    ) -> None:
        host = contract_host
        base = self.prompt(host, 2.5, seed=11)
        for extra in (0, 3, 17):
            self.serve(host, base + contract_tokens(extra, seed=12))
        self.assert_no_leaks(host)

    def test_no_reference_outstanding_after_aborts(self, contract_host: ContractHost) -> None:
        host = contract_host
        prompt = self.prompt(host, 2.5, seed=13)
        self.serve(host, prompt)
        early = host.submit(prompt + [1, 2, 3], max_tokens=32)
        late = host.submit(prompt + [4, 5, 6], max_tokens=32)
        host.abort(early)
        host.run_until_idle()
        rid = host.submit(prompt + [7], max_tokens=32)
        host.run_until_idle()
        host.abort(late)
        host.abort(rid)
        host.run_until_idle()
        self.assert_no_leaks(host)

    def test_no_reference_outstanding_after_abort_all_fail_all_and_reset(
        self, contract_host: ContractHost
    ) -> None:
        host = contract_host
        prompt = self.prompt(host, 2.5, seed=14)
        self.serve(host, prompt)
        if host.supports_abort_all:
            host.submit(prompt + [1], max_tokens=32)
            host.abort_all()
            host.run_until_idle()
        if host.supports_fail_all:
            host.submit(prompt + [2], max_tokens=32)
            host.fail_all("injected")
            host.run_until_idle()
        host.submit(prompt + [3], max_tokens=32)
        if self.has(host, "supports_reset"):
            host.reset(deep=False)
        host.run_until_idle()
        self.assert_no_leaks(host)


class WholeBlockStoreTests(_ContractBase):
    """What a request leaves in the prefix cache: whole blocks of its prompt only."""

    def test_stored_prefix_is_whole_blocks_of_the_prompt(self, contract_host: ContractHost) -> None:
        host = contract_host
        prompt = self.prompt(host, 2.5, seed=15)
        self.serve(host, prompt)
        stored = stored_tokens(host, prompt)
        whole = len(prompt) // host.block_size * host.block_size
        assert stored % host.block_size == 0
        assert 0 < stored <= whole
        self.assert_no_leaks(host)

    def test_second_request_with_the_same_prefix_restores_its_whole_blocks(
        self, contract_host: ContractHost
    ) -> None:
        host = contract_host
        prompt = self.prompt(host, 2.5, seed=16)
        _, first = self.serve(host, prompt)
        _, second = self.serve(host, prompt + contract_tokens(5, seed=17))
        assert first.cached_tokens == 0
        if self.whole_entries(host):
            # A whole entry is the prompt as stored, not cut at a block boundary.
            assert second.cached_tokens >= 2 * host.block_size
        else:
            assert second.cached_tokens == 2 * host.block_size

    def test_sparse_route_stores_nothing(self, contract_host: ContractHost) -> None:
        host = contract_host
        self.require(host, "supports_sparse_route")
        blocks = (host.sparse_threshold + host.block_size) / host.block_size + 1.5
        prompt = self.prompt(host, blocks, seed=18)
        _, first = self.serve(host, prompt, sparse=True)
        assert stored_tokens(host, prompt) == 0
        _, again = self.serve(host, prompt + [1, 2, 3], sparse=True)
        assert (first.cached_tokens, again.cached_tokens) == (0, 0)
        self.assert_no_leaks(host)


class IdleTests(_ContractBase):
    """Idle means idle: no step without work; the idle hook only while queues are empty,
    and only while some implementation asks for more."""

    def test_serving_offers_no_idle_step(
        self, contract_host: ContractHost, event_recorder: EventRecorder
    ) -> None:
        host = contract_host
        self.serve(host, self.prompt(host, 1.5, seed=19))
        assert event_recorder.idle_steps() == []

    def test_idle_host_never_steps_and_offers_one_idle_step_when_nobody_asks(
        self, contract_host: ContractHost, event_recorder: EventRecorder
    ) -> None:
        host = contract_host
        self.require(host, "supports_idle_steps")
        self.serve(host, self.prompt(host, 1.5, seed=20))
        steps = host.step_count()
        assert host.drive_idle(max_steps=50) == 1
        assert host.step_count() == steps
        assert event_recorder.queues_empty_at_idle == [True]

    def test_idle_steps_continue_while_asked_and_count_up(
        self, contract_host: ContractHost, event_recorder: EventRecorder
    ) -> None:
        host = contract_host
        self.require(host, "supports_idle_steps")
        event_recorder.idle_answer = lambda step: step.consecutive < 4 or None
        steps = host.step_count()
        assert host.drive_idle(max_steps=50) == 4
        assert [s.consecutive for s in event_recorder.idle_steps()] == [1, 2, 3, 4]
        assert all(event_recorder.queues_empty_at_idle)
        assert host.step_count() == steps

    def test_a_delay_answer_ends_the_idle_run(
        self, contract_host: ContractHost, event_recorder: EventRecorder
    ) -> None:
        host = contract_host
        self.require(host, "supports_idle_steps")
        event_recorder.idle_answer = lambda step: 0.5
        assert host.drive_idle(max_steps=50) == 1

    def test_work_resets_the_idle_count(
        self, contract_host: ContractHost, event_recorder: EventRecorder
    ) -> None:
        host = contract_host
        self.require(host, "supports_idle_steps")
        event_recorder.idle_answer = lambda step: step.consecutive < 2 or None
        host.drive_idle(max_steps=50)
        self.serve(host, self.prompt(host, 1.25, seed=21))
        host.drive_idle(max_steps=50)
        assert [s.consecutive for s in event_recorder.idle_steps()] == [1, 2, 1, 2]

    def test_an_arrival_stops_idle_steps_at_once(
        self, contract_host: ContractHost, event_recorder: EventRecorder
    ) -> None:
        host = contract_host
        self.require(host, "supports_idle_steps")
        arrived: list[str] = []

        def arrive_then_ask_for_more(step: IdleStep) -> IdleAnswer:
            if not arrived:
                arrived.append(host.submit(self.prompt(host, 1.25, seed=22)))
            return True

        event_recorder.idle_answer = arrive_then_ask_for_more
        assert host.drive_idle(max_steps=50) == 1
        event_recorder.idle_answer = None
        host.run_until_idle()
        assert len(host.result(arrived[0]).output_tokens) > 0


    def test_an_idle_host_takes_no_step(self, contract_host: ContractHost) -> None:
        """Whether or not it offers idle steps: once served, nothing steps by itself."""
        host = contract_host
        self.serve(host, self.prompt(host, 1.5, seed=40))
        steps = host.step_count()
        time.sleep(0.05)  # a host with a live engine thread of its own must stay still
        assert host.step_count() == steps


class ThreadedTests(_ContractBase):
    """The real engine loop on its own thread: serves arrivals, never steps while idle."""

    def test_engine_thread_serves_then_stays_idle(
        self, contract_host: ContractHost, event_recorder: EventRecorder
    ) -> None:
        host = contract_host
        self.require(host, "supports_threads")
        self.require(host, "supports_idle_steps")
        assert isinstance(host, ThreadedContractHost)
        went_idle = threading.Event()
        served: list[str] = []

        def note_idle(step: IdleStep) -> IdleAnswer:
            if served:
                went_idle.set()
            return None

        event_recorder.idle_answer = note_idle
        host.start()
        try:
            rid = host.submit(self.prompt(host, 1.5, seed=23))
            served.append(rid)
            result = host.wait(rid, 60.0)
            assert went_idle.wait(60.0)
            steps = host.step_count()
            offered = len(event_recorder.idle_steps())
            time.sleep(0.05)  # a window in which an idle host must do nothing at all
        finally:
            host.stop()
        assert len(result.output_tokens) > 0
        assert host.step_count() == steps
        assert len(event_recorder.idle_steps()) == offered
        assert all(event_recorder.queues_empty_at_idle)


def dense_blocks(host: ContractHost, tokens: Sequence[int], n_blocks: int) -> list[BlockState]:
    """Blocks ``0 .. n_blocks - 1`` of ``tokens``, prefilled densely with the engine's own
    model outside the host (what recovery's runner publishes). Engine thread only."""
    import mlx.core as mx

    from ..kvcodec import blocks_from_cache, cache_arrays

    size = host.block_size
    handle = host.engine.model
    cache = handle.make_cache()
    handle.model(mx.array(list(tokens[: n_blocks * size]))[None], cache=cache)
    mx.eval(cache_arrays(cache))
    blocks = blocks_from_cache(cache, 0, n_blocks, size, origin="recovery")
    mx.eval([a for b in blocks for a in b.arrays()])
    return blocks


class PublicationTests(_ContractBase):
    """What recovery stores through the port is what the host's next lookup restores:
    paged hosts get the new trailing blocks, whole-entry hosts one entry for the prefix."""

    def test_published_prefix_is_restored_by_the_next_request_and_nothing_stays_taken(
        self, contract_host: ContractHost
    ) -> None:
        from ..recovery.publication import publish

        host = contract_host
        self.require(host, "supports_publication")
        size = host.block_size
        prompt = self.prompt(host, 3.5, seed=24)
        blocks = dense_blocks(host, prompt, 3)
        cache = host.engine.prefix_cache
        ids = iter(range(1, 100))

        def holder(kind: str) -> str:
            return f"{HOLDER_PREFIX}:contract:{kind}:{next(ids)}"

        first = publish(cache, prompt, blocks[:1], size, holder_id=holder("store"), probe_id=holder("probe"))
        second = publish(cache, prompt, blocks[1:], size, holder_id=holder("store"), probe_id=holder("probe"))
        assert (first.boundary, second.boundary) == (size, 3 * size)
        assert stored_tokens(host, prompt) == 3 * size
        self.assert_no_leaks(host)
        _, result = self.serve(host, prompt + contract_tokens(3, seed=25))
        assert result.cached_tokens >= 3 * size
        self.assert_no_leaks(host)

    def test_publication_on_a_prefix_the_host_lost_is_refused(self, contract_host: ContractHost) -> None:
        from ..recovery.publication import PublicationError, publish

        host = contract_host
        self.require(host, "supports_publication")
        size = host.block_size
        prompt = self.prompt(host, 3.5, seed=26)
        blocks = dense_blocks(host, prompt, 3)
        cache = host.engine.prefix_cache
        with pytest.raises(PublicationError):
            publish(cache, prompt, blocks[2:], size, holder_id=f"{HOLDER_PREFIX}:c:store:1",
                    probe_id=f"{HOLDER_PREFIX}:c:probe:2")
        assert stored_tokens(host, prompt) == 0
        self.assert_no_leaks(host)


class _Raising:
    """A plugin that raises in every lifecycle hook (what a broken third party does)."""

    def __init__(self) -> None:
        self.calls = 0

    def _raise(self) -> None:
        self.calls += 1
        raise RuntimeError("a broken plugin")

    @hookimpl
    def request_arrived(self, event: Any) -> None:
        self._raise()

    @hookimpl
    def request_admitted(self, event: Any) -> None:
        self._raise()

    @hookimpl
    def request_prefilled(self, event: Any) -> None:
        self._raise()

    @hookimpl
    def request_departed(self, event: Any) -> None:
        self._raise()

    @hookimpl
    def request_aborted(self, engine_id: str, request_id: str) -> None:
        self._raise()

    @hookimpl
    def prefix_lookup(self, lookup: Any) -> None:
        self._raise()


class LifecycleBalanceTests(_ContractBase):
    """Every arrival departs exactly once, and a plugin's error never reaches the host."""

    def test_every_arrival_departs_once_served_or_aborted(
        self, contract_host: ContractHost, event_recorder: EventRecorder
    ) -> None:
        host = contract_host
        prompt = self.prompt(host, 2.5, seed=41)
        self.serve(host, prompt)
        kept = host.submit(prompt + contract_tokens(9, seed=42), max_tokens=4)
        dropped = host.submit(prompt + contract_tokens(9, seed=43), max_tokens=32)
        host.abort(dropped)
        host.run_until_idle()
        arrived = [str(e.request_id) for e in event_recorder.named("request_arrived")]
        departed = [str(e.request_id) for e in event_recorder.named("request_departed")]
        assert kept in arrived and dropped in arrived
        assert sorted(arrived) == sorted(departed)
        self.assert_no_leaks(host)

    def test_a_plugin_that_raises_in_every_hook_costs_the_host_nothing(
        self, contract_host: ContractHost, event_recorder: EventRecorder
    ) -> None:
        host = contract_host
        prompt = self.prompt(host, 2.5, seed=44)
        self.serve(host, prompt, max_tokens=4)
        broken = _Raising()
        with registered(host.plugin_manager, broken):
            rid, again = self.serve(host, prompt[: 2 * host.block_size + 7] + contract_tokens(9, 45), max_tokens=4)
        assert broken.calls > 0
        assert len(again.output_tokens) > 0
        assert event_recorder.hooks_for(rid)[-1] == "request_departed"
        self.assert_no_leaks(host)


class PrefixLookupTests(_ContractBase):
    """A host with a partial-prefix adopter asks ``prefix_lookup`` where its own lookup
    cannot reuse a stored entry's shared blocks, with the documented fields."""

    def test_a_partial_match_the_host_cannot_reuse_asks_one_lookup(
        self, contract_host: ContractHost, event_recorder: EventRecorder
    ) -> None:
        host = contract_host
        self.require(host, "supports_prefix_lookup")
        size = host.block_size
        prompt = self.prompt(host, 3.5, seed=46)
        self.serve(host, prompt)
        before = len(event_recorder.lookups)
        shared = 2 * size + size // 3
        rid, result = self.serve(host, prompt[:shared] + contract_tokens(size, seed=47))
        lookups = event_recorder.lookups[before:]
        assert len(lookups) == 1
        (lookup,) = lookups
        assert lookup.engine_id == host.engine.engine_id
        assert lookup.request_id == rid
        assert lookup.block_size == size
        assert lookup.entry_tokens > shared
        assert 0 < lookup.matched_tokens <= shared
        assert result.cached_tokens <= shared and len(result.output_tokens) > 0
        self.assert_no_leaks(host)


class HostContractSuite(
    EventOrderTests, ReferenceBalanceTests, WholeBlockStoreTests, PublicationTests, IdleTests, ThreadedTests,
    LifecycleBalanceTests, PrefixLookupTests,
):
    """The whole host contract; subclass it and supply ``contract_host``."""


__all__ = [
    "FLAG_DEFAULTS",
    "FLAG_REASONS",
    "ContractHost",
    "ContractResult",
    "EventOrderTests",
    "EventRecorder",
    "HostContractSuite",
    "IdleAnswer",
    "IdleTests",
    "LifecycleBalanceTests",
    "PrefixLookupTests",
    "PublicationTests",
    "RecordedEvent",
    "ReferenceBalanceTests",
    "ThreadedContractHost",
    "ThreadedTests",
    "WholeBlockStoreTests",
    "contract_tokens",
    "dense_blocks",
    "event_recorder",
    "registered",
    "stored_tokens",
]
