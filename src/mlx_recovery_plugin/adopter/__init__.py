"""Partial-prefix adoption: reuse the block-floored part of a partly matching stored entry."""

from .decision import Plan, Reason, floor_to_block, plan_adoption
from .plugin import AdopterPlugin
from .ports import (
    AdoptionError,
    DetachedEntryStore,
    EntryLayout,
    PinError,
    PinsNotOwnedError,
    ReleaseErrors,
)

__all__ = [
    "AdopterPlugin",
    "AdoptionError",
    "DetachedEntryStore",
    "EntryLayout",
    "PinError",
    "PinsNotOwnedError",
    "Plan",
    "Reason",
    "ReleaseErrors",
    "floor_to_block",
    "plan_adoption",
]
