"""Attach the lifecycle hooks to rapid-mlx at run time, without editing any file of it.

:class:`RapidInstrumentor` follows the OpenTelemetry instrumentor pattern:
``instrument()`` checks rapid-mlx's version and that every method it wraps exists, then
replaces those methods on ``rapid_mlx.scheduler.Scheduler`` and
``rapid_mlx.engine_core.EngineCore`` with thin wrappers (:mod:`.wrappers`);
``uninstrument()`` puts back the very objects that were there. Both are idempotent.
Importing this module imports neither rapid-mlx, MLX, asyncio nor pluggy.

===========================================  =================================================
rapid-mlx                                    hook (thread)
===========================================  =================================================
``EngineCore.__init__``, first sight of a    ``engine_attached`` (the building thread)
scheduler
``EngineCore.add_request``,                  ``request_arrived``, once, at the earlier of the
``Scheduler.add_request``                    two (event-loop thread / mlx-step thread)
``Scheduler._schedule_waiting``              ``request_admitted`` (mlx-step thread)
``Scheduler._cleanup_finished``              ``request_prefilled`` for a request that
                                             finished in its prefill step,
                                             ``sparse_route_served`` for PFlash-compressed
                                             requests, with the original prompt, then
                                             ``request_departed`` finished (mlx-step thread)
``Scheduler._do_abort_request``              ``request_aborted`` + ``request_departed`` aborted
``Scheduler._recover_from_generation_error``  ``engine_failed_all`` + ``request_departed``
                                             failed (mlx-step thread)
``Scheduler.reset`` / ``deep_reset`` /       ``engine_reset`` deep (rapid-mlx's reset empties
``_recover_from_cache_error``                its prefix cache too), before it is emptied
``Scheduler.clear_prefix_cache`` (the idle   ``engine_reset`` deep, after it emptied the cache
cache clear, the admin route)
``EngineCore.stop``                          ``engine_shutdown`` (event-loop thread)
``EngineCore.close`` (model unloads)         ``engine_shutdown`` if not yet, then
                                             ``model_unloaded``
``Scheduler.has_requests`` / ``step``        idle driving: ``engine_idle_step`` on the
                                             mlx-step thread (see :mod:`.idle_driver`)
===========================================  =================================================

Threads: see :mod:`.lifecycle`. ``instrument`` / ``uninstrument`` hold ``_lock``.
"""

from __future__ import annotations

import importlib
import importlib.util
import logging
import os
import time
from collections.abc import Callable, Mapping
from typing import TYPE_CHECKING, Any

from ..instrumenting import Factories, HostInstrumentor, VersionRange

if TYPE_CHECKING:
    from ...plugins import HookEmitter
    from .idle_driver import IdleDriver
    from .lifecycle import Lifecycle

log = logging.getLogger(__name__)

#: rapid-mlx releases this adapter was written against (read from 0.16.10's code).
VERSIONS = VersionRange((0, 16, 10), (0, 17))

#: The top-level import package of rapid-mlx (its ``vllm_mlx`` is a forwarding shim).
HOST_PACKAGE = "rapid_mlx"

#: Environment variable: tokens per published entry step. It is the settings' field
#: ``rapid_block_tokens`` (so it is documented and validated there), read here without
#: loading the settings, which would import pydantic into every process at start.
BLOCK_VARIABLE = "MLX_RECOVERY_RAPID_BLOCK_TOKENS"
DEFAULT_BLOCK_TOKENS = 256

# Used by the ports and wrappers, not wrapped: their absence means a rapid-mlx this
# adapter does not know.
SCHEDULER_NEEDS = ("abort_request", "SchedulerOutput")

def version_supported(version: str) -> bool:
    return VERSIONS.admits(version)


def block_tokens(environ: dict[str, str] | None = None) -> int:
    env = os.environ if environ is None else environ
    raw = env.get(BLOCK_VARIABLE, "").strip()
    if not raw:
        return DEFAULT_BLOCK_TOKENS
    try:
        value = int(raw)
    except ValueError:
        value = 0
    if value <= 0:
        log.warning("mlx-recovery: %s=%r is not a positive integer; using %d", BLOCK_VARIABLE, raw, DEFAULT_BLOCK_TOKENS)
        return DEFAULT_BLOCK_TOKENS
    return value


class RapidInstrumentor(HostInstrumentor):
    """The rapid-mlx host adapter (entry point ``rapid_mlx`` of ``mlx_recovery_plugin.hosts``).
    ``instrument()``, uninstrumenting and the per-engine look-ups are
    :class:`~..instrumenting.HostInstrumentor`'s; this class says what is rapid-mlx's."""

    log = log

    name = "rapid_mlx"
    trigger_module = "rapid_mlx.engine_core"

    def __init__(self, clock: Callable[[], float] = time.monotonic, block_size: int | None = None) -> None:
        """``clock`` drives idle-step delays; ``block_size`` is the granularity recovery
        publishes entries at (default: ``MLX_RECOVERY_RAPID_BLOCK_TOKENS`` or 256)."""
        super().__init__()
        self._clock = clock
        self._block_size = block_size
        self._life: Lifecycle | None = None

    # -- the adapter protocol --------------------------------------------------------

    def host_importable(self) -> bool:
        try:
            return importlib.util.find_spec(HOST_PACKAGE) is not None
        except (ImportError, ValueError):
            return False

    # -- the template's parts (:class:`~..instrumenting.HostInstrumentor`) ---------------

    def _host_version(self) -> str:
        return rapid_version()

    def _host_versions(self) -> VersionRange:
        return VERSIONS

    def _host_classes(self) -> dict[str, type]:
        return {
            "Scheduler": importlib.import_module("rapid_mlx.scheduler").Scheduler,
            "EngineCore": importlib.import_module("rapid_mlx.engine_core").EngineCore,
        }

    def _host_factories(self) -> Factories:
        from .wrappers import FACTORIES

        return FACTORIES

    def _host_missing(self, classes: Mapping[str, type]) -> list[str]:
        scheduler_module = importlib.import_module("rapid_mlx.scheduler")
        return [
            f"scheduler.{n}" for n in SCHEDULER_NEEDS
            if not hasattr(classes["Scheduler"], n) and not hasattr(scheduler_module, n)
        ]

    def _new_lifecycle(self, emitter: HookEmitter) -> Lifecycle:
        from .lifecycle import Lifecycle

        size = self._block_size if self._block_size is not None else block_tokens()
        return Lifecycle(emitter, self._clock, size)

    def _host_label(self) -> str:
        return "rapid-mlx"

    def startup_hooks(self) -> dict[str, Callable[[Any], None]]:
        """What the start-up hook waits for: the engine module (it imports the scheduler)."""
        return {self.trigger_module: lambda _module: self.instrument()}

    # -- engines ---------------------------------------------------------------------

    def idle_driver(self, scheduler: Any) -> IdleDriver | None:
        record = self._life.get(scheduler) if self._life is not None else None
        return record.driver if record is not None else None



def rapid_version() -> str:
    """rapid-mlx's installed version, from its distribution metadata (no import)."""
    from importlib.metadata import PackageNotFoundError, version

    try:
        return version("rapid-mlx")
    except PackageNotFoundError:
        return "0"
