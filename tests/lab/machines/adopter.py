"""The adopter state machine: stores, lookups, adoptions, releases and evictions over the real
refcounted pool: every block's count stays what the live sets account for, no block is
freed while a set references it, and everything returns to the empty baseline."""

from __future__ import annotations

from typing import Any

from hypothesis import strategies as st
from hypothesis.stateful import (
    RuleBasedStateMachine,
    initialize,
    invariant,
    precondition,
    rule,
    run_state_machine_as_test,
)

from mlx_recovery_plugin.adopter.plugin import AdopterPlugin
from mlx_recovery_plugin.plugins import make_plugin_manager
from mlx_recovery_plugin.settings import RecoverySettings
from mlx_recovery_plugin.testing.block_pool import BlockPool
from mlx_recovery_plugin.testing.detached_store import DetachedSet, DetachedStore

B = 4
STEM = [7, 3, 9, 1, 4, 4, 8, 2, 6, 5, 0, 3, 7, 7, 1, 9, 2, 8, 5, 6, 4, 0, 1, 3]
LAYOUTS = {
    "plain": {},
    "side": {"side_data": {1: "sidecar"}},
    "window": {"logical_start": 4},
    "hybrid": {"recurrent": True, "snapshot_boundaries": [8]},
}

prefixes = st.integers(0, len(STEM))
tails = st.lists(st.integers(10, 12), min_size=1, max_size=6)


class AdopterMachine(RuleBasedStateMachine):
    def __init__(self) -> None:
        super().__init__()
        self.pool = BlockPool(num_blocks=40, block_size=B)
        self.handles: list[DetachedSet] = []
        self.snapshots: dict[str, tuple[tuple[int, ...], list[int]]] = {}
        self.evicted: set[str] = set()
        self.requests = 0

    @initialize(mode=st.sampled_from(["clone", "trim"]), min_prefix=st.sampled_from([0, 8]))
    def make_store(self, mode: str, min_prefix: int) -> None:
        self.mode = mode
        adopter = AdopterPlugin(
            settings=RecoverySettings(
                adopter_enabled=True, adopter_mode=mode, adopter_min_prefix_tokens=min_prefix  # type: ignore[arg-type]
            )
        )
        pm = make_plugin_manager([adopter], settings=RecoverySettings(), entry_points_too=False)
        self.store = DetachedStore(self.pool, pm=pm)

    @rule(prefix=prefixes, tail=tails, layout=st.sampled_from(["plain", "plain", *sorted(LAYOUTS)]))
    def store_entry(self, prefix: int, tail: list[int], layout: str) -> None:
        tokens = [*STEM[:prefix], *tail]
        if not self.pool.can_allocate(-(-len(tokens) // B)):
            return
        entry = self.store.store(tokens, **LAYOUTS[layout])  # type: ignore[arg-type]
        self.snapshots[entry.set_id] = (entry.tokens, list(entry.block_ids))

    @rule(prefix=prefixes, tail=tails)
    def admit(self, prefix: int, tail: list[int]) -> None:
        self._admit([*STEM[:prefix], *tail])

    @precondition(lambda self: self.store.entries())
    @rule(i=st.integers(0, 100), extra=tails)
    def admit_continuation(self, i: int, extra: list[int]) -> None:
        entries = self.store.entries()
        self._admit([*entries[i % len(entries)].tokens, *extra])

    def _admit(self, prompt: list[int]) -> None:
        self.requests += 1
        admission = self.store.admit(f"r{self.requests}", prompt)
        assert admission.cached_tokens <= admission.matched_tokens
        if admission.reason == "partial":
            assert admission.cached_tokens % B == 0
        if admission.handle is not None:
            assert admission.handle.length == admission.cached_tokens
            self.handles.append(admission.handle)
        else:
            assert admission.cached_tokens == 0

    @precondition(lambda self: self.handles)
    @rule(i=st.integers(0, 100))
    def release_handle(self, i: int) -> None:
        self.store.release(self.handles.pop(i % len(self.handles)))

    @precondition(lambda self: self.store.entries())
    @rule(i=st.integers(0, 100))
    def evict_entry(self, i: int) -> None:
        entries = self.store.entries()
        entry = entries[i % len(entries)]
        self.store.evict(entry)
        self.evicted.add(entry.set_id)

    @rule(block=st.none() | st.integers(0, 39))
    def pins_fail_on(self, block: int | None) -> None:
        self.store.fail_pin_on = None if block is None else (lambda b, bad=block: b == bad)

    @invariant()
    def refcounts_are_what_live_sets_account_for(self) -> None:
        if not hasattr(self, "store"):
            return
        expected = self.store.expected_refcounts()
        for block_id in range(self.pool.num_blocks):
            assert self.pool.refcount(block_id) == expected.get(block_id, 0), block_id

    @invariant()
    def no_referenced_block_is_free(self) -> None:
        if not hasattr(self, "store"):
            return
        for s in self.store.live_sets():
            assert all(not self.pool.is_free(b) for b in s.block_ids), s.set_id

    @invariant()
    def clone_mode_never_changes_a_stored_entry(self) -> None:
        if not hasattr(self, "store") or self.mode != "clone":
            return
        indexed = {entry.set_id: entry for entry in self.store.entries()}
        for entry in indexed.values():
            assert (entry.tokens, entry.block_ids) == self.snapshots[entry.set_id]
        # An entry taken out and trimmed is no longer indexed: in clone mode only an
        # eviction may take one away.
        for set_id in self.snapshots:
            assert set_id in indexed or set_id in self.evicted, f"{set_id} left the index unevicted"

    def teardown(self) -> None:
        if not hasattr(self, "store"):
            return
        for handle in self.handles:
            self.store.release(handle)
        for entry in self.store.entries():
            self.store.evict(entry)
        assert self.pool.outstanding(ignore=()) == {}
        assert self.pool.used_blocks == 0


def run_adopter_machine(hypothesis_settings: Any, machine: type[AdopterMachine] = AdopterMachine) -> None:
    """Run ``machine``; raises on the first falsified invariant, after shrinking."""
    run_state_machine_as_test(machine, settings=hypothesis_settings)
