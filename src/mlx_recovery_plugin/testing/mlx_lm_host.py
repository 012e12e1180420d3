"""The host contract suite's adapter for mlx-lm's own server, in process.

:class:`MlxLmContractHost` satisfies :class:`~mlx_recovery_plugin.testing.contract.
ContractHost` over the real server's classes: ``mlx_lm.server.ModelProvider`` (which
loads the model with ``mlx_lm.load``), ``LRUPromptCache`` and ``ResponseGenerator`` with
its own generation thread, attached through :class:`~..hosts.mlx_lm.MlxLmInstrumentor`
with the adopter registered. Requests go onto the generator's own queue as
``generate()`` puts them, as text completions whose prompt is already token ids.

mlx-lm's generation thread always runs; to drive it step by step the host swaps the
server module's ``BatchGenerator`` (a module attribute looked up at run time) for a
subclass whose ``next()`` steps only inside :meth:`run_until_idle` and otherwise lets the
loop take arrivals. One ``next()`` that reaches mlx-lm is one step, and the server's
time-budget loop ends after each (so an abort applies at the next step, not up to half a
second later as on a busy server). mlx-lm has no
sparse route, abort-all, fail-all, reset, idle steps or store path: those flags are
False, and an abort is what a client that goes away does (``GenerationContext.stop``).

Threads: the test thread submits and waits; mlx-lm's generation thread does the work.
"""

from __future__ import annotations

import itertools
import threading
import time
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path
from queue import Empty, Queue
from types import SimpleNamespace
from typing import Any

import pluggy

from ..adopter.plugin import AdopterPlugin
from ..hosts.mlx_lm.instrumentor import MlxLmInstrumentor
from ..hosts.mlx_lm.lifecycle import MlxLmEngine, Requests
from ..plugins import make_plugin_manager
from ..settings import RecoverySettings

_names = itertools.count(1)


@dataclass(slots=True)
class MlxLmResult:
    cached_tokens: int
    output_tokens: list[int] = field(default_factory=list)


class TokenPrompt(str):
    """A text prompt that is already token ids (the contract's prompts are ids)."""

    tokens: list[int]

    def __new__(cls, tokens: Sequence[int]) -> TokenPrompt:
        out = super().__new__(cls, "")
        out.tokens = list(tokens)
        return out


class _Tokenizer:
    """The loaded tokenizer, but a :class:`TokenPrompt` encodes to its own ids."""

    def __init__(self, inner: Any) -> None:
        self._inner = inner

    def __getattr__(self, name: str) -> Any:
        return getattr(self._inner, name)

    def encode(self, text: Any, *args: Any, **kwargs: Any) -> Any:
        if isinstance(text, TokenPrompt):
            return list(text.tokens)
        return self._inner.encode(text, *args, **kwargs)


def cli_args(model_dir: str | Path, **overrides: Any) -> SimpleNamespace:
    """``mlx_lm.server``'s command-line defaults, for building its classes in process."""
    values: dict[str, Any] = dict(
        model=str(model_dir), adapter_path=None, draft_model=None, num_draft_tokens=3,
        trust_remote_code=False, chat_template="", use_default_chat_template=False,
        temp=0.0, top_p=1.0, top_k=0, min_p=0.0, max_tokens=512, chat_template_args={},
        decode_concurrency=32, prompt_concurrency=8, prefill_step_size=2048,
        prompt_cache_size=10, prompt_cache_bytes=None, kv_bits=None, kv_group_size=64,
        quantized_kv_start=0, pipeline=False,
    )
    values.update(overrides)
    return SimpleNamespace(**values)


class MlxLmContractHost:
    """:class:`ContractHost` over mlx-lm's server classes, instrumented, in process."""

    supports_sparse_route = False
    supports_abort_all = False
    supports_fail_all = False
    supports_threads = False  # its generation thread always runs; see the module docstring
    supports_reset = False
    supports_publication = False
    supports_idle_steps = False
    supports_prefix_lookup = True

    def __init__(
        self, model_dir: str | Path, *, block_size: int = 64, snapshot_bytes: int = 1 << 30,
        pm: pluggy.PluginManager | None = None, timeout: float = 120.0,
    ) -> None:
        from mlx_lm import server

        self._block = block_size
        self._timeout = timeout
        self._server = server
        settings = RecoverySettings(adopter_enabled=True, mlxlm_block_tokens=block_size,
                                    mlxlm_snapshot_bytes=snapshot_bytes)
        self.pm = pm if pm is not None else make_plugin_manager(
            [AdopterPlugin(settings)], settings=settings, entry_points_too=False)
        self.instrumentor = MlxLmInstrumentor(settings)
        if not self.instrumentor.instrument(self.pm):
            raise RuntimeError("the mlx-lm adapter refused to attach (see the log)")
        self._gate = threading.Event()
        self._steps = 0
        self._original_batch = server.BatchGenerator
        server.BatchGenerator = _gated_batch_generator(self, server.BatchGenerator)

        class Provider(server.ModelProvider):  # type: ignore[misc]
            def _load(self, *args: Any, **kwargs: Any) -> None:
                super()._load(*args, **kwargs)
                self.tokenizer: Any = _Tokenizer(self.tokenizer)

        self.provider = Provider(cli_args(model_dir))
        self.prompt_cache = server.LRUPromptCache(self.provider.cli_args.prompt_cache_size)
        self.generator = server.ResponseGenerator(self.provider, self.prompt_cache)
        self._requests: dict[str, tuple[Queue[Any], Any, Any]] = {}
        self._results: dict[str, MlxLmResult] = {}
        self._stopped = False
        self._closed = False

    # -- what the suite reads ----------------------------------------------------------
    @property
    def block_size(self) -> int:
        return self._block

    @property
    def sparse_threshold(self) -> int:
        return 1 << 30

    @property
    def lifecycle(self) -> Requests:
        life = self.instrumentor._life
        assert life is not None, "the adapter is not attached"
        requests: Requests = life.requests
        return requests

    @property
    def engine(self) -> MlxLmEngine:
        engine = self.lifecycle.engine
        assert engine is not None, "the server's ResponseGenerator was built before the adapter attached"
        return engine

    @property
    def plugin_manager(self) -> pluggy.PluginManager:
        return self.pm

    def result(self, request_id: str) -> MlxLmResult:
        if request_id in self.lifecycle.live_ids():
            raise KeyError(f"request {request_id!r} has not finished yet")
        out = self._results.get(request_id)
        if out is None:
            queue, ctx, _ = self._requests[request_id]
            out = MlxLmResult(cached_tokens=max(0, int(ctx.prompt_cache_count)))
            while True:
                try:
                    item = queue.get_nowait()
                except Empty:
                    break
                if isinstance(item, self._server.Response):
                    out.output_tokens.append(int(item.token))
            self._results[request_id] = out
        return out

    def outstanding_refs(self) -> dict[str, Any]:
        """Live requests once idle, and snapshots no stored entry extends."""
        out: dict[str, Any] = {}
        if live := self.lifecycle.live_ids():
            out["live requests"] = live
        life = self.instrumentor._life
        if life is not None and not live and (pending := life.snapshots.pending()):
            out["pending snapshots"] = pending
        return out

    def step_count(self) -> int:
        return self._steps

    # -- driving -----------------------------------------------------------------------
    def submit(self, prompt_tokens: Sequence[int], *, max_tokens: int = 4, sparse: bool = False) -> str:
        """Queue a request as ``ResponseGenerator.generate`` does; returns once mlx-lm's
        generation thread admitted it (the adapter's id for it is known then)."""
        server = self._server
        request = server.CompletionRequest("text", TokenPrompt(prompt_tokens), [], None, None)
        args = server.GenerationArguments(
            model=server.ModelDescription(model="default_model", draft="default_model", adapter=None),
            sampling=server.SamplingArguments(0.0, 1.0, 0, 0.0, 0.0, 0.0),
            logits=server.LogitsProcessorArguments(None, 1.0, 20, 0.0, 20, 0.0, 20),
            stop_words=[], max_tokens=max_tokens, num_draft_tokens=3, logprobs=False,
            top_logprobs=0, seed=None, chat_template_kwargs=None,
        )
        queue: Queue[Any] = Queue()
        self.generator.requests.put((queue, request, args))
        ctx = queue.get(timeout=self._timeout)
        if isinstance(ctx, Exception):
            raise ctx
        rid = self.lifecycle.request_id(request)
        if rid is None:
            raise RuntimeError("the adapter reported no arrival for the request")
        self._requests[rid] = (queue, ctx, request)  # keeps ``request`` alive: its id is the key
        return rid

    def run_until_idle(self) -> None:
        deadline = time.monotonic() + self._timeout
        self._gate.set()
        try:
            while self.lifecycle.live_ids() or not self.generator.requests.empty():
                if time.monotonic() > deadline:
                    raise TimeoutError(f"mlx-lm still busy: {self.lifecycle.live_ids()}")
                time.sleep(0.002)
        finally:
            self._gate.clear()

    def drive_idle(self, max_steps: int = 100) -> int:
        return 0  # mlx-lm offers no idle steps

    def abort(self, request_id: str) -> None:
        entry = self._requests.get(request_id)
        if entry is not None:
            entry[1].stop()  # what mlx-lm's HTTP handler does when the client goes away

    def abort_all(self) -> None:  # pragma: no cover - supports_abort_all is False
        raise NotImplementedError

    def fail_all(self, error: str) -> None:  # pragma: no cover - supports_fail_all is False
        raise NotImplementedError

    def reset(self, deep: bool = False) -> None:  # pragma: no cover - supports_reset is False
        raise NotImplementedError

    def shutdown(self) -> None:
        if self._stopped:
            return
        self._stopped = True
        self.generator.stop_and_join()

    def unload(self) -> None:
        self.shutdown()  # mlx-lm's generation thread drops the model as it ends

    def close(self) -> None:
        if self._closed:
            return
        self._closed = True
        try:
            self.shutdown()
        finally:
            self._server.BatchGenerator = self._original_batch
            self.instrumentor.uninstrument()


def _gated_batch_generator(host: MlxLmContractHost, base: type) -> type:
    class GatedBatchGenerator(base):  # type: ignore[misc]
        """``next()`` steps only while the host runs; otherwise it lets the loop take
        an arrival, or waits. After each step it answers nothing once, which ends the
        server's time-budget loop: the server then applies what it deferred (a stopped
        request's removal) before the next step, as it does between budgets."""

        stepped = False

        def next(self) -> Any:
            if self.stepped:
                self.stepped = False
                return [], []
            while not host._gate.is_set():
                if host._stopped or not host.generator.requests.empty():
                    return [], []
                time.sleep(0.001)
            host._steps += 1
            self.stepped = True
            return super().next()

    return GatedBatchGenerator
