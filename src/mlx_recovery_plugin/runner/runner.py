"""Dense prefill of a recovery job, one bounded slice at a time, cut into whole blocks.

The runner owns a live mlx-lm prompt cache per job (:class:`LiveState`) and advances it
with the model's own forward pass, so every architecture mlx-lm ships computes exactly
what a plain ``model(tokens, cache=cache)`` prefill computes. After each slice it copies
out every block the slice completed, in the neutral :mod:`~mlx_recovery_plugin.state`
format, marked ``origin="recovery"`` and without draft / MTP state (the runner never runs
draft work). Logits are never evaluated, so the output head costs nothing.

Models with recurrent layers (mlx-lm ``ArraysCache``) have state only at the position the
forward stopped at, so a slice is run in pieces that end at every block boundary it
crosses and the recurrent state is snapshotted there. Sliding-window layers are read
while the slice's positions are still in the window; the part of a block written by an
earlier slice is carried between slices, so a window smaller than a block still works.

Interruptible slices stop between layers (see :mod:`.layer_stop`): the forward is evaluated
layer by layer and the stop signal consulted in between. A slice runs in passes of at
most ``stop_grain`` tokens; an interrupted slice keeps the passes it finished (their
blocks come back as usual) and puts the live cache back exactly as it was before the pass
it abandoned, without copying it.

Threading: all methods run on the caller's thread, which must be the engine's own (the
host never steps concurrently); a LiveState belongs to that thread.
"""

from __future__ import annotations

import contextlib
import time
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass, field
from typing import Any

import mlx.core as mx
from mlx.utils import tree_flatten
from mlx_lm.models.cache import ArraysCache, RotatingKVCache

from .. import ports
from ..kvcodec import (
    cache_arrays,
    cache_from_blocks,
    has_recurrent_layers,
    kv_positions,
    recurrent_snapshot,
)
from ..state import RECOVERY_ORIGIN, BlockState, KVBlock, LayerBlock
from . import blas, layer_stop

# Interruptible slices run in forward passes of at most this many tokens, so an arrival
# waits for one layer of one such pass.
STOP_GRAIN = 256

Carry = dict[int, tuple[int, mx.array, mx.array]]
"""Sliding-window layer index -> (first position, keys, values) of the open block's head."""


@dataclass(slots=True, eq=False)
class LiveState:
    """One job's live dense cache. ``offset`` tokens of ``tokens`` are in ``cache``.

    Owned by the runner that made it and by the engine thread that calls that runner;
    callers read ``offset`` and ``tokens`` and leave ``cache`` alone.
    """

    tokens: tuple[int, ...]
    cache: list[Any] = field(repr=False)
    offset: int
    recurrent: bool
    carry: Carry = field(default_factory=dict, repr=False)
    discarded: bool = False

    @property
    def remaining(self) -> int:
        return len(self.tokens) - self.offset


@dataclass(slots=True, frozen=True)
class SliceOutcome:
    """What one :meth:`SliceRunner.advance` did.

    ``blocks``: every whole block the slice completed (when interrupted: the blocks its
    finished passes completed); ``tokens_run``: tokens added to the live cache (when
    interrupted: those of its finished passes); ``interrupted``: the stop signal abandoned
    a pass, and the live cache is as it was before that pass;
    ``seconds``: wall time of the call; ``interruptible``: whether this slice checked the
    stop signal between layers at all (False for a non-interruptible runner, without a
    ``should_stop``, or when no layer's cache could be hooked); ``stop_checks``: how many
    times it checked.
    """

    blocks: list[BlockState]
    tokens_run: int
    interrupted: bool
    seconds: float
    interruptible: bool = False
    stop_checks: int = 0


def _pieces(
    start: int, end: int, block_size: int, split: bool, grain: int | None = None
) -> list[tuple[int, int]]:
    """Cut ``[start, end)`` at every block boundary (``split``: recurrent state exists only
    where a forward stops) and at every multiple of ``grain`` (a stop check then waits
    for one layer of at most ``grain`` tokens, not one layer of the whole slice)."""
    steps = ([block_size] if split else []) + ([grain] if grain else [])
    cuts = sorted({c for step in steps for c in range((start // step + 1) * step, end, step)})
    bounds = [start, *cuts, end]
    return list(zip(bounds[:-1], bounds[1:]))


def _schedule_sensitive(cache: Sequence[Any]) -> bool:
    """Sliding windows with sink positions mask by buffer slot in mlx-lm, so extra cuts
    would change what they compute."""
    return any(isinstance(layer, RotatingKVCache) and layer.keep > 0 for layer in cache)


def model_dtype(model: Any) -> mx.Dtype | None:
    """The dtype of the model's first floating-point parameter."""
    try:
        for _, value in tree_flatten(model.parameters()):
            if isinstance(value, mx.array) and mx.issubdtype(value.dtype, mx.floating):
                return value.dtype
    except Exception:  # noqa: BLE001 - an exotic model object: just skip the BLAS hint
        return None
    return None


class SliceRunner:
    """Prefills recovery slices with ``model`` and cuts the result into ``block_size`` blocks.

    ``interruptible``: check ``should_stop`` between layers (costs one evaluation per
    layer instead of one per slice), running the slice in forward passes of at most
    ``stop_grain`` tokens so that a check comes at least once per layer of such a pass. ``clear_cache``: return MLX's buffer cache after each
    slice and on discard (off by default: the host's next prefill then reuses the freed
    buffers instead of faulting fresh memory in; measured on a 2-core CPU, a 2,048-token
    prefill right after ``mx.clear_cache()`` took 1.12x (median of 4 alternating pairs,
    [0.92, 1.15]), and the real server's sparse turns after recovery slices 1.05-1.13x
    sparse on's). Under memory pressure the service clears the cache itself. ``clock``: for ``SliceOutcome.seconds``.
    """

    def __init__(
        self,
        model: ports.ModelHandle,
        block_size: int,
        *,
        interruptible: bool = True,
        clear_cache: bool = False,
        clock: Callable[[], float] = time.perf_counter,
        stop_grain: int = STOP_GRAIN,
    ) -> None:
        if block_size <= 0:
            raise ValueError(f"block_size must be positive, got {block_size}")
        self.handle = model
        self.block_size = block_size
        self.interruptible = interruptible
        self.stop_grain = stop_grain
        self.clear_cache = clear_cache
        self._clock = clock
        blas.warn_once_if_slow(model_dtype(model.model))

    # -- public API -----------------------------------------------------------------------
    def begin(self, tokens: Sequence[int], prefix: ports.FetchedPrefix | None = None) -> LiveState:
        """A live cache for ``tokens``, positioned after ``prefix`` (or at 0).

        ``prefix`` must be whole blocks ``0..n-1`` of ``tokens`` (what the host's fetch
        restored); the runner keeps no reference to the host's blocks beyond the arrays.
        """
        tokens = tuple(int(t) for t in tokens)
        blocks: Sequence[BlockState] = ()
        if prefix is not None and prefix.tokens:
            whole = len(prefix.blocks) * self.block_size
            if prefix.tokens % self.block_size or whole != prefix.tokens:
                raise ValueError(
                    f"prefix of {prefix.tokens} tokens with {len(prefix.blocks)} blocks is not "
                    f"a whole number of {self.block_size}-token blocks"
                )
            if prefix.tokens > len(tokens):
                raise ValueError(f"prefix of {prefix.tokens} tokens is longer than the job")
            blocks = prefix.blocks
        with self._on_stream():
            cache = cache_from_blocks(self.handle.make_cache, blocks)  # checks cache classes
            mx.eval(cache_arrays(cache))
        offset = prefix.tokens if blocks and prefix is not None else 0
        return LiveState(tokens, cache, offset, has_recurrent_layers(cache))

    def advance(
        self,
        live: LiveState,
        end: int,
        should_stop: Callable[[], bool] | None = None,
        stop_grain: int | None = None,
    ) -> SliceOutcome:
        """Densely prefill ``live.tokens[live.offset:end]`` and return the blocks it completed.
        ``stop_grain``: this slice's passes where finer than the runner's ``stop_grain``.

        When interruptible and ``should_stop()`` turns True between layers, the pass it
        turned True in is abandoned: the live cache is exactly as it was after the last
        finished pass, and the blocks and tokens of the finished passes are returned.
        Genuine errors (MLX errors, out of memory) restore the live cache to where the call
        began and are raised.
        """
        if live.discarded:
            raise ValueError("this LiveState was discarded")
        if not live.offset <= end <= len(live.tokens):
            raise ValueError(
                f"slice end {end} is outside [{live.offset}, {len(live.tokens)}]"
            )
        started = self._clock()
        if end == live.offset:
            return SliceOutcome([], 0, False, self._clock() - started)
        start = live.offset
        stop_gate = layer_stop.StopGate(should_stop) if self.interruptible and should_stop else None
        # The same cuts with or without a stop signal, so a job's blocks do not depend on it;
        # none where mlx-lm's own result depends on the chunk schedule (windows with sinks).
        finest = min(stop_grain, self.stop_grain) if stop_grain else self.stop_grain
        grain = finest if self.interruptible and not _schedule_sensitive(live.cache) else None
        pieces = _pieces(start, end, self.block_size, live.recurrent, grain)
        restore_point = layer_stop.RestorePoint.capture(live.cache)
        saved_carry = dict(live.carry)
        hooked = layer_stop.install(live.cache, stop_gate) if stop_gate else 0
        blocks: list[BlockState] = []
        interrupted = False
        # Where the pass now running began: a stop goes back there, keeping earlier passes.
        pass_point, pass_carry, pass_start = restore_point, saved_carry, start
        try:
            with self._on_stream():
                for a, b in pieces:
                    if a != start:
                        pass_point = layer_stop.RestorePoint.capture(live.cache)
                        pass_carry, pass_start = dict(live.carry), a
                    blocks += self._run_piece(live, a, b)
        except layer_stop.SliceAbandoned:
            self._rewind(live, pass_point, pass_carry, pass_start)
            interrupted = True
        except BaseException:
            self._rewind(live, restore_point, saved_carry, start)
            raise
        finally:
            layer_stop.remove(live.cache)
        if self.clear_cache and not interrupted:
            mx.clear_cache()
        return SliceOutcome(
            blocks,
            live.offset - start,
            interrupted,
            self._clock() - started,
            hooked > 0,
            stop_gate.checks if stop_gate else 0,
        )

    def discard(self, live: LiveState) -> None:
        """Drop the live cache (its buffers go back to MLX's cache, for the host's next
        prefill; to the system too with ``clear_cache``). Idempotent."""
        if live.discarded:
            return
        live.cache = []
        live.carry = {}
        live.discarded = True
        if self.clear_cache:
            mx.clear_cache()

    # -- internals ------------------------------------------------------------------------
    @contextlib.contextmanager
    def _on_stream(self) -> Iterator[None]:
        stream = self.handle.stream
        if stream is None:
            yield
        else:
            with mx.stream(stream):
                yield

    def _rewind(
        self, live: LiveState, point: layer_stop.RestorePoint, carry: Carry, offset: int
    ) -> None:
        point.restore(live.cache)
        live.carry = carry
        live.offset = offset

    def _run_piece(self, live: LiveState, start: int, end: int) -> list[BlockState]:
        """Forward ``[start, end)``, then copy out the blocks it completed, in one eval."""
        inputs = mx.array(live.tokens[start:end], dtype=mx.int32)[None]
        self.handle.model(inputs, cache=live.cache)  # logits stay lazy: never computed
        blocks, carry = self._extract(live, start, end)
        pending = cache_arrays(live.cache)
        for block in blocks:
            pending += block.arrays()
        for _, keys, values in carry.values():
            pending += [keys, values]
        # One evaluation: the block copies are materialised before any later write could
        # force the cache buffers to be copied.
        mx.eval(pending)
        live.offset = end
        live.carry = carry
        return blocks

    def _extract(self, live: LiveState, start: int, end: int) -> tuple[list[BlockState], Carry]:
        size = self.block_size
        blocks = []
        for index in range(start // size, end // size):
            lo, hi = index * size, (index + 1) * size
            layers: list[LayerBlock] = []
            for i, layer in enumerate(live.cache):
                if isinstance(layer, ArraysCache):
                    # Pieces end at every block boundary, so hi == end here.
                    assert hi == end, (hi, end)
                    layers.append(recurrent_snapshot(layer))
                else:
                    layers.append(KVBlock(*self._positions(live, i, layer, lo, hi, start)))
            blocks.append(BlockState(index, tuple(layers), origin=RECOVERY_ORIGIN))
        carry: Carry = {}
        open_start = (end // size) * size
        if open_start < end:
            for i, layer in enumerate(live.cache):
                if isinstance(layer, RotatingKVCache):
                    keys, values = self._positions(live, i, layer, open_start, end, start)
                    carry[i] = (open_start, keys, values)
        return blocks, carry

    def _positions(
        self, live: LiveState, i: int, layer: Any, lo: int, hi: int, start: int
    ) -> tuple[mx.array, mx.array]:
        """Keys/values of ``[lo, hi)``; a window layer's positions before ``start`` come
        from the carry, since the window may have moved past them."""
        if not isinstance(layer, RotatingKVCache) or lo >= start:
            return kv_positions(layer, lo, hi)
        carried = live.carry.get(i)
        if carried is None or carried[0] != lo or carried[0] + carried[1].shape[2] != start:
            # Restored from blocks at a boundary or never carried: read the window.
            return kv_positions(layer, lo, hi)
        _, head_k, head_v = carried
        tail_k, tail_v = kv_positions(layer, start, hi)
        return (
            mx.concatenate([head_k, tail_k], axis=2),
            mx.concatenate([head_v, tail_v], axis=2),
        )


__all__ = ["RECOVERY_ORIGIN", "LiveState", "SliceOutcome", "SliceRunner"]
