"""Recovery jobs: lineage (append extends, fork replaces, other sessions coexist), the
bounded book, working order and fault back-off."""

from __future__ import annotations

import pytest
from hypothesis import given
from hypothesis import strategies as st

from mlx_recovery_plugin.recovery.jobs import (
    JobBook,
    Relation,
    common_prefix_len,
    relate,
)
from mlx_recovery_plugin.testing.clock import random_tokens

B = 16


def served(book: JobBook, tokens: tuple[int, ...], start: int = 0):
    return book.offer(tokens, start, len(tokens))


def test_common_prefix_len_counts_shared_leading_tokens_across_chunk_sizes() -> None:
    a = tuple(random_tokens(1, 1000))
    for cut in (0, 1, 255, 256, 257, 999):
        b = a[:cut] + tuple((t + 1) % 256 for t in a[cut:])
        assert common_prefix_len(a, b) == cut
    assert common_prefix_len(a, a) == 1000
    assert common_prefix_len(a, a[:300]) == 300


@given(st.lists(st.integers(0, 3), max_size=40), st.lists(st.integers(0, 3), max_size=40))
def test_common_prefix_len_matches_the_definition(a: list[int], b: list[int]) -> None:
    n = 0
    while n < min(len(a), len(b)) and a[n] == b[n]:
        n += 1
    assert common_prefix_len(a, b) == n


def test_relation_of_append_prefix_fork_and_other_session() -> None:
    job = tuple(random_tokens(1, 100))
    assert relate(job, job + tuple(random_tokens(2, 30)), B) is Relation.EXTENDS
    assert relate(job, job, B) is Relation.EXTENDS
    assert relate(job, job[:40], B) is Relation.CONTAINED
    # Shares most of the job, then differs: an edited last turn.
    assert relate(job, job[:80] + tuple(random_tokens(3, 40)), B) is Relation.FORKS
    # Shares only a short head (a system prompt): another session.
    assert relate(job, job[:20] + tuple(random_tokens(4, 200)), B) is Relation.UNRELATED
    # Shares less than one block: never a fork, however short the job.
    assert relate(job[:20], job[:10] + tuple(random_tokens(5, 10)), B) is Relation.UNRELATED


def test_first_served_range_queues_a_job_with_the_host_prefix_as_committed() -> None:
    book = JobBook(B, max_jobs=4)
    tokens = tuple(random_tokens(1, 100))
    offer = book.offer(tokens, 35, 100)
    assert offer.relation is Relation.UNRELATED and offer.job is not None
    job = offer.job
    assert job.tokens == tokens
    assert job.committed == 32  # floored to a whole block
    assert job.target_end == 100
    assert job.publish_end(B) == 96
    assert job.debt == 68
    assert len(book) == 1


def test_served_range_without_a_new_whole_block_queues_nothing() -> None:
    book = JobBook(B, max_jobs=4)
    offer = book.offer(tuple(random_tokens(1, 40)), 32, 40)
    assert offer.job is None and len(book) == 0


def test_append_of_the_same_conversation_extends_the_job_and_keeps_its_progress() -> None:
    book = JobBook(B, max_jobs=4)
    first = tuple(random_tokens(1, 100))
    job = served(book, first).job
    assert job is not None
    job.committed = 64
    second = first + tuple(random_tokens(2, 50))
    offer = book.offer(second, 64, len(second))
    assert offer.relation is Relation.EXTENDS and offer.job is job
    assert job.tokens == second and job.target_end == 150 and job.committed == 64
    assert len(book) == 1 and offer.dropped == []


def test_extension_takes_a_longer_host_prefix_as_committed() -> None:
    book = JobBook(B, max_jobs=4)
    first = tuple(random_tokens(1, 100))
    job = served(book, first).job
    assert job is not None
    second = first + tuple(random_tokens(2, 50))
    book.offer(second, 96, len(second))
    assert job.committed == 96


def test_earlier_turn_served_again_only_refreshes_the_job() -> None:
    book = JobBook(B, max_jobs=4)
    long = tuple(random_tokens(1, 200))
    job = served(book, long).job
    other = served(book, tuple(random_tokens(9, 100))).job
    assert list(book)[0] is other
    offer = served(book, long[:120])
    assert offer.relation is Relation.CONTAINED and offer.job is job
    assert job.tokens == long and len(book) == 2
    assert list(book)[0] is job  # most recently served again


def test_fork_replaces_the_job_it_forks_from() -> None:
    book = JobBook(B, max_jobs=4)
    base = tuple(random_tokens(1, 200))
    old = served(book, base).job
    forked = base[:150] + tuple(random_tokens(2, 60))
    offer = served(book, forked)
    assert offer.relation is Relation.FORKS
    assert offer.dropped == [old]
    assert len(book) == 1 and list(book)[0].tokens == forked


def test_interleaved_sessions_sharing_a_system_prompt_keep_their_own_jobs() -> None:
    book = JobBook(B, max_jobs=4)
    system = tuple(random_tokens(0, 32))
    a = system + tuple(random_tokens(1, 200))
    b = system + tuple(random_tokens(2, 200))
    job_a = served(book, a).job
    job_b = served(book, b).job
    a2 = a + tuple(random_tokens(3, 40))
    b2 = b + tuple(random_tokens(4, 40))
    assert served(book, a2).job is job_a
    assert served(book, b2).job is job_b
    assert {j.tokens for j in book} == {a2, b2}


def test_book_keeps_at_most_max_jobs_dropping_the_least_recently_served() -> None:
    book = JobBook(B, max_jobs=3)
    jobs = [served(book, tuple(random_tokens(i, 64))).job for i in range(3)]
    served(book, tuple(random_tokens(0, 64)) + tuple(random_tokens(10, 16)))  # session 0 comes back
    offer = served(book, tuple(random_tokens(3, 64)))
    assert offer.dropped == [jobs[1]]
    assert len(book) == 3
    assert [j.tokens[:64] for j in book] == [tuple(random_tokens(3, 64)), tuple(random_tokens(0, 64)), tuple(random_tokens(2, 64))]


def test_next_runnable_is_the_most_recent_unparked_unfinished_job() -> None:
    book = JobBook(B, max_jobs=4)
    older = served(book, tuple(random_tokens(1, 64))).job
    newer = served(book, tuple(random_tokens(2, 64))).job
    assert older is not None and newer is not None
    assert book.next_runnable(now=0.0) is newer
    assert book.park(newer, now=0.0, base_s=1.0, max_s=8.0, max_attempts=3)
    assert book.next_runnable(now=0.5) is older
    assert book.seconds_until_unparked(now=0.5) == pytest.approx(0.5)
    assert book.next_runnable(now=1.0) is newer
    older.committed = 64
    newer.committed = 64
    assert book.next_runnable(now=1.0) is None


def test_parking_doubles_the_wait_and_drops_the_job_after_max_attempts() -> None:
    book = JobBook(B, max_jobs=4)
    job = served(book, tuple(random_tokens(1, 64))).job
    assert job is not None
    waits = []
    for _ in range(3):
        assert book.park(job, now=100.0, base_s=1.0, max_s=3.0, max_attempts=4)
        waits.append(job.parked_until - 100.0)  # type: ignore[operator]
    assert waits == [1.0, 2.0, 3.0]
    assert not book.park(job, now=100.0, base_s=1.0, max_s=3.0, max_attempts=4)
    assert len(book) == 0


def test_debt_sums_served_but_not_committed_tokens() -> None:
    book = JobBook(B, max_jobs=4)
    a = served(book, tuple(random_tokens(1, 100))).job
    served(book, tuple(random_tokens(2, 50)))
    assert a is not None
    a.committed = 64
    assert sum(job.debt for job in book) == (100 - 64) + 50


def test_bad_served_range_is_refused() -> None:
    book = JobBook(B, max_jobs=4)
    with pytest.raises(ValueError):
        book.offer(tuple(random_tokens(1, 10)), 5, 11)


@given(
    st.lists(
        st.tuples(st.integers(0, 3), st.integers(1, 6), st.booleans()),
        min_size=1,
        max_size=30,
    )
)
def test_book_invariants_hold_over_random_offers(ops: list[tuple[int, int, bool]]) -> None:
    """Committed stays block-aligned and inside each job; the bound holds; every job's
    committed boundary is within its own tokens (lineage)."""
    book = JobBook(B, max_jobs=3)
    convs: dict[int, tuple[int, ...]] = {}
    for conv, blocks, fork in ops:
        tokens = convs.get(conv, tuple(random_tokens(100 + conv, 8)))
        tokens = tokens[: len(tokens) // 2] if fork else tokens
        tokens = tokens + tuple(random_tokens(len(tokens) * 7 + conv, blocks * B - 3))
        convs[conv] = tokens
        offer = served(book, tokens)
        if offer.job is not None:
            offer.job.committed = min(offer.job.publish_end(B), offer.job.committed + B)
        assert len(book) <= 3
        for job in book:
            assert job.committed % B == 0
            assert 0 <= job.committed <= job.publish_end(B) <= job.target_end <= len(job.tokens)
