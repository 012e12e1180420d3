"""Recovery jobs and their lineage: which served ranges an engine still owes, and in what order.

A job is a conversation's token sequence, the end of the range the sparse route served,
and the committed boundary: the whole-block prefix known to be restorable through the
host's own fetch path. Publication always stores under ``job.tokens[:boundary]``, so a job
can only ever publish its own conversation's prefix; lineage is the token prefix itself.

How a newly served prompt relates to a job already on the book (:func:`relate`):

* it *extends* the job when it starts with all of the job's tokens (the next turn of an
  append-only conversation): the job grows and keeps its committed boundary;
* it is *contained* in the job when the job's tokens start with it (an earlier turn asked
  again): recovering the job covers it, so the job only counts as used again;
* it *forks* the job when the two share at least one whole block and at least half of the
  job's tokens, then differ (an edited or regenerated turn, a compaction that kept most
  of the history): the new prompt replaces the job;
* otherwise they are *unrelated* (another session, maybe one sharing a short system
  prompt): the new prompt gets a job of its own, so interleaved sessions do not erase each
  other's work.

An engine keeps a bounded number of jobs; the least recently served is dropped first, and
the most recently served conversation, the one most likely to come back, is worked first.

Threads: a :class:`JobBook` belongs to one engine's recovery service, which guards it with
its own lock; the book itself is not thread-safe.
"""

from __future__ import annotations

import itertools
from collections import deque
from collections.abc import Iterator, Sequence
from dataclasses import dataclass, field
from enum import Enum
from typing import TYPE_CHECKING

from ..state import floor_block

if TYPE_CHECKING:
    from ..state import BlockState


class Relation(str, Enum):
    """How a newly served prompt relates to an existing job's tokens."""

    EXTENDS = "extends"
    CONTAINED = "contained"
    FORKS = "forks"
    UNRELATED = "unrelated"


def common_prefix_len(a: Sequence[int], b: Sequence[int], limit: int | None = None) -> int:
    """Number of leading tokens ``a`` and ``b`` share (at most ``limit``)."""
    n = min(len(a), len(b)) if limit is None else min(len(a), len(b), limit)
    i = 0
    # Compare in chunks first: conversations share long prefixes, token loops are slow.
    step = 256
    while i + step <= n and tuple(a[i : i + step]) == tuple(b[i : i + step]):
        i += step
    while i < n and a[i] == b[i]:
        i += 1
    return i


def relate(job_tokens: Sequence[int], new_tokens: Sequence[int], block_size: int) -> Relation:
    """Classify ``new_tokens`` against a job's tokens (see the module docstring)."""
    shared = common_prefix_len(job_tokens, new_tokens)
    if shared == len(job_tokens):
        return Relation.EXTENDS
    if shared == len(new_tokens):
        return Relation.CONTAINED
    if shared >= block_size and 2 * shared >= len(job_tokens):
        return Relation.FORKS
    return Relation.UNRELATED


@dataclass(slots=True, eq=False)
class RecoveryJob:
    """One conversation's served-but-not-canonical range.

    ``committed`` is block-aligned and only ever set to a prefix the host's fetch path
    restored. ``target_end`` is the end of the served range; only its whole blocks can be
    published (:meth:`publish_end`). ``held`` are finished blocks right after
    ``committed`` that the publish policy keeps back until a longer prefix pays, or that
    an interrupted slice finished before it stopped.
    ``stood_down`` is the reason recovery stopped working on the job because no prefix of
    it would pay; ``paused`` the reason it waits on the job (its held blocks kept) because
    the verdict on its whole prefix is not clear either way on evidence that already
    reaches that far, so more of its slices would only be held. What the host said of the
    conversation's sparse route is the publish policy's memory, not the job's
    (:class:`~.judge.PublishJudge`).

    The fields change only through the methods below, called by the job's book or by its
    engine's recovery service under the service's lock.
    """

    job_id: int
    tokens: tuple[int, ...]
    target_end: int
    committed: int = 0
    served_seq: int = 0
    attempts: int = 0
    parked_until: float | None = None
    tokens_recovered: int = 0
    held: list[BlockState] = field(default_factory=list, repr=False)
    stood_down: str | None = None
    #: The cost model's evidence when the job stood down: more evidence reopens it.
    stood_down_evidence: int = 0
    paused: str | None = None
    #: The policy's evidence when the job paused: more evidence resumes it.
    paused_evidence: int = 0
    #: A turn arrived since the last slice: the next slice runs before any stand-down, so
    #: that verdict is taken on a measurement of today's machine at the job's frontier.
    fresh_turn: bool = False
    #: The policy's evidence when the held blocks were last judged.
    held_evidence: int = 0

    # -- queries ---------------------------------------------------------------------

    def publish_end(self, block_size: int) -> int:
        """The last block boundary recovery can reach for this job."""
        return floor_block(self.target_end, block_size)

    def frontier(self, block_size: int) -> int:
        """Where recovery goes on from: the committed boundary plus the held blocks."""
        return self.committed + len(self.held) * block_size

    def done(self, block_size: int) -> bool:
        return self.committed >= self.publish_end(block_size)

    def runnable(self, now: float, block_size: int) -> bool:
        return (
            not self.parked(now)
            and self.stood_down is None
            and self.paused is None
            and self.frontier(block_size) < self.publish_end(block_size)
        )

    @property
    def debt(self) -> int:
        """Served tokens that are not yet restorable from the host's cache."""
        return max(0, self.target_end - self.committed)

    def parked(self, now: float) -> bool:
        return self.parked_until is not None and now < self.parked_until

    def pending_with(self, blocks: Sequence[BlockState], block_size: int) -> list[BlockState]:
        """The held blocks and ``blocks`` that the host does not restore by itself yet
        (it may have stored some of them meanwhile): what a publication would store."""
        return [b for b in (*self.held, *blocks) if b.index * block_size >= self.committed]

    # -- updates ---------------------------------------------------------------------

    def extend(self, tokens: tuple[int, ...], served_end: int, canonical: int, block_size: int, seq: int) -> None:
        """The conversation's next turn was served: grow, keep the committed boundary (or
        the host's own, if longer), and judge it again with the new turn's measurements."""
        self.tokens = tokens
        self.target_end = max(self.target_end, served_end)
        self.committed = max(self.committed, canonical)
        self.drop_held_below(self.committed, block_size)
        self.stood_down = None
        self.paused = None
        self.fresh_turn = True
        self.served_seq = seq

    def asked_again(self, served_end: int, seq: int) -> None:
        """An earlier turn of the conversation was served again."""
        self.target_end = max(self.target_end, served_end)
        self.served_seq = seq

    def restore_to(self, restorable: int, block_size: int) -> int:
        """The host restores ``restorable`` tokens of the job now: that is the committed
        boundary. Returns the committed tokens the host lost (evicted) since."""
        lost = max(0, self.committed - restorable)
        if lost:
            self.held = []  # held blocks sit on a prefix the host lost
        self.committed = restorable
        self.drop_held_below(restorable, block_size)
        return lost

    def commit(self, boundary: int) -> int:
        """A publication read back up to ``boundary``; returns the tokens it gained."""
        gained = boundary - self.committed
        self.committed = boundary
        self.tokens_recovered += gained
        return gained

    def hold(self, blocks: list[BlockState], evidence: int = 0) -> None:
        """Keep finished blocks back until a longer prefix pays (``evidence``: the policy's
        when they were held)."""
        self.held = blocks
        self.held_evidence = evidence

    def held_whole(self, block_size: int) -> bool:
        """Every block up to the end is finished, and some are held back."""
        return bool(self.held) and self.stood_down is None and self.frontier(block_size) >= self.publish_end(block_size)

    def release_held(self) -> None:
        """The held blocks go out with a publication."""
        self.held = []

    def drop_held(self) -> int:
        """Forget the held blocks (memory is wanted back); returns how many there were."""
        dropped, self.held = len(self.held), []
        return dropped

    def held_bytes(self) -> int:
        return sum(block.nbytes for block in self.held)

    def stand_down(self, reason: str, evidence: int = 0) -> bool:
        """Stop working on the job: no prefix of it would pay, on the cost model's
        ``evidence``. True the first time."""
        first = self.stood_down is None
        self.stood_down = reason
        self.stood_down_evidence = evidence
        self.held = []
        return first

    def pause(self, reason: str, evidence: int = 0) -> bool:
        """Stop running slices of the job, keeping what it holds, until the policy's
        ``evidence`` grows or the conversation's next turn arrives. True the first time."""
        first = self.paused is None
        self.paused = reason
        self.paused_evidence = evidence
        return first

    def reconsider(self, evidence: int) -> bool:
        """The cost model learned more since the job stood down or paused: judge it again
        (before any slice runs). True if it was reopened."""
        reopened = False
        if self.stood_down is not None and evidence > self.stood_down_evidence:
            self.stood_down, reopened = None, True
        if self.paused is not None and evidence > self.paused_evidence:
            self.paused, reopened = None, True
        return reopened

    def park(self, now: float, *, base_s: float, max_s: float) -> None:
        """Back off after a fault, doubling the wait per fault in a row."""
        self.attempts += 1
        self.parked_until = now + min(max_s, base_s * 2 ** (self.attempts - 1))

    def progressed(self) -> None:
        """A slice ran whole: the faults in a row are over, and the turn is measured."""
        self.attempts, self.parked_until = 0, None
        self.fresh_turn = False

    def drop_held_below(self, boundary: int, block_size: int) -> None:
        """Forget held blocks the host now restores by itself (below ``boundary``)."""
        self.held = [b for b in self.held if b.index * block_size >= boundary]
        if self.held and self.held[0].index * block_size != boundary:
            self.held = []  # no longer contiguous with the committed prefix


@dataclass(slots=True)
class Offer:
    """What :meth:`JobBook.offer` did with a served range.

    ``relation`` is how the served prompt related to ``job`` (the job it now lives in, or
    None when nothing was queued); ``dropped`` lists the jobs that left the book (the one
    a fork replaced, or least recently served ones over the bound); ``appended`` is how
    many tokens the conversation grew by when the prompt extended its job.
    """

    relation: Relation | None
    job: RecoveryJob | None
    dropped: list[RecoveryJob] = field(default_factory=list)
    appended: int | None = None


class JobBook:
    """One engine's recovery jobs, at most ``max_jobs`` of them."""

    def __init__(self, block_size: int, max_jobs: int) -> None:
        if block_size <= 0:
            raise ValueError(f"block size must be positive, got {block_size}")
        if max_jobs <= 0:
            raise ValueError(f"max jobs must be positive, got {max_jobs}")
        self.block_size = block_size
        self.max_jobs = max_jobs
        self._jobs: dict[int, RecoveryJob] = {}
        # Jobs recovered in full, most recent last: their conversations' next turns are
        # what the publish policy checks its predictions against.
        self._finished: deque[RecoveryJob] = deque(maxlen=max_jobs)
        self._ids = itertools.count(1)
        self._seq = itertools.count(1)

    # -- queries ---------------------------------------------------------------------

    def __len__(self) -> int:
        return len(self._jobs)

    def __iter__(self) -> Iterator[RecoveryJob]:
        """Jobs in working order: most recently served first."""
        return iter(sorted(self._jobs.values(), key=lambda j: j.served_seq, reverse=True))

    def runnable(self, now: float) -> list[RecoveryJob]:
        """The jobs that may run now, most recently served first."""
        return [job for job in self if job.runnable(now, self.block_size)]

    def next_runnable(self, now: float) -> RecoveryJob | None:
        """The job to work on now: the most recently served one that is not parked."""
        for job in self:
            if job.runnable(now, self.block_size):
                return job
        return None

    def seconds_until_unparked(self, now: float) -> float | None:
        """How long until the earliest parked job may run again; None if none is parked."""
        waits = [j.parked_until - now for j in self._jobs.values() if j.parked(now)]  # type: ignore[operator]
        return max(0.0, min(waits)) if waits else None

    # -- updates ---------------------------------------------------------------------

    def offer(self, tokens: Sequence[int], served_start: int, served_end: int) -> Offer:
        """Record that ``tokens[served_start:served_end]`` was served without reusable state.

        ``served_start`` is where the host's restorable prefix ended when it served the
        request; it is taken as already canonical.
        """
        tokens = tuple(tokens)
        if not 0 <= served_start <= served_end <= len(tokens):
            raise ValueError(f"served range [{served_start}, {served_end}) outside the prompt")
        canonical = floor_block(served_start, self.block_size)
        jobs = list(self)

        for job in jobs:
            relation = relate(job.tokens, tokens, self.block_size)
            if relation is Relation.EXTENDS:
                appended = len(tokens) - len(job.tokens) if len(tokens) > len(job.tokens) else None
                job.extend(tokens, served_end, canonical, self.block_size, next(self._seq))
                return Offer(relation, job, self._drop_redundant(keep=job), appended)
            if relation is Relation.CONTAINED:
                job.asked_again(served_end, next(self._seq))
                return Offer(relation, job)

        if floor_block(served_end, self.block_size) <= canonical:
            # Nothing whole-block is left to recover for this prompt.
            return Offer(None, None)

        dropped: list[RecoveryJob] = []
        forked = [
            (common_prefix_len(job.tokens, tokens), job)
            for job in jobs
            if relate(job.tokens, tokens, self.block_size) is Relation.FORKS
        ]
        relation = Relation.UNRELATED
        if forked:
            _, replaced = max(forked, key=lambda pair: pair[0])
            dropped.append(self._jobs.pop(replaced.job_id))
            relation = Relation.FORKS
        job = RecoveryJob(
            job_id=next(self._ids),
            tokens=tokens,
            target_end=served_end,
            committed=canonical,
            served_seq=next(self._seq),
        )
        self._jobs[job.job_id] = job
        dropped.extend(self._enforce_bound())
        return Offer(relation, job, dropped)

    def conversation_of(self, tokens: Sequence[int]) -> RecoveryJob | None:
        """The job, on the book or recently finished, whose conversation ``tokens``
        continues (or asks again), if any."""
        known: list[RecoveryJob] = [*self, *reversed(self._finished)]
        for job in known:
            if relate(job.tokens, tokens, self.block_size) in (Relation.EXTENDS, Relation.CONTAINED):
                return job
        return None

    def known_ids(self) -> list[int]:
        """The jobs on the book and the recently finished ones."""
        return [*self._jobs, *(job.job_id for job in self._finished)]

    def complete(self, job_id: int) -> RecoveryJob | None:
        """``job_id`` was recovered in full: off the book, into the recently finished."""
        job = self._jobs.pop(job_id, None)
        if job is not None:
            self._finished.append(job)
        return job

    def remove(self, job_id: int) -> RecoveryJob | None:
        return self._jobs.pop(job_id, None)

    def clear(self) -> list[RecoveryJob]:
        jobs = list(self._jobs.values())
        self._jobs.clear()
        self._finished.clear()
        return jobs

    def park(
        self, job: RecoveryJob, now: float, *, base_s: float, max_s: float, max_attempts: int
    ) -> bool:
        """Back ``job`` off after a fault, doubling the wait each time. Returns False, and
        drops the job, once it has failed ``max_attempts`` times in a row."""
        job.park(now, base_s=base_s, max_s=max_s)
        if job.attempts >= max_attempts:
            self._jobs.pop(job.job_id, None)
            return False
        return True

    # -- private ---------------------------------------------------------------------

    def _drop_redundant(self, keep: RecoveryJob) -> list[RecoveryJob]:
        """Drop jobs whose whole sequence is a prefix of ``keep``'s: ``keep`` covers them."""
        dropped = []
        for job in list(self._jobs.values()):
            if job is not keep and relate(job.tokens, keep.tokens, self.block_size) is Relation.EXTENDS:
                dropped.append(self._jobs.pop(job.job_id))
        return dropped

    def _enforce_bound(self) -> list[RecoveryJob]:
        dropped = []
        while len(self._jobs) > self.max_jobs:
            oldest = min(self._jobs.values(), key=lambda j: j.served_seq)
            dropped.append(self._jobs.pop(oldest.job_id))
        return dropped
