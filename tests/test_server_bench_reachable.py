"""The server bench's best reachable: one pool of idle time for all the conversations."""

from __future__ import annotations

import pytest

from mlx_recovery_plugin.bench.server.reachable import best_reachable_steps, runner_rate
from mlx_recovery_plugin.bench.server.report import ArmRun, SessionResult, StepRecord

OFF = 1.0  # sparse off's later turn: the whole prefix cached
ON = 4.0  # sparse on's later turn


def _arms(rows: list[tuple[str, int, int, float, float]], rec_cached: dict[int, int] | None = None
          ) -> dict[str, ArmRun]:
    """Rows of (conversation, turn, prompt, sent, done) as the recovery arm timed them;
    first turns take 18 s sparse off (500 tokens/s) and 2 s sparse on, later ones ``OFF`` and
    ``ON``, with sparse off's whole previous prompt cached. ``rec_cached``: the cached
    tokens of the recovery arm's steps by index (sparse on's and elsewhere: 0)."""
    arms = {}
    for arm in ("sparse_off", "sparse_on", "sparse_recovery"):
        run = ArmRun(arm)
        previous: dict[str, int] = {}
        for i, (conv, turn, prompt, sent, done) in enumerate(rows):
            later = turn > 1
            cached = previous.get(conv, 0) if arm == "sparse_off" else (rec_cached or {}).get(i, 0)
            ttft = (OFF if arm == "sparse_off" else ON) if later else (18.0 if arm == "sparse_off" else 2.0)
            run.steps.append(StepRecord(i + 1, conv, turn, "", prompt, cached if later else 0, ttft, ttft, 0.0,
                                        sent_s=sent, done_s=done))
            if arm == "sparse_off":
                previous[conv] = prompt
        arms[arm] = run
    return arms


def _best(arms: dict[str, ArmRun], dense_rate: float | None = 1000.0) -> list[float]:
    return best_reachable_steps(arms["sparse_off"], arms["sparse_on"], arms["sparse_recovery"], 50.0, dense_rate)


# Two conversations of 9,000 tokens whose first turns end by 10 s and whose turn 2 both
# come at 30 s: 20 idle seconds at 1,000 tokens/s and 50 % re-read 10,000 tokens, enough
# for one of them.
TOGETHER = [("A", 1, 9000, 0.0, 8.0), ("B", 1, 9000, 8.0, 10.0), ("A", 2, 9600, 30.0, 31.0),
            ("B", 2, 9600, 30.5, 31.5)]


def test_conversations_share_the_idle_time_so_only_one_of_two_arriving_together_is_reachable() -> None:
    """Before, each conversation had the 20 s to itself and both turn 2 counted at sparse
    off's time (a best reachable of 2 + 2 + 1 + 1 s)."""
    best = _best(_arms(TOGETHER))
    assert best == [2.0, 2.0, OFF, ON]
    result = SessionResult("concurrent", "test", _arms(TOGETHER), concurrent=True, dense_rate=1000.0)
    assert result.sums()["best_reachable"] == pytest.approx(2.0 + 2.0 + OFF + ON)


def test_with_twice_the_idle_time_both_conversations_are_reachable() -> None:
    rows = [*TOGETHER[:2], ("A", 2, 9600, 50.0, 51.0), ("B", 2, 9600, 50.5, 51.5)]
    assert _best(_arms(rows)) == [2.0, 2.0, OFF, OFF]


def test_of_turns_sent_together_the_one_recovery_reached_takes_the_pool() -> None:
    """B's turn 2 was sent after A's but recovery restored B's prefix, not A's: the pool
    paid for B's, and A's, beside it, is not reachable as well."""
    arms = _arms(TOGETHER, rec_cached={3: 8960})
    assert _best(arms) == [2.0, 2.0, ON, OFF]


def test_a_turn_the_pool_cannot_cover_takes_nothing_from_it() -> None:
    """A's turn 2 at 20 s (10 idle seconds: 5,000 tokens) is out of reach; the pool is
    still whole for B's turn 2 at 30 s (10,000 tokens)."""
    rows = [*TOGETHER[:2], ("A", 2, 9600, 20.0, 21.0), ("B", 2, 9600, 31.0, 32.0)]
    assert _best(_arms(rows)) == [2.0, 2.0, ON, OFF]


def _with_cost_model(arms: dict[str, ArmRun], a: float, b: float) -> None:
    arms["sparse_recovery"].final_status = {"policy": {"dense_s_per_token": a, "dense_s_per_token_per_context": b}}


def test_a_runner_faster_than_the_servers_prefill_widens_the_pool() -> None:
    """At the balance's 500 tokens/s the 20 s re-read 5,000 tokens: neither turn 2 is
    reachable. Recovery's own cost model says its runner reads 9,000 tokens at 1 ms a
    token (1,000 tokens/s): one of them is."""
    arms = _arms(TOGETHER)
    assert _best(arms, dense_rate=500.0) == [2.0, 2.0, ON, ON]
    _with_cost_model(arms, 0.0008, 0.0002 / 4500)  # 0.8 ms a token + 0.2 ms at 4,500 tokens of context
    assert runner_rate(arms["sparse_recovery"], 9000) == pytest.approx(1000.0)
    assert _best(arms, dense_rate=500.0) == [2.0, 2.0, OFF, ON]


def test_a_runner_slower_than_the_balance_does_not_shrink_the_pool() -> None:
    arms = _arms(TOGETHER)
    _with_cost_model(arms, 0.01, 0.0)  # 100 tokens/s
    assert _best(arms) == [2.0, 2.0, OFF, ON]


def test_without_a_fitted_cost_model_there_is_no_runner_rate() -> None:
    arms = _arms(TOGETHER)
    assert runner_rate(arms["sparse_recovery"], 9000) is None
    arms["sparse_recovery"].final_status = {"policy": {"dense_s_per_token": None, "dense_s_per_token_per_context": None}}
    assert runner_rate(arms["sparse_recovery"], 9000) is None
