"""Extra prefill cuts: where the host's own prefill stops so boundary state can be saved.

mlx-lm's server prefills a chat prompt segment by segment (system, user part, thinking
tail; see ``ResponseGenerator._tokenize``) and, at each segment's end, hands the
request's cache to ``LRUPromptCache.insert_cache`` with the segment's type. Splitting a
segment at a block multiple makes the host stop there too; the piece before the cut is
typed :data:`CUT`, a ``str`` equal to ``"assistant"`` that the adapter's ``insert_cache``
wrapper recognises by its class and turns into a snapshot of the non-trimmable layers
instead of a full entry. Should the adapter be detached while such a prompt is in flight,
the host stores it as an ordinary assistant entry, which is harmless.

Pure functions; no state.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence


class CutType(str):
    """A segment type that ends at an adapter's cut (equal to the host's own type)."""

    __slots__ = ()


#: The type given to the piece of a segment before an extra cut.
CUT = CutType("assistant")


def is_cut(cache_type: object) -> bool:
    return isinstance(cache_type, CutType)


def plan_cuts(
    segments: Sequence[Sequence[int]],
    types: Sequence[str],
    block: int,
    skip: Callable[[int], bool] | None = None,
) -> tuple[list[list[int]], list[str], list[int]]:
    """Split ``segments`` at every multiple of ``block`` strictly inside a segment.

    Returns the new segments, their types and the cut positions (token counts from the
    prompt's start). No cut falls on a segment boundary the host already has, nor within
    the last two tokens of the prompt (the host stores the prompt less its last token
    itself); ``skip(position)`` vetoes a cut (e.g. a snapshot is already held there).
    """
    if block <= 0:
        raise ValueError(f"block must be positive, got {block}")
    total = sum(len(s) for s in segments)
    out_segments: list[list[int]] = []
    out_types: list[str] = []
    cuts: list[int] = []
    start = 0
    for segment, kind in zip(segments, types):
        end = start + len(segment)
        last = start
        position = (start // block + 1) * block
        while position < end and position < total - 1:
            if skip is None or not skip(position):
                out_segments.append(list(segment[last - start : position - start]))
                out_types.append(CUT)
                cuts.append(position)
                last = position
            position += block
        out_segments.append(list(segment[last - start :]))
        out_types.append(kind)
        start = end
    return out_segments, out_types, cuts
