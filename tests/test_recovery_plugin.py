"""The recovery plugin against the mock host with a real tiny model and the real runner:
off switches, an append-heavy session, foreground wins, cancellation, several jobs per
engine, budget and idle-step settings, status and the control channel."""

from __future__ import annotations

import os
import stat
import threading
import time
from collections import Counter
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any

import mlx.core as mx
import pytest

from mlx_recovery_plugin.plugins import make_plugin_manager
from mlx_recovery_plugin.recovery.control import request
from mlx_recovery_plugin.recovery.outcomes import Refusal
from mlx_recovery_plugin.recovery.plugin import RecoveryPlugin
from mlx_recovery_plugin.runner import SliceRunner
from mlx_recovery_plugin.settings import RecoverySettings
from mlx_recovery_plugin.testing.clock import FakeClock, TickingClock, random_tokens
from mlx_recovery_plugin.testing.host import MockHost

B = 64
STEP = 128
MODEL = "tiny"


# These rigs test publication mechanics on partial prefixes; the auto policy would hold
# a partial prefix under a next turn that stays sparse (see tests/test_costs.py).
def make_settings(**overrides: Any) -> RecoverySettings:
    values: dict[str, Any] = {
        "publish_policy": "always",
        "budget_pct": 50.0,
        "idle_steps": 2,
        "models": {MODEL: {"enabled": True}},
    }
    values.update(overrides)
    return RecoverySettings(**values)


class RecordingRunner:
    """The real runner, with every call recorded and a hook before each slice."""

    def __init__(self, inner: SliceRunner, rig: Rig) -> None:
        self.inner = inner
        self.rig = rig

    def begin(self, tokens: Sequence[int], prefix: Any) -> Any:
        live = self.inner.begin(tokens, prefix)
        self.rig.calls["begin"] += 1
        self.rig.begun.append((tuple(tokens), prefix.tokens if prefix is not None else 0))
        self.rig.open_lives.add(id(live))
        return live

    def advance(self, live: Any, end: int, should_stop: Callable[[], bool] | None = None, stop_grain: int | None = None) -> Any:
        self.rig.calls["advance"] += 1
        if self.rig.before_advance is not None:
            self.rig.before_advance(self.rig.calls["advance"])
        if self.rig.slice_cost is not None:
            self.rig.slice_cost(end - live.offset)
        outcome = self.inner.advance(live, end, should_stop, stop_grain)
        self.rig.outcomes.append(outcome)
        return outcome

    def discard(self, live: Any) -> None:
        self.rig.calls["discard"] += 1
        self.rig.open_lives.discard(id(live))
        self.inner.discard(live)


@dataclass
class Rig:
    host: MockHost
    plugin: RecoveryPlugin
    clock: FakeClock
    calls: Counter[str] = field(default_factory=Counter)
    begun: list[tuple[tuple[int, ...], int]] = field(default_factory=list)
    open_lives: set[int] = field(default_factory=set)
    outcomes: list[Any] = field(default_factory=list)
    before_advance: Callable[[int], None] | None = None  # gets the advance call's number
    slice_cost: Callable[[int], None] | None = None  # gets the slice's token count

    def serve(self, engine_id: str, prompt: Sequence[int], *, sparse: bool = True, max_tokens: int = 4):
        rid = self.host.submit(engine_id, prompt, sparse=sparse, max_tokens=max_tokens)
        self.host.run_until_idle()
        return self.host.result(rid)

    def engine_status(self, engine_id: str = "e") -> dict[str, Any]:
        return self.plugin.status()["engines"][engine_id]



@pytest.fixture(params=["paged", "entries"])
def cache_kind(request: pytest.FixtureRequest) -> str:
    """Every recovery test runs on both kinds of prefix cache: oMLX's paged blocks and
    rapid-mlx's whole entries."""
    return str(request.param)


@pytest.fixture
def make_rig(loaded, cache_kind):
    rigs: list[Rig] = []
    model, tokenizer, draft = loaded

    def make(
        settings: RecoverySettings | None = None,
        *,
        engines: Sequence[str] = ("e",),
        clock: FakeClock | None = None,
        host_clock: Any = None,
        **plugin_kw: Any,
    ) -> Rig:
        settings = settings or make_settings()
        clock = clock or FakeClock(1000.0)
        rig_box: list[Rig] = []

        def factory(handle: Any, block_size: int, interruptible: bool) -> RecordingRunner:
            return RecordingRunner(SliceRunner(handle, block_size, interruptible=interruptible), rig_box[0])

        plugin_kw.setdefault("control_socket", False)
        plugin = RecoveryPlugin(settings, clock=clock, runner_factory=factory, **plugin_kw)
        host = MockHost(make_plugin_manager([plugin], settings=settings, entry_points_too=False))
        rig = Rig(host, plugin, clock)
        rig_box.append(rig)
        for engine_id in engines:
            host.add_engine(
                engine_id, model=model, tokenizer=tokenizer, draft_model=draft, model_id=MODEL,
                block_size=B, prefill_step=STEP, sparse_threshold=16, cache_kind=cache_kind,
                **({"clock": host_clock} if host_clock is not None else {}),
            )
        rigs.append(rig)
        return rig

    yield make
    for rig in rigs:
        rig.plugin.close()
        assert rig.host.leaked() == {}
        assert rig.open_lives == set()


@pytest.fixture(scope="module")
def cold(loaded):
    """Dense results of a host that has never stored anything (a new engine per prompt)."""
    model, tokenizer, _ = loaded
    host = MockHost(make_plugin_manager([], settings=make_settings(), entry_points_too=False))
    made = iter(range(1_000_000))

    def run(prompt: Sequence[int], max_tokens: int = 4):
        engine_id = f"cold{next(made)}"
        host.add_engine(engine_id, model=model, tokenizer=tokenizer, block_size=B, prefill_step=STEP)
        rid = host.submit(engine_id, prompt, max_tokens=max_tokens)
        host.run_until_idle()
        return host.result(rid)

    return run


# -- recovery off ------------------------------------------------------------------------


@pytest.mark.parametrize(
    "settings",
    [
        make_settings(budget_pct=0.0),
        make_settings(models={}),
        make_settings(models={"another-model": {"enabled": True}}),
    ],
    ids=["budget-zero", "no-model-opted-in", "other-model-opted-in"],
)
def test_recovery_off_serves_no_job_and_stores_nothing(make_rig, settings) -> None:
    rig = make_rig(settings)
    engine = rig.host.engines["e"]
    prompt = random_tokens(1, 400)
    for _ in range(3):
        result = rig.serve("e", prompt)
        assert rig.host.drive_idle() == 1  # offered once, nothing asked for more
        prompt = prompt + list(result.output_tokens) + random_tokens(2, 50)
    assert result.cached_tokens == 0
    assert engine.prefix_cache.counters.stores == 0
    assert rig.calls == Counter()
    status = rig.engine_status()
    assert status["jobs"] == [] and status["counters"]["slices"] == 0


def test_recovery_off_still_tracks_arrivals_and_departures(make_rig) -> None:
    rig = make_rig(make_settings(budget_pct=0.0))
    rid = rig.host.submit("e", random_tokens(1, 100))
    assert rig.plugin.registry.foreground_active()
    rig.host.run_until_idle()
    assert not rig.plugin.registry.foreground_active()
    assert rig.host.result(rid).output_tokens


# -- the append-heavy session --------------------------------------------------------------


def test_seven_turn_sparse_session_keeps_the_reusable_prefix_up_with_the_conversation(make_rig, cold) -> None:
    rig = make_rig()
    prompt = random_tokens(10, 330)
    previous_len = 0
    for turn in range(7):
        result = rig.serve("e", prompt)
        assert result.route == "sparse"
        debt = len(prompt) - result.cached_tokens
        assert rig.engine_status()["debt"] == debt
        if turn > 0:
            appended = len(prompt) - previous_len
            assert result.cached_tokens > 0
            assert debt <= B + appended, f"turn {turn}: debt {debt}, appended {appended}"
        rig.host.drive_idle()
        status = rig.engine_status()
        assert status["jobs"] == []  # the whole served range was recovered
        assert rig.host.engines["e"].prefix_cache.stored_tokens(prompt) == len(prompt) // B * B
        previous_len = len(prompt)
        prompt = prompt + list(result.output_tokens) + random_tokens(100 + turn, 90)

    status = rig.engine_status()
    assert status["counters"]["faults"] == {}
    assert status["counters"]["tokens_recovered"] >= previous_len // B * B - 330 // B * B

    # A dense request restoring the recovered blocks answers exactly like a cold one.
    warm = rig.serve("e", prompt, sparse=False, max_tokens=6)
    assert warm.route == "dense" and warm.cached_tokens >= previous_len // B * B
    reference = cold(prompt, max_tokens=6)
    assert reference.cached_tokens == 0
    assert warm.output_tokens == reference.output_tokens
    assert mx.allclose(warm.first_logits, reference.first_logits, atol=1e-4).item()


def test_a_job_starts_from_the_prefix_the_host_already_has(make_rig) -> None:
    rig = make_rig()
    head = random_tokens(3, 256)
    rig.serve("e", head, sparse=False)  # the host stores 256 tokens itself
    prompt = head + random_tokens(4, 300)
    result = rig.serve("e", prompt)
    assert result.route == "sparse" and result.cached_tokens == 256
    rig.host.drive_idle()
    assert rig.begun[0][1] == 256  # the live state began on the host's prefix
    # 512 - 256 tokens: a one-block first slice (no rate measured yet), then 128-token ones
    assert [o.tokens_run for o in rig.outcomes] == [B, STEP, B]
    assert rig.engine_status()["counters"]["tokens_recovered"] == len(prompt) // B * B - 256


# -- foreground wins -----------------------------------------------------------------------


def test_arrival_during_a_slice_stops_it_and_the_job_resumes_from_its_committed_block(make_rig, cold) -> None:
    rig = make_rig()
    prompt = random_tokens(20, 700)
    rig.serve("e", prompt)
    arriving = random_tokens(21, 150)
    rids: list[str] = []

    def arrive_on_second_slice(n: int) -> None:
        if n == 2:
            rids.append(rig.host.submit("e", arriving, max_tokens=4))

    rig.before_advance = arrive_on_second_slice
    rig.host.drive_idle()
    status = rig.engine_status()
    assert rig.outcomes[1].interrupted and rig.outcomes[1].blocks == []
    assert status["counters"]["slices_interrupted"] == 1
    assert status["live_offset"] is None and rig.open_lives == set()
    (job,) = status["jobs"]
    assert job["committed"] == B  # the first (one-block) slice only; nothing of the stopped one
    assert status["last_refusal"] == "slice_interrupted"

    rig.before_advance = None
    rig.host.run_until_idle()
    assert rig.host.result(rids[0]).output_tokens == cold(arriving).output_tokens
    rig.host.drive_idle()
    assert rig.engine_status()["jobs"] == []
    assert rig.begun[-1][1] == B  # resumed from the committed block, fetched back
    assert rig.host.engines["e"].prefix_cache.stored_tokens(prompt) == 640


def test_status_says_how_long_a_request_arriving_during_a_slice_waited_for_it(make_rig) -> None:
    clock = FakeClock(1000.0)
    rig = make_rig(clock=clock)
    rig.serve("e", random_tokens(22, 700))

    def arrive_then_wait(n: int) -> None:
        if n == 2:
            rig.host.submit("e", random_tokens(23, 150), max_tokens=4)
            clock.advance(0.3)  # the layer the request waits behind

    rig.before_advance = arrive_then_wait
    rig.host.drive_idle()
    counters = rig.engine_status()["counters"]
    assert counters["slices"] == 2 and counters["slices_interrupted"] == 1
    assert counters["arrival_waits"] == 1, "the first slice had no request waiting"
    assert counters["arrival_wait_seconds_max"] == pytest.approx(0.3)
    assert counters["arrival_wait_seconds"] == pytest.approx(0.3)
    assert counters["arrival_wait_seconds_max_by_phase"] == {"slice": pytest.approx(0.3)}
    exported = rig.plugin.counters()
    assert exported["mlx_recovery_arrival_waits_total:e"] == 1
    assert exported["mlx_recovery_arrival_wait_seconds_total:e"] == pytest.approx(0.3)


def test_two_requests_arriving_during_one_slice_each_count_their_own_wait(make_rig) -> None:
    clock = FakeClock(1000.0)
    rig = make_rig(clock=clock)
    rig.serve("e", random_tokens(24, 700))

    def two_arrive(n: int) -> None:
        if n == 2:
            rig.host.submit("e", random_tokens(25, 150), max_tokens=4)
            clock.advance(0.2)
            rig.host.submit("e", random_tokens(26, 150), max_tokens=4)
            clock.advance(0.1)  # the rest of the layer both wait behind

    rig.before_advance = two_arrive
    rig.host.drive_idle()
    counters = rig.engine_status()["counters"]
    assert counters["slices_interrupted"] == 1
    assert counters["arrival_waits"] == 2
    assert counters["arrival_wait_seconds_max"] == pytest.approx(0.3), "the first request waited longest"
    assert counters["arrival_wait_seconds"] == pytest.approx(0.4)


def test_admission_retires_the_live_state_before_the_request_runs(make_rig) -> None:
    rig = make_rig()
    engine = rig.host.engines["e"]
    rig.serve("e", random_tokens(30, 700))
    engine.offer_idle_step()
    engine.offer_idle_step()  # one slice; the live state stays for the next one
    assert len(rig.open_lives) == 1
    rig.serve("e", random_tokens(31, 100), sparse=False)
    assert rig.open_lives == set()
    assert rig.calls["advance"] == 1


def test_a_departure_the_host_lost_holds_recovery_back_only_until_the_age_bound(make_rig) -> None:
    from mlx_recovery_plugin.events import RequestArrived
    from mlx_recovery_plugin.recovery.registry import ARRIVAL_MAX_AGE_S

    rig = make_rig()
    rig.serve("e", random_tokens(42, 700))
    # A request the host refused somewhere the adapter never saw: arrived, never departs.
    rig.plugin.request_arrived(RequestArrived(engine_id="e", request_id="lost", model_id=MODEL, prompt_tokens=()))
    rig.host.drive_idle()
    status = rig.engine_status()
    assert status["last_refusal"] == Refusal.FOREGROUND_ACTIVE and status["counters"]["tokens_recovered"] == 0
    rig.clock.now += ARRIVAL_MAX_AGE_S + 1
    for _ in range(20):
        rig.host.drive_idle()
    assert rig.engine_status()["counters"]["tokens_recovered"] > 0
    assert rig.plugin.status()["registry"]["bad_input"] == {"stale_arrival": 1}


def test_arrival_on_another_engine_refuses_the_next_slice_and_retires_the_live_state(make_rig) -> None:
    rig = make_rig(engines=("e1", "e2"))
    e1 = rig.host.engines["e1"]
    rig.serve("e1", random_tokens(40, 700))
    e1.offer_idle_step()
    e1.offer_idle_step()
    assert len(rig.open_lives) == 1
    rig.host.submit("e2", random_tokens(41, 100))
    answers = e1.offer_idle_step()
    assert answers and isinstance(answers[0], float) and answers[0] > 0
    assert rig.calls["advance"] == 1 and rig.open_lives == set()
    assert rig.engine_status("e1")["last_refusal"] in (Refusal.OTHER_ENGINE_BUSY, Refusal.FOREGROUND_ACTIVE)
    rig.host.run_until_idle()
    rig.host.drive_idle()
    assert rig.engine_status("e1")["jobs"] == []


# -- cancellation --------------------------------------------------------------------------


def _cancel(rig: Rig, how: str) -> None:
    host = rig.host
    if how == "reset":
        host.reset("e")
    elif how == "deep_reset":
        host.reset("e", deep=True)
    elif how == "abort_all":
        host.abort_all("e")
        host.run_until_idle()
    elif how == "fail_all":
        host.fail_all("e", "boom")
        host.run_until_idle()
    elif how == "shutdown":
        host.shutdown("e")
    elif how == "unload":
        host.unload("e")


@pytest.mark.parametrize("how", ["reset", "deep_reset", "abort_all", "fail_all", "shutdown", "unload"])
def test_cancellation_hooks_drop_jobs_live_state_and_references(make_rig, how) -> None:
    rig = make_rig()
    engine = rig.host.engines["e"]
    rig.serve("e", random_tokens(50, 700))
    rig.serve("e", random_tokens(51, 300))
    engine.offer_idle_step()
    engine.offer_idle_step()
    assert len(rig.open_lives) == 1 and len(rig.engine_status()["jobs"]) == 2
    _cancel(rig, how)
    assert rig.open_lives == set()
    assert rig.host.leaked() == {}
    engines = rig.plugin.status()["engines"]
    if how in ("shutdown", "unload"):
        assert "e" not in engines
        assert rig.host.drive_idle() == 0
        return
    assert engines["e"]["jobs"] == []
    assert engines["e"]["counters"]["jobs_cancelled"] == 2
    assert rig.host.drive_idle() == 1
    # The engine keeps recovering what it serves next.
    prompt = random_tokens(52, 300)
    rig.serve("e", prompt)
    rig.host.drive_idle()
    assert engine.prefix_cache.stored_tokens(prompt) == 256


# -- several jobs per engine ---------------------------------------------------------------


def test_interleaved_sessions_keep_their_jobs_and_the_latest_is_recovered_first(make_rig) -> None:
    # Like conversations timed alike: on a loaded machine their wall-clock sparse turns
    # can differ 2x by noise, and the order would then (rightly) follow the larger saving.
    rig = make_rig(host_clock=TickingClock())
    system = random_tokens(60, 64)
    a = system + random_tokens(61, 330)
    b = system + random_tokens(62, 330)
    rig.serve("e", a)
    rig.serve("e", b)
    assert len(rig.engine_status()["jobs"]) == 2
    rig.host.drive_idle()
    assert rig.begun[0][0][:100] == tuple(b[:100])  # most recently served goes first
    assert rig.engine_status()["jobs"] == []
    a2 = rig.serve("e", a + random_tokens(63, 80))
    b2 = rig.serve("e", b + random_tokens(64, 80))
    assert a2.cached_tokens == len(a) // B * B
    assert b2.cached_tokens == len(b) // B * B


def _conversations_with_a_known_gap(rig: Rig, served_at: dict[str, float]) -> dict[str, list[int]]:
    """Conversation A served twice 30 s apart (the gap the engine learns), then the others
    at ``served_at`` (seconds after A's second turn, in that order); a dense cost of 1 ms
    a token fitted, so a 384-token job takes 0.77 s at the 50 % budget."""
    system = random_tokens(60, 64)
    prompts = {name: system + random_tokens(61 + i, 330) for i, name in enumerate(["a", *served_at])}
    rig.serve("e", prompts["a"][:200])
    rig.clock.advance(30.0)
    rig.serve("e", prompts["a"])
    start = rig.clock.now
    for name, after in served_at.items():
        rig.clock.now = start + after
        rig.serve("e", prompts[name])
    judge = rig.plugin._engines["e"].judge
    for context in (0, 128, 256):
        judge.observe(context, 64, 0.064)
    assert judge.costs.fitted
    return prompts


def test_the_conversation_due_back_first_is_recovered_first(make_rig) -> None:
    """A's turns came 30 s apart and B came 10 s after A's second: both are expected back
    30 s after their last turn, A first. Before, the most recently served (B) went first,
    and A came back to a prefix not done while B's waited 10 s more."""
    rig = make_rig(host_clock=TickingClock())
    prompts = _conversations_with_a_known_gap(rig, {"b": 10.0})
    jobs = rig.engine_status()["jobs"]
    assert sorted(job["due_in_s"] for job in jobs) == pytest.approx([20.0, 30.0])
    rig.host.drive_idle(max_steps=3)
    assert rig.begun[0][0][:100] == tuple(prompts["a"][:100])


def test_a_dense_turn_of_a_known_conversation_teaches_when_conversations_come_back(make_rig) -> None:
    """A's second turn came 30 s after its first and was prefilled densely (as a turn over
    a restored prefix is): the engine learns the 30 s gap from it all the same."""
    rig = make_rig(host_clock=TickingClock())
    a = random_tokens(61, 330)
    rig.serve("e", a[:200])
    assert rig.engine_status()["jobs"][0]["due_in_s"] is None
    rig.clock.advance(30.0)
    rig.serve("e", a, sparse=False)
    assert [job["due_in_s"] for job in rig.engine_status()["jobs"]] == [pytest.approx(30.0)]


class _Untouchable:
    def __getattr__(self, name: str) -> Any:
        raise AssertionError(f"read {name} of the live cost model")


def test_status_tells_how_long_each_jobs_rest_takes_at_the_budget(make_rig) -> None:
    """Beside ``due_in_s``, ``work_left_s`` says whether the idle time keeps up: unknown
    before a dense cost is known, then the rest of each job at 1 ms a token and the 50 %
    budget (0.77 s for 384 tokens), less after a slice of the job due back first."""
    rig = make_rig(host_clock=TickingClock())
    rig.serve("e", random_tokens(59, 330))
    assert [job["work_left_s"] for job in rig.engine_status()["jobs"]] == [None]
    rig = make_rig(host_clock=TickingClock())
    prompts = _conversations_with_a_known_gap(rig, {"b": 10.0})
    # The status is read on any thread: it goes by the judge's copy of the fit, never
    # the cost model, which the engine thread changes without the lock.
    judge = rig.plugin._engines["e"].judge
    live, judge.costs = judge.costs, _Untouchable()
    try:
        jobs = rig.engine_status()["jobs"]
    finally:
        judge.costs = live
    assert len(jobs) == 2
    for job in jobs:
        assert job["publish_end"] == 384
        assert job["work_left_s"] == pytest.approx(2 * 0.001 * 384, rel=1e-3)
    rig.host.drive_idle(max_steps=3)
    assert rig.begun[0][0][:100] == tuple(prompts["a"][:100])
    first, last = sorted(rig.engine_status()["jobs"], key=lambda job: job["due_in_s"])
    done = first["committed"] + first["held_tokens"]
    assert 0 < done <= 384 and last["committed"] + last["held_tokens"] == 0
    assert first["work_left_s"] == pytest.approx(2 * judge.costs.seconds(384 - done, done), rel=1e-3)
    assert first["work_left_s"] < last["work_left_s"]


def test_a_job_that_cannot_finish_before_its_conversation_is_back_yields_to_one_that_can(make_rig) -> None:
    """A is due back in 0.5 s and needs 0.77: C, due in 5.5 s, goes first (not B, served
    last and due last)."""
    rig = make_rig(host_clock=TickingClock())
    prompts = _conversations_with_a_known_gap(rig, {"c": 5.0, "b": 29.5})
    rig.host.drive_idle(max_steps=3)
    assert rig.begun[0][0][:100] == tuple(prompts["c"][:100])


def test_jobs_per_engine_are_bounded_dropping_the_least_recently_served(make_rig) -> None:
    rig = make_rig(make_settings(max_jobs_per_engine=2))
    sessions = [random_tokens(70 + i, 300) for i in range(3)]
    for prompt in sessions:
        rig.serve("e", prompt)
    status = rig.engine_status()
    assert len(status["jobs"]) == 2
    assert status["counters"]["jobs_dropped"] == 1
    rig.host.drive_idle()
    cache = rig.host.engines["e"].prefix_cache
    assert cache.stored_tokens(sessions[0]) == 0
    assert cache.stored_tokens(sessions[1]) == cache.stored_tokens(sessions[2]) == 256


def test_a_fork_replaces_the_job_it_forks_from(make_rig) -> None:
    rig = make_rig()
    base = random_tokens(80, 500)
    rig.serve("e", base)
    forked = base[:400] + random_tokens(81, 100)
    rig.serve("e", forked)
    (job,) = rig.engine_status()["jobs"]
    assert job["tokens"] == len(forked)


# -- budget, idle steps and slice size --------------------------------------------------


def test_spent_budget_window_asks_to_be_called_back_when_it_refills(make_rig) -> None:
    clock = FakeClock(1000.0)
    rig = make_rig(make_settings(budget_pct=10.0, budget_window_s=10.0), clock=clock)
    rig.before_advance = lambda n: clock.advance(0.6)  # each slice costs 0.6 s of a 1 s allowance
    rig.serve("e", random_tokens(90, 700))
    rig.host.drive_idle()
    assert rig.calls["advance"] == 2
    status = rig.engine_status()
    assert status["last_refusal"] == Refusal.BUDGET_SPENT
    assert rig.host.last_idle_retry_after == pytest.approx(10.0 - 1.2)
    assert len(rig.open_lives) == 1, "a spent window is not foreground work: the live state stays"
    clock.advance(9.0)
    rig.host.drive_idle()
    assert rig.calls["advance"] == 4
    assert rig.calls["begin"] == 1, "the next window goes on from the kept live state"


def test_slices_shrink_to_the_allowance_so_long_slices_do_not_overshoot_the_cap(make_rig) -> None:
    clock = FakeClock(1000.0)
    rate = 1000.0  # simulated tokens per second: a 512-token slice would cost 5x the allowance
    rig = make_rig(
        make_settings(budget_pct=10.0, budget_window_s=1.0, models={MODEL: {"enabled": True, "slice_tokens": 512}}),
        clock=clock,
    )
    rig.slice_cost = lambda n: clock.advance(n / rate)
    rig.serve("e", random_tokens(91, 1600))
    started = clock()
    for _ in range(200):
        rig.host.drive_idle()
        if rig.host.last_idle_retry_after is None:
            break
        clock.advance(rig.host.last_idle_retry_after)
    runs = [o.tokens_run for o in rig.outcomes]
    assert runs[0] == B  # nothing measured yet: one block, whatever the configured slice
    allowance_tokens = rate * 0.10 * 1.0
    assert all(B <= n <= allowance_tokens for n in runs[1:-1])
    assert runs[-1] <= allowance_tokens + B  # the slice that finishes the job: one block more at most
    assert sum(runs) >= 1600 - B  # the whole served range still gets recovered
    share = sum(runs[1:]) / rate / (clock() - started)
    assert share <= 0.10 + (16 + B) / rate


def test_a_job_one_block_short_of_whole_when_the_allowance_runs_out_finishes_in_that_window(make_rig) -> None:
    clock = FakeClock(1024.0)  # times in binary fractions: the allowance is spent exactly
    rate = 512.0  # simulated tokens per second: a block costs 0.125 s of a 0.625 s allowance
    rig = make_rig(
        make_settings(budget_window_s=1.25, models={MODEL: {"enabled": True, "slice_tokens": 8 * B}}), clock=clock
    )
    rig.slice_cost = lambda n: clock.advance(n / rate)
    rig.serve("e", random_tokens(92, 6 * B + 10))
    rig.host.drive_idle()
    # One block to learn the cost; the 4 the rest of the allowance pays for would leave
    # the prefix one block short until the next window, so that block runs now.
    assert [o.tokens_run for o in rig.outcomes] == [B, 5 * B]
    assert rig.engine_status()["counters"]["tokens_recovered"] == 6 * B
    assert rig.engine_status()["jobs"] == []
    assert rig.plugin.budget.snapshot()["used_in_window_s"] == pytest.approx(0.75)
    clock.advance(1.25)
    assert rig.plugin.budget.snapshot()["carry_s"] == pytest.approx(0.125), "the next window pays the block back"


def test_slices_wait_for_the_models_idle_steps_and_use_its_slice_size(make_rig) -> None:
    rig = make_rig(make_settings(models={MODEL: {"enabled": True, "idle_steps": 4, "slice_tokens": 64}}))
    engine = rig.host.engines["e"]
    rig.serve("e", random_tokens(95, 300))
    for _ in range(3):
        assert engine.offer_idle_step() == [True]
    assert rig.calls["advance"] == 0
    assert rig.engine_status()["last_refusal"] == Refusal.NOT_ENOUGH_IDLE_STEPS
    rig.host.drive_idle()
    assert [o.tokens_run for o in rig.outcomes] == [64, 64, 64, 64]


def test_set_budget_turns_recovery_off_and_on_in_place(make_rig) -> None:
    rig = make_rig()
    rig.plugin.set_budget(0)
    rig.serve("e", random_tokens(96, 300))
    assert rig.engine_status()["jobs"] == []
    assert rig.plugin.status()["enabled"] is False
    snapshot = rig.plugin.set_budget(25)
    assert snapshot["pct"] == 25
    rig.serve("e", random_tokens(97, 300))
    rig.host.drive_idle()
    assert rig.engine_status()["last_refusal"] == Refusal.BUDGET_SPENT  # from the next window
    rig.clock.advance(rig.plugin.budget.window_s)
    rig.host.drive_idle()
    assert rig.engine_status()["counters"]["tokens_recovered"] == 256
    with pytest.raises(ValueError):
        rig.plugin.set_budget(101)


def test_jobs_paused_by_a_zero_budget_resume_when_it_is_raised_on_an_idle_host(make_rig) -> None:
    rig = make_rig()
    rig.serve("e", random_tokens(98, 300))
    rig.plugin.set_budget(0)
    rig.host.drive_idle()
    assert rig.engine_status()["counters"]["tokens_recovered"] == 0
    # The idle host is told when to look again, instead of never.
    assert rig.host.last_idle_retry_after == rig.plugin.budget.window_s
    rig.plugin.set_budget(50)
    rig.clock.advance(rig.host.last_idle_retry_after)
    rig.host.drive_idle()
    assert rig.engine_status()["counters"]["tokens_recovered"] == 256


# -- status and control ----------------------------------------------------------------


def test_status_reports_jobs_boundaries_debt_and_counters(make_rig) -> None:
    rig = make_rig()
    engine = rig.host.engines["e"]
    rig.serve("e", random_tokens(98, 700))
    engine.offer_idle_step()
    engine.offer_idle_step()
    status = rig.plugin.status()
    es = status["engines"]["e"]
    (job,) = es["jobs"]
    assert job["committed"] == B and job["target_end"] == 700 and job["publish_end"] == 640
    assert es["live_offset"] == B and es["live_job_id"] == job["job_id"]
    assert es["debt"] == 700 - B == status["process"]["debt"]
    assert es["counters"]["slices"] == 1 and es["counters"]["tokens_recovered"] == B
    assert status["budget"]["pct"] == 50.0
    assert "share_used" in status["budget"] and status["process"]["faults"] == {}
    counters = rig.plugin.counters()
    assert counters["mlx_recovery_tokens_recovered_total:e"] == B
    assert counters["mlx_recovery_debt_tokens"] == 700 - B


def test_control_socket_serves_status_and_budget_and_goes_with_the_last_engine(make_rig, tmp_path_factory) -> None:
    path = str(tmp_path_factory.mktemp("ctl") / "r.sock")
    rig = make_rig(control_socket=path)
    assert stat.S_IMODE(os.stat(path).st_mode) == 0o600
    answer = request(path, {"op": "status"})
    assert answer["ok"] and "e" in answer["status"]["engines"]
    answer = request(path, {"op": "budget", "pct": 12.5})
    assert answer["ok"] and rig.plugin.budget.pct == 12.5
    assert request(path, {"op": "budget", "pct": -1})["ok"] is False
    rig.host.shutdown("e")
    assert not os.path.exists(path)


def test_plugin_loads_from_its_entry_point_with_settings_from_the_environment(monkeypatch) -> None:
    monkeypatch.setenv("MLX_RECOVERY_BUDGET_PCT", "5")
    monkeypatch.setenv("MLX_RECOVERY_MODELS", '{"org/model": {"enabled": true, "slice_tokens": 256}}')
    monkeypatch.setenv("MLX_RECOVERY_CONTROL_SOCKET", "off")
    monkeypatch.setenv("MLX_RECOVERY_PLUGINS", "recovery")
    pm = make_plugin_manager()
    assert pm.load_report.loaded == ["recovery"]
    plugin = pm.get_plugin("recovery")
    assert isinstance(plugin, RecoveryPlugin)
    try:
        assert plugin.budget.pct == 5.0
        assert plugin.enabled_for("org/model") and not plugin.enabled_for("other/model")
        assert plugin.status()["control_socket"] is None
    finally:
        plugin.close()


def test_with_the_budget_at_zero_the_channel_still_serves_and_can_turn_recovery_on(make_rig, tmp_path_factory) -> None:
    path = str(tmp_path_factory.mktemp("ctl0") / "z.sock")
    rig = make_rig(make_settings(budget_pct=0.0), control_socket=path)
    assert os.path.exists(path), "served although recovery is off"
    answer = request(path, {"op": "budget", "pct": 10})
    assert answer["ok"] and rig.plugin.budget.pct == 10.0


def test_a_cancel_that_arrives_during_a_whole_slice_publishes_nothing_of_it(make_rig) -> None:
    """A non-interruptible slice cannot stop; when it returns into a cancelled service,
    what it computed must not reach the host."""
    rig = make_rig(make_settings(interruptible=False))
    service = rig.plugin.service("e")
    cancels: list[threading.Thread] = []

    def cancel_mid_slice(n: int) -> None:
        if n != 1:
            return
        cancels.append(threading.Thread(target=service.cancel, args=("test",)))
        cancels[0].start()
        while not service._cancel.stop_requested():  # the cancel has been asked for
            time.sleep(0.001)

    rig.before_advance = cancel_mid_slice
    prompt = random_tokens(97, 400)
    rig.serve("e", prompt)
    rig.host.drive_idle()
    cancels[0].join(5)
    status = rig.engine_status()
    assert status["counters"]["blocks_published"] == 0
    assert status["jobs"] == []
    cache = rig.host.engines["e"].prefix_cache
    assert cache.fetch("check", prompt).tokens == 0
    cache.release("check")


def test_when_the_host_loses_committed_blocks_the_job_goes_back_and_recovers_them(make_rig) -> None:
    rig = make_rig(make_settings(budget_pct=100.0))
    prompt = random_tokens(98, 400)
    rig.serve("e", prompt)
    engine = rig.host.engines["e"]
    engine.offer_idle_step()
    engine.offer_idle_step()  # one slice: its first, one block, committed
    assert rig.engine_status()["jobs"][0]["committed"] == B
    engine.prefix_cache.clear()  # the host evicted what recovery committed
    rig.serve("e", random_tokens(99, 50), sparse=False)  # foreground: the live state goes
    rig.host.drive_idle()
    status = rig.engine_status()
    assert status["counters"]["ground_lost_tokens"] == B
    assert status["counters"]["faults"] == {}
    assert engine.prefix_cache.fetch("check", prompt).tokens == 384
    engine.prefix_cache.release("check")
