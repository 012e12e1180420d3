"""The cost balance of a model on this machine: a token at long context against a short one.

Whether a cached dense append beats a sparse rerun depends on how much of a token's cost
grows with the context it attends over. Real 8B-70B models spend most prefill work in
matrix products, so a token at 10k context costs only a little more than one at 0; tiny
models on a CPU are attention-bound, so the same token costs many times more. Every
report prints this balance, measured on the bench's own model, next to what a real
model's shape gives when attention and matrix products run at the same efficiency (a
GPU's fused attention), so a reader can tell whether a figure means anything.

The measurement fills a fresh prompt cache with ``context`` random keys and values
(attention's cost does not depend on their values) and times one ``chunk``-token forward
pass on top of it, against the same pass on an empty cache. Only plain ``KVCache`` layers
can be filled this way; a model with other cache layers is refused.
"""

from __future__ import annotations

import time
from dataclasses import dataclass
from typing import Any

import mlx.core as mx


@dataclass(slots=True, frozen=True)
class RealShape:
    """A real model's dimensions, for the reference balance."""

    name: str
    hidden_size: int
    num_layers: int
    num_heads: int
    num_kv_heads: int
    intermediate_size: int

    @property
    def matmul_flops_per_token(self) -> float:
        head_dim = self.hidden_size // self.num_heads
        kv = self.num_kv_heads * head_dim
        per_layer = (
            self.hidden_size * self.hidden_size * 2  # q and o projections
            + self.hidden_size * kv * 2  # k and v projections
            + self.hidden_size * self.intermediate_size * 3  # gate, up, down
        )
        return 2.0 * per_layer * self.num_layers

    def attention_flops_per_token(self, context: int) -> float:
        # q.k and p.v over ``context`` positions, every head, every layer.
        return 4.0 * self.hidden_size * context * self.num_layers


LLAMA3_8B = RealShape("Llama-3-8B", 4096, 32, 32, 8, 14336)


def reference_ratio(context: int, shape: RealShape = LLAMA3_8B) -> float:
    """Cost of a token at ``context`` over one at 0 for ``shape``, counting FLOPs only."""
    matmul = shape.matmul_flops_per_token
    return (matmul + shape.attention_flops_per_token(context)) / matmul


@dataclass(slots=True, frozen=True)
class Balance:
    """``short_s`` / ``long_s``: one ``chunk``-token pass at context 0 / ``context``
    (median of the repeats); ``ratio`` = long / short; ``reference`` = a real model's
    ratio at the same context (:func:`reference_ratio`)."""

    context: int
    chunk: int
    short_s: float
    long_s: float
    reference: float
    reference_name: str

    @property
    def ratio(self) -> float:
        return self.long_s / self.short_s if self.short_s > 0 else float("inf")

    def describe(self) -> str:
        return (
            f"cost balance: a token at {self.context:,} context costs {self.ratio:.2f}x one at 0 "
            f"({self.chunk}-token pass: {self.long_s:.3f} s vs {self.short_s:.3f} s); "
            f"{self.reference_name} at equal attention/matmul efficiency: {self.reference:.2f}x"
        )

    def as_dict(self) -> dict[str, Any]:
        return {
            "context": self.context,
            "chunk": self.chunk,
            "short_s": self.short_s,
            "long_s": self.long_s,
            "ratio": self.ratio,
            "reference": self.reference,
            "reference_model": self.reference_name,
        }


def measure_balance(
    model: Any,
    context: int,
    *,
    chunk: int = 256,
    repeats: int = 3,
    shape: RealShape = LLAMA3_8B,
) -> Balance:
    """Time a ``chunk``-token pass at context 0 and at ``context``, alternating, and
    return the medians. Raises ValueError for a model whose caches are not plain KV."""
    if context < 0 or chunk <= 0 or repeats <= 0:
        raise ValueError(f"need context >= 0, chunk > 0, repeats > 0; got {context}, {chunk}, {repeats}")
    tokens = mx.array([[(7 * i + 3) % 200 for i in range(chunk)]], dtype=mx.int32)
    short = _filled_cache(model, 0)
    long = _filled_cache(model, context)
    _timed_pass(model, tokens, short)  # compile and allocate once before timing
    _timed_pass(model, tokens, long)
    shorts: list[float] = []
    longs: list[float] = []
    for _ in range(repeats):
        shorts.append(_timed_pass(model, tokens, short))
        longs.append(_timed_pass(model, tokens, long))
    shorts.sort()
    longs.sort()
    return Balance(
        context=context,
        chunk=chunk,
        short_s=shorts[len(shorts) // 2],
        long_s=longs[len(longs) // 2],
        reference=reference_ratio(context, shape),
        reference_name=shape.name,
    )


def _filled_cache(model: Any, context: int) -> list[Any]:
    from mlx_lm.models.cache import KVCache, make_prompt_cache

    cache = make_prompt_cache(model)
    if not all(type(layer) is KVCache for layer in cache):
        kinds = sorted({type(layer).__name__ for layer in cache})
        raise ValueError(f"balance needs plain KVCache layers, the model has {kinds}")
    model(mx.array([[0]], dtype=mx.int32), cache=cache)  # learn the key/value shapes
    for layer in cache:
        batch, heads, _, head_dim = layer.keys.shape
        dtype = layer.keys.dtype
        if context:
            layer.keys = mx.random.normal((batch, heads, context, head_dim)).astype(dtype)
            layer.values = mx.random.normal((batch, heads, context, head_dim)).astype(dtype)
        else:
            layer.keys = layer.values = None
        layer.offset = context
    mx.eval([x for layer in cache if layer.keys is not None for x in (layer.keys, layer.values)])
    return cache


def _timed_pass(model: Any, tokens: mx.array, cache: list[Any]) -> float:
    started = time.perf_counter()
    mx.eval(model(tokens, cache=cache))
    seconds = time.perf_counter() - started
    for layer in cache:
        layer.trim(tokens.shape[1])  # back to the same context for the next pass
    return seconds


def measure_or_say_why(model: Any, context: int, **kwargs: Any) -> tuple[Balance | None, str]:
    """The balance and its one-line description, or None and one line saying why it was
    not measured (a report then says so rather than print a number it does not have)."""
    try:
        balance = measure_balance(model, context, **kwargs)
    except ValueError as exc:
        return None, f"cost balance: not measured ({exc})"
    return balance, balance.describe()
