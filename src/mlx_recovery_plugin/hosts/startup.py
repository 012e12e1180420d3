"""The start-up hook: "pip install, then set a variable" for hosts with no plugin loader.

``mlx_recovery_plugin.pth`` (see ``hooks/``) sits in site-packages; Python runs its one
line at every start. The line only reads ``MLX_RECOVERY_ENABLE``; when it is set to a
true value it calls :func:`install`, which puts a finder at the front of
``sys.meta_path``. Most processes never import a host, so install loads nothing: it reads
the entry points (:mod:`.entry_scan`, no ``importlib.metadata``) and waits for each
adapter's host package (group ``mlx_recovery_plugin.host_packages``; oMLX's is ``omlx``).
When that package is imported, the adapter (group ``mlx_recovery_plugin.hosts``) is
loaded and its trigger modules are awaited in turn (oMLX: ``omlx.scheduler``); right
after such a module has executed, the adapter instruments the host. Once nothing is
awaited, the finder removes itself. A host already imported is instrumented at once; an
adapter that names no host package is loaded at start.

This module imports only what a bare interpreter has already loaded, so the hook costs a
few milliseconds where no host is imported. Nothing here may stop the interpreter or the
host from starting: every failure is logged and swallowed.
"""

from __future__ import annotations

import _thread
import os
import sys

from .entry_scan import HOST_PACKAGES_ENTRY_POINT_GROUP, HOSTS_ENTRY_POINT_GROUP, scan_groups

TYPE_CHECKING = False  # typing's own costs ms to import; mypy reads this name the same
if TYPE_CHECKING:
    import logging
    from collections.abc import Callable, Iterable, Mapping
    from types import ModuleType
    from typing import Any

    OnLoaded = Callable[[ModuleType], None]

ENABLE_VARIABLE = "MLX_RECOVERY_ENABLE"
# The spellings pydantic reads as true, so the .pth line and the settings agree.
TRUE_VALUES = frozenset({"1", "true", "yes", "on", "t", "y"})
FALSE_VALUES = frozenset({"", "0", "false", "no", "off", "f", "n"})


def _log() -> logging.Logger:
    import logging

    return logging.getLogger(__name__)


def enabled(environ: Mapping[str, str] | None = None) -> bool:
    env = os.environ if environ is None else environ
    return env.get(ENABLE_VARIABLE, "").strip().lower() in TRUE_VALUES


class _NotifyingLoader:
    """Runs the real loader, puts it back on the module, then calls ``on_loaded``."""

    def __init__(self, loader: Any, on_loaded: OnLoaded) -> None:
        self._loader = loader
        self._on_loaded = on_loaded

    def create_module(self, spec: Any) -> ModuleType | None:
        return self._loader.create_module(spec)

    def exec_module(self, module: ModuleType) -> None:
        if module.__spec__ is not None:
            module.__spec__.loader = self._loader
        module.__loader__ = self._loader
        self._loader.exec_module(module)
        self._on_loaded(module)

    def __getattr__(self, name: str) -> Any:
        return getattr(self._loader, name)


class PostImportFinder:
    """Calls back after named modules are imported; joins ``sys.meta_path`` while it
    waits for one and leaves it when done (a meta-path finder and loader by duck typing:
    ``importlib.abc`` costs ms to import).

    Threads: imports may happen on any thread; the pending table is guarded by
    ``_lock``, and a callback runs on the importing thread, outside the lock.
    """

    def __init__(self) -> None:
        self._lock = _thread.allocate_lock()
        self._pending: dict[str, list[OnLoaded]] = {}

    def watch(self, module_name: str, callback: OnLoaded) -> None:
        module = sys.modules.get(module_name)
        if module is not None and getattr(module, "__spec__", None) is not None:
            _run(callback, module)
            return
        with self._lock:
            self._pending.setdefault(module_name, []).append(callback)
        self.install()

    @property
    def watching(self) -> list[str]:
        with self._lock:
            return sorted(self._pending)

    def find_spec(self, fullname: str, path: Any = None, target: Any = None) -> Any:
        with self._lock:
            if fullname not in self._pending:
                return None
        spec = None
        for finder in list(sys.meta_path):
            find = getattr(finder, "find_spec", None)
            if finder is self or find is None:
                continue
            spec = find(fullname, path, target)
            if spec is not None:
                break
        if spec is None or spec.loader is None or not hasattr(spec.loader, "exec_module"):
            return spec
        spec.loader = _NotifyingLoader(spec.loader, lambda module: self._loaded(fullname, module))
        return spec

    def _loaded(self, name: str, module: ModuleType) -> None:
        with self._lock:
            callbacks = self._pending.pop(name, [])
            done = not self._pending
        if done:
            self.remove()
        for callback in callbacks:
            _run(callback, module)
        # A callback may have found nothing more to wait for (an adapter that declines).
        with self._lock:
            done = not self._pending
        if done:
            self.remove()

    def install(self) -> None:
        if self not in sys.meta_path:
            sys.meta_path.insert(0, self)

    def remove(self) -> None:
        try:
            sys.meta_path.remove(self)
        except ValueError:
            pass


def _run(callback: OnLoaded, module: ModuleType) -> None:
    try:
        callback(module)
    except Exception as exc:  # noqa: BLE001 - the host's import must go on
        _log().warning("mlx-recovery: start-up hook for %s failed: %r", module.__name__, exc)


_finder: PostImportFinder | None = None


def install(environ: Mapping[str, str] | None = None) -> PostImportFinder | None:
    """Arrange for every installed host adapter to attach when its host is imported.

    Does nothing unless ``MLX_RECOVERY_ENABLE`` is true. Safe to call more than once.
    Returns the finder (None when disabled or on failure).
    """
    global _finder
    try:
        if not enabled(environ):
            _say_if_misspelt(os.environ if environ is None else environ)
            return None
        if _finder is not None:
            return _finder
        finder = PostImportFinder()
        groups = scan_groups([HOSTS_ENTRY_POINT_GROUP, HOST_PACKAGES_ENTRY_POINT_GROUP])
        packages = groups[HOST_PACKAGES_ENTRY_POINT_GROUP]
        at_start: list[str] = []
        for name in sorted(groups[HOSTS_ENTRY_POINT_GROUP]):
            package = packages.get(name)
            if package is None:
                at_start.append(name)
            elif _findable(package):
                finder.watch(package, _loading(finder, name))
        if at_start:
            watch_adapters(finder, at_start)
        _finder = finder
        return finder
    except Exception as exc:  # noqa: BLE001 - never break the interpreter's start
        _log().warning("mlx-recovery: start-up hook not installed: %r", exc)
        return None


def _say_if_misspelt(env: Mapping[str, str]) -> None:
    # The .pth line runs install() for every value that is not plainly false, so a value
    # that is neither (``2``, ``maybe``) is said on stderr instead of meaning "off" silently;
    # logging is not set up this early in a host's start.
    raw = env.get(ENABLE_VARIABLE, "")
    if raw.strip().lower() not in FALSE_VALUES:
        sys.stderr.write(
            f"mlx-recovery: {ENABLE_VARIABLE}={raw!r} is neither true ({', '.join(sorted(TRUE_VALUES))}) "
            f"nor false ({', '.join(sorted(FALSE_VALUES - {''}))}); recovery is not attached\n"
        )


def watch_adapters(finder: PostImportFinder, names: Iterable[str]) -> None:
    """Load the adapters ``names`` and await their trigger modules."""
    from .adapters import load_host_adapters

    for name, adapter in load_host_adapters(names=names).items():
        if not adapter.host_importable():
            continue
        hooks = getattr(adapter, "startup_hooks", None)
        watched = hooks() if callable(hooks) else {adapter.trigger_module: _instrumenting(adapter)}
        for module_name, callback in watched.items():
            finder.watch(module_name, callback)
        _log().debug("mlx-recovery: start-up hook waits for %s (%s)", sorted(watched), name)


def _loading(finder: PostImportFinder, name: str) -> OnLoaded:
    def load(_package: ModuleType) -> None:
        watch_adapters(finder, [name])

    return load


def _findable(package: str) -> bool:
    """Is a top-level package installed? Asks the meta-path finders, imports nothing."""
    for meta in list(sys.meta_path):
        find = getattr(meta, "find_spec", None)
        if find is None or isinstance(meta, PostImportFinder):
            continue
        try:
            if find(package, None) is not None:
                return True
        except (ImportError, ValueError):
            continue
    return False


def _instrumenting(adapter: Any) -> OnLoaded:
    def instrument(_module: ModuleType) -> None:
        adapter.instrument()

    return instrument
