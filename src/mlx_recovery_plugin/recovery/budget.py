"""The process's recovery budget: a share of wall time per window, and the execution claim.

One :class:`Budget` per process is shared by every engine and model. Time is cut into
windows of ``window_s`` seconds counted from the budget's creation; each window allows
``pct`` % of it (the allowance). A slice may start while the current window has allowance
left and is charged after it has run, because a slice cannot be stopped midway unless
the runner supports it. Whatever a window overspends is carried, whole, into the windows
after it, each paying it off with its allowance, so a slice longer than an allowance (a
slow machine, a first compile) is paid back by the windows that follow instead of being
forgiven: whatever the slice lengths, the share charged over any stretch of time stays
within ``pct`` plus one slice and one allowance.

The execution claim keeps two engines from running slices at once: an engine takes it
before a slice and gives it back after.

Threads: engine threads check, charge and claim; the control thread changes ``pct``.
All mutable state is owned by ``_lock``.
"""

from __future__ import annotations

import logging
import math
import threading
import time
from collections.abc import Callable
from typing import Any

from ..settings import MIN_BUDGET_WINDOW_S, validate_budget_pct

log = logging.getLogger(__name__)

Clock = Callable[[], float]

_MIN_WAIT_S = 1e-6
# The longest wait :meth:`Budget.seconds_until_available` asks for while the budget is on:
# a caller asks again after it, so an overshoot that takes longer to pay off (a huge slice
# at a small share) never becomes a timer no thread can hold.
MAX_WAIT_S = 3600.0

validate_pct = validate_budget_pct


class Budget:
    """A wall-time share per window, charged after each slice, plus the execution claim.

    ``pct`` 0 means off: :meth:`available` is False. A change of ``pct`` made with
    :meth:`set_pct` applies from the next window, except a change to 0, which stops
    recovery at once.
    """

    def __init__(self, pct: float, window_s: float, *, clock: Clock = time.monotonic) -> None:
        pct = validate_pct(pct)
        if isinstance(window_s, bool) or not (
            isinstance(window_s, (int, float)) and math.isfinite(window_s) and window_s >= MIN_BUDGET_WINDOW_S
        ):
            raise ValueError(
                f"budget window must be a number of seconds >= {MIN_BUDGET_WINDOW_S}, got {window_s!r}"
            )
        self._lock = threading.Lock()
        self._clock = clock
        self._window_s = float(window_s)
        self._pct = pct  # as last set
        self._pct_in_window = pct  # what the current window allows
        now = clock()
        self._origin = now
        self._window_index = 0
        self._used = 0.0  # charged to the current window, carry included
        self._carry = 0.0  # overshoot of earlier windows still to be paid off
        self._charged_total = 0.0
        self._slices = 0
        self._share_since = now
        self._claim: str | None = None

    # -- settings --------------------------------------------------------------------

    @property
    def pct(self) -> float:
        """The percentage last set (it may apply from the next window on)."""
        with self._lock:
            return self._pct

    @property
    def window_s(self) -> float:
        return self._window_s

    def set_pct(self, pct: float) -> None:
        """Change the share in place for every engine. Raises ValueError outside [0, 100]."""
        value = validate_pct(pct)
        with self._lock:
            self._roll_locked(self._clock())
            self._pct = value
            if value == 0.0:
                self._pct_in_window = 0.0

    # -- spending --------------------------------------------------------------------

    def available(self) -> bool:
        """True when a slice may start now: the current window has allowance left."""
        with self._lock:
            self._roll_locked(self._clock())
            return self._available_locked()

    def seconds_until_available(self) -> float:
        """0 when a slice may start now; ``math.inf`` when the budget is off; otherwise
        the seconds until a window with allowance left begins, at most ``MAX_WAIT_S``."""
        with self._lock:
            now = self._clock()
            self._roll_locked(now)
            if self._available_locked():
                return 0.0
            if self._pct == 0.0:
                return math.inf
            to_next = self._window_start_locked(self._window_index + 1) - now
            next_allowance = self._allowance(self._pct)
            overshoot = max(0.0, self._used - self._allowance(self._pct_in_window))
            # Window k after this one starts with overshoot - (k - 1) * allowance charged;
            # the first with allowance left is the one where that falls below an allowance.
            windows = overshoot / next_allowance if next_allowance > 0 else 0.0
            wait = to_next + min(windows, MAX_WAIT_S / self._window_s) // 1 * self._window_s
            # Never 0 while unavailable, even where float rounding puts "now" on a boundary.
            return min(max(wait, _MIN_WAIT_S), MAX_WAIT_S)

    def remaining_s(self) -> float:
        """Allowance left in the current window, in seconds (0 when spent or off)."""
        with self._lock:
            self._roll_locked(self._clock())
            return max(0.0, self._allowance(self._pct_in_window) - self._used)

    def charge(self, seconds: float) -> None:
        """Charge a slice that has run for ``seconds`` to the current window."""
        if not isinstance(seconds, (int, float)) or not math.isfinite(seconds) or seconds < 0:
            log.warning("mlx-recovery: budget charge of %r seconds ignored", seconds)
            return
        with self._lock:
            self._roll_locked(self._clock())
            self._used += seconds
            self._charged_total += seconds
            self._slices += 1

    def share_used(self) -> float:
        """Measured share of wall time charged since creation or :meth:`reset_share`,
        as a fraction (0.1 is 10 %)."""
        with self._lock:
            elapsed = self._clock() - self._share_since
            return self._charged_total / elapsed if elapsed > 0 else 0.0

    def reset_share(self) -> None:
        """Start measuring :meth:`share_used` afresh from now."""
        with self._lock:
            self._charged_total = 0.0
            self._slices = 0
            self._share_since = self._clock()

    # -- execution claim -------------------------------------------------------------

    def try_claim(self, engine_id: str) -> bool:
        """Take the execution claim for ``engine_id``; True if it now holds it (also
        when it already did), False if another engine holds it."""
        with self._lock:
            if self._claim is None or self._claim == engine_id:
                self._claim = engine_id
                return True
            return False

    def release_claim(self, engine_id: str) -> None:
        """Give the claim back if ``engine_id`` holds it; otherwise do nothing."""
        with self._lock:
            if self._claim == engine_id:
                self._claim = None

    @property
    def claimed_by(self) -> str | None:
        with self._lock:
            return self._claim

    # -- status ----------------------------------------------------------------------

    def snapshot(self) -> dict[str, Any]:
        with self._lock:
            now = self._clock()
            self._roll_locked(now)
            elapsed = now - self._share_since
            return {
                "pct": self._pct,
                "pct_in_window": self._pct_in_window,
                "window_s": self._window_s,
                "allowance_s": self._allowance(self._pct_in_window),
                "window_index": self._window_index,
                "window_elapsed_s": now - self._window_start_locked(self._window_index),
                "used_in_window_s": self._used,
                "carry_s": self._carry,
                "available": self._available_locked(),
                "charged_s": self._charged_total,
                "slices": self._slices,
                "share_used": self._charged_total / elapsed if elapsed > 0 else 0.0,
                "claimed_by": self._claim,
            }

    # -- private ---------------------------------------------------------------------

    def _allowance(self, pct: float) -> float:
        return self._window_s * pct / 100.0

    def _available_locked(self) -> bool:
        return self._pct_in_window > 0.0 and self._used < self._allowance(self._pct_in_window)

    def _window_start_locked(self, index: int) -> float:
        return self._origin + index * self._window_s

    def _roll_locked(self, now: float) -> None:
        """Move to the window that contains ``now``, carrying overshoot and applying
        a changed ``pct``. A clock that goes backwards leaves the window as it is."""
        index = int((now - self._origin) // self._window_s)
        if index <= self._window_index:
            return
        overshoot = max(0.0, self._used - self._allowance(self._pct_in_window))
        self._pct_in_window = self._pct
        # Each window skipped in between paid off one allowance of the overshoot.
        skipped = index - self._window_index - 1
        carry = max(0.0, overshoot - skipped * self._allowance(self._pct_in_window))
        self._window_index = index
        self._carry = carry
        self._used = carry
