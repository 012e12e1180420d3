"""The partial-prefix adopter as a ``prefix_lookup`` hook implementation.

Enabled by ``MLX_RECOVERY_ADOPTER_ENABLED``; off, it returns None and the host keeps its
plain behaviour. On, it answers every lookup whose host passes a
:class:`~.ports.DetachedEntryStore`: adopt the whole entry, adopt a block-floored prefix
(clone-and-pin by default, take-and-trim with ``MLX_RECOVERY_ADOPTER_MODE=trim``), or
refuse with a counted reason so the request prefills cold.
"""

from __future__ import annotations

import logging
import threading
from collections import Counter
from typing import Any

from ..events import AdoptionDecision, PrefixLookup
from ..hookspecs import hookimpl
from ..settings import AdoptMode, RecoverySettings, load_settings
from .decision import Plan, Reason, plan_adoption
from .ports import DetachedEntryStore, PinError, PinsNotOwnedError, ReleaseErrors

log = logging.getLogger(__name__)


class AdopterPlugin:
    """Decides prefix lookups for hosts with detached paged sets.

    Threads: ``prefix_lookup`` runs on engine threads (several engines may call it at
    once); ``status`` on any thread. The counters are the only mutable state and are
    guarded by ``_lock``; store calls happen outside it.
    """

    def __init__(
        self, settings: RecoverySettings | None = None, *, trim_keep_fraction: float | None = None
    ) -> None:
        settings = settings if settings is not None else load_settings()
        if trim_keep_fraction is None:
            trim_keep_fraction = settings.adopter_trim_keep_fraction
        if not 0.0 <= trim_keep_fraction <= 1.0:
            raise ValueError(f"trim_keep_fraction must be within [0, 1], got {trim_keep_fraction}")
        self.enabled = settings.adopter_enabled
        self.mode = AdoptMode(settings.adopter_mode)
        self.min_prefix_tokens = settings.adopter_min_prefix_tokens
        self.trim_keep_fraction = trim_keep_fraction
        self._lock = threading.Lock()
        self._reasons: Counter[str] = Counter()
        self._lookups = 0
        self._adopted_tokens = 0

    # -- hook ---------------------------------------------------------------------
    @hookimpl
    def prefix_lookup(self, lookup: PrefixLookup) -> AdoptionDecision | None:
        if not self.enabled:
            return None
        store = lookup.store
        if lookup.entry is None or not isinstance(store, DetachedEntryStore):
            self._count(Reason.NO_STORE)
            return None
        try:
            return self._decide(lookup, store)
        except Exception as exc:  # noqa: BLE001 - a store fault costs reuse, never the step
            log.warning("mlx-recovery adopter: lookup %s failed: %r", lookup.request_id, exc)
            self._count(Reason.STORE_ERROR)
            return AdoptionDecision(0, Reason.STORE_ERROR.value)

    # -- status -------------------------------------------------------------------
    def status(self) -> dict[str, Any]:
        """A snapshot: settings, lookups decided, adopted tokens, count per reason."""
        with self._lock:
            reasons = dict(sorted(self._reasons.items()))
            lookups, adopted = self._lookups, self._adopted_tokens
        return {
            "enabled": self.enabled,
            "mode": self.mode.value,
            "min_prefix_tokens": self.min_prefix_tokens,
            "lookups": lookups,
            "adoptions": reasons.get(Reason.WHOLE.value, 0) + reasons.get(Reason.PARTIAL.value, 0),
            "adopted_tokens": adopted,
            "reasons": reasons,
        }

    # -- internals ----------------------------------------------------------------
    def _decide(self, lookup: PrefixLookup, store: DetachedEntryStore) -> AdoptionDecision:
        layout = store.describe(lookup.entry)
        if layout.block_size != lookup.block_size:
            return self._refuse(Reason.INVALID_LOOKUP)
        plan = plan_adoption(
            entry_tokens=lookup.entry_tokens,
            matched_tokens=lookup.matched_tokens,
            layout=layout,
            mode=self.mode,
            min_prefix_tokens=self.min_prefix_tokens,
            trim_keep_fraction=self.trim_keep_fraction,
        )
        if not plan.adopted:
            return self._refuse(plan.reason)
        if self.mode is AdoptMode.CLONE:
            return self._clone(lookup, store, plan)
        return self._take_and_trim(lookup, store, plan)

    def _clone(
        self, lookup: PrefixLookup, store: DetachedEntryStore, plan: Plan
    ) -> AdoptionDecision:
        try:
            handle = store.clone_prefix(lookup.entry, plan.adopt_tokens, owner=lookup.request_id)
        except PinsNotOwnedError:
            return self._refuse(Reason.PINS_NOT_OWNED)
        except PinError as exc:
            log.info("mlx-recovery adopter: pin failed for %s: %s", lookup.request_id, exc)
            return self._refuse(Reason.PIN_FAILED)
        return self._adopt(plan, handle)

    def _take_and_trim(
        self, lookup: PrefixLookup, store: DetachedEntryStore, plan: Plan
    ) -> AdoptionDecision:
        try:
            handle = store.take(lookup.entry)
        except PinsNotOwnedError:
            return self._refuse(Reason.PINS_NOT_OWNED)
        if plan.cut:
            try:
                store.trim(handle, plan.adopt_tokens)
            except Exception as exc:  # noqa: BLE001 - the set is ours now: give it all back
                self._give_back(store, handle, lookup.request_id, exc)
                reason = Reason.RELEASE_ERROR if isinstance(exc, ReleaseErrors) else Reason.STORE_ERROR
                return self._refuse(reason)
        return self._adopt(plan, handle)

    def _give_back(
        self, store: DetachedEntryStore, handle: object, request_id: str, cause: Exception
    ) -> None:
        log.warning("mlx-recovery adopter: trim for %s failed, prefilling cold: %s", request_id, cause)
        try:
            store.release(handle)
        except Exception as exc:  # noqa: BLE001
            log.warning("mlx-recovery adopter: releasing the set for %s: %s", request_id, exc)

    def _adopt(self, plan: Plan, handle: object) -> AdoptionDecision:
        with self._lock:
            self._lookups += 1
            self._reasons[plan.reason.value] += 1
            self._adopted_tokens += plan.adopt_tokens
        return AdoptionDecision(plan.adopt_tokens, plan.reason.value, handle)

    def _refuse(self, reason: Reason) -> AdoptionDecision:
        self._count(reason)
        return AdoptionDecision(0, reason.value)

    def _count(self, reason: Reason) -> None:
        with self._lock:
            self._lookups += 1
            self._reasons[reason.value] += 1
