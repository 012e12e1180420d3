"""The references recovery takes from one engine's prefix cache, and giving them back.

Every fetch, store and probe recovery makes runs under a holder id of its own
(:meth:`ReleaseLedger.holder`); :meth:`ReleaseLedger.release` gives a holder's
references back, and a release that raises keeps the holder for :meth:`retry`, so no
reference the plugin took is ever forgotten. A host whose releases keep failing would
see the plugin pin more of its cache with every slice: after
:data:`RELEASE_FAILURES_STAND_DOWN` failed releases in a row the ledger says
:attr:`failing`, and the engine takes no further references until the pending ones are
given back.

Threads: one engine's recovery service owns its ledger; only that engine's thread calls
it (inside an idle step, or a cancellation that holds the service's work lock).
:attr:`pending` may be read from any thread as a status figure.
"""

from __future__ import annotations

import itertools
import logging
from collections.abc import Callable
from typing import Any

from ..ports import HOLDER_PREFIX
from .outcomes import FaultKind

log = logging.getLogger(__name__)

#: Failed releases in a row after which the engine stops taking references.
RELEASE_FAILURES_STAND_DOWN = 3


class ReleaseLedger:
    """Holder ids for one engine, and the holders whose release has not gone through."""

    def __init__(self, engine_id: str, count_fault: Callable[[FaultKind], None]) -> None:
        self._engine_id = engine_id
        self._count_fault = count_fault
        self._ids = itertools.count(1)
        self._unreleased: list[str] = []
        self._failures_in_a_row = 0

    @property
    def pending(self) -> int:
        """Holders whose release raised and that are still to be given back."""
        return len(self._unreleased)

    @property
    def failing(self) -> bool:
        """Releases keep failing: take no further references until :attr:`pending` is 0."""
        return bool(self._unreleased) and self._failures_in_a_row >= RELEASE_FAILURES_STAND_DOWN

    def holder(self, kind: str) -> str:
        """A fresh holder id, recognisably the plugin's (:data:`~..ports.HOLDER_PREFIX`)."""
        return f"{HOLDER_PREFIX}:{self._engine_id}:{kind}:{next(self._ids)}"

    def release(self, cache: Any, holder: str) -> None:
        """Give ``holder``'s references back; a failure is counted and the holder kept
        for :meth:`retry`. Never raises."""
        try:
            cache.release(holder)
        except Exception as exc:  # noqa: BLE001 - counted, and retried later
            log.error("mlx-recovery: engine %s: release(%s) failed: %r", self._engine_id, holder, exc)
            self._count_fault(FaultKind.RELEASE_ERROR)
            self._failures_in_a_row += 1
            if holder not in self._unreleased:
                self._unreleased.append(holder)
            return
        self._failures_in_a_row = 0

    def retry(self, cache_of: Callable[[], Any]) -> None:
        """Release again every holder whose release failed; keep those that still fail.
        ``cache_of`` gives the engine's prefix cache (it may raise: the host is going away)."""
        if not self._unreleased:
            return
        try:
            cache = cache_of()
        except Exception as exc:  # noqa: BLE001 - the host is going away
            log.warning("mlx-recovery: engine %s: no cache to release into: %r", self._engine_id, exc)
            return
        still: list[str] = []
        for holder in self._unreleased:
            try:
                cache.release(holder)
            except Exception as exc:  # noqa: BLE001 - try again later
                log.warning("mlx-recovery: engine %s: release(%s) failed again: %r", self._engine_id, holder, exc)
                still.append(holder)
                self._failures_in_a_row += 1
            else:
                self._failures_in_a_row = 0
        self._unreleased = still
