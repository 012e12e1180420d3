"""Cancelling one engine's recovery from any thread, while its engine thread may be in a slice.

A cancellation (reset, abort all, shutdown, unload) sets the stop flag, which a running
slice's ``should_stop`` sees between layers, and bumps a generation, so the engine thread
can tell after a slice that one came in while it ran. ``closed`` means the engine is
going away: no further work is taken. The engine thread settles a cancellation (drops its
state) either at once, when no slice is running, or when its slice returns.

Threads: any thread requests; the engine thread reads and settles. The flag is an
``Event``; generation and ``closed`` change under ``_lock``.
"""

from __future__ import annotations

import threading


class Cancellation:
    """The stop flag, the cancellation generation and the closed mark of one engine."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._stop = threading.Event()
        self._generation = 0
        self._closed = False

    @property
    def closed(self) -> bool:
        return self._closed

    @property
    def generation(self) -> int:
        return self._generation

    def request(self, *, forget: bool) -> None:
        """Any thread: stop the running slice; ``forget``: the engine is going away."""
        with self._lock:
            self._generation += 1
            if forget:
                self._closed = True
        self._stop.set()

    def stop_requested(self) -> bool:
        return self._stop.is_set()

    def settled(self) -> None:
        """Engine thread: the cancellation's state is dropped. A closed engine stays
        stopped; an open one may work again."""
        with self._lock:
            if self._closed:
                self._stop.set()
            else:
                self._stop.clear()
