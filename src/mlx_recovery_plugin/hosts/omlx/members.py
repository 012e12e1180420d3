"""The oMLX family: what differs between the servers that share oMLX's scheduler.

flyto-mlx (import name ``omlx``) ships oMLX's scheduler as one module; fusion-mlx
(``fusion_mlx``) splits it into ``sched_*.py`` modules whose functions are attached to one
``Scheduler`` class. The lifecycle, the methods the adapter wraps and the prefix cache's
calls are the same; what differs is where things live, which versions the adapter was
checked against, how the prefix cache is switched on and how the server is started. That
difference is data, one frozen :class:`Member` per server, and the one family adapter
(:class:`~.instrumentor.OmlxInstrumentor`) is bound to a member.

Nothing here imports a host: names are resolved when the adapter instruments.
"""

from __future__ import annotations

import importlib
import sys
from collections.abc import Mapping
from dataclasses import dataclass, field
from types import MappingProxyType
from typing import Any

from ..instrumenting import VersionRange


@dataclass(slots=True, frozen=True)
class Member:
    """One server of the oMLX family. Dotted names are ``module`` or ``module:attribute``."""

    #: Entry-point name and log label.
    name: str
    label: str
    #: PyPI distribution and top-level import package.
    distribution: str
    package: str
    versions: VersionRange
    version_module: str
    scheduler_module: str
    engine_core_module: str
    request_module: str
    engine_pool_module: str
    server_module: str
    #: oMLX's lock around its cache writer's reads of MLX buffers, and what an idle
    #: ``step()`` returns.
    buffer_lock: str
    scheduler_output: str
    #: Where the sparse route's default threshold and keep share live.
    specprefill_defaults: str
    #: The admin session dependency the recovery admin routes sit behind (None: the
    #: server builds its app later than its module import, so no routes are added).
    admin_auth: str | None
    #: ``SchedulerConfig`` settings that switch the block prefix cache on, given a
    #: cache directory (``{dir}`` is replaced).
    cache_config: Mapping[str, Any]
    #: ... and the settings that leave it off.
    cache_off_config: Mapping[str, Any]
    #: The serve command: console script, then the arguments for a model directory, a
    #: base path and a cache directory (``{model_dir}``, ``{base_path}``, ``{cache_dir}``).
    serve_script: str
    serve_args: tuple[str, ...]
    #: Environment the server needs (``{base_path}`` is replaced), and where it reads
    #: per-model settings (``model_settings.json``), relative to the base path.
    serve_env: Mapping[str, str] = field(default_factory=lambda: MappingProxyType({}))
    settings_dir: str = "."
    #: Per-model settings every bench arm gets (``model_settings.json`` entries).
    model_settings: Mapping[str, Any] = field(default_factory=lambda: MappingProxyType({}))
    #: The ``EngineCore`` flag without which ``add_request`` refuses requests (set by its
    #: ``start()``); test hosts that step the scheduler themselves raise it around a call.
    engine_running_flag: str | None = None

    # -- resolving names ----------------------------------------------------------------

    def resolve(self, dotted: str) -> Any:
        """The module, or its attribute, named ``module[:attribute]`` (imports it)."""
        module_name, _, attr = dotted.partition(":")
        module = sys.modules.get(module_name) or importlib.import_module(module_name)
        return getattr(module, attr) if attr else module

    def version(self) -> str:
        return str(getattr(self.resolve(self.version_module), "__version__", "0"))

    def scheduler_class(self) -> type:
        return self.resolve(self.scheduler_module).Scheduler  # type: ignore[no-any-return]

    def engine_core_class(self) -> type:
        return self.resolve(self.engine_core_module).EngineCore  # type: ignore[no-any-return]

    def host_buffer_lock(self) -> Any:
        """The host's re-entrant buffer lock, or None where this install has none."""
        try:
            return self.resolve(self.buffer_lock)
        except (ImportError, AttributeError):
            return None

    def sparse_defaults(self) -> tuple[int | None, float | None]:
        """The sparse route's default threshold and keep share (None where unknown)."""
        try:
            module = self.resolve(self.specprefill_defaults)
        except Exception:  # noqa: BLE001 - another layout: only the request's own values
            return None, None
        return getattr(module, "DEFAULT_THRESHOLD", None), getattr(module, "DEFAULT_KEEP_RATE", None)

    def scheduler_cache_config(self, cache_dir: str) -> dict[str, Any]:
        return {k: v.format(dir=cache_dir) if isinstance(v, str) else v for k, v in self.cache_config.items()}

    def serve_argv(self, script: str, model_dir: str, base_path: str, cache_dir: str) -> list[str]:
        values = {"model_dir": model_dir, "base_path": base_path, "cache_dir": cache_dir}
        return [script, *(arg.format(**values) for arg in self.serve_args)]

    def server_env(self, base_path: str) -> dict[str, str]:
        return {k: v.format(base_path=base_path) for k, v in self.serve_env.items()}


FLYTO_MLX = Member(
    name="omlx",
    label="oMLX (flyto-mlx)",
    distribution="flyto-mlx",
    package="omlx",
    versions=VersionRange((0, 7), (0, 8)),
    version_module="omlx._version",
    scheduler_module="omlx.scheduler",
    engine_core_module="omlx.engine_core",
    request_module="omlx.request",
    engine_pool_module="omlx.engine_pool",
    server_module="omlx.server",
    buffer_lock="omlx.scheduler:_mx_buffer_access_lock",
    scheduler_output="omlx.scheduler:SchedulerOutput",
    specprefill_defaults="omlx.patches.specprefill",
    admin_auth="omlx.admin.auth:require_admin",
    # flyto-mlx keeps no prefix cache unless it has an SSD directory.
    cache_config=MappingProxyType({"paged_ssd_cache_dir": "{dir}"}),
    cache_off_config=MappingProxyType({}),
    serve_script="omlx",
    serve_args=(
        "serve", "--model-dir", "{model_dir}", "--base-path", "{base_path}",
        "--paged-ssd-cache-dir", "{cache_dir}",
    ),
)

FUSION_MLX = Member(
    name="fusion_mlx",
    label="fusion-mlx",
    distribution="fusion-mlx",
    package="fusion_mlx",
    versions=VersionRange((0, 10), (0, 11)),
    version_module="fusion_mlx._version",
    scheduler_module="fusion_mlx.scheduler",
    engine_core_module="fusion_mlx.engine_core",
    request_module="fusion_mlx.request",
    engine_pool_module="fusion_mlx.pool.engine_pool",
    server_module="fusion_mlx.server",
    # The split scheduler keeps its shared state in ``types`` and ``config``, not in the
    # module of the method that uses it.
    buffer_lock="fusion_mlx.scheduler.types:_mx_buffer_access_lock",
    scheduler_output="fusion_mlx.scheduler.config:SchedulerOutput",
    specprefill_defaults="fusion_mlx.patches.specprefill",
    admin_auth=None,  # fusion_mlx.server.app is built after the module is imported
    # Its block prefix cache is on by default, in memory, without an SSD directory.
    cache_config=MappingProxyType({"enable_prefix_cache": True}),
    cache_off_config=MappingProxyType({"enable_prefix_cache": False}),
    serve_script="fusion-mlx",
    # --base-path and --model-dir are exclusive there; per-model settings come from
    # $HOME/.fusion-mlx, so the bench points HOME at the base path.
    serve_args=("serve", "--model-dir", "{model_dir}", "--enable-prefix-cache"),
    serve_env=MappingProxyType({"HOME": "{base_path}", "FUSION_MLX_API_KEY": "mlx-recovery-bench"}),
    settings_dir=".fusion-mlx",
    # Its default 4-bit TurboQuant KV cache keys blocks by quantized layer types, which
    # refuse the plugin's float blocks (the read-back probe catches it): off in every arm.
    model_settings=MappingProxyType({"turboquant_kv_enabled": False}),
    engine_running_flag="_running",
)

MEMBERS: Mapping[str, Member] = MappingProxyType({m.name: m for m in (FLYTO_MLX, FUSION_MLX)})


def member_of(obj: Any) -> Member | None:
    """The member whose package defines ``obj``'s class (a scheduler, an engine)."""
    module = type(obj).__module__
    for member in MEMBERS.values():
        if module == member.package or module.startswith(member.package + "."):
            return member
    return None
