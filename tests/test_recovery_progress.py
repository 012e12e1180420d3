"""Recovery on a slow machine and the publish policy, on the mock host with the real runner
and a tiny model; slice costs are simulated on an injected clock, so a 25 tokens/s machine
is tested without waiting for one."""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any

import pytest

from mlx_recovery_plugin.events import RequestPrefilled, Route, SparseRouteServed
from mlx_recovery_plugin.plugins import make_plugin_manager
from mlx_recovery_plugin.recovery import service as service_module
from mlx_recovery_plugin.recovery.costs import HOST_APPEND_PRIOR
from mlx_recovery_plugin.recovery.plugin import RecoveryPlugin
from mlx_recovery_plugin.recovery.slice_size import MIN_STOP_GRAIN
from mlx_recovery_plugin.runner import SliceRunner
from mlx_recovery_plugin.settings import RecoverySettings
from mlx_recovery_plugin.testing.clock import FakeClock, random_tokens
from mlx_recovery_plugin.testing.host import MockHost

MODEL = "tiny"


class CostedRunner:
    """The real runner; each slice first moves the clock by ``a*n + b*(n*c + n*n/2)``
    (n tokens on top of c), as a machine of that speed would take."""

    def __init__(self, inner: SliceRunner, clock: FakeClock, a: float, b: float) -> None:
        self.inner, self.clock, self.a, self.b = inner, clock, a, b
        self.begun: list[int] = []
        self.lives: set[int] = set()
        self.grains: list[int | None] = []  # each slice's passes, as the service asked

    def begin(self, tokens: Sequence[int], prefix: Any) -> Any:
        live = self.inner.begin(tokens, prefix)
        self.begun.append(prefix.tokens if prefix is not None else 0)
        self.lives.add(id(live))
        return live

    def advance(self, live: Any, end: int, should_stop: Callable[[], bool] | None = None, stop_grain: int | None = None) -> Any:
        n, c = end - live.offset, live.offset
        self.clock.advance(self.a * n + self.b * (n * c + n * n / 2))
        self.grains.append(stop_grain)
        return self.inner.advance(live, end, should_stop, stop_grain)

    def discard(self, live: Any) -> None:
        self.lives.discard(id(live))
        self.inner.discard(live)


class Rig:
    def __init__(self, loaded: Any, *, block: int, a: float, b: float = 0.0, threshold: int = 16,
                 attention: Callable[[int], float | None] | None = None, **settings: Any) -> None:
        self.clock = FakeClock(1000.0)
        values: dict[str, Any] = {"budget_pct": 10.0, "budget_window_s": 10.0, "idle_steps": 1,
                                  "models": {MODEL: {"enabled": True}}}
        values.update(settings)
        self.settings = RecoverySettings(**values)
        self.runners: list[CostedRunner] = []

        def factory(handle: Any, block_size: int, interruptible: bool) -> CostedRunner:
            runner = CostedRunner(SliceRunner(handle, block_size, interruptible=interruptible), self.clock, a, b)
            self.runners.append(runner)
            return runner

        probe = None if attention is None else (lambda handle: attention)
        self.plugin = RecoveryPlugin(self.settings, clock=self.clock, runner_factory=factory, control_socket=False,
                                     attention_probe=probe)
        self.host = MockHost(make_plugin_manager([self.plugin], settings=self.settings, entry_points_too=False))
        model, tokenizer, draft = loaded
        self.engine = self.host.add_engine(
            "e", model=model, tokenizer=tokenizer, draft_model=draft, model_id=MODEL,
            block_size=block, prefill_step=block, sparse_threshold=threshold,
        )

    def served(self, prompt: Sequence[int], *, threshold: int | None, prefill_s: float | None) -> None:
        """Report ``prompt`` as served by the host's sparse route (as an adapter would)."""
        self.host.pm.hook.sparse_route_served(event=SparseRouteServed(
            "e", f"r{len(prompt)}", MODEL, tuple(prompt), 0, len(prompt),
            threshold=threshold, keep=0.2, prefill_s=prefill_s,
        ))

    def prefilled(self, prompt: Sequence[int], *, cached: int, route: Route, seconds: float) -> None:
        """Report the host's prefill of ``prompt`` (as an adapter would, at its first token)."""
        self.host.pm.hook.request_prefilled(event=RequestPrefilled(
            "e", f"p{len(prompt)}-{cached}", MODEL, tuple(prompt), cached, route, seconds,
        ))

    def idle(self, until: float) -> None:
        """Offer idle steps and skip the clock over the waits asked for, up to ``until``."""
        while self.clock() < until:
            answers = self.engine.offer_idle_step()
            if any(a is True for a in answers):
                continue
            delays = [a for a in answers if isinstance(a, float) and a > 0]
            if not delays:
                return
            self.clock.advance(min(delays))

    def status(self) -> dict[str, Any]:
        return self.plugin.status()["engines"]["e"]

    def restorable(self, prompt: Sequence[int]) -> int:
        cache = self.engine.prefix_cache
        try:
            return cache.fetch("test-probe", prompt).tokens
        finally:
            cache.release("test-probe")

    def close(self) -> None:
        self.plugin.close()
        assert self.host.leaked() == {}
        assert all(not r.lives for r in self.runners)


@pytest.fixture
def rigs(loaded):
    made: list[Rig] = []

    def make(**kw: Any) -> Rig:
        made.append(Rig(loaded, **kw))
        return made[-1]

    yield make
    for rig in made:
        rig.close()


# -- progress at any speed ------------------------------------------------------------


def test_where_a_layer_of_a_pass_is_slow_the_slices_run_finer_passes_and_still_finish(rigs) -> None:
    """An arriving request waits for the layer of the pass running: at 25 tokens a second
    a layer of a 256-token pass of the 2-layer model takes 5 s, so once the cost is
    measured the slices ask for the finest passes, and the status says so."""
    rig = rigs(block=256, a=1.0 / 25.0, budget_pct=50.0)
    prompt = random_tokens(12, 1100)
    rig.served(prompt, threshold=16, prefill_s=None)
    rig.idle(until=rig.clock() + 3000.0)
    grains = [g for r in rig.runners for g in r.grains]
    assert grains[0] is None, "the first slice's cost is not known yet"
    assert grains[-1] == MIN_STOP_GRAIN
    assert rig.status()["stop_grain"] == MIN_STOP_GRAIN
    assert rig.restorable(prompt) == 1024, "finer passes, the same blocks"


@pytest.mark.parametrize("slice_tokens", [None, 4096, 16])
def test_a_slow_machine_commits_at_least_80_percent_of_its_budgeted_dense_rate(rigs, slice_tokens) -> None:
    """25 tokens/s, 256-token blocks, 10 % of 10 s windows: an allowance of 1 s pays for a
    tenth of a block. Before, each window shrank the slice to 16 tokens and then threw the
    live state away, and the committed boundary never moved."""
    rate, block = 25.0, 256
    extra = {"slice_tokens": slice_tokens} if slice_tokens else {}
    rig = rigs(block=block, a=1.0 / rate, **extra)
    prompt = random_tokens(11, 2100)
    rig.served(prompt, threshold=16, prefill_s=None)
    start = rig.clock()
    rig.idle(until=start + 3000.0)
    committed = rig.restorable(prompt)
    assert committed == 2048, "the whole served range became restorable"
    assert rig.status()["counters"]["slices_interrupted"] == 0
    # Rate check over the first 1,000 s only: the job is done before 3,000 s.
    rig2 = rigs(block=block, a=1.0 / rate, **extra)
    rig2.served(prompt, threshold=16, prefill_s=None)
    begin = rig2.clock()
    rig2.idle(until=begin + 1000.0)
    first_slice_s = min(slice_tokens or block, 2048) / rate
    elapsed = rig2.clock() - begin - first_slice_s
    goal = 0.8 * rate * 0.10 * elapsed
    assert rig2.restorable(prompt) >= goal, (rig2.restorable(prompt), goal)
    assert rig2.plugin.status()["budget"]["share_used"] <= 0.10 + (first_slice_s + 1.0) / (rig2.clock() - begin)


def test_a_spent_window_keeps_the_live_state_and_goes_on_from_it(rigs) -> None:
    rig = rigs(block=256, a=1.0 / 25.0)
    prompt = random_tokens(12, 1100)
    rig.served(prompt, threshold=16, prefill_s=None)
    rig.idle(until=rig.clock() + 2000.0)
    assert rig.restorable(prompt) == 1024
    (runner,) = rig.runners
    assert runner.begun == [0], "one live state for the whole job: no window started over"


# -- the publish policy ---------------------------------------------------------------

# A matmul-bound machine: 10 ms a token whatever the context.
A = 0.01
PROMPT = 1000  # 960 tokens in 15 blocks of 64


def test_a_partial_prefix_that_would_slow_the_next_turn_is_held_then_published(rigs) -> None:
    """Every partial prefix flips the next turn (1,512 tokens expected) to the dense route;
    the sparse rerun costs ~10 s, so a prefix pays once fewer than ~900 tokens stay
    uncached, that is from 640 tokens on."""
    rig = rigs(block=64, a=A, budget_pct=100.0, slice_tokens=128)
    prompt = random_tokens(13, PROMPT)
    rig.served(prompt, threshold=5000, prefill_s=6.6)
    seen: list[tuple[int, int]] = []
    while rig.restorable(prompt) < 960:
        before = rig.status()["counters"]["slices"]
        rig.engine.offer_idle_step()
        assert rig.status()["counters"]["slices"] > before, "recovery stalled"
        (job,) = rig.status()["jobs"] or [{"committed": 960, "held_tokens": 0}]
        seen.append((job["committed"], job["held_tokens"]))
    assert seen[0] == (0, 64), "the first block (a one-block first slice) is held, not published"
    assert all(committed == 0 or committed >= 640 for committed, _ in seen)
    assert any(committed >= 640 for committed, _ in seen)
    policy = rig.status()["policy"]
    assert policy["verdict"] == "publish" and policy["dense_s_per_token"] == pytest.approx(A, rel=0.05)


def test_held_blocks_survive_a_foreground_request(rigs) -> None:
    rig = rigs(block=64, a=A, budget_pct=100.0, slice_tokens=128)
    prompt = random_tokens(14, PROMPT)
    rig.served(prompt, threshold=5000, prefill_s=6.6)
    for _ in range(3):
        rig.engine.offer_idle_step()
    (job,) = rig.status()["jobs"]
    assert job["committed"] == 0 and job["held_tokens"] == 64 + 128 + 128  # first slice: one block
    rid = rig.host.submit("e", random_tokens(15, 50), max_tokens=2)  # foreground: live state retired
    rig.host.run_until_idle()
    assert rig.host.result(rid).output_tokens
    rig.idle(until=rig.clock() + 100.0)
    assert rig.runners[0].begun == [0, 320], "the job went on from its held blocks"
    # The host told of that request before its lookup: the whole prefix now waits, held,
    # for its conversation's return, and is published then (tests/test_arrival_publication.py).
    (job,) = rig.status()["jobs"]
    assert job["committed"] == 0 and job["held_tokens"] == 960
    nxt = rig.host.submit("e", [*prompt, *random_tokens(16, 40)], max_tokens=2)
    rig.host.run_until_idle()
    assert rig.host.result(nxt).cached_tokens == 960


def test_held_blocks_are_given_back_when_recovery_is_switched_off(rigs) -> None:
    rig = rigs(block=64, a=A, budget_pct=100.0, slice_tokens=128)
    prompt = random_tokens(14, PROMPT)
    rig.served(prompt, threshold=5000, prefill_s=6.6)
    for _ in range(3):
        rig.engine.offer_idle_step()
    assert rig.status()["jobs"][0]["held_tokens"] == 320
    assert rig.plugin.status()["process"]["tokens_held"] == 320
    assert rig.plugin.counters()["mlx_recovery_held_tokens:e"] == 320
    rig.plugin.set_budget(0.0)
    rig.idle(until=rig.clock() + 100.0)
    status = rig.status()
    assert status["jobs"][0]["held_tokens"] == 0 and status["counters"]["held_blocks_dropped"] == 320 // 64
    assert rig.plugin.status()["process"]["tokens_held"] == 0


def test_held_blocks_are_given_back_under_memory_pressure(loaded) -> None:
    short = {"ok": True}
    rig = Rig(loaded, block=64, a=A, budget_pct=100.0, slice_tokens=128)
    rig.plugin.gate._memory_ok = lambda: short["ok"]
    try:
        prompt = random_tokens(14, PROMPT)
        rig.served(prompt, threshold=5000, prefill_s=6.6)
        for _ in range(3):
            rig.engine.offer_idle_step()
        assert rig.status()["jobs"][0]["held_tokens"] == 320
        short["ok"] = False
        rig.engine.offer_idle_step()
        assert rig.status()["last_refusal"] == "memory_pressure"
        assert rig.status()["jobs"][0]["held_tokens"] == 0
    finally:
        rig.close()


def test_held_blocks_past_the_byte_limit_stand_the_job_down_until_its_next_turn(rigs) -> None:
    rig = rigs(block=64, a=A, budget_pct=100.0, slice_tokens=128, max_held_mib=0.0)
    prompt = random_tokens(14, PROMPT)
    rig.served(prompt, threshold=5000, prefill_s=6.6)
    rig.engine.offer_idle_step()
    (job,) = rig.status()["jobs"]
    assert job["held_tokens"] == 0 and "MLX_RECOVERY_MAX_HELD_MIB" in (job["stood_down"] or "")
    rig.served(prompt + random_tokens(16, 64), threshold=5000, prefill_s=6.6)
    assert rig.status()["jobs"][0]["stood_down"] is None


def test_unset_the_held_memory_bound_is_an_eighth_of_the_machine_and_the_status_says_so(rigs, monkeypatch) -> None:
    monkeypatch.setattr(service_module, "machine_memory_bytes", lambda: 64 << 30)
    assert rigs(block=64, a=A).status()["held_bound_mib"] == 8192.0
    assert rigs(block=64, a=A, max_held_mib=300.0).status()["held_bound_mib"] == 300.0


def test_past_the_byte_limit_blocks_a_sparse_next_turn_would_not_use_are_published_not_lost(rigs) -> None:
    """The next turn stays sparse over any partial prefix (threshold 200): the policy holds
    them, but where holding would pass the cap, publishing brings the full prefix closer
    and the next turn is sparse either way."""
    rig = rigs(block=64, a=A, budget_pct=100.0, slice_tokens=128, max_held_mib=0.0)
    prompt = random_tokens(15, PROMPT)
    rig.served(prompt, threshold=200, prefill_s=6.6)
    rig.engine.offer_idle_step()
    (job,) = rig.status()["jobs"]
    assert job["stood_down"] is None and job["held_tokens"] == 0
    assert rig.restorable(prompt) == 64


def test_a_whole_prefix_held_as_not_yet_clear_is_published_once_the_evidence_says_it_pays(rigs) -> None:
    """Dense append 5.12 s against a sparse rerun of about 5.4 s: the whole prefix is held,
    neither surely paying nor surely not. Nothing runs for it any more, so the policy judges
    it again when it learns more: here the host times the conversation's sparse route again
    at 12 s, and the held prefix is published before the conversation comes back."""
    rig = rigs(block=64, a=A, budget_pct=100.0, slice_tokens=128)
    prompt = random_tokens(23, PROMPT)
    rig.served(prompt, threshold=5000, prefill_s=3.51)
    rig.idle(until=rig.clock() + 100.0)
    (job,) = rig.status()["jobs"]
    assert job["held_tokens"] == 960 and rig.restorable(prompt) == 0
    assert "not yet clear" in rig.status()["policy"]["reason"]
    rig.prefilled(prompt, cached=0, route=Route.SPARSE, seconds=12.0)
    rig.idle(until=rig.clock() + 100.0)
    assert rig.restorable(prompt) == 960
    assert rig.status()["jobs"] == []


def test_a_job_held_back_by_the_host_prior_alone_runs_on_rather_than_pausing(rigs) -> None:
    """W, a longer conversation, is run whole first: its slices are evidence past Y's whole
    prefix. Y's conversation comes back 200 tokens longer and is served sparse again. At
    the slices' own estimate its whole prefix pays by the margin; at the host's prior
    (1.2x) it is "not yet clear". No host dense turn has measured the factor, and it is
    that turn (a probe, any conversation's) that decides, not more slices: Y's job runs on
    to its new end, where a hold on a measured factor pauses it (bench server, 3072x2,
    three conversations: three such jobs paused left 44 s of idle time unused until the
    probe went out)."""
    rig = rigs(block=64, a=A, budget_pct=100.0, slice_tokens=128)
    w = random_tokens(33, 2 * PROMPT)
    rig.served(w, threshold=5000, prefill_s=60.0)
    rig.idle(until=rig.clock() + 100.0)
    y = random_tokens(30, PROMPT)
    rig.served(y, threshold=5000, prefill_s=4.2)
    rig.idle(until=rig.clock() + 100.0)
    ran = rig.status()["counters"]["tokens_run"]
    longer = y + random_tokens(32, 200)
    rig.served(longer, threshold=5000, prefill_s=2.45)
    rig.idle(until=rig.clock() + 100.0)
    status = rig.status()
    job = next(j for j in status["jobs"] if j["tokens"] == PROMPT + 200)
    assert job["paused"] is None and job["held_tokens"] == 1152, repr((job, status["policy"]))
    assert "the host's first dense turn" in status["policy"]["reason"]
    assert status["counters"]["tokens_run"] == ran + 192
    assert status["counters"]["jobs_paused"] == 0
    assert rig.restorable(longer) == 0  # held, not published: the verdict is still the prior's


def test_a_job_whose_whole_prefix_is_not_yet_clear_on_evidence_that_reaches_it_pauses(rigs) -> None:
    """Conversation X is run whole and held "not yet clear"; the host's own dense append of
    another turn at that context then tells the policy what such a turn costs (1.3x the
    slices' estimate, as its prior said). Conversation Y, alike, would only be held too:
    it pauses instead of being run (the evidence reaches its whole prefix already), costs
    no slice while nothing changes, and resumes (and is published) once the host says its
    sparse route takes 12 s."""
    rig = rigs(block=64, a=A, budget_pct=100.0, slice_tokens=128)
    x = random_tokens(27, PROMPT)
    rig.served(x, threshold=5000, prefill_s=3.51)
    rig.idle(until=rig.clock() + 100.0)
    assert rig.status()["jobs"][0]["held_tokens"] == 960
    ran_for_x = rig.status()["counters"]["tokens_run"]
    other = random_tokens(28, 1512)
    rig.prefilled(other, cached=960, route=Route.DENSE, seconds=1.3 * (1512 - 960) * A)
    y = random_tokens(29, PROMPT + 1)
    rig.served(y, threshold=5000, prefill_s=3.51)
    rig.idle(until=rig.clock() + 100.0)
    status = rig.status()
    job_y = next(j for j in status["jobs"] if j["tokens"] == PROMPT + 1)
    assert "not yet clear" in (job_y["paused"] or ""), repr((job_y, status["policy"]))
    assert job_y["stood_down"] is None
    assert status["counters"]["tokens_run"] == ran_for_x, "nothing was run for Y only to be held"
    assert status["counters"]["jobs_paused"] == 1
    for _ in range(5):
        rig.engine.offer_idle_step()
    assert rig.status()["counters"]["tokens_run"] == ran_for_x, "a pause is not re-run without new evidence"
    rig.prefilled(y, cached=0, route=Route.SPARSE, seconds=12.0)
    rig.idle(until=rig.clock() + 100.0)
    assert rig.restorable(y) == 960
    assert rig.status()["counters"]["jobs_paused"] == 1


def test_a_new_turn_of_a_conversation_still_not_yet_clear_runs_no_slice_for_it(rigs) -> None:
    """X is run whole and held "not yet clear", and the host's own dense append tells the
    policy what such a turn costs. X's conversation comes back with 200 more tokens at a
    sparse cost per token a little lower: the next turn's dense append is expected 1.02x
    its rerun, the verdict on its whole prefix is still not clear, on evidence that reaches
    it, so the new turn pauses the job without a slice (one would only be held). Its held
    blocks stay, and a slow sparse turn still resumes and publishes it. (At the same cost
    per token the next turn reads 0.95 of its rerun and the turns after it pay: published.)"""
    rig = rigs(block=64, a=A, budget_pct=100.0, slice_tokens=128)
    x = random_tokens(30, PROMPT)
    rig.served(x, threshold=5000, prefill_s=3.51)
    rig.idle(until=rig.clock() + 100.0)
    assert rig.status()["jobs"][0]["held_tokens"] == 960
    other = random_tokens(31, 1512)
    rig.prefilled(other, cached=960, route=Route.DENSE, seconds=1.3 * (1512 - 960) * A)
    rig.idle(until=rig.clock() + 100.0)
    counters = rig.status()["counters"]
    ran, slices = counters["tokens_run"], counters["slices"]
    longer = x + random_tokens(32, 200)
    rig.served(longer, threshold=5000, prefill_s=2.7)
    rig.idle(until=rig.clock() + 100.0)
    status = rig.status()
    (job,) = status["jobs"]
    assert "not yet clear" in (job["paused"] or ""), repr((job, status["policy"]))
    assert status["counters"]["slices"] == slices and status["counters"]["tokens_run"] == ran
    assert job["held_tokens"] == 960 and job["stood_down"] is None
    rig.prefilled(longer, cached=0, route=Route.SPARSE, seconds=12.0)
    rig.idle(until=rig.clock() + 100.0)
    assert rig.restorable(longer) == 1152


@pytest.mark.parametrize(("sparse_s", "spilled"), [(60.0, 64), (4.8, 0)], ids=["whole-pays", "whole-unclear"])
def test_past_the_byte_limit_blocks_spill_only_where_the_whole_prefix_is_expected_to_pay(
    rigs, sparse_s: float, spilled: int
) -> None:
    """The host's dense appends at short contexts fit the cost model; the next turn stays
    sparse over a one-block prefix (threshold 1,000 uncached), is dense over the whole one,
    and no block can be held (cap 0). Where
    the whole prefix is expected to pay (a 60 s sparse route), the first block is
    published: it brings that prefix closer. Where the whole prefix is not clear (a dense
    append of about 7.2 s against a sparse rerun of about 7.3 s), a published block would
    only cost the sparse turn (its draft misses) for nothing: the job stands down and the
    host's route is left alone."""
    rig = rigs(block=64, a=A, budget_pct=100.0, slice_tokens=128, max_held_mib=0.0)
    # Short new conversations over a shared cached part (more new than cached): dense
    # cost evidence, but no conversation's growth, so the next turn is judged at 512.
    for seed, cached in enumerate((0, 200, 500)):
        rig.prefilled(random_tokens(40 + seed, cached + 600), cached=cached, route=Route.DENSE,
                      seconds=1.3 * 600 * A)
    prompt = random_tokens(44, PROMPT)
    rig.served(prompt, threshold=1000, prefill_s=sparse_s)
    rig.engine.offer_idle_step()
    assert rig.restorable(prompt) == spilled
    (job,) = rig.status()["jobs"]
    assert job["held_tokens"] == 0
    if not spilled:
        assert "would not pay" in (job["stood_down"] or ""), repr((job, rig.status()["policy"]))


def test_recovery_stands_down_where_no_prefix_pays_and_says_why(rigs) -> None:
    rig = rigs(block=64, a=A, budget_pct=100.0, slice_tokens=128)
    prompt = random_tokens(16, PROMPT)
    rig.served(prompt, threshold=5000, prefill_s=0.5)  # the sparse route is far cheaper
    rig.idle(until=rig.clock() + 100.0)
    assert rig.restorable(prompt) == 0
    (job,) = rig.status()["jobs"]
    assert "costs more than a sparse rerun" in job["stood_down"]
    assert job["held_tokens"] == 0
    status = rig.status()
    assert status["policy"]["verdict"] == "stand_down"
    assert status["counters"]["jobs_stood_down"] == 1
    slices = status["counters"]["slices"]
    assert slices == 3, "it stood down as soon as the cost model was fitted"
    assert rig.runners[0].lives == set()


def test_a_close_call_holds_what_was_run_and_the_next_turn_goes_on_from_it(rigs) -> None:
    """The sparse rerun (~4.8 s) is a little cheaper than the cheapest reading of the dense
    append over the whole prefix (~5.0 s), by less than the margin: too close to stand down. The
    blocks run so far are kept (the job pauses), and when the conversation's next turn
    finds the sparse route slow, recovery goes on from them instead of running them again
    (a stand-down dropped them: bench server, 768x6, 9,472 tokens)."""
    rig = rigs(block=64, a=A, budget_pct=100.0, slice_tokens=128)
    prompt = random_tokens(33, PROMPT)
    rig.served(prompt, threshold=5000, prefill_s=3.2)
    rig.idle(until=rig.clock() + 100.0)
    status = rig.status()
    (job,) = status["jobs"]
    assert "too close to stand down" in (job["paused"] or ""), repr((job, status["policy"]))
    assert job["stood_down"] is None and status["counters"]["jobs_stood_down"] == 0
    held = job["held_tokens"]
    assert held > 0 and rig.restorable(prompt) == 0
    assert status["counters"]["tokens_run"] == held
    longer = prompt + random_tokens(34, 200)
    rig.served(longer, threshold=5000, prefill_s=60.0)  # now the sparse route is slow
    rig.idle(until=rig.clock() + 100.0)
    assert rig.restorable(longer) == 1152
    assert rig.runners[0].begun[-1] == held, "the next slice went on from the held blocks"
    assert rig.status()["counters"]["tokens_run"] == 1152, "nothing was run twice"


def test_attention_timed_at_the_next_turns_depth_stands_a_job_down_before_its_slices_get_there(rigs) -> None:
    """An attention-bound machine (the dense append over the whole prefix ~16 s at the
    host's prior against a sparse rerun of ~7 s): the first slices measure only shallow contexts, where the
    deepest one's rate bounds the append at ~3 s, not clear either way. Timing attention
    at the next turn's depth (here the machine's own attention cost) bounds it above the
    rerun at once: the job stands down as soon as the cost model is fitted (320 tokens
    run), where without the timing its slices went on until they had measured 832 of the
    960 tokens."""
    a, b = 1e-4, 2e-5
    asked: list[int] = []

    def attention(context: int) -> float:
        asked.append(context)
        return b * context  # seconds per token of all layers' attention at that depth

    def run(probe: Callable[[int], float | None]) -> Rig:
        rig = rigs(block=64, a=a, b=b, budget_pct=100.0, slice_tokens=128, attention=probe)
        prompt = random_tokens(25, PROMPT)
        rig.served(prompt, threshold=5000, prefill_s=3.0)
        for _ in range(40):
            if rig.status()["jobs"][0]["stood_down"] or rig.restorable(prompt) >= 960:
                break
            rig.engine.offer_idle_step()
        return rig

    timed = run(attention)
    (job,) = timed.status()["jobs"]
    assert "costs more than a sparse rerun" in (job["stood_down"] or ""), (job, dict(timed.status()["policy"]), timed.status()["counters"])
    assert timed.status()["counters"]["slices"] == 3, "it stood down as soon as the cost model was fitted"
    assert timed.status()["counters"]["tokens_run"] == 320
    assert timed.status()["counters"]["attention_probes"] == 1 and asked == [PROMPT + 512]
    assert timed.status()["policy"]["attention_s_per_token_per_context"] == pytest.approx(b)
    untimed = run(lambda context: None)  # a model that cannot be timed
    assert untimed.status()["counters"]["attention_probes"] == 0
    counters = untimed.status()["counters"]
    assert untimed.status()["jobs"][0]["stood_down"], "the same verdict in the end"
    assert counters["slices"] >= 7 and counters["tokens_run"] >= 832, "without it, the slices measured their way there"
    assert untimed.status()["policy"]["attention_s_per_token_per_context"] is None


def test_a_request_arriving_during_the_attention_probe_waits_for_the_probe_only(rigs) -> None:
    """The probe cannot be stopped; a request that came in during it waits for its end,
    not also for a fetch of the host's blocks and a slice begun only to stop at its first
    layer. The status books the wait to the probe."""
    box: list[Rig] = []
    arrived: list[str] = []

    def attention(context: int) -> float:
        if not arrived:
            arrived.append(box[0].host.submit("e", random_tokens(28, 300), max_tokens=2))
            box[0].clock.advance(0.4)  # the probe's own time
        return 1e-7  # cheap attention: the job goes on, its slices are not cut short

    rig = rigs(block=64, a=1e-4, b=1e-7, budget_pct=100.0, slice_tokens=128, attention=attention)
    box.append(rig)
    rig.served(random_tokens(27, PROMPT), threshold=5000, prefill_s=3.0)
    for _ in range(40):
        if arrived:
            break
        rig.engine.offer_idle_step()
    assert arrived, "the probe was asked for"
    counters = rig.status()["counters"]
    assert counters["arrival_waits"] == 1
    assert counters["arrival_wait_seconds_max"] == pytest.approx(0.4), "it waited for the probe, nothing more"
    assert counters["arrival_wait_seconds_max_by_phase"] == {"probe": pytest.approx(0.4)}
    assert counters["slices_interrupted"] == 0, "no slice was begun behind the arrival"
    rig.host.run_until_idle()
    assert len(rig.host.result(arrived[0]).output_tokens) == 2


def test_an_attention_probe_that_fails_is_dropped_and_the_slices_go_on(rigs) -> None:
    calls: list[int] = []

    def broken(context: int) -> float:
        calls.append(context)
        raise RuntimeError("no memory for the keys")

    rig = rigs(block=64, a=1e-4, b=2e-5, budget_pct=100.0, slice_tokens=128, attention=broken)
    prompt = random_tokens(26, PROMPT)
    rig.served(prompt, threshold=5000, prefill_s=6.0)
    for _ in range(8):
        rig.engine.offer_idle_step()
    assert len(calls) == 1, "asked once, then never again"
    status = rig.status()
    assert status["counters"]["slices"] >= 5 and status["counters"]["attention_probes"] == 0


def test_policy_always_publishes_every_finished_block(rigs) -> None:
    rig = rigs(block=64, a=A, budget_pct=100.0, slice_tokens=128, publish_policy="always")
    prompt = random_tokens(17, PROMPT)
    rig.served(prompt, threshold=5000, prefill_s=0.5)
    rig.engine.offer_idle_step()
    assert rig.restorable(prompt) == 64  # the first slice, one block, published at once
    rig.idle(until=rig.clock() + 100.0)
    assert rig.restorable(prompt) == 960


def test_a_new_turn_lifts_a_stand_down_for_a_fresh_judgement(rigs) -> None:
    rig = rigs(block=64, a=A, budget_pct=100.0, slice_tokens=128)
    prompt = random_tokens(18, PROMPT)
    rig.served(prompt, threshold=5000, prefill_s=0.5)
    rig.idle(until=rig.clock() + 100.0)
    assert rig.status()["jobs"][0]["stood_down"]
    longer = prompt + random_tokens(19, 200)
    rig.served(longer, threshold=5000, prefill_s=60.0)  # now the sparse route is slow
    rig.idle(until=rig.clock() + 100.0)
    assert rig.restorable(longer) == 1152


def test_a_stand_down_is_revisited_when_the_host_measures_its_sparse_route_again(rigs) -> None:
    """No new turn, only new evidence: the conversation was asked again and the sparse
    route took 60 s this time; the stood-down job is judged again and recovered."""
    rig = rigs(block=64, a=A, budget_pct=100.0, slice_tokens=128)
    prompt = random_tokens(21, PROMPT)
    rig.served(prompt, threshold=5000, prefill_s=0.5)
    rig.idle(until=rig.clock() + 100.0)
    (job,) = rig.status()["jobs"]
    assert job["stood_down"] and rig.restorable(prompt) == 0
    rig.prefilled(prompt, cached=0, route=Route.SPARSE, seconds=60.0)
    rig.idle(until=rig.clock() + 100.0)
    assert rig.restorable(prompt) == 960
    assert rig.status()["counters"]["jobs_stood_down"] == 1


def test_evidence_that_changes_nothing_costs_no_slice(rigs) -> None:
    rig = rigs(block=64, a=A, budget_pct=100.0, slice_tokens=128)
    prompt = random_tokens(22, PROMPT)
    rig.served(prompt, threshold=5000, prefill_s=0.5)
    rig.idle(until=rig.clock() + 100.0)
    slices = rig.status()["counters"]["slices"]
    for _ in range(5):
        rig.engine.offer_idle_step()
    assert rig.status()["counters"]["slices"] == slices, "a stand-down is not re-run without new evidence"


def test_a_new_turn_measures_the_machine_once_before_its_verdict(rigs) -> None:
    """The first slice after a new turn runs whatever the old evidence said, so a stand
    down taken on a loaded machine is re-taken on today's; one slice, not more."""
    rig = rigs(block=64, a=A, budget_pct=100.0, slice_tokens=128)
    prompt = random_tokens(23, PROMPT)
    rig.served(prompt, threshold=5000, prefill_s=0.5)
    rig.idle(until=rig.clock() + 100.0)
    slices = rig.status()["counters"]["slices"]
    rig.served(prompt + random_tokens(24, 200), threshold=5000, prefill_s=0.5)  # still cheap
    rig.idle(until=rig.clock() + 100.0)
    status = rig.status()
    assert status["counters"]["slices"] == slices + 1
    assert status["jobs"][0]["stood_down"] and status["jobs"][0]["held_tokens"] == 0


def test_the_host_dense_turn_after_a_publication_is_learned_and_checked(rigs) -> None:
    rig = rigs(block=64, a=A, budget_pct=100.0, slice_tokens=128)
    prompt = random_tokens(25, PROMPT)
    rig.served(prompt, threshold=5000, prefill_s=60.0)
    rig.idle(until=rig.clock() + 100.0)
    assert rig.restorable(prompt) == 960
    policy = rig.status()["policy"]
    assert policy["verdict"] == "publish" and policy["host_dense_samples"] == 0
    nxt = prompt + random_tokens(26, 300)
    rig.prefilled(nxt, cached=960, route=Route.DENSE, seconds=3.4)
    policy = rig.status()["policy"]
    assert policy["host_dense_samples"] == 1 and policy["host_turns_learned"] == 1
    # The host's own append now says what the host costs over the slices' estimate.
    assert policy["host_append_measured"] == 1
    # Slices cost A a token at any context here, so the model predicted uncached * A.
    assert policy["host_append_factor"] == pytest.approx(3.4 / ((len(nxt) - 960) * A), rel=0.05)
    turn = policy["last_turn_after_publication"]
    assert turn["cached_tokens"] == 960 and turn["prefill_s"] == 3.4
    assert turn["predicted_s"] is not None and turn["paid"] is True


def test_the_conversation_whose_recovery_saves_most_is_worked_first_not_the_latest(rigs) -> None:
    rig = rigs(block=64, a=A, budget_pct=100.0, slice_tokens=128)
    slow, cheap = random_tokens(27, PROMPT), random_tokens(28, PROMPT)
    rig.served(slow, threshold=5000, prefill_s=60.0)  # its next sparse turn costs a minute
    rig.served(cheap, threshold=5000, prefill_s=12.0)  # served later, saves less
    slow_id, _ = sorted(job["job_id"] for job in rig.status()["jobs"])  # ids in serving order
    rig.engine.offer_idle_step()
    assert rig.status()["live_job_id"] == slow_id
    rig.idle(until=rig.clock() + 300.0)
    assert rig.restorable(slow) == 960 and rig.restorable(cheap) == 960


def test_a_conversation_begun_is_finished_before_one_served_after_it(rigs) -> None:
    # A partial prefix is held back (the next turn would stay sparse), so idle time spread
    # over two conversations restores neither; one at a time restores the first.
    rig = rigs(block=64, a=A, budget_pct=100.0, slice_tokens=128)
    first, second = random_tokens(31, PROMPT), random_tokens(32, PROMPT)
    rig.served(first, threshold=5000, prefill_s=20.0)
    first_id = rig.status()["jobs"][0]["job_id"]
    for _ in range(2):
        assert rig.engine.offer_idle_step() == [True]
    held = rig.status()["jobs"][0]["held_tokens"]
    # Under half done: per token still to run, the first saves under twice the second's.
    assert 0 < held < 960 // 2 and rig.restorable(first) == 0
    rig.served(second, threshold=5000, prefill_s=20.0)  # as costly, and the latest
    for _ in range(40):
        if rig.restorable(first) or rig.restorable(second):
            break
        assert rig.engine.offer_idle_step() == [True]
        assert rig.status()["live_job_id"] in (first_id, None)
    assert rig.restorable(first) == 960 and rig.restorable(second) == 0
    rig.idle(until=rig.clock() + 300.0)
    assert rig.restorable(second) == 960


def test_a_conversation_long_gone_yields_to_one_just_served(rigs) -> None:
    rig = rigs(block=64, a=A, budget_pct=100.0, slice_tokens=128)
    old, new = random_tokens(29, PROMPT), random_tokens(30, PROMPT)
    rig.served(old, threshold=5000, prefill_s=30.0)
    rig.clock.advance(3600.0)  # an hour later: unlikely to come back soon
    rig.served(new, threshold=5000, prefill_s=20.0)
    new_id = max(job["job_id"] for job in rig.status()["jobs"])
    rig.engine.offer_idle_step()
    assert rig.status()["live_job_id"] == new_id


def test_a_request_keyed_by_more_than_its_tokens_gets_no_job_and_is_counted(rigs) -> None:
    rig = rigs(block=64, a=A, budget_pct=100.0)
    prompt = random_tokens(20, PROMPT)
    rig.host.pm.hook.sparse_route_served(event=SparseRouteServed(
        "e", "vision", MODEL, tuple(prompt), 0, len(prompt), threshold=16, keyed_beyond_tokens=True,
    ))
    rig.idle(until=rig.clock() + 100.0)
    status = rig.status()
    assert status["jobs"] == []
    assert status["counters"]["refusals"] == {"keyed_beyond_tokens": 1}
    assert rig.restorable(prompt) == 0


# -- the host's cost measured by one publication -------------------------------------

# A conversation that grows by 128 tokens a turn; its sparse route takes 1.91 ms a token.
# Its next turn's dense append over the whole 960-token prefix costs 1.68 s at the
# slices' rate and 2.02 s at the host's prior (1.2x), against a sparse rerun of 2.15 s:
# it pays by the slices, and only the prior holds it back.
GROWTH = 128
PROBE_SPARSE_S_PER_TOKEN = 1.91e-3


def _whole_then_next(rig: Rig, seed: int) -> tuple[list[int], list[int]]:
    """Serve a conversation's two sparse turns (the second of ``PROMPT`` tokens); return
    that turn's prompt and the next one's."""
    prompt = random_tokens(seed, PROMPT)
    for turn in (prompt[:-GROWTH], prompt):
        rig.served(turn, threshold=5000, prefill_s=PROBE_SPARSE_S_PER_TOKEN * len(turn))
    return prompt, prompt + random_tokens(seed + 1, GROWTH)


def test_a_whole_prefix_only_the_prior_holds_back_is_published_once_to_measure_the_host(rigs) -> None:
    """The deadlock seen on the real server: three conversations, each whole prefix held
    back only by the host factor's prior, all paused; no publication, so the host never
    ran a dense turn and the prior was never corrected. Now X is published to measure the
    host; Y, alike, waits (one probe at a time). X's next turn comes back dense over the
    recovered prefix at the slices' own cost: the factor is measured (1.0), and Y, which
    now pays, is published before its conversation returns."""
    rig = rigs(block=64, a=A, budget_pct=100.0, slice_tokens=128)
    x, x_next = _whole_then_next(rig, 50)
    rig.idle(until=rig.clock() + 100.0)
    policy = rig.status()["policy"]
    assert rig.restorable(x) == 960, (policy["reason"], policy["host_probe"], rig.status()["jobs"])
    assert "to measure the host" in policy["reason"] and policy["host_append_measured"] == 0
    y, _ = _whole_then_next(rig, 52)
    rig.idle(until=rig.clock() + 100.0)
    assert rig.restorable(y) == 0, "one probe at a time"
    assert "not yet clear" in rig.status()["policy"]["reason"]
    rig.prefilled(x_next, cached=960, route=Route.DENSE, seconds=(len(x_next) - 960) * A)
    rig.idle(until=rig.clock() + 100.0)
    status = rig.status()
    assert status["policy"]["host_append_factor"] == pytest.approx(1.0, rel=0.05)
    assert rig.restorable(y) == 960, status["policy"]
    assert status["policy"]["host_probe"]["taken"] == 1


@pytest.mark.parametrize(("factor", "published", "why"), [
    (HOST_APPEND_PRIOR, 960, "later turns pay"), (1.3, 0, "not yet clear"),
], ids=["as-dear-as-the-prior", "dearer"])
def test_a_host_as_dear_as_the_prior_says_ends_the_probes(rigs, factor: float, published: int, why: str) -> None:
    """The probe's next turn costs what the prior said (1.2x the slices'): the factor is
    measured and no other conversation is published as a probe. Y's next turn then reads
    0.94 of its rerun and its later turns 0.80: Y is published on the measured factor. On
    a host dearer still (1.3x) Y's next turn would be 1.02x its rerun: a close call, held."""
    rig = rigs(block=64, a=A, budget_pct=100.0, slice_tokens=128)
    x, x_next = _whole_then_next(rig, 54)
    rig.idle(until=rig.clock() + 100.0)
    assert rig.restorable(x) == 960
    rig.prefilled(x_next, cached=960, route=Route.DENSE, seconds=factor * (len(x_next) - 960) * A)
    y, _ = _whole_then_next(rig, 56)
    rig.clock.advance(10_000.0)  # however long after: a measured factor is not probed again
    rig.idle(until=rig.clock() + 100.0)
    status = rig.status()
    assert status["policy"]["host_append_measured"] == 1
    assert rig.restorable(y) == published and status["policy"]["host_probe"]["taken"] == 1
    assert why in status["policy"]["reason"], status["policy"]["reason"]


def test_a_probe_whose_conversation_never_returns_lets_another_be_tried_when_its_wait_runs_out(rigs) -> None:
    """X is published to measure the host and never comes back. Y, held meanwhile, is
    published as the probe once the probe's wait has run out, before its own conversation
    returns (the wait's end is evidence that reopens what the prior held), and not a
    moment before."""
    from mlx_recovery_plugin.recovery.host_probe import PROBE_WAIT_S

    rig = rigs(block=64, a=A, budget_pct=100.0, slice_tokens=128)
    x, _ = _whole_then_next(rig, 58)
    rig.idle(until=rig.clock() + 100.0)
    assert rig.restorable(x) == 960
    y, _ = _whole_then_next(rig, 60)
    rig.idle(until=rig.clock() + 100.0)
    assert rig.restorable(y) == 0
    # X became the probe in the 200 s just idled: 1 s short of its wait, at the most.
    rig.clock.advance(PROBE_WAIT_S - 200.0 - 1.0)
    rig.idle(until=rig.clock() + 0.5)
    assert rig.restorable(y) == 0 and rig.status()["policy"]["host_probe"]["lapsed"] == 0
    rig.clock.advance(201.0)
    rig.idle(until=rig.clock() + 100.0)
    status = rig.status()
    assert rig.restorable(y) == 960, status["policy"]
    assert "to measure the host" in status["policy"]["reason"]
    assert status["policy"]["host_probe"] == {"job_id": status["policy"]["host_probe"]["job_id"], "taken": 2,
                                              "lapsed": 1}


def test_a_probe_that_lapsed_lets_a_paused_conversation_be_tried_at_its_next_turn(rigs) -> None:
    """Y, held while X is the probe, comes back after X's wait with a cheaper sparse turn:
    it is the probe at that turn, over its grown prefix."""
    from mlx_recovery_plugin.recovery.host_probe import PROBE_WAIT_S

    rig = rigs(block=64, a=A, budget_pct=100.0, slice_tokens=128)
    x, _ = _whole_then_next(rig, 62)
    rig.idle(until=rig.clock() + 100.0)
    assert rig.restorable(x) == 960
    y, y_next = _whole_then_next(rig, 64)
    rig.idle(until=rig.clock() + 100.0)
    assert rig.restorable(y) == 0
    rig.clock.advance(PROBE_WAIT_S)
    # A little cheaper a token this time: the turn is still a close call at the prior.
    rig.served(y_next, threshold=5000, prefill_s=0.92 * PROBE_SPARSE_S_PER_TOKEN * len(y_next))
    rig.idle(until=rig.clock() + 100.0)
    status = rig.status()
    assert rig.restorable(y_next) == 1088, status["policy"]
    assert "to measure the host" in status["policy"]["reason"]
    assert status["policy"]["host_probe"]["taken"] == 2


# -- publication at the conversation's return -----------------------------------------

# The host's sparse threshold here: a 1,000-token conversation that grows by more than
# 500 goes back to the sparse route unless its prefix is restored.
RETURN_THRESHOLD = 1500


def held_for_return(rigs) -> tuple[Rig, list[int]]:
    """A conversation served sparsely (6.6 s), then recovered whole in idle time, on a host
    that has told of a request before its lookup (an unrelated short one)."""
    rig = rigs(block=64, a=A, budget_pct=100.0, slice_tokens=128, threshold=RETURN_THRESHOLD)
    other = rig.host.submit("e", random_tokens(15, 50), max_tokens=2)
    rig.host.run_until_idle()
    assert rig.host.result(other).route == "dense"
    prompt = random_tokens(13, PROMPT)
    rig.served(prompt, threshold=RETURN_THRESHOLD, prefill_s=6.6)
    rig.idle(until=rig.clock() + 100.0)
    status = rig.status()
    assert status["policy"]["publishes_at_arrival"] is True
    (job,) = status["jobs"]
    assert (job["committed"], job["held_tokens"]) == (0, 960), "held whole, nothing published yet"
    assert rig.restorable(prompt) == 0 and status["live_job_id"] is None
    return rig, prompt


def test_a_held_prefix_is_published_when_its_conversation_returns_with_a_short_turn(rigs) -> None:
    """At a 10 ms token the 50 new tokens cost ~0.6 s densely against a ~7 s sparse rerun:
    published at the arrival, before the host's lookup, which restores all of it."""
    rig, prompt = held_for_return(rigs)
    nxt = rig.host.submit("e", [*prompt, *random_tokens(17, 50)], max_tokens=2, sparse=True)
    rig.host.run_until_idle()
    result = rig.host.result(nxt)
    assert (result.cached_tokens, result.route) == (960, "dense")
    counters = rig.status()["counters"]
    assert counters["arrival_publications"] == 1 and counters["tokens_recovered"] == 960
    assert rig.status()["jobs"] == []
    assert rig.status()["policy"]["at_last_request"]["verdict"] == "publish"


def test_a_held_prefix_stays_unpublished_when_its_conversation_returns_with_a_long_turn(rigs) -> None:
    """1,400 new tokens would cost ~17 s densely over the prefix, more than the ~16 s sparse
    rerun of the whole prompt: the prefix a guess of the growth would have published at
    the first gap (512 tokens, ~6 s) stays held, and the turn keeps its sparse route."""
    rig, prompt = held_for_return(rigs)
    longer = [*prompt, *random_tokens(18, 1400)]
    nxt = rig.host.submit("e", longer, max_tokens=2, sparse=True)
    rig.host.run_until_idle()
    result = rig.host.result(nxt)
    assert (result.cached_tokens, result.route) == (0, "sparse")
    status = rig.status()
    assert status["counters"]["arrival_publications"] == 0 and status["counters"]["tokens_recovered"] == 0
    assert status["policy"]["verdict"] == "hold"
    assert status["policy"]["at_last_request"]["verdict"] == "hold"
    (job,) = status["jobs"]
    assert job["held_tokens"] == 960 and job["tokens"] == len(longer), "the held blocks go on with the conversation"


@pytest.mark.parametrize("grown", [False, True], ids=["growth-unknown", "growth-seen"])
def test_before_any_conversation_grew_a_job_runs_on_where_the_next_prompts_length_decides(rigs, grown: bool) -> None:
    """X, twice as long, is run whole, so the slices' evidence reaches past Y's whole
    prefix and its next turn. At the guessed growth of 512 tokens, Y's verdict is "not yet
    clear" (a dense append of 6.6 s at the host's prior, from 6.0, against a sparse rerun
    of 5.3 s), on evidence that already reaches it. The host tells of each request before
    its lookup, and a growth of one block would pay, so while nothing on the server has
    grown Y is run whole, not paused, and its return 50 tokens later restores all of it.
    Once a conversation has grown (552 tokens, a dense turn over its cached prefix), the
    growth is no guess: Y pauses unrun and its return restores nothing."""
    rig = rigs(block=64, a=A, budget_pct=100.0, slice_tokens=128, threshold=5000)
    other = rig.host.submit("e", random_tokens(15, 50), max_tokens=2)
    rig.host.run_until_idle()
    assert rig.host.result(other).route == "dense"
    x = random_tokens(27, 2 * PROMPT)
    rig.served(x, threshold=5000, prefill_s=7.0)
    rig.idle(until=rig.clock() + 100.0)
    assert rig.status()["jobs"][0]["held_tokens"] == 1984
    if grown:
        rig.prefilled(random_tokens(28, 1512), cached=960, route=Route.DENSE, seconds=1.2 * (1512 - 960) * A)
    y = random_tokens(29, PROMPT + 1)
    rig.served(y, threshold=5000, prefill_s=3.51)
    rig.idle(until=rig.clock() + 100.0)
    status = rig.status()
    job_y = next(j for j in status["jobs"] if j["tokens"] == PROMPT + 1)
    assert status["policy"]["publishes_at_arrival"] is True
    if grown:
        assert "not yet clear" in (job_y["paused"] or ""), repr((job_y, status["policy"]))
        assert job_y["held_tokens"] == 0
    else:
        assert job_y["paused"] is None and job_y["held_tokens"] == 960, repr((job_y, status["policy"]))
    nxt = rig.host.submit("e", [*y, *random_tokens(17, 50)], max_tokens=2, sparse=True)
    rig.host.run_until_idle()
    assert rig.host.result(nxt).cached_tokens == (0 if grown else 960)


def test_the_prompt_is_not_asked_for_while_nothing_is_held(rigs) -> None:
    """A host tokenizes a text prompt at its door only for a plugin that asks."""
    from mlx_recovery_plugin.events import LookupDue

    rig = rigs(block=64, a=A, budget_pct=100.0, slice_tokens=128)
    asked: list[str] = []

    def prompt_tokens() -> tuple[int, ...]:
        asked.append("asked")
        return ()

    rig.plugin.prefix_lookup_due(event=LookupDue("e", "r1", MODEL, prompt_tokens))
    assert asked == [] and rig.status()["policy"]["publishes_at_arrival"] is True


def test_a_return_that_leaves_the_prompt_inside_its_last_block_restores_the_blocks_it_shares(rigs) -> None:
    """A chat template may end a turn's prompt otherwise than the next turn goes on: the
    held blocks up to where the two part are published, and the rest are not."""
    rig, prompt = held_for_return(rigs)
    nxt = rig.host.submit("e", [*prompt[:900], *random_tokens(19, 60)], max_tokens=2, sparse=True)
    rig.host.run_until_idle()
    assert rig.host.result(nxt).cached_tokens == 896
    assert rig.status()["counters"]["arrival_publications"] == 1


def test_past_the_byte_limit_a_prefix_is_published_in_idle_time_even_where_publications_wait(rigs) -> None:
    """Nothing may be held (the cap is 0): a host that tells of its lookups still gets the
    prefix in idle time, as before the wait for the conversation's return, not never."""
    rig = rigs(block=64, a=A, budget_pct=100.0, slice_tokens=128, max_held_mib=0.0, threshold=200)
    other = rig.host.submit("e", random_tokens(15, 50), max_tokens=2)
    rig.host.run_until_idle()
    assert rig.host.result(other).output_tokens
    prompt = random_tokens(15, PROMPT)
    rig.served(prompt, threshold=200, prefill_s=6.6)
    rig.idle(until=rig.clock() + 100.0)
    status = rig.status()
    assert status["policy"]["publishes_at_arrival"] is True
    assert rig.restorable(prompt) == 960 and status["counters"]["arrival_publications"] == 0


def test_a_partial_prefix_held_before_the_dense_cost_is_known_is_not_published_at_the_return(rigs) -> None:
    """Two slices ran (a few blocks of 960 tokens, at two contexts: the dense cost is not
    learned) when the conversation returns with 50 more tokens. Over what is held the turn
    would be dense (under 900 uncached, the threshold) at a cost nobody knows; the blocks
    stay held, the turn keeps its sparse route, and the job goes on in the next gap."""
    rig = rigs(block=64, a=A, budget_pct=100.0, slice_tokens=128, threshold=900)
    other = rig.host.submit("e", random_tokens(15, 50), max_tokens=2)
    rig.host.run_until_idle()
    assert rig.host.result(other).route == "dense"
    prompt = random_tokens(21, PROMPT)
    rig.served(prompt, threshold=900, prefill_s=6.6)
    rig.idle(until=rig.clock() + 1.0)  # two slices at 10 ms a token
    status = rig.status()
    (job,) = status["jobs"]
    held = job["held_tokens"]
    assert 1050 - held < 900 and status["policy"]["dense_s_per_token"] is None, status["policy"]
    nxt = rig.host.submit("e", [*prompt, *random_tokens(22, 50)], max_tokens=2, sparse=True)
    rig.host.run_until_idle()
    assert (rig.host.result(nxt).cached_tokens, rig.host.result(nxt).route) == (0, "sparse")
    status = rig.status()
    assert status["counters"]["arrival_publications"] == 0
    assert status["policy"]["at_last_request"]["verdict"] == "hold"
    assert status["jobs"][0]["held_tokens"] == held


class _MachineCounters:
    """The machine's CPU counters as :class:`MachineLoad` reads them, on the rig's clock:
    2 cores, ``others`` of them busy with other processes."""

    def __init__(self, clock: Any) -> None:
        self.clock, self.others = clock, 1.0
        self.busy = 0.0
        self.since = clock()

    def __call__(self) -> tuple[float, float, float]:
        now = self.clock()
        self.busy += self.others * (now - self.since)
        self.since = now
        return self.busy, 2 * now, 0.0


def test_a_stand_down_taken_under_load_is_judged_again_once_the_machine_is_quiet_with_no_slice_running(
    rigs,
) -> None:
    """Every job stood down while other processes loaded the machine: no slice runs, and
    before, nothing read the load until the next turn (the host offers no idle step after
    an answer of "nothing"), so the stand-down held through the quiet idle time after it
    (bench policy, 4096x2 loaded: the quiet next turn would have paid 2.2x). Now the
    engine asks for an idle step every few seconds while loaded, reads the load there,
    and the switch to quiet reopens the job."""
    from mlx_recovery_plugin.recovery.machine_load import MachineLoad

    rig = rigs(block=64, a=A, budget_pct=100.0, slice_tokens=128)
    counters = _MachineCounters(rig.clock)
    (service,) = rig.plugin._engines.values()
    service.judge._load = MachineLoad(counters)
    for _ in range(2):  # the load read from the start: the first turn is timed under it
        service.judge.look_at_load()
        rig.clock.advance(5.0)
    prompt = random_tokens(25, PROMPT)
    rig.served(prompt, threshold=5000, prefill_s=0.5)
    rig.idle(until=rig.clock() + 100.0)
    status = rig.status()
    assert status["jobs"][0]["stood_down"] and status["policy"]["load_regime"] == "busy", (status["jobs"], status["policy"]["reason"], status["policy"]["load_regime"])
    slices = status["counters"]["slices"]

    # The host offers idle steps only while one asks for them (as oMLX's idle driver does):
    # under load the stood-down job's engine asks every LOAD_RECHECK_S to read the load.
    rig.idle(until=rig.clock() + 20.0)
    assert rig.status()["counters"]["slices"] == slices  # still loaded: nothing new, nothing run

    counters.others = 0.0  # the other processes end; no turn comes
    rig.idle(until=rig.clock() + 100.0)
    status = rig.status()
    assert status["policy"]["load_regime"] == "quiet"
    assert status["counters"]["slices"] > slices, "the quiet machine judges the job on its own slices"
