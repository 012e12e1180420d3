"""Publication onto a whole-entry prefix cache: one entry for the whole prefix, built on
what the host's own lookup restores; the lookup's references are given back on every path."""

from __future__ import annotations

from collections.abc import Sequence

import pytest

from mlx_recovery_plugin.ports import FetchedPrefix, StoreUnit
from mlx_recovery_plugin.recovery.publication import BaseFetchError, StoreRefused, publish
from mlx_recovery_plugin.state import RECOVERY_ORIGIN, BlockState
from mlx_recovery_plugin.testing import WholeEntryPrefixCache

B = 4


def _blocks(first: int, end: int) -> list[BlockState]:
    return [BlockState(index=k, layers=()) for k in range(first, end)]


class FailingLookup(WholeEntryPrefixCache):
    """A whole-entry cache whose lookup raises once armed; it records releases."""

    def __init__(self) -> None:
        super().__init__(B)
        self.fail = False
        self.released: list[str] = []

    def fetch(self, holder_id: str, tokens: Sequence[int]) -> FetchedPrefix:
        if self.fail:
            raise RuntimeError("lookup broke")
        return super().fetch(holder_id, tokens)

    def release(self, holder_id: str) -> None:
        self.released.append(holder_id)
        super().release(holder_id)


def test_the_new_blocks_are_stored_as_one_entry_on_the_restored_prefix() -> None:
    cache = WholeEntryPrefixCache(B)
    tokens = list(range(5 * B))
    publish(cache, tokens, _blocks(0, 2), B, holder_id="s1", probe_id="p1")
    result = publish(cache, tokens, _blocks(2, 5), B, holder_id="s2", probe_id="p2")
    assert (result.boundary, result.blocks) == (5 * B, 3)
    assert len(cache) == 1  # the longer entry replaced the one it covers
    restored = cache.fetch("check", tokens)
    assert [b.index for b in restored.blocks] == [0, 1, 2, 3, 4]
    assert {b.origin for b in restored.blocks[2:]} == {RECOVERY_ORIGIN}
    cache.release("check")
    assert cache.outstanding() == {}


def test_a_lookup_that_raises_is_a_fetch_error_and_its_holder_is_released() -> None:
    cache = FailingLookup()
    tokens = list(range(4 * B))
    publish(cache, tokens, _blocks(0, 2), B, holder_id="s1", probe_id="p1")
    cache.fail = True
    with pytest.raises(BaseFetchError) as raised:
        publish(cache, tokens, _blocks(2, 4), B, holder_id="s2", probe_id="p2")
    assert raised.value.kind == "fetch_error"
    assert "s2:base" in cache.released
    assert cache.outstanding() == {}


def test_a_prefix_the_host_lost_is_refused_and_nothing_is_stored() -> None:
    cache = WholeEntryPrefixCache(B)
    tokens = list(range(4 * B))
    publish(cache, tokens, _blocks(0, 2), B, holder_id="s1", probe_id="p1")
    cache.clear()  # rapid-mlx's idle cache clear, say
    with pytest.raises(StoreRefused):
        publish(cache, tokens, _blocks(2, 4), B, holder_id="s2", probe_id="p2")
    assert cache.stored_tokens(tokens) == 0 and cache.outstanding() == {}
    assert cache.store_unit is StoreUnit.WHOLE_ENTRY
