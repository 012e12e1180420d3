"""A competing CPU load: other processes spinning on every core, as a user's machine has
while it builds, indexes or serves another model."""

from __future__ import annotations

import os
import subprocess
import sys
from types import TracebackType

_SPIN = "while True:\n    pass\n"


class CompetingLoad:
    """Start ``processes`` busy loops on entry or :meth:`start` (default: one per core);
    stop them on exit or :meth:`stop`. Owned by the bench's thread."""

    def __init__(self, processes: int | None = None) -> None:
        self.processes = processes if processes is not None else (os.cpu_count() or 1)
        self._children: list[subprocess.Popen[bytes]] = []

    def __enter__(self) -> CompetingLoad:
        self.start()
        return self

    def start(self) -> None:
        """Start the busy loops (nothing more if they run already)."""
        if not self._children:
            self._children = [subprocess.Popen([sys.executable, "-c", _SPIN]) for _ in range(self.processes)]

    @property
    def running(self) -> bool:
        return bool(self._children)

    def __exit__(self, kind: type[BaseException] | None, exc: BaseException | None, tb: TracebackType | None) -> None:
        self.stop()

    def stop(self) -> None:
        children, self._children = self._children, []
        for child in children:
            child.kill()
        for child in children:
            child.wait()
