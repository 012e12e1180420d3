"""The matrix ``bench policy`` measures: target shapes x contexts x machine load.

A cell is one conversation's first turn of ``context`` tokens served on the sparse route,
then a next turn that appends ``append`` tokens. Whether recovering the first turn's
prefix pays depends on what the host does with that next turn: a dense append over the
recovered prefix, or (nothing recovered) another sparse prefill of the whole prompt.

The full matrix spans the widths and depths of real targets that a CPU can still run in
minutes (layers 2-8, hidden 1k-4k, feed-forward 2-4x, 4-32 query heads, 1-8 key/value
heads), some attention-bound and some not; the quick one is tiny models at contexts scaled
down with the host's threshold, for CI.
"""

from __future__ import annotations

from dataclasses import dataclass

from ...testing.tiny_model import TinyModelSpec

# The host's own threshold (oMLX applies SpecPrefill above 8,192 uncached tokens) and its
# block and prefill step defaults.
THRESHOLD = 8192
BLOCK = 256
PREFILL_STEP = 2048
# An agent's next turn: the reply, a tool's output and a question.
APPEND = 600
CONTEXTS = (8704, 12288)

# Seeds differ from the bench target's (13) on purpose: no cell is the model the policy
# was first tuned on.
SHAPES = (
    TinyModelSpec(arch="llama", hidden_size=1024, num_layers=2, num_heads=4, num_kv_heads=1,
                  intermediate_size=2048, seed=31),
    TinyModelSpec(arch="llama", hidden_size=1024, num_layers=8, num_heads=16, num_kv_heads=4,
                  intermediate_size=4096, seed=32),
    TinyModelSpec(arch="llama", hidden_size=2048, num_layers=4, num_heads=32, num_kv_heads=8,
                  intermediate_size=5632, seed=33),
    TinyModelSpec(arch="llama", hidden_size=4096, num_layers=2, num_heads=8, num_kv_heads=2,
                  intermediate_size=14336, seed=34),
)
DRAFT = TinyModelSpec(arch="llama", hidden_size=128, num_layers=2, num_heads=4, num_kv_heads=2,
                      intermediate_size=256, seed=35)

QUICK_THRESHOLD = 256
QUICK_BLOCK = 64
QUICK_PREFILL_STEP = 128
QUICK_APPEND = 96
QUICK_CONTEXTS = (384, 640)
QUICK_SHAPES = (
    TinyModelSpec(arch="llama", hidden_size=64, num_layers=2, num_heads=4, num_kv_heads=1,
                  intermediate_size=128, seed=41),
    TinyModelSpec(arch="llama", hidden_size=256, num_layers=2, num_heads=4, num_kv_heads=2,
                  intermediate_size=1024, seed=42),
)
QUICK_DRAFT = TinyModelSpec(arch="llama", hidden_size=64, num_layers=1, num_heads=4, num_kv_heads=2,
                            intermediate_size=128, seed=43)


@dataclass(slots=True, frozen=True)
class Cell:
    shape: TinyModelSpec
    context: int
    append: int
    loaded: bool
    #: When a loaded cell's load runs: ``first`` (the first turn and the first stretch of
    #: idle time; the next turn on a quiet machine) or ``next`` (from the second stretch of
    #: idle time through the next turn, whose truth is then measured loaded too).
    load_at: str = "first"

    @property
    def label(self) -> str:
        s = self.shape
        loaded = (" loaded" + (" at next" if self.load_at == "next" else "")) if self.loaded else ""
        return (f"{s.hidden_size}x{s.num_layers} ffn{s.intermediate_size} q{s.num_heads}/kv{s.num_kv_heads} "
                f"@{self.context}{loaded}")


@dataclass(slots=True, frozen=True)
class Matrix:
    """Everything a run measures: the cells, and the host settings they run under."""

    cells: tuple[Cell, ...]
    draft: TinyModelSpec
    threshold: int
    block: int
    prefill_step: int


def full_matrix(
    shapes: tuple[TinyModelSpec, ...] = SHAPES,
    contexts: tuple[int, ...] = CONTEXTS,
    loads: tuple[bool, ...] = (False, True),
    append: int = APPEND,
    load_at: str = "first",
) -> Matrix:
    cells = tuple(Cell(s, c, append, load, load_at) for s in shapes for c in contexts for load in loads)
    return Matrix(cells, DRAFT, THRESHOLD, BLOCK, PREFILL_STEP)


def quick_matrix(loads: tuple[bool, ...] = (False, True), load_at: str = "first") -> Matrix:
    cells = tuple(Cell(s, c, QUICK_APPEND, load, load_at) for s in QUICK_SHAPES for c in QUICK_CONTEXTS
                  for load in loads)
    return Matrix(cells, QUICK_DRAFT, QUICK_THRESHOLD, QUICK_BLOCK, QUICK_PREFILL_STEP)


def parse_shape(text: str, seed: int = 30) -> TinyModelSpec:
    """``HIDDENxLAYERSxFFNxHEADSxKV`` (e.g. ``2048x4x5632x32x8``)."""
    try:
        hidden, layers, ffn, heads, kv = (int(p) for p in text.lower().split("x"))
    except ValueError:
        raise ValueError(f"a shape is HIDDENxLAYERSxFFNxHEADSxKV, e.g. 2048x4x5632x32x8; got {text!r}") from None
    if min(hidden, layers, ffn, heads, kv) <= 0 or hidden % heads or heads % kv:
        raise ValueError(f"shape {text!r}: sizes must be positive, heads must divide hidden and kv divide heads")
    return TinyModelSpec(arch="llama", hidden_size=hidden, num_layers=layers, num_heads=heads,
                         num_kv_heads=kv, intermediate_size=ffn, seed=seed)
