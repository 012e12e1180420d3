"""Read entry-point groups from the installed distributions, cheaply.

The start-up hook runs in every Python process where recovery is enabled, most of which
never import a host. ``importlib.metadata`` costs about 20 ms to import and scan; this
reads the same ``entry_points.txt`` files with ``os`` alone. It follows the same rules:
``sys.path`` order, the first distribution of a name wins, ``*.dist-info`` and
``*.egg-info`` alike. It returns the entry points' values as text and loads nothing.
"""

from __future__ import annotations

import os
import sys

TYPE_CHECKING = False  # typing's own costs ms to import; mypy reads this name the same
if TYPE_CHECKING:
    from collections.abc import Iterable

#: Adapters: name -> ``module:attribute`` of the adapter class or object.
HOSTS_ENTRY_POINT_GROUP = "mlx_recovery_plugin.hosts"
#: For each adapter name, the top-level package of its host. The start-up hook waits for
#: that package to be imported before it loads the adapter; an adapter without one is
#: loaded at start.
HOST_PACKAGES_ENTRY_POINT_GROUP = "mlx_recovery_plugin.host_packages"

_METADATA_SUFFIXES = (".dist-info", ".egg-info")


def scan_groups(groups: Iterable[str], path: Iterable[str] | None = None) -> dict[str, dict[str, str]]:
    """``{group: {name: value}}`` over the distributions on ``path`` (default
    ``sys.path``), in one pass; unreadable folders and files are skipped."""
    found: dict[str, dict[str, str]] = {group: {} for group in groups}
    seen_dists: set[str] = set()
    for folder in sys.path if path is None else path:
        try:
            entries = sorted(e.name for e in os.scandir(folder or ".") if e.name.endswith(_METADATA_SUFFIXES))
        except OSError:
            continue
        for entry in entries:
            dist = _normalized(entry.rsplit(".", 1)[0].split("-", 1)[0])
            if dist in seen_dists:
                continue
            seen_dists.add(dist)
            try:
                with open(os.path.join(folder or ".", entry, "entry_points.txt"), encoding="utf-8") as file:
                    text = file.read()
            except OSError:
                continue
            for group, entries_of_group in parse_groups(text, found).items():
                for name, value in entries_of_group.items():
                    found[group].setdefault(name, value)
    return found


def parse_group(text: str, group: str) -> dict[str, str]:
    """The ``name = value`` lines of ``[group]`` in an ``entry_points.txt``."""
    return parse_groups(text, [group])[group]


def parse_groups(text: str, groups: Iterable[str]) -> dict[str, dict[str, str]]:
    """The ``name = value`` lines of each of ``groups`` in an ``entry_points.txt``, read
    in one pass (the first of a repeated name wins)."""
    found: dict[str, dict[str, str]] = {group: {} for group in groups}
    current: dict[str, str] | None = None
    for raw in text.splitlines():
        line = raw.strip()
        if not line or line.startswith(("#", ";")):
            continue
        if line.startswith("[") and line.endswith("]"):
            current = found.get(line[1:-1].strip())
            continue
        if current is not None and "=" in line:
            name, value = (part.strip() for part in line.split("=", 1))
            current.setdefault(name, value)
    return found


def _normalized(name: str) -> str:
    # PEP 503's rule without ``re``, whose import alone would cost a few ms here.
    return "_".join(filter(None, name.lower().replace("-", "_").replace(".", "_").split("_")))
