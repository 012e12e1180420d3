"""An asyncio event loop on a thread of its own: how the contract hosts
(:mod:`.omlx_host`, :mod:`.rapid_host`) drive a real ``EngineCore`` the way a server's
loop does, while the test thread waits on results.

Threads: the loop thread owns the loop; other threads reach it only through
``call_soon_threadsafe`` / ``run_coroutine_threadsafe``. What the host does around
start and stop (which coroutine, with which timeout, when its own ``_loop`` reads None)
stays in each host.
"""

from __future__ import annotations

import asyncio
import threading


def start_loop_thread(name: str) -> tuple[asyncio.AbstractEventLoop, threading.Thread]:
    """A new event loop running forever on a daemon thread called ``name``; returns once
    the thread has set it as its loop."""
    loop = asyncio.new_event_loop()
    ready = threading.Event()

    def run() -> None:
        asyncio.set_event_loop(loop)
        ready.set()
        loop.run_forever()

    thread = threading.Thread(target=run, name=name, daemon=True)
    thread.start()
    ready.wait()
    return loop, thread


def stop_loop_thread(loop: asyncio.AbstractEventLoop, thread: threading.Thread | None) -> None:
    """Stop ``loop`` from another thread, wait for its thread (30 s at most), close it."""
    loop.call_soon_threadsafe(loop.stop)
    if thread is not None:
        thread.join(30.0)
    loop.close()
