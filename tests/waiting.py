"""Waiting in a test for what another thread (a host's engine loop) does."""

from __future__ import annotations

import threading
from collections.abc import Callable


def wait_until(condition: Callable[[], bool], what: str, timeout_s: float = 60.0) -> None:
    """Poll ``condition`` every 10 ms for up to ``timeout_s`` (a generous bound, never a
    timing assertion); fail naming ``what`` if it never holds."""
    pause = threading.Event()
    for _ in range(int(timeout_s / 0.01)):
        if condition():
            return
        pause.wait(0.01)
    raise AssertionError(f"timed out waiting for {what}")
