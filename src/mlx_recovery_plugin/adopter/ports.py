"""What a host with detached paged sets provides to the adopter.

A paged host keeps a finished request's KV blocks as a *detached set*: the block-table
allocation plus a detach pin on every block, indexed as a stored prefix entry. The
adopter never looks inside an entry; it asks the host's store, through
:class:`DetachedEntryStore`, to describe the entry's layout, to clone-and-pin a prefix
of it (the default), or to take it and trim it in place (for hosts that cannot clone).

The store is called from the engine thread that admits the request. A host that admits
on several threads at once makes each method atomic on its own; the adopter copes with
an entry that another thread took or released in between (``PinsNotOwnedError``).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Protocol, runtime_checkable


class AdoptionError(RuntimeError):
    """A store operation the adopter asked for did not happen."""


class PinsNotOwnedError(AdoptionError):
    """The set no longer owns its pins (taken, released or evicted meanwhile)."""


class PinError(AdoptionError):
    """A pin could not be taken; every pin the operation had taken is given back."""


class ReleaseErrors(AdoptionError):
    """Some references could not be given back. Raised only after the set's bookkeeping
    is complete, so the set is consistent and can still be released as a whole."""

    def __init__(self, errors: list[BaseException]) -> None:
        self.errors: tuple[BaseException, ...] = tuple(errors)
        detail = "; ".join(f"{type(e).__name__}: {e}" for e in self.errors)
        super().__init__(f"{len(self.errors)} release error(s): {detail}")


@dataclass(slots=True, frozen=True)
class EntryLayout:
    """What the adopter needs to know to cut an entry safely.

    ``tokens``: the entry's length. ``side_data_blocks``: indexes of blocks that carry
    per-block side data (quantisation sidecars, draft/MTP state) that a cut would orphan.
    ``logical_start``: first logical position of a sliding-window state (0 when the set
    still holds position 0). ``recurrent``: some layer carries recurrent (hybrid) state,
    which exists only at ``snapshot_boundaries`` (token counts). ``owns_pins``: the set
    still owns the pins on its blocks.
    """

    tokens: int
    block_size: int
    side_data_blocks: frozenset[int] = frozenset()
    logical_start: int = 0
    recurrent: bool = False
    snapshot_boundaries: frozenset[int] = frozenset()
    owns_pins: bool = True


@runtime_checkable
class DetachedEntryStore(Protocol):
    """The host's store of detached paged sets, as the adopter uses it.

    ``entry`` is the opaque handle the host put into :class:`~..events.PrefixLookup`;
    the sets returned by :meth:`clone_prefix` and :meth:`take` are owned by the caller
    and handed to the host as the decision's ``handle``, which releases them later.
    """

    def describe(self, entry: object) -> EntryLayout:
        """The entry's layout now. Cheap: it is called on every lookup."""

    def clone_prefix(self, entry: object, tokens: int, *, owner: str) -> object:
        """A new set over the same physical blocks as the first ``tokens`` of ``entry``,
        each block pinned once for the new set. ``entry`` is left exactly as it was.

        ``tokens`` is a multiple of the block size, or the entry's whole length.
        Raises ``ValueError`` for a misaligned or oversized target,
        :class:`PinsNotOwnedError` when ``entry`` is gone, and :class:`PinError` after
        rolling back every pin it took.
        """

    def take(self, entry: object) -> object:
        """Remove ``entry`` from the index and hand it, with its references, to the
        caller (one-shot). Raises :class:`PinsNotOwnedError` when it is already gone."""

    def trim(self, detached: object, tokens: int) -> None:
        """Cut ``detached`` in place to its first ``tokens`` (a multiple of the block size,
        not more than its length): give back both references (allocation and pin) of
        every dropped block and clamp offsets and lengths to ``tokens``.

        Raises ``ValueError`` (nothing changed) for a misaligned or oversized target or a
        layout that cannot be cut; :class:`ReleaseErrors` after the bookkeeping is done.
        """

    def release(self, detached: object) -> None:
        """Give back every reference the set holds. Idempotent. May raise
        :class:`ReleaseErrors` after the set is fully released in its bookkeeping."""
