"""``bench server``'s concurrent session: several conversations on their own schedules,
their turns overlapping on one server. Cheap parts with a stand-in client (the threading,
the records, errors), the best reachable from the recovery arm's real idle time, and one
short concurrent session on the real oMLX server when it is installed."""

from __future__ import annotations

import threading
import time
from pathlib import Path
from types import SimpleNamespace

import pytest

from mlx_recovery_plugin.bench.server import process, sessions
from mlx_recovery_plugin.bench.server.concurrent import ORDER_WAIT_S, serve_concurrently
from mlx_recovery_plugin.bench.server.report import (
    ArmRun,
    BenchReport,
    SessionResult,
    StepRecord,
    best_reachable_steps,
    format_session,
)


def test_a_concurrent_session_staggers_its_conversations_and_lists_steps_by_send_time() -> None:
    shape = sessions.Shape(context_chars=2000, turns=3)
    session = sessions.build("concurrent", shape, think_s=30.0, conversations=3)
    assert session.concurrent
    assert [s.conversation for s in session.steps if s.turn == 1] == ["A", "B", "C"]
    starts = {s.conversation: s.start_s for s in session.steps}
    assert starts["A"] == 0.0 and 7.5 <= starts["B"] <= 12.5 and 17.5 <= starts["C"] <= 22.5
    for name in "ABC":
        own = [s for s in session.steps if s.conversation == name]
        assert [s.turn for s in own] == [1, 2, 3]
        lengths = [sum(len(m["content"]) for m in s.messages) for s in own]
        assert lengths == sorted(lengths) and lengths[0] > 2000
        assert all(15.0 <= s.think_s <= 45.0 for s in own[:-1]) and own[-1].think_s == 0.0
    # Different conversations, not one conversation sent three times.
    assert len({s.messages[1]["content"] for s in session.steps if s.turn == 1}) == 3
    with pytest.raises(ValueError, match="at least one"):
        sessions.concurrent(shape, 30.0, conversations=0)


def _schedule(session: sessions.Session) -> list[tuple[str, int, float, float]]:
    return [(s.conversation, s.turn, s.start_s, s.think_s) for s in session.steps]


def test_another_seed_is_another_schedule_of_the_same_conversations() -> None:
    shape = sessions.Shape(context_chars=500, turns=3)
    first = sessions.build("concurrent", shape, 30.0, 3, seed=11)
    assert _schedule(sessions.build("concurrent", shape, 30.0, 3, seed=11)) == _schedule(first)
    other = sessions.build("concurrent", shape, 30.0, 3, seed=12)
    assert _schedule(other) != _schedule(first)
    assert {s.start_s for s in other.steps if s.conversation == "B"} != {s.start_s for s in first.steps
                                                                         if s.conversation == "B"}
    # Same prompts, turn for turn: only the timing differs.
    key = lambda session: sorted((s.conversation, s.turn, s.messages) for s in session.steps)  # noqa: E731
    assert key(other) == key(first)


def _chunk(text: str | None = None, usage=None) -> SimpleNamespace:
    delta = SimpleNamespace(content=text)
    return SimpleNamespace(choices=[SimpleNamespace(delta=delta)] if text is not None else [], usage=usage)


class OneServer:
    """A stand-in server that answers a conversation's first turn only once every
    conversation's first turn has arrived: served one after another, the session would
    never end (the barrier breaks), so finishing proves the turns overlapped."""

    def __init__(self, conversations: int, fail_on: str | None = None) -> None:
        self.first_turns = threading.Barrier(conversations, timeout=10.0)
        self.fail_on = fail_on
        self.lock = threading.Lock()
        self.served: list[int] = []

    def client(self) -> SimpleNamespace:
        def create(*, messages, **kw):
            prompt = sum(len(m["content"]) for m in messages)
            if self.fail_on and self.fail_on in messages[-1]["content"]:
                raise ConnectionError("the server went away")
            if len(messages) == 3:  # a first turn: system, context, question
                self.first_turns.wait()
            with self.lock:
                self.served.append(prompt)
            usage = SimpleNamespace(prompt_tokens=prompt, completion_tokens=1,
                                    prompt_tokens_details=SimpleNamespace(cached_tokens=len(self.served)))
            return iter([_chunk("x"), _chunk(usage=usage)])

        return SimpleNamespace(chat=SimpleNamespace(completions=SimpleNamespace(create=create)))


def _tiny_concurrent(conversations: int = 3, turns: int = 2) -> sessions.Session:
    session = sessions.concurrent(sessions.Shape(context_chars=300, turns=turns), think_s=0.05,
                                  conversations=conversations)
    return session


def test_conversations_are_served_at_once_and_recorded_in_the_sessions_step_order() -> None:
    session = _tiny_concurrent()
    server = OneServer(conversations=3)
    statuses: list[int] = []

    def read_status() -> dict:
        statuses.append(1)
        return {"process": {"tokens_recovered": len(statuses), "tokens_run": 10}}

    run = ArmRun("sparse_recovery")
    serve_concurrently(session, make_client=server.client, model="m", max_tokens=1, absent_cached_is_zero=False,
                       read_status=read_status, progress=lambda line: None, tag="t", run=run)
    assert [(r.conversation, r.turn) for r in run.steps] == [(s.conversation, s.turn) for s in session.steps]
    assert [r.prompt_tokens for r in run.steps] == [sum(len(m["content"]) for m in s.messages) for s in session.steps]
    assert all(r.sent_s is not None and r.done_s is not None and r.done_s >= r.sent_s for r in run.steps)
    assert all(r.status is not None for r in run.steps)
    assert run.final_status == {"tokens_recovered": len(session.steps) + 1, "tokens_run": 10, "tokens_held": None,
                                "debt": None, "slices": None, "budget_share_used": 0.0}
    assert sorted(server.served) == sorted(r.prompt_tokens for r in run.steps)


def test_a_failed_turn_stops_the_other_conversations_and_is_raised() -> None:
    session = _tiny_concurrent(conversations=2, turns=3)
    second_of_b = next(s for s in session.steps if s.conversation == "B" and s.turn == 2)
    server = OneServer(conversations=2, fail_on=second_of_b.messages[-1]["content"])
    run = ArmRun("sparse_on")
    with pytest.raises(ConnectionError, match="went away"):
        serve_concurrently(session, make_client=server.client, model="m", max_tokens=1, absent_cached_is_zero=False,
                           read_status=None, progress=lambda line: None, tag="t", run=run)
    assert run.steps == []  # nothing half-recorded is reported
    assert len(server.served) < len(session.steps)


def test_a_turn_is_not_sent_before_the_other_arm_sent_it_nor_before_its_own_think_time() -> None:
    """Two conversations, two turns each, about 0.05 s think. B's turn 2 is held until 0.6 s
    into the session (the other arm sent it then); A's turn 2 was sent at 0 s there, so
    it goes on its own schedule: after A's first answer and its think time."""
    session = _tiny_concurrent(conversations=2, turns=2)
    index = {(s.conversation, s.turn): i for i, s in enumerate(session.steps)}
    not_before: list[float | None] = [None] * len(session.steps)
    not_before[index[("B", 2)]] = 0.6
    not_before[index[("A", 2)]] = 0.0
    server = OneServer(conversations=2)
    run = ArmRun("sparse_recovery")
    serve_concurrently(session, make_client=server.client, model="m", max_tokens=1, absent_cached_is_zero=False,
                       read_status=None, progress=lambda line: None, tag="t", run=run, not_before=not_before)
    sent = {(r.conversation, r.turn): r for r in run.steps}
    assert sent[("B", 2)].sent_s >= 0.6
    a1, a2 = sent[("A", 1)], sent[("A", 2)]
    think = session.steps[index[("A", 1)]].think_s  # the seeded think time, about 0.05 s
    assert a2.sent_s >= a1.done_s + think - 0.002 and a2.sent_s < 0.5  # records are rounded to ms
    with pytest.raises(ValueError, match="arrival times"):
        serve_concurrently(session, make_client=server.client, model="m", max_tokens=1, absent_cached_is_zero=False,
                           read_status=None, progress=lambda line: None, tag="t", run=ArmRun("x"), not_before=[0.0])


def _record(step: int, conv: str, turn: int, prompt: int, ttft: float, sent: float, done: float) -> StepRecord:
    return StepRecord(step, conv, turn, "", prompt, 0, ttft, ttft, 0.0, sent_s=sent, done_s=done)


def test_the_best_reachable_of_a_concurrent_session_counts_only_time_with_no_request_in_flight() -> None:
    """Dense rate 1,000 tokens/s (A's first turn; B's queued and is slower), budget 50 %.
    A's turn 2 comes 20 s after its first answer, but B's first turn keeps the server busy
    for 8 of them: 12 s idle re-read 6,000 tokens, short of A's 9,000, so it counts at
    sparse on's time. B's turn 2 had 30 s, 29 of them idle: 14,500 tokens, enough."""
    timings = [("A", 1, 9000, 0.0, 9.0), ("B", 1, 9000, 5.0, 17.0), ("A", 2, 9600, 29.0, 30.0),
               ("B", 2, 9600, 47.0, 48.0)]
    off_ttft = [9.0, 18.0, 1.0, 1.1]
    on_ttft = [2.0, 4.0, 3.0, 3.2]
    arms = {}
    for arm, ttfts in (("sparse_off", off_ttft), ("sparse_on", on_ttft), ("sparse_recovery", on_ttft)):
        run = ArmRun(arm)
        for i, ((conv, turn, prompt, sent, done), ttft) in enumerate(zip(timings, ttfts)):
            run.steps.append(_record(i + 1, conv, turn, prompt, ttft, sent, done))
        arms[arm] = run
    # Only the recovery arm's idle time counts: the others' records carry no times here.
    for arm in ("sparse_off", "sparse_on"):
        for rec in arms[arm].steps:
            rec.sent_s = rec.done_s = None
    best = best_reachable_steps(arms["sparse_off"], arms["sparse_on"], arms["sparse_recovery"], 50.0)
    assert best == [2.0, 4.0, 3.0, 1.1]
    result = SessionResult("concurrent", "test", arms, concurrent=True)
    assert result.sums()["best_reachable"] == pytest.approx(10.1)


def _arms_of(on: list[tuple[str, int, float, float, float]],
             rec: list[tuple[str, int, float, float, float]]) -> dict[str, ArmRun]:
    """Sparse off and on from ``on``, recovery from ``rec``: rows of (conversation, turn,
    sent, ttft, done), 9,000-token prompts."""
    return {arm: ArmRun(arm, steps=[_record(i + 1, c, t, 9000, ttft, sent, done)
                                    for i, (c, t, sent, ttft, done) in enumerate(rows)])
            for arm, rows in (("sparse_off", on), ("sparse_on", on), ("sparse_recovery", rec))}


def test_the_worst_later_turn_no_queue_touched_leaves_out_turns_that_queued_in_either_arm() -> None:
    """B's turn 2 arrived while A's was in flight in the recovery arm and took 3x sparse
    on's: the worst later turn says 3x, the worst of those no other request touched (A's
    turn 2 and B's turn 3, alone in both arms) says 1.05x."""
    on = [("A", 1, 0.0, 5.0, 5.0), ("B", 1, 10.0, 5.0, 15.0), ("A", 2, 20.0, 4.0, 24.0),
          ("B", 2, 30.0, 2.0, 32.0), ("B", 3, 40.0, 2.0, 42.0)]
    rec = [("A", 1, 0.0, 5.0, 5.0), ("B", 1, 10.0, 5.0, 15.0), ("A", 2, 20.0, 4.2, 31.0),
           ("B", 2, 30.0, 6.0, 36.0), ("B", 3, 40.0, 2.0, 42.0)]
    arms = _arms_of(on, rec)
    result = SessionResult("concurrent", "test", arms, concurrent=True)
    assert result.worst_later_turn() == pytest.approx(3.0)
    assert result.worst_later_turn(alone_only=True) == pytest.approx(1.05)


def test_with_sparse_ons_arrivals_the_worst_later_turn_is_taken_over_the_turns_sent_when_sparse_on_sent_them() -> None:
    """A's turn 2 queued behind B's turn 1 in both arms (sent at 20 s in both) and took
    1.2x; B's turn 2 came 4 s late with recovery (its first answer came later) and took
    2x: that one says what recovery did to the turn before it, not to this one."""
    on = [("A", 1, 0.0, 5.0, 5.0), ("B", 1, 18.0, 5.0, 23.0), ("A", 2, 20.0, 5.0, 25.0),
          ("B", 2, 40.0, 2.0, 42.0)]
    rec = [("A", 1, 0.0, 5.0, 5.0), ("B", 1, 18.0, 9.0, 27.0), ("A", 2, 20.1, 6.0, 26.1),
           ("B", 2, 44.0, 4.0, 48.0)]
    arms = _arms_of(on, rec)
    result = SessionResult("concurrent", "test", arms, concurrent=True)
    assert not result.arrivals_replayed()
    text = "\n".join(format_session(result))
    assert "sent when sparse on sent them" not in text
    arms["sparse_recovery"].arrivals_from = "sparse_on"
    assert result.worst_later_turn() == pytest.approx(2.0)
    assert result.worst_later_turn(alike_only=True) == pytest.approx(1.2)
    text = "\n".join(format_session(result))
    assert "arrivals from sparse on" in text and "of the 1 later turns sent when sparse on sent them, the worst 1.20x" in text
    summary = BenchReport("t", "d", "h", "b", 50.0, 30.0, 1.0, 2, "auto", sessions=[result]).to_json()["summary"]
    assert summary["concurrent"]["worst_alike_later_turn_vs_on"] == pytest.approx(1.2)


def test_two_turns_that_queued_together_in_both_arms_are_compared_summed_whatever_their_order() -> None:
    """A's and B's turn 2 arrive together in both arms: sparse on served A first (5 s,
    then B 10 s), recovery B first (B 5 s, then A 10.5 s): A's turn alone reads 2.1x,
    the queue 15.5 s against 15 s. C's first turn queued behind A's with recovery and ran
    alone with sparse on: not one queue in both arms, left out. C's turn 2 ran alone in
    both (a queue of one), and once it takes twice as long it is the worst."""
    on = [("A", 1, 0.0, 5.0, 5.0), ("C", 1, 6.0, 5.0, 11.0), ("A", 2, 30.0, 5.0, 35.1),
          ("B", 2, 30.0, 10.0, 40.1), ("C", 2, 50.0, 3.0, 53.0)]
    rec = [("A", 1, 0.0, 5.0, 5.0), ("C", 1, 4.0, 6.0, 10.0), ("A", 2, 30.0, 10.5, 40.6),
           ("B", 2, 30.0, 5.0, 35.1), ("C", 2, 50.0, 3.1, 53.1)]
    arms = _arms_of(on, rec)
    result = SessionResult("concurrent", "test", arms, concurrent=True)
    assert result.worst_later_turn() == pytest.approx(2.1)
    assert result.worst_same_queue() == pytest.approx(15.5 / 15.0)
    text = "\n".join(format_session(result))
    assert "of the 2 queues the same turns formed in both arms (3 turns), summed, the worst 1.03x" in text
    summary = BenchReport("t", "d", "h", "b", 50.0, 30.0, 1.0, 2, "auto", sessions=[result]).to_json()["summary"]
    assert summary["concurrent"]["worst_same_queue_vs_on"] == pytest.approx(15.5 / 15.0)
    from mlx_recovery_plugin.bench.server.repeats import RepeatPair, repeat_lines, repeats_summary

    pairs = [RepeatPair(seed, "sparse_on", arms["sparse_on"], arms["sparse_recovery"]) for seed in (11, 12)]
    assert repeats_summary(pairs)["same_queues"] == 4
    assert repeats_summary(pairs)["same_queues_above_1_1"] == 0
    arms["sparse_recovery"].steps[4].ttft_s = 6.2
    assert result.worst_same_queue() == pytest.approx(6.2 / 3.0)
    assert repeats_summary(pairs)["same_queues_above_1_1"] == 2
    assert any("worst queue against sparse on, summed" in line and "2.07x (4 such queues" in line
               for line in repeat_lines(pairs))


def test_an_unqueued_dense_rate_lets_the_best_reachable_count_turns_the_queued_rate_would_not() -> None:
    """Sparse off's first turns queued behind each other (9,000 tokens in 18 s and 27 s: at
    most 500 tokens/s); with the balance's unqueued rate of 2,000 tokens/s, A's 12 idle
    seconds at 50 % re-read 12,000 tokens, enough for its 9,000."""
    timings = [("A", 1, 9000, 0.0, 9.0), ("B", 1, 9000, 5.0, 17.0), ("A", 2, 9600, 29.0, 30.0)]
    arms = {}
    for arm, ttfts in (("sparse_off", [18.0, 27.0, 1.0]), ("sparse_on", [2.0, 4.0, 3.0]),
                       ("sparse_recovery", [2.0, 4.0, 3.0])):
        run = ArmRun(arm)
        for i, ((conv, turn, prompt, sent, done), ttft) in enumerate(zip(timings, ttfts)):
            run.steps.append(_record(i + 1, conv, turn, prompt, ttft, sent, done))
        arms[arm] = run
    queued = best_reachable_steps(arms["sparse_off"], arms["sparse_on"], arms["sparse_recovery"], 50.0)
    assert queued == [2.0, 4.0, 3.0]
    unqueued = best_reachable_steps(arms["sparse_off"], arms["sparse_on"], arms["sparse_recovery"], 50.0,
                                    dense_rate=2000.0)
    assert unqueued == [2.0, 4.0, 1.0]
    result = SessionResult("concurrent", "test", arms, concurrent=True, dense_rate=2000.0)
    assert result.sums()["best_reachable"] == pytest.approx(7.0)


def test_the_dense_rate_from_the_balance_falls_with_the_prompts_length() -> None:
    from mlx_recovery_plugin.bench.server.run import dense_rate

    flat = {"chunk": 256, "context": 8192, "short_s": 0.256, "long_s": 0.256}  # 1 ms a token at any context
    assert dense_rate(flat, 4096) == pytest.approx(1000.0)
    steep = {"chunk": 256, "context": 8192, "short_s": 0.256, "long_s": 0.512}  # 2 ms a token at 8,192
    assert dense_rate(steep, 8192) == pytest.approx(8192 / (8.192 + 8.192 / 2))
    assert dense_rate(steep, 8192) < dense_rate(steep, 1024) < 1000.0
    assert dense_rate(None, 8192) is None and dense_rate(flat, 0) is None


def test_the_bench_takes_the_number_of_conversations() -> None:
    from mlx_recovery_plugin.bench.server.cli import _config
    from mlx_recovery_plugin.cli import build_parser

    args = build_parser().parse_args(["bench", "server", "--sessions", "concurrent", "--conversations", "4"])
    assert _config(args, Path("/tmp/unused")).conversations == 4
    args = build_parser().parse_args(["bench", "server", "--conversations", "0"])
    with pytest.raises(ValueError, match="at least 1"):
        _config(args, Path("/tmp/unused"))


def test_two_conversations_at_once_on_the_real_server_are_both_recovered(tmp_path: Path) -> None:
    from mlx_recovery_plugin.hosts.omlx.members import FLYTO_MLX

    for module in (FLYTO_MLX.server_module, "openai", "uvicorn", "python_multipart", "psutil", "tabulate"):
        pytest.importorskip(module, reason="CI installs the server's packages in .venv-omlx")
    from mlx_recovery_plugin.bench.server.hosts import OMLX
    from mlx_recovery_plugin.bench.server.models import write_models
    from mlx_recovery_plugin.bench.server.run import BenchConfig, run_arm
    from mlx_recovery_plugin.testing.tiny_model import TinyModelSpec

    pair = write_models(tmp_path / "models", TinyModelSpec(arch="llama", seed=0),
                        TinyModelSpec(arch="llama", num_layers=1, seed=7))
    # The whole idle time (budget 100 %): at 50 % the gaps re-read 7,680 of B's 8,704
    # tokens on this project's machine some days; what is checked is that what was
    # recovered for each conversation is restored, not how fast.
    config = BenchConfig(workdir=tmp_path, pair=pair, budget_pct=100.0, publish_policy="always", host=OMLX)
    session = sessions.concurrent(sessions.Shape(turns=2), think_s=12.0, conversations=2)
    off = run_arm(config, pair, session, "sparse_off", tmp_path / "off", lambda line: None)
    rec = run_arm(config, pair, session, "sparse_recovery", tmp_path / "rec", lambda line: None)

    firsts = [s for s in rec.steps if s.turn == 1]
    assert [s.cached_tokens for s in firsts] == [0, 0] and all(s.prompt_tokens > 8192 for s in firsts)
    assert rec.sparse_requests is not None and rec.sparse_requests >= 2, "both first turns took the sparse route"
    assert off.sparse_requests == 0
    block = 256
    for a, c in zip(off.steps, rec.steps):
        if c.turn > 1:
            assert abs(c.cached_tokens - a.cached_tokens) <= block, (off.steps, rec.steps)
    assert rec.final_status is not None and rec.final_status["tokens_recovered"] >= 2 * (8192 - block)
    # The host's own sparse-route seconds, read from its log: none with the route off.
    assert off.host_sparse_s == 0.0 and rec.host_sparse_s is not None and rec.host_sparse_s > 0.0
    for run in (off, rec):
        assert not run.traceback_in_log, Path(run.log_path).read_text()[-3000:]
    assert not process._live


class SlowFirstAnswer:
    """A stand-in server that answers at once, except one conversation's first turn,
    which it holds ``delay_s``."""

    def __init__(self, slow_question: str, delay_s: float) -> None:
        self.slow_question, self.delay_s = slow_question, delay_s

    def client(self) -> SimpleNamespace:
        def create(*, messages, **kw):
            if messages[-1]["content"] == self.slow_question:
                time.sleep(self.delay_s)
            usage = SimpleNamespace(prompt_tokens=1, completion_tokens=1,
                                    prompt_tokens_details=SimpleNamespace(cached_tokens=0))
            return iter([_chunk("x"), _chunk(usage=usage)])

        return SimpleNamespace(chat=SimpleNamespace(completions=SimpleNamespace(create=create)))


@pytest.mark.parametrize("delay_s", [0.35, 1.6])
def test_turns_the_other_arm_sent_together_reach_the_host_in_its_order_waiting_a_bounded_time(delay_s: float) -> None:
    """The other arm sent B's turn 2 at 0.25 s and A's at 0.30 s. Here B's first answer is
    slow, so A's turn 2 is due first: it waits for B's, as the host would otherwise serve
    them in the other order (on the real server the turn sent second took 1.4-1.9x as
    long). A conversation that is much slower here holds it back 1 s at most."""
    session = _tiny_concurrent(conversations=2, turns=2)
    index = {(s.conversation, s.turn): i for i, s in enumerate(session.steps)}
    not_before: list[float | None] = [0.0] * len(session.steps)
    not_before[index[("B", 2)]] = 0.25
    not_before[index[("A", 2)]] = 0.30
    slow = session.steps[index[("B", 1)]].messages[-1]["content"]
    run = ArmRun("sparse_recovery")
    serve_concurrently(session, make_client=SlowFirstAnswer(slow, delay_s).client, model="m", max_tokens=1,
                       absent_cached_is_zero=False, read_status=None, progress=lambda line: None, tag="t", run=run,
                       not_before=not_before)
    sent = {(r.conversation, r.turn): r.sent_s for r in run.steps}
    if delay_s < 0.5:
        assert sent[("B", 2)] >= delay_s and sent[("A", 2)] >= sent[("B", 2)]
        # And the other arm's spacing: sent 0.05 s after B's there, A's goes as far after here.
        assert sent[("A", 2)] - sent[("B", 2)] >= 0.05 - 0.005
    else:
        assert 0.3 + ORDER_WAIT_S - 0.01 <= sent[("A", 2)] < sent[("B", 2)]


class _Load:
    """A stand-in for the competing load (what the test is about is its window): when it
    started and stopped, on which thread."""

    def __init__(self) -> None:
        self.events: list[tuple[str, float, str]] = []
        self.running = False

    def start(self) -> None:
        self.running = True
        self.events.append(("start", time.monotonic(), threading.current_thread().name))

    def stop(self) -> None:
        if self.running:
            self.events.append(("stop", time.monotonic(), threading.current_thread().name))
        self.running = False


def _quick_client(fail_on: str | None = None, sent: list[tuple[str, float]] | None = None):
    def make() -> SimpleNamespace:
        def create(*, messages, **kw):
            if sent is not None:
                sent.append((messages[-1]["content"], time.monotonic()))
            if fail_on and fail_on in messages[-1]["content"]:
                raise ConnectionError("the server went away")
            prompt = sum(len(m["content"]) for m in messages)
            usage = SimpleNamespace(prompt_tokens=prompt, completion_tokens=1,
                                    prompt_tokens_details=SimpleNamespace(cached_tokens=0))
            return iter([_chunk("x"), _chunk(usage=usage)])

        return SimpleNamespace(chat=SimpleNamespace(completions=SimpleNamespace(create=create)))

    return make


def test_a_load_runs_from_the_start_until_the_first_conversation_sends_its_second_turn() -> None:
    """``--load-first-turn`` in a concurrent session: the load is on for every turn sent
    before the first conversation's second turn, off from that turn on, and started and
    stopped on the caller's thread only."""
    session = sessions.concurrent(sessions.Shape(context_chars=300, turns=2), think_s=1.0, conversations=2)
    load = _Load()
    run = ArmRun("sparse_recovery")
    serve_concurrently(session, make_client=_quick_client(), model="m", max_tokens=1, absent_cached_is_zero=False,
                       read_status=None, progress=lambda line: None, tag="t", run=run, load=load)  # type: ignore[arg-type]
    assert [e[0] for e in load.events] == ["start", "stop"]
    assert {e[2] for e in load.events} == {threading.current_thread().name}
    by_turn = {(r.conversation, r.turn): r for r in run.steps}
    assert run.load_s is not None and run.load_s[0] == 0.0
    assert by_turn[("A", 2)].sent_s >= run.load_s[1]  # the first conversation's second turn: quiet
    assert [(r.conversation, r.turn, r.loaded) for r in run.steps] == [
        (r.conversation, r.turn, r.sent_s < run.load_s[1]) for r in run.steps]
    assert by_turn[("A", 1)].loaded and by_turn[("B", 1)].loaded  # B starts ~0.5 s in, A's turn 2 ~0.95 s
    assert not by_turn[("A", 2)].loaded and not by_turn[("B", 2)].loaded


def test_the_load_is_stopped_when_a_turn_fails() -> None:
    session = sessions.concurrent(sessions.Shape(context_chars=300, turns=2), think_s=0.4, conversations=2)
    first = session.steps[0].messages[-1]["content"]
    load = _Load()
    with pytest.raises(ConnectionError, match="went away"):
        serve_concurrently(session, make_client=_quick_client(fail_on=first), model="m", max_tokens=1,
                           absent_cached_is_zero=False, read_status=None, progress=lambda line: None, tag="t",
                           run=ArmRun("sparse_on"), load=load)  # type: ignore[arg-type]
    assert [e[0] for e in load.events] == ["start", "stop"] and not load.running


def test_idle_time_under_the_load_counts_at_the_loaded_rate_in_the_best_reachable() -> None:
    """As the test above it (budget 50 %, 9,000-token prompts, a quiet dense rate of 1,000
    tokens/s), but a load ran until 44 s and sparse off's loaded first turn read 500
    tokens/s: B's 29 idle seconds before its turn 2, 26 of them under the load, re-read
    8,000 tokens, short of 9,000 (14,500 without the load): that turn counts at sparse
    on's time."""
    timings = [("A", 1, 9000, 0.0, 9.0), ("B", 1, 9000, 5.0, 17.0), ("A", 2, 9600, 29.0, 30.0),
               ("B", 2, 9600, 47.0, 48.0)]
    arms = {}
    for arm, ttfts in (("sparse_off", [18.0, 18.0, 1.0, 1.1]), ("sparse_on", [2.0, 4.0, 3.0, 3.2]),
                       ("sparse_recovery", [2.0, 4.0, 3.0, 3.2])):
        run = ArmRun(arm)
        for i, ((conv, turn, prompt, sent, done), ttft) in enumerate(zip(timings, ttfts)):
            run.steps.append(_record(i + 1, conv, turn, prompt, ttft, sent, done))
        arms[arm] = run
    arms["sparse_off"].steps[0].loaded = True
    quiet = best_reachable_steps(arms["sparse_off"], arms["sparse_on"], arms["sparse_recovery"], 50.0, 1000.0)
    assert quiet == [2.0, 4.0, 3.0, 1.1]
    arms["sparse_recovery"].load_s = (0.0, 44.0)
    loaded = best_reachable_steps(arms["sparse_off"], arms["sparse_on"], arms["sparse_recovery"], 50.0, 1000.0)
    assert loaded == [2.0, 4.0, 3.0, 3.2]
