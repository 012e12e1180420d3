"""Publishing recovered blocks through the host's own store, and proving them restorable.

Committed means restorable: a job's committed boundary may only move to a prefix that the
host's own fetch path gave back. :func:`publish` stores the whole blocks a slice completed
under the job's own token prefix, then fetches that prefix under a throwaway holder id and
releases it again, whatever happens. A host that stores whole entries
(:attr:`~..ports.StoreUnit.WHOLE_ENTRY`) gets one entry for the whole prefix: the blocks
before the new ones are fetched back from the host's own entry first, so what is stored
on top of is exactly what the host restores. Every failure is raised as a
:class:`PublicationError` whose ``kind`` the caller counts; the caller drops the job.

Threads: called on the engine thread only, like every :class:`~..ports.PrefixCachePort`
method.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Iterator, Sequence
from contextlib import contextmanager
from dataclasses import dataclass

from ..ports import FetchedPrefix, PrefixCachePort, StoreUnit, store_unit
from ..state import RECOVERY_ORIGIN, BlockState
from .outcomes import FaultKind


class PublicationError(RuntimeError):
    """Publication failed; ``kind`` names the fault for the status counters."""

    kind: FaultKind = FaultKind.PUBLICATION_ERROR


class StoreError(PublicationError):
    """The host's store raised."""

    kind = FaultKind.STORE_ERROR


class StoreRefused(PublicationError):
    """The store returned normally but holds less than was published (for example the
    job's earlier blocks were evicted, so the new ones would leave a gap)."""

    kind = FaultKind.STORE_REFUSED


class BaseFetchError(PublicationError):
    """The fetch of the stored prefix a whole entry is built on raised."""

    kind = FaultKind.FETCH_ERROR


class ProbeFetchError(PublicationError):
    """The read-back fetch raised."""

    kind = FaultKind.FETCH_ERROR


class ProbeMismatch(PublicationError):
    """The read-back fetch restored less than was published (``restored`` tokens)."""

    kind = FaultKind.PROBE_MISMATCH

    def __init__(self, message: str, restored: int) -> None:
        super().__init__(message)
        self.restored = restored


@dataclass(slots=True, frozen=True)
class Publication:
    """A successful publication: ``boundary`` is the new committed boundary."""

    boundary: int
    blocks: int
    stored_tokens: int
    restored_tokens: int


Release = Callable[[str], None]


@contextmanager
def fetched(
    cache: PrefixCachePort, holder_id: str, tokens: Sequence[int], release: Release | None = None
) -> Iterator[FetchedPrefix]:
    """Fetch through the host's path and give every reference back on the way out
    (through ``release``, default the cache's own, which may raise)."""
    try:
        yield cache.fetch(holder_id, tokens)
    finally:
        (release or cache.release)(holder_id)


def probe_restorable(
    cache: PrefixCachePort, probe_id: str, tokens: Sequence[int], release: Release | None = None
) -> int:
    """How many leading tokens of ``tokens`` the host restores now (its references are
    released before returning)."""
    with fetched(cache, probe_id, tokens, release) as prefix:
        return prefix.tokens


def as_recovered(block: BlockState) -> BlockState:
    """The block marked as recovery's work, carrying no draft-model / MTP side data."""
    if block.origin == RECOVERY_ORIGIN and not block.draft_state:
        return block
    return dataclasses.replace(block, origin=RECOVERY_ORIGIN, draft_state=False)


def stored_prefix_blocks(
    cache: PrefixCachePort,
    holder_id: str,
    lineage: Sequence[int],
    first: int,
    block_size: int,
    release: Release | None = None,
) -> list[BlockState]:
    """Blocks ``0 .. first - 1`` of ``lineage`` as the host restores them now (for a whole
    entry built on them); its references are released before returning. Raises
    :class:`StoreRefused` when the host no longer holds them (evicted, or wiped)."""
    try:
        with fetched(cache, holder_id, lineage, release) as prefix:
            have = min(int(prefix.tokens) // block_size, len(prefix.blocks))
            base = list(prefix.blocks[:first])
    except Exception as exc:
        raise BaseFetchError(f"fetch of the stored {first * block_size}-token prefix failed: {exc!r}") from exc
    if have < first or [b.index for b in base] != list(range(first)):
        raise StoreRefused(f"the host holds {have * block_size} of the {first * block_size} tokens the entry builds on")
    return base


def publish(
    cache: PrefixCachePort,
    job_tokens: Sequence[int],
    blocks: Sequence[BlockState],
    block_size: int,
    *,
    holder_id: str,
    probe_id: str,
    release: Release | None = None,
) -> Publication:
    """Store ``blocks`` under ``job_tokens[:boundary]`` and read the prefix back.

    ``blocks`` are contiguous whole blocks ending at ``boundary``; the blocks before them
    must already be stored (the job's committed prefix). Raises :class:`PublicationError`
    when the host cannot give back at least ``boundary`` tokens. ``release`` gives the
    probe's references back; one that does not raise keeps a failed release from being
    read as a failed read-back.
    """
    if not blocks:
        raise ValueError("nothing to publish")
    first = blocks[0].index
    for offset, block in enumerate(blocks):
        if block.index != first + offset:
            raise ValueError(f"blocks must be contiguous; block {block.index} after {first + offset - 1}")
    boundary = (blocks[-1].index + 1) * block_size
    if boundary > len(job_tokens):
        raise ValueError(f"blocks reach token {boundary}, past the job's {len(job_tokens)} tokens")
    lineage = tuple(job_tokens[:boundary])
    marked = [as_recovered(block) for block in blocks]
    entry = marked
    if first > 0 and store_unit(cache) is StoreUnit.WHOLE_ENTRY:
        entry = stored_prefix_blocks(cache, f"{holder_id}:base", lineage, first, block_size, release) + marked

    try:
        stored = cache.store(holder_id, lineage, entry)
    except Exception as exc:
        raise StoreError(f"store of {len(marked)} blocks up to {boundary} failed: {exc!r}") from exc
    if stored < boundary:
        raise StoreRefused(f"store holds {stored} of {boundary} published tokens")

    try:
        restored = probe_restorable(cache, probe_id, lineage, release)
    except Exception as exc:
        raise ProbeFetchError(f"read-back of {boundary} tokens failed: {exc!r}") from exc
    if restored < boundary:
        raise ProbeMismatch(f"read-back restored {restored} of {boundary} published tokens", restored)
    return Publication(boundary, len(marked), stored, restored)
