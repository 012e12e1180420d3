"""What became of recovery's work, from the plugin's status figures.

Of the tokens the slices ran, some were committed (published and read back), some are
finished but still held back by the publish policy for a conversation that may come
back, and the rest was dropped (a stand-down, a fork, an eviction). A session's end
cuts the held share off wherever it stands; ``bench server --settle`` reads the status
again after more idle time, so work the next think time would have committed is told
apart from work that stays held.
"""

from __future__ import annotations

from typing import Any


def committed_share(status: dict[str, Any] | None) -> float | None:
    """Tokens committed over tokens run (None: no status, or nothing ran)."""
    if not status or not status.get("tokens_run"):
        return None
    return float(status["tokens_recovered"]) / float(status["tokens_run"])


def held_share(status: dict[str, Any] | None) -> float | None:
    """Tokens held back over tokens run (None: nothing ran, or an older plugin did not say)."""
    if not status or not status.get("tokens_run") or status.get("tokens_held") is None:
        return None
    return float(status["tokens_held"]) / float(status["tokens_run"])
