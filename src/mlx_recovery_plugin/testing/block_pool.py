"""A refcounted pool of fixed-size KV blocks, as a paged host keeps them.

Every reference is taken under a named holder (a request id, a probe id, ``"cache"`` for
the prefix index itself), so a test can ask who still holds what and prove that nothing
leaked. A block returns to the free list when its last reference is given back; its data
goes with it. Owned by one engine thread; not thread-safe by design, like the host's.
"""

from __future__ import annotations

from collections import Counter, deque
from dataclasses import dataclass, field

from ..state import BlockState


class PoolExhaustedError(RuntimeError):
    """No free block is left."""


class BlockReferenceError(RuntimeError):
    """A reference was given back that was never taken (a double release)."""


@dataclass(slots=True)
class _Block:
    block_id: int
    refs: Counter[str] = field(default_factory=Counter)
    state: BlockState | None = None
    chain_hash: int | None = None


class BlockPool:
    """``num_blocks`` blocks of ``block_size`` tokens each."""

    def __init__(self, num_blocks: int, block_size: int) -> None:
        assert num_blocks > 0 and block_size > 0
        self.block_size = block_size
        self.num_blocks = num_blocks
        self._blocks = [_Block(i) for i in range(num_blocks)]
        self.free_block_ids: deque[int] = deque(range(num_blocks))

    # -- allocation and references -------------------------------------------------
    def can_allocate(self, n: int = 1) -> bool:
        return len(self.free_block_ids) >= n

    def allocate(self, holder: str) -> int:
        """Take a free block with one reference for ``holder``."""
        if not self.free_block_ids:
            raise PoolExhaustedError(f"all {self.num_blocks} blocks are in use")
        block_id = self.free_block_ids.popleft()
        block = self._blocks[block_id]
        assert not block.refs and block.state is None
        block.refs[holder] += 1
        return block_id

    def incref(self, block_id: int, holder: str) -> None:
        block = self._blocks[block_id]
        if not block.refs:
            raise BlockReferenceError(f"block {block_id} is free; cannot reference it")
        block.refs[holder] += 1

    def decref(self, block_id: int, holder: str) -> bool:
        """Give back one of ``holder``'s references; True when the block became free."""
        block = self._blocks[block_id]
        if block.refs[holder] <= 0:
            del block.refs[holder]
            raise BlockReferenceError(f"{holder!r} holds no reference on block {block_id}")
        block.refs[holder] -= 1
        if block.refs[holder] == 0:
            del block.refs[holder]
        if block.refs:
            return False
        block.state = None
        block.chain_hash = None
        self.free_block_ids.append(block_id)
        return True

    def refcount(self, block_id: int) -> int:
        return sum(self._blocks[block_id].refs.values())

    def holders(self, block_id: int) -> dict[str, int]:
        return dict(self._blocks[block_id].refs)

    def is_free(self, block_id: int) -> bool:
        return not self._blocks[block_id].refs

    # -- data ---------------------------------------------------------------------
    def put(self, block_id: int, state: BlockState, chain_hash: int | None = None) -> None:
        block = self._blocks[block_id]
        assert block.refs, f"block {block_id} is free"
        block.state = state
        block.chain_hash = chain_hash

    def get(self, block_id: int) -> BlockState:
        block = self._blocks[block_id]
        if not block.refs or block.state is None:
            raise BlockReferenceError(f"block {block_id} holds no data")
        return block.state

    def chain_hash(self, block_id: int) -> int | None:
        return self._blocks[block_id].chain_hash

    # -- leak checks --------------------------------------------------------------
    @property
    def used_blocks(self) -> int:
        return self.num_blocks - len(self.free_block_ids)

    def outstanding(self, ignore: tuple[str, ...] = ("cache",)) -> dict[str, Counter[int]]:
        """Every reference held by a holder not in ``ignore``: holder -> block -> count."""
        out: dict[str, Counter[int]] = {}
        for block in self._blocks:
            for holder, n in block.refs.items():
                if holder not in ignore:
                    out.setdefault(holder, Counter())[block.block_id] += n
        return out
