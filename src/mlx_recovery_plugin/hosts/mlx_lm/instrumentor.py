"""Attach the partial-prefix adopter to mlx-lm's own server, without editing any file of it.

:class:`MlxLmInstrumentor` follows the OpenTelemetry instrumentor pattern: ``instrument()``
checks mlx-lm's version and that every method it wraps exists, replaces them with thin
wrappers (:mod:`.wrappers`), and ``uninstrument()`` puts back the very objects that were
there. Both are idempotent. Importing this module imports neither mlx-lm, MLX nor pluggy.

======================================  ==============================================
mlx-lm                                  what the adapter does (thread)
======================================  ==============================================
``ResponseGenerator._tokenize``         cuts at block multiples inside segments, for
                                        models with non-trimmable layers (generation)
``LRUPromptCache.insert_cache``         at a cut: snapshot of the non-trimmable layers,
                                        no entry; otherwise the host's insert, then the
                                        snapshots are attached / pruned (generation)
``LRUPromptCache.fetch_nearest_cache``  ``prefix_lookup`` where the host cannot reuse a
                                        longer entry; the adopted cache (generation)
``APIHandler.do_GET``                   ``GET /v1/mlx-recovery/status`` (HTTP thread)
``ResponseGenerator`` / ``BatchGenerator``  the request lifecycle as hook calls (see
lifecycle methods                       :mod:`.lifecycle`: generation thread; attach
                                        and shutdown on the server's own threads)
======================================  ==============================================

``python -m mlx_lm.server`` runs the server module as ``__main__``: the start-up hook then
wraps the prompt cache at once and the server's classes when the server builds its
prompt cache (``LRUPromptCache.__init__``), just before its first request. Only the server
uses these classes, so a process that imports mlx-lm for anything else pays nothing.

Threads: ``instrument`` / ``uninstrument`` hold ``_lock``; see :mod:`.adoption`.
"""

from __future__ import annotations

import importlib
import importlib.util
import logging
import sys
from collections.abc import Callable, Mapping
from types import ModuleType
from typing import TYPE_CHECKING, Any

from ..instrumenting import Factories, HostInstrumentor, VersionRange

if TYPE_CHECKING:
    import pluggy

    from ...plugins import HookEmitter
    from ...settings import RecoverySettings
    from .adoption import Adoption

log = logging.getLogger(__name__)

#: mlx-lm releases this adapter was written against and tested on.
VERSIONS = VersionRange((0, 32, 2), (0, 33))

HOST_PACKAGE = "mlx_lm"
SERVER_MODULE = "mlx_lm.server"
CACHE_MODULE = "mlx_lm.models.cache"

# Used by the adoption, not wrapped: without them this is an mlx-lm the adapter does not know.
CACHE_NEEDS = ("PromptTrie", "can_trim_prompt_cache", "make_prompt_cache", "RotatingKVCache", "ArraysCache")


def version_supported(version: str) -> bool:
    return VERSIONS.admits(version)


def mlx_lm_version() -> str:
    from importlib.metadata import PackageNotFoundError, version

    try:
        return version("mlx-lm")
    except PackageNotFoundError:
        return "0"


def main_is_server() -> bool:
    """Is this process ``python -m mlx_lm.server``?"""
    main = sys.modules.get("__main__")
    spec = getattr(main, "__spec__", None)
    if spec is not None and getattr(spec, "name", None) == SERVER_MODULE:
        return True
    argv = list(getattr(sys, "orig_argv", ()))
    return any(a == "-m" and b == SERVER_MODULE for a, b in zip(argv, argv[1:]))


def server_module() -> ModuleType | None:
    """The server module whose classes serve requests here (``__main__`` under ``-m``)."""
    if main_is_server():
        main = sys.modules.get("__main__")
        return main if main is not None and hasattr(main, "ResponseGenerator") else None
    return sys.modules.get(SERVER_MODULE)


class MlxLmInstrumentor(HostInstrumentor):
    """The mlx-lm server adapter (entry point ``mlx_lm`` of ``mlx_recovery_plugin.hosts``)."""

    log = log

    name = "mlx_lm"
    trigger_module = SERVER_MODULE

    def __init__(self, settings: RecoverySettings | None = None) -> None:
        """``settings`` default to the environment's, read at ``instrument()``."""
        super().__init__()
        self._settings = settings
        self._life: Adoption | None = None
        self._server_wrapped = False
        self._server: ModuleType | None = None
        self._pm: pluggy.PluginManager | None = None

    # -- the adapter protocol --------------------------------------------------------

    def host_importable(self) -> bool:
        try:
            return importlib.util.find_spec(HOST_PACKAGE) is not None
        except (ImportError, ValueError):
            return False

    def instrument(self, pm: pluggy.PluginManager | None = None) -> bool:
        """Wrap mlx-lm's prompt cache and server (the template's); hooks go to ``pm``."""
        self._pm = pm
        return super().instrument(pm)

    # -- the template's parts (:class:`~..instrumenting.HostInstrumentor`) ---------------

    def _host_version(self) -> str:
        return mlx_lm_version()

    def _host_versions(self) -> VersionRange:
        return VERSIONS

    def _host_classes(self) -> dict[str, type]:
        return {"LRUPromptCache": importlib.import_module(CACHE_MODULE).LRUPromptCache}

    def _host_factories(self) -> Factories:
        from .wrappers import CACHE_FACTORIES

        factories: dict[tuple[str, str], Any] = dict(CACHE_FACTORIES)
        self._server = server_module()
        if self._server is None and not main_is_server():
            self._server = importlib.import_module(SERVER_MODULE)
        if self._server is None:
            # ``-m mlx_lm.server``: its classes exist once it builds its prompt cache.
            factories[("LRUPromptCache", "__init__")] = self._finishing_init
        return factories

    def _host_missing(self, classes: Mapping[str, type]) -> list[str]:
        cache_module = importlib.import_module(CACHE_MODULE)
        return [n for n in CACHE_NEEDS if not hasattr(cache_module, n)]

    def _new_lifecycle(self, emitter: HookEmitter) -> Adoption:
        from ...settings import load_settings
        from .adoption import Adoption

        settings = self._settings if self._settings is not None else load_settings()
        self._pm = emitter.pm
        return Adoption(
            emitter, active=settings.adopter_enabled,
            block_size=settings.mlxlm_block_tokens, budget_bytes=settings.mlxlm_snapshot_bytes,
        )

    def _attached(self) -> str:
        if self._server is not None:
            self._wrap_server(self._server)
        assert self._life is not None
        return f"adopter {'on' if self._life.active else 'off'}"

    def uninstrument(self) -> None:
        with self._lock:
            if not self._patches.restore():
                return
            life, self._life = self._life, None
            self._server_wrapped = False
        if life is not None:
            life.forget()
        log.info("mlx-recovery: detached from mlx-lm; original methods restored")

    def _host_label(self) -> str:
        return "mlx-lm"

    def startup_hooks(self) -> dict[str, Callable[[Any], None]]:
        """What the start-up hook waits for: the server module, or under ``-m`` (where it
        runs as ``__main__``) the prompt cache module it imports first. Nothing where the
        installed mlx-lm is one this adapter does not know (an oMLX or rapid-mlx process
        pinning an older one): the hook would wait for its server for ever."""
        if not version_supported(mlx_lm_version()):
            return {}

        def attach(_module: Any) -> None:
            self.instrument()

        return {CACHE_MODULE if main_is_server() else SERVER_MODULE: attach}

    # -- status ----------------------------------------------------------------------

    def status(self) -> dict[str, Any]:
        """The adapter's status: cuts, lookups, adoptions, snapshots, and the adopter's."""
        life = self._life
        out: dict[str, Any] = {"host": "mlx_lm", "version": self.version, "instrumented": life is not None}
        if life is None:
            return out
        out.update(life.status())
        out["adopter"] = self._adopter_status()
        return out

    def _adopter_status(self) -> dict[str, Any] | None:
        from ...adopter.plugin import AdopterPlugin

        pm = self._pm
        for plugin in pm.get_plugins() if pm is not None else ():
            if isinstance(plugin, AdopterPlugin):
                return plugin.status()
        return None

    # -- internals -------------------------------------------------------------------

    def _wrap_server(self, module: ModuleType) -> None:
        from .wrappers import server_factories

        classes = {"ResponseGenerator": module.ResponseGenerator, "APIHandler": module.APIHandler,
                   "BatchGenerator": module.BatchGenerator}
        self._patches.wrap(classes, server_factories(self.status), self._life)
        self._server_wrapped = True

    def _finishing_init(self, _life: Any, original: Any, _originals: Mapping[str, Any]) -> Any:
        instrumentor = self

        def wrapper(cache: Any, *args: Any, **kwargs: Any) -> None:
            original(cache, *args, **kwargs)
            try:
                instrumentor._finish_server()
            except Exception as exc:  # noqa: BLE001 - the server must start regardless
                log.warning("mlx-recovery: wrapping mlx-lm's server failed: %r", exc)

        return wrapper

    def _finish_server(self) -> None:
        with self._lock:
            if self._server_wrapped or not self._patches:
                return
            module = server_module()
            if module is not None and hasattr(module, "APIHandler"):
                self._wrap_server(module)
