"""Partial-prefix adoption: reuse the block-floored part of a partly matching stored entry."""

from .decision import Plan, Reason, plan_adoption
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
    "plan_adoption",
]
