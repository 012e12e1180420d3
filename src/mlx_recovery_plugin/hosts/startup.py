"""The start-up hook: "pip install, then set a variable" for hosts with no plugin loader.

``mlx_recovery_plugin.pth`` (see ``hooks/``) sits in site-packages; Python runs its one
line at every start. The line only reads ``MLX_RECOVERY_ENABLE``; when it is set to a
true value it calls :func:`install`, which loads the host adapters (entry-point group
``mlx_recovery_plugin.hosts``) and puts a finder at the front of ``sys.meta_path`` that
waits for each adapter's trigger module (oMLX: ``omlx.scheduler``). Right after that
module has executed, the adapter instruments the host. Once every awaited module has
loaded, the finder removes itself. A host already imported is instrumented at once.

Nothing here may stop the interpreter or the host from starting: every failure is
logged and swallowed.
"""

from __future__ import annotations

import importlib.abc
import logging
import os
import sys
import threading
from collections.abc import Callable, Mapping
from types import ModuleType
from typing import Any

log = logging.getLogger(__name__)

ENABLE_VARIABLE = "MLX_RECOVERY_ENABLE"
# The spellings pydantic reads as true, so the .pth line and the settings agree.
TRUE_VALUES = frozenset({"1", "true", "yes", "on", "t", "y"})

OnLoaded = Callable[[ModuleType], None]


def enabled(environ: Mapping[str, str] | None = None) -> bool:
    env = os.environ if environ is None else environ
    return env.get(ENABLE_VARIABLE, "").strip().lower() in TRUE_VALUES


class _NotifyingLoader(importlib.abc.Loader):
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


class PostImportFinder(importlib.abc.MetaPathFinder):
    """Calls back after named modules are imported; leaves ``sys.meta_path`` when done.

    Threads: imports may happen on any thread; the pending table is guarded by
    ``_lock``, and a callback runs on the importing thread, outside the lock.
    """

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._pending: dict[str, list[OnLoaded]] = {}

    def watch(self, module_name: str, callback: OnLoaded) -> None:
        module = sys.modules.get(module_name)
        if module is not None and getattr(module, "__spec__", None) is not None:
            _run(callback, module)
            return
        with self._lock:
            self._pending.setdefault(module_name, []).append(callback)

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
        log.warning("mlx-recovery: start-up hook for %s failed: %r", module.__name__, exc)


_finder: PostImportFinder | None = None


def install(environ: Mapping[str, str] | None = None) -> PostImportFinder | None:
    """Arrange for every installed host adapter to attach when its host is imported.

    Does nothing unless ``MLX_RECOVERY_ENABLE`` is true. Safe to call more than once.
    Returns the finder (None when disabled or nothing is awaited).
    """
    global _finder
    try:
        if not enabled(environ):
            return None
        if _finder is not None:
            return _finder
        from . import load_host_adapters

        finder = PostImportFinder()
        for name, adapter in load_host_adapters().items():
            if not adapter.host_importable():
                continue
            hooks = getattr(adapter, "startup_hooks", None)
            watched = hooks() if callable(hooks) else {adapter.trigger_module: _instrumenting(adapter)}
            for module_name, callback in watched.items():
                finder.watch(module_name, callback)
            log.debug("mlx-recovery: start-up hook waits for %s (%s)", sorted(watched), name)
        if finder.watching:
            finder.install()
        _finder = finder
        return finder
    except Exception as exc:  # noqa: BLE001 - never break the interpreter's start
        log.warning("mlx-recovery: start-up hook not installed: %r", exc)
        return None


def _instrumenting(adapter: Any) -> OnLoaded:
    def instrument(_module: ModuleType) -> None:
        adapter.instrument()

    return instrument
