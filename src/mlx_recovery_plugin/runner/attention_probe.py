"""What attention costs a token deep in a context, timed on the model's own shapes.

The publish policy's cost model is fitted to slices, which only reach as far as the job
has got: where the next turn's prefix lies beyond them, what attention costs there is not
known, and the cost model bounds it from below by the deepest slice's rate, as if
attention stopped growing there. On an attention-bound model that bound is far too low:
a stand-down that the evidence would support is not taken, and the slices go on for whole
gaps only to learn what the answer was (rapid-mlx, SmolLM2-135M: the dense append was
estimated 22.96 s at turn 2, the host took 22.98 s, the bound said 11.01 s, and the job ran
6,912 tokens over the session that never paid).

This times the one part of a pass that grows with the context, the attention itself, at
the context in question: a few queries against keys and values of that length, in the
model's head counts, head size and dtype, through the same kernel the model's layers use
(``mx.fast.scaled_dot_product_attention``). No cache is needed: the keys are constants.
Models whose layers are not all full attention (sliding windows, linear or recurrent
mixers) are not timed: there the growth is not one kernel's.

Threads: runs on the engine thread, inside an idle step (the host's stream), like a slice.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from contextlib import nullcontext
from dataclasses import dataclass
from typing import Any

import mlx.core as mx

# Queries per timing: enough for the kernel's per-query cost to dominate its launch (the
# slope per position read within 15 % from 16 to 256 queries), few enough to keep the
# probe short.
PROBE_QUERIES = 32
# Timings per probe, after one that warms the kernel; the fastest speaks (load only
# slows a timing down). The probe is not interruptible: an arriving request waits for it
# (0.1-0.6 s at 8-12k context on the 3072x2 target here, 0.05-0.2 s on SmolLM2).
PROBE_REPEATS = 2


@dataclass(slots=True, frozen=True)
class AttentionShape:
    """The attention of a model whose every layer attends over the whole context."""

    layers: int
    heads: int
    kv_heads: int
    head_dim: int
    dtype: Any


def attention_shape(model: Any) -> AttentionShape | None:
    """The model's attention shape, or None where a layer is not plain full attention."""
    layers = getattr(model, "layers", None)
    if not layers:
        return None
    shapes = set()
    dtype = None
    for layer in layers:
        attn = getattr(layer, "self_attn", None)
        if attn is None or _sliding(layer) or _sliding(attn):
            return None
        try:
            heads, kv_heads = int(attn.n_heads), int(attn.n_kv_heads)
            head_dim = int(getattr(attn, "head_dim", 0) or attn.q_proj.weight.shape[0] // heads)
        except (AttributeError, TypeError, ValueError, ZeroDivisionError):
            return None
        shapes.add((heads, kv_heads, head_dim))
        if dtype is None:
            proj = attn.q_proj
            dtype = getattr(proj, "scales", proj.weight).dtype
    if len(shapes) != 1 or dtype is None:
        return None
    heads, kv_heads, head_dim = shapes.pop()
    if heads <= 0 or kv_heads <= 0 or head_dim <= 0 or heads % kv_heads:
        return None
    return AttentionShape(len(layers), heads, kv_heads, head_dim, dtype)


def _sliding(module: Any) -> bool:
    return any(bool(getattr(module, name, False)) for name in ("use_sliding", "is_sliding", "sliding_window"))


def attention_seconds_per_token(
    shape: AttentionShape,
    context: int,
    *,
    queries: int = PROBE_QUERIES,
    repeats: int = PROBE_REPEATS,
    clock: Callable[[], float] = time.perf_counter,
) -> float:
    """Seconds the attention of all the model's layers takes per token of a pass over
    ``context`` cached positions (the fastest of ``repeats`` timings)."""
    if context <= 0:
        return 0.0
    # The kernel's time does not depend on the values: constants cost no random draws.
    q = mx.full((1, shape.heads, queries, shape.head_dim), 0.5, dtype=shape.dtype)
    k = mx.full((1, shape.kv_heads, context, shape.head_dim), 0.25, dtype=shape.dtype)
    v = mx.full((1, shape.kv_heads, context, shape.head_dim), 0.125, dtype=shape.dtype)
    mx.eval(q, k, v)
    scale = shape.head_dim**-0.5
    mx.eval(mx.fast.scaled_dot_product_attention(q, k, v, scale=scale))  # warm the kernel
    best = float("inf")
    for _ in range(max(1, repeats)):
        began = clock()
        mx.eval(mx.fast.scaled_dot_product_attention(q, k, v, scale=scale))
        best = min(best, clock() - began)
    return best * shape.layers / queries


def probe_for(handle: Any) -> Callable[[int], float | None]:
    """``context -> seconds per token`` of the attention of ``handle``'s model (a
    :class:`~..ports.ModelHandle`), on its stream; None where the model cannot be timed
    so (its shape is read once)."""
    shapes: list[AttentionShape | None] = []

    def probe(context: int) -> float | None:
        if not shapes:
            shapes.append(attention_shape(handle.model))
        shape = shapes[0]
        if shape is None:
            return None
        with nullcontext() if handle.stream is None else mx.stream(handle.stream):
            return attention_seconds_per_token(shape, context)

    return probe
