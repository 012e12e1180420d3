"""How much of a matching stored entry to adopt: pure functions, no store access.

A whole-entry match is adopted as it is. A partial match is floored to the cache block,
so the request's own prefill always starts on a fresh block and never writes into a
block another set still reads. Anything that cannot be cut safely is refused with a
named reason, before any reference is touched.
"""

from __future__ import annotations

from dataclasses import dataclass
from enum import Enum

from ..settings import AdoptMode
from ..state import floor_block
from .ports import EntryLayout


class Reason(str, Enum):
    """Every outcome the adopter counts."""

    WHOLE = "whole"
    PARTIAL = "partial"
    BELOW_BLOCK_FLOOR = "below_block_floor"
    SIDE_DATA = "side_data"
    SLIDING_WINDOW = "sliding_window"
    NO_RECURRENT_SNAPSHOT = "no_recurrent_snapshot"
    PINS_NOT_OWNED = "pins_not_owned"
    TRIM_WOULD_GUT = "trim_would_gut"
    INVALID_LOOKUP = "invalid_lookup"
    PIN_FAILED = "pin_failed"
    RELEASE_ERROR = "release_error"
    STORE_ERROR = "store_error"
    NO_STORE = "no_store"


@dataclass(slots=True, frozen=True)
class Plan:
    """``adopt_tokens`` to adopt (0: refused for ``reason``); ``cut`` when the adopted
    part is shorter than the entry."""

    adopt_tokens: int
    reason: Reason
    cut: bool = False

    @property
    def adopted(self) -> bool:
        return self.adopt_tokens > 0


def plan_adoption(
    *,
    entry_tokens: int,
    matched_tokens: int,
    layout: EntryLayout,
    mode: AdoptMode = AdoptMode.CLONE,
    min_prefix_tokens: int = 0,
    trim_keep_fraction: float = 0.5,
) -> Plan:
    """Decide for one lookup. ``layout`` is the store's description of the entry.

    ``trim_keep_fraction`` applies in trim mode only: a cut that would keep less than
    that share of the entry is refused, because trimming destroys the rest for every
    later request (a few shared chat-template tokens must not gut a long entry).
    """
    block = layout.block_size
    if block <= 0 or entry_tokens != layout.tokens or not 0 <= matched_tokens <= entry_tokens:
        return Plan(0, Reason.INVALID_LOOKUP)
    if not layout.owns_pins:
        return Plan(0, Reason.PINS_NOT_OWNED)
    if matched_tokens == entry_tokens and entry_tokens > 0:
        return Plan(entry_tokens, Reason.WHOLE)
    target = floor_block(matched_tokens, block)
    if target < max(min_prefix_tokens, 1):
        return Plan(0, Reason.BELOW_BLOCK_FLOOR)
    kept_blocks = target // block
    if any(index >= kept_blocks for index in layout.side_data_blocks):
        return Plan(0, Reason.SIDE_DATA)
    if layout.logical_start != 0:
        return Plan(0, Reason.SLIDING_WINDOW)
    if layout.recurrent and target not in layout.snapshot_boundaries:
        return Plan(0, Reason.NO_RECURRENT_SNAPSHOT)
    if mode is AdoptMode.TRIM and target < trim_keep_fraction * entry_tokens:
        return Plan(0, Reason.TRIM_WOULD_GUT)
    return Plan(target, Reason.PARTIAL, cut=True)
