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
from collections.abc import Iterator, Sequence
from dataclasses import dataclass, field
from enum import Enum
from typing import TYPE_CHECKING

from ..state import floor_block
from .costs import SparseSample

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
    ``committed`` that the publish policy keeps back until a longer prefix pays.

    What the host said of its sparse route for this conversation: ``threshold`` and
    ``keep`` (None: unknown), ``sparse`` (its last measured sparse prefill), ``last_append``
    (how much the conversation grew at its last turn). ``stood_down`` is the reason
    recovery stopped working on the job because no prefix of it would pay.
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
    threshold: int | None = None
    keep: float | None = None
    sparse: SparseSample | None = None
    last_append: int | None = None
    stood_down: str | None = None

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
            and self.frontier(block_size) < self.publish_end(block_size)
        )

    def drop_held_below(self, boundary: int, block_size: int) -> None:
        """Forget held blocks the host now restores by itself (below ``boundary``)."""
        self.held = [b for b in self.held if b.index * block_size >= boundary]
        if self.held and self.held[0].index * block_size != boundary:
            self.held = []  # no longer contiguous with the committed prefix

    @property
    def debt(self) -> int:
        """Served tokens that are not yet restorable from the host's cache."""
        return max(0, self.target_end - self.committed)

    def parked(self, now: float) -> bool:
        return self.parked_until is not None and now < self.parked_until


@dataclass(slots=True)
class Offer:
    """What :meth:`JobBook.offer` did with a served range.

    ``relation`` is how the served prompt related to ``job`` (the job it now lives in, or
    None when nothing was queued); ``dropped`` lists the jobs that left the book (the one
    a fork replaced, or least recently served ones over the bound).
    """

    relation: Relation | None
    job: RecoveryJob | None
    dropped: list[RecoveryJob] = field(default_factory=list)


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
        self._ids = itertools.count(1)
        self._seq = itertools.count(1)

    # -- queries ---------------------------------------------------------------------

    def __len__(self) -> int:
        return len(self._jobs)

    def __iter__(self) -> Iterator[RecoveryJob]:
        """Jobs in working order: most recently served first."""
        return iter(sorted(self._jobs.values(), key=lambda j: j.served_seq, reverse=True))

    def get(self, job_id: int) -> RecoveryJob | None:
        return self._jobs.get(job_id)

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

    @property
    def debt(self) -> int:
        return sum(job.debt for job in self._jobs.values())

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
                if len(tokens) > len(job.tokens):
                    job.last_append = len(tokens) - len(job.tokens)
                job.tokens = tokens
                job.target_end = max(job.target_end, served_end)
                job.committed = max(job.committed, canonical)
                job.drop_held_below(job.committed, self.block_size)
                job.stood_down = None  # a new turn, new measurements: judge again
                job.served_seq = next(self._seq)
                return Offer(relation, job, self._drop_redundant(keep=job))
            if relation is Relation.CONTAINED:
                job.target_end = max(job.target_end, served_end)
                job.served_seq = next(self._seq)
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

    def remove(self, job_id: int) -> RecoveryJob | None:
        return self._jobs.pop(job_id, None)

    def clear(self) -> list[RecoveryJob]:
        jobs = list(self._jobs.values())
        self._jobs.clear()
        return jobs

    def park(
        self, job: RecoveryJob, now: float, *, base_s: float, max_s: float, max_attempts: int
    ) -> bool:
        """Back ``job`` off after a fault, doubling the wait each time. Returns False, and
        drops the job, once it has failed ``max_attempts`` times in a row."""
        job.attempts += 1
        if job.attempts >= max_attempts:
            self._jobs.pop(job.job_id, None)
            return False
        job.parked_until = now + min(max_s, base_s * 2 ** (job.attempts - 1))
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
