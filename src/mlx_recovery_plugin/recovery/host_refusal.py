"""Telling that a host refuses recovery's blocks, so an engine stops paying for nothing.

A host that keys its cache differently from what recovery publishes (a quantized KV
layout, a recurrent state it does not store) restores none of it: every read-back comes
back empty. After :data:`HOST_RESTORES_NOTHING_AFTER` empty read-backs in a row, on an
engine where nothing was ever committed, recovery stands down on that engine for good;
each further job would cost a slice and restore nothing.

Threads: owned by one engine's recovery service, used on its engine thread only.
"""

from __future__ import annotations

from .publication import ProbeMismatch, PublicationError

HOST_RESTORES_NOTHING_AFTER = 3


class HostRefusalWatch:
    """Counts empty read-backs in a row; says why the host refuses, once it does."""

    def __init__(self, after: int = HOST_RESTORES_NOTHING_AFTER) -> None:
        self._after = after
        self._empty_in_a_row = 0

    def note_failure(self, exc: PublicationError, *, ever_committed: bool) -> str | None:
        """A publication failed with ``exc``: the reason recovery should stand down on
        this engine, or None while it should go on trying."""
        if not (isinstance(exc, ProbeMismatch) and exc.restored == 0 and not ever_committed):
            self._empty_in_a_row = 0
            return None
        self._empty_in_a_row += 1
        if self._empty_in_a_row < self._after:
            return None
        return (
            f"the host restored none of what recovery published, {self._empty_in_a_row} times in a "
            "row (a cache layout it keys differently, e.g. a quantized KV cache, or a state it does "
            "not store): recovery stands down on this engine"
        )
