"""What a host adapter provides to the contract suite (:mod:`.contract`): one engine under
test, driven synchronously from the test's thread, and, if it can, threaded."""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any, Protocol, runtime_checkable

import pluggy

from ..ports import EnginePort


@runtime_checkable
class ContractResult(Protocol):
    """What the suite reads from a departed request's result."""

    cached_tokens: int
    output_tokens: Sequence[int]


@runtime_checkable
class ContractHost(Protocol):
    """One engine of a host, driven by the suite.

    Synchronous driving: the test's thread owns the engine; nothing happens between calls.

    * ``submit`` queues a request (``request_arrived`` fires on the calling thread) and
      returns its id; the engine does nothing until ``run_until_idle``.
    * ``run_until_idle`` steps the engine until it has no requests (no idle steps).
    * ``drive_idle(max_steps)`` offers ``engine_idle_step`` while any implementation
      answers True and the queues stay empty; returns how many it offered.
    * ``abort`` / ``abort_all`` / ``fail_all`` are applied by the engine on its next step;
      ``reset`` / ``shutdown`` / ``unload`` act at once.
    * ``result(id)`` is the departed request's result; ``outstanding_refs()`` maps each
      holder other than the prefix index itself to what it still references (empty when
      nothing leaked); ``step_count()`` counts the host's scheduler steps so far.
    * ``engine`` is the :class:`~mlx_recovery_plugin.ports.EnginePort` the plugin gets;
      the suite probes the prefix cache through it (fetch, then release).

    Capability flags: ``supports_sparse_route`` (a draft model is set; a request with
    ``sparse=True`` whose uncached part exceeds ``sparse_threshold`` takes the sparse
    route), ``supports_abort_all``, ``supports_fail_all``, ``supports_threads`` (then the
    adapter also has ``start()``, ``stop()`` and ``wait(id, timeout)``, see
    :class:`ThreadedContractHost`). Optional, read with a default where an adapter does
    not set them (see ``contract.FLAG_DEFAULTS``): ``supports_reset`` (True),
    ``supports_publication`` (True: the prefix cache port stores what recovery publishes),
    ``supports_idle_steps`` (True: ``drive_idle`` offers ``engine_idle_step``),
    ``supports_prefix_lookup`` (False: a partial match the host cannot reuse asks the
    ``prefix_lookup`` hook), ``serves_sparse_one_at_a_time`` (False: the host prefills one
    sparse request at a time, so a second one waits behind the first),
    ``tells_of_lookups`` (False: the host calls ``prefix_lookup_due`` before it looks a
    request up in its prefix cache).
    """

    supports_sparse_route: bool
    supports_abort_all: bool
    supports_fail_all: bool
    supports_threads: bool

    @property
    def block_size(self) -> int: ...

    @property
    def sparse_threshold(self) -> int: ...

    @property
    def engine(self) -> EnginePort: ...

    @property
    def plugin_manager(self) -> pluggy.PluginManager: ...

    def submit(
        self, prompt_tokens: Sequence[int], *, max_tokens: int = 4, sparse: bool = False
    ) -> str: ...

    def run_until_idle(self) -> None: ...

    def drive_idle(self, max_steps: int = 100) -> int: ...

    def abort(self, request_id: str) -> None: ...

    def abort_all(self) -> None: ...

    def fail_all(self, error: str) -> None: ...

    def reset(self, deep: bool = False) -> None: ...

    def shutdown(self) -> None: ...

    def unload(self) -> None: ...

    def result(self, request_id: str) -> ContractResult: ...

    def outstanding_refs(self) -> Mapping[str, Any]: ...

    def step_count(self) -> int: ...


@runtime_checkable
class ThreadedContractHost(ContractHost, Protocol):
    """A host that can also run its real engine loop on its own thread."""

    def start(self) -> None: ...

    def stop(self) -> None: ...

    def wait(self, request_id: str, timeout: float) -> ContractResult: ...
