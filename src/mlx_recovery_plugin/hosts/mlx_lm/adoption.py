"""What the mlx-lm adapter does at each of the host's three prompt-cache moments.

* ``ResponseGenerator._tokenize`` (the segments of a prompt): :meth:`Adoption.segments`
  adds cuts at block multiples inside segments, for models with non-trimmable layers only
  (a pure-attention model gets the host's own result back, the very same object).
* ``LRUPromptCache.insert_cache``: at a cut, :meth:`Adoption.snapshot` keeps copies of
  the non-trimmable layers and the host stores nothing; any other insert goes to the
  host, then attaches the snapshots the new entry extends and drops the orphaned ones.
* ``LRUPromptCache.fetch_nearest_cache``: :meth:`Adoption.fetch` finds the case the host
  cannot serve (a longer stored entry that is not trimmable, sharing more than the host
  would reuse), asks the ``prefix_lookup`` hook (the adopter's decision), and returns the
  adopted cache and the rest of the prompt. Everything else is the host's own answer.

Threads: mlx-lm's generation thread calls all three; the counters are read by the status
route on an HTTP thread, under ``_lock``. Nothing here raises into the host: a fault is
logged, counted, and the host's own answer is used.
"""

from __future__ import annotations

import itertools
import logging
import threading
import time
import weakref
from collections.abc import Callable, Hashable, Sequence
from typing import Any

from ...events import PrefixLookup
from ...plugins import HookEmitter
from . import layers as layer_ops
from .cuts import is_cut, plan_cuts
from .lifecycle import ENGINE_ID, Requests
from .snapshots import SnapshotStore
from .store import EntryRef, PromptCacheStore, adopted_cache

log = logging.getLogger(__name__)


class Adoption:
    """The adapter's state for one process (mlx-lm's server serves one model at a time)."""

    def __init__(self, emitter: HookEmitter, *, active: bool, block_size: int, budget_bytes: int) -> None:
        self.emitter = emitter
        self.active = active and budget_bytes > 0
        self.block_size = block_size
        self.snapshots = SnapshotStore(budget_bytes)
        self.store = PromptCacheStore(self.snapshots, block_size)
        self.requests = Requests(emitter, block_size, on_aborted=self._aborted)
        self.requests.snapshots = self.snapshots
        self._lock = threading.Lock()
        self._ids = itertools.count(1)
        # The model last asked about (the server serves one at a time) and its answer;
        # a weak reference, so an unloaded model is not kept alive.
        self._stateful: tuple[weakref.ref[Any], bool] | None = None
        self._counts: dict[str, int] = {
            "prompts_cut": 0, "cuts": 0, "lookups_asked": 0, "adopted": 0,
            "adopted_tokens": 0, "host_tokens_over": 0, "faults": 0,
            "host_cache_bytes": 0, "host_cache_entries": 0, "snapshot_us": 0,
        }

    # -- _tokenize -------------------------------------------------------------------

    def segments(self, generator: Any, result: tuple[Any, ...]) -> tuple[Any, ...]:
        """The host's ``_tokenize`` result, with cuts where boundary state is worth saving."""
        if not self.active:
            return result
        try:
            prompt, segments, types = result[0], result[1], result[2]
            model = generator.model_provider.model
            if model is None or not self._model_needs_state(model) or len(segments) != len(types):
                return result
            key = generator.model_provider.model_key
            new_segments, new_types, cuts = plan_cuts(
                segments, types, self.block_size,
                skip=lambda position: self.snapshots.holds(key, prompt[:position]),
            )
            if not cuts:
                return result
            self._count(prompts_cut=1, cuts=len(cuts))
            return (prompt, new_segments, new_types, *result[3:])
        except Exception as exc:  # noqa: BLE001 - the host's own segments are always fine
            self._fault("segments", exc)
            return result

    # -- insert_cache ----------------------------------------------------------------

    def takes_insert(self, cache_type: object) -> bool:
        """Is this insert the end of one of the adapter's cuts (snapshot, not entry)?"""
        return is_cut(cache_type)

    def snapshot(self, model: Hashable, tokens: Sequence[int], cache: Sequence[Any]) -> None:
        start = time.perf_counter()  # the capture is the adapter's own cost in the host's prefill
        try:
            saved = {i: layer_ops.copy_layer(cache[i]) for i in layer_ops.stateful_layers(cache)}
            if saved:
                self.snapshots.put(model, tokens, saved, sum(layer_ops.layer_bytes(c) for c in saved.values()))
        except Exception as exc:  # noqa: BLE001 - a lost snapshot costs reuse only
            self._fault("snapshot", exc)
        self._count(snapshot_us=int((time.perf_counter() - start) * 1e6))

    def entries(self, prompt_cache: Any) -> dict[int, tuple[Hashable, list[int]]] | None:
        """Before the host's insert: its entries by the identity of their token lists
        (cheap: no token is read), so :meth:`inserted` can tell which ones it evicted."""
        if not self.active or not len(self.snapshots):
            return None  # nothing to prune (always so for a pure-attention model)
        try:
            return {id(t): (m, t) for lru in prompt_cache._lru._lrus.values() for m, t in lru}
        except Exception as exc:  # noqa: BLE001
            self._fault("entries", exc)
            return None

    def inserted(
        self, prompt_cache: Any, model: Hashable, tokens: Sequence[int],
        before: dict[int, tuple[Hashable, list[int]]] | None,
    ) -> None:
        """After the host stored an entry (and maybe evicted others)."""
        if not self.active:
            return
        try:
            with self._lock:  # the host's own memory, beside the snapshots', for the status
                self._counts["host_cache_bytes"] = int(prompt_cache.nbytes)
                self._counts["host_cache_entries"] = len(prompt_cache)
            if not len(self.snapshots):
                return
            self.snapshots.attach(model, tokens, self.block_size)
            if before:
                kept = {id(t) for lru in prompt_cache._lru._lrus.values() for _, t in lru}
                for key in before.keys() - kept:
                    gone_model, gone_tokens = before[key]
                    self.snapshots.prune_under(
                        gone_model, gone_tokens, self.block_size,
                        lambda m, prefix: _extended(prompt_cache._trie, m, prefix),
                    )
        except Exception as exc:  # noqa: BLE001
            self._fault("prune", exc)

    # -- fetch_nearest_cache ---------------------------------------------------------

    def fetch(self, prompt_cache: Any, original: Callable[..., Any], model: Hashable, tokens: list[int]) -> Any:
        if self.active:
            try:
                adopted = self._adopt(prompt_cache, model, tokens)
            except Exception as exc:  # noqa: BLE001 - fall back to the host's own answer
                self._fault("fetch", exc)
                adopted = None
            if adopted is not None:
                return adopted
        return original(prompt_cache, model, tokens)

    def _adopt(self, prompt_cache: Any, model: Hashable, tokens: list[int]) -> tuple[list[Any], list[int]] | None:
        from mlx_lm.models.cache import can_trim_prompt_cache

        trie = prompt_cache._trie
        found = trie.search(model, tokens)
        if found.exact is not None or found.longer is None:
            return None
        host_tokens = len(found.shorter) if found.shorter is not None else 0
        if found.common_prefix <= host_tokens:
            return None
        entry = trie.get(found.model, found.longer)
        if can_trim_prompt_cache(entry.prompt_cache):
            return None  # the host trims a copy itself
        # The host keeps at least one token to prefill; the adopter floors to the block.
        matched = min(len(tokens) - 1, found.common_prefix)
        if (matched // self.block_size) * self.block_size <= host_tokens:
            return None  # a divergence at (or just past) a segment end the host stored
        boundaries = self.snapshots.boundaries(model, tokens, self.block_size, matched)
        usable = [b for b in boundaries if b > host_tokens]
        ref = EntryRef(trie, found.model, list(found.longer), list(tokens), frozenset(usable))
        lookup = PrefixLookup(
            engine_id=ENGINE_ID,
            request_id=self.requests.current or f"mlx_lm-lookup-{next(self._ids)}",
            entry_id=f"{len(found.longer)}-tokens",
            entry_tokens=len(found.longer),
            # Walk back to the last boundary with a snapshot; with none, the decision
            # refuses (and counts) the block floor of the match.
            matched_tokens=usable[0] if usable else matched,
            block_size=self.block_size,
            entry=ref,
            store=self.store,
        )
        self._count(lookups_asked=1)
        decision = self.emitter.prefix_lookup(lookup)
        if decision is None or decision.adopt_tokens <= host_tokens:
            return None
        cache = adopted_cache(decision.handle)
        if cache is None:
            return None
        self._count(adopted=1, adopted_tokens=decision.adopt_tokens,
                    host_tokens_over=decision.adopt_tokens - host_tokens)
        return cache, tokens[decision.adopt_tokens :]

    # -- status ----------------------------------------------------------------------

    def status(self) -> dict[str, Any]:
        with self._lock:
            counts = dict(self._counts)
        return {"active": self.active, "block_tokens": self.block_size, **counts,
                "snapshots": self.snapshots.status()}

    def forget(self) -> None:
        self.snapshots.clear()

    def _aborted(self, model: Hashable, tokens: Sequence[int]) -> None:
        # An aborted prefill never reaches its insert: its snapshots would stay pending.
        if self.active:
            self.snapshots.drop_pending(model, tokens, self.block_size)

    # -- internals -------------------------------------------------------------------

    def _model_needs_state(self, model: Any) -> bool:
        memo = self._stateful
        if memo is not None and memo[0]() is model:
            return memo[1]
        known = layer_ops.model_needs_state(model)
        self._stateful = (weakref.ref(model), known)
        return known

    def _count(self, **deltas: int) -> None:
        with self._lock:
            for name, delta in deltas.items():
                self._counts[name] += delta

    def _fault(self, where: str, exc: BaseException) -> None:
        log.warning("mlx-recovery: mlx-lm %s failed, the host's own behaviour stands: %r", where, exc)
        self._count(faults=1)


def _extended(trie: Any, model: Hashable, prefix: tuple[int, ...]) -> bool:
    """Does the host's trie hold an entry strictly longer than ``prefix`` that starts with it?"""
    node = trie._trie.get(model)
    if node is None:
        return False
    for token in prefix:
        node = node.get(token)
        if node is None:
            return False
    stack = [child for key, child in node.items() if key != "__value__"]
    while stack:
        current = stack.pop()
        if "__value__" in current:
            return True
        stack.extend(child for key, child in current.items() if key != "__value__")
    return False
