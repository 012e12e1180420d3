"""Each prefill's share of the host's time, when several prefill side by side.

Hosts run several prefills on one thread: rapid-mlx, mlx-lm's server and the mock host
advance each in-flight prefill by a chunk per step; oMLX admits several waiting requests
in one call and prefills each in turn. Timed from admission to its first token, a
prefill that ran beside two others counts their work as its own, and the publish policy
learns a sparse turn three times as dear as it is (a 10 s sparse rerun read as 25 s, and
a partial publication that lost was judged to pay). Here each prefill is charged
``dt / n`` for every interval ``dt`` in which ``n`` prefills were in flight: a
processor-sharing clock. Alone, a prefill's share is its wall time. Where the host says
when each of one call's prefills ended (oMLX stamps it), :func:`admission_shares` gives
each its own part of the call instead of an even split.

An interval the host spent taking another request in (oMLX's draft scores a sparse
prompt inside ``add_request``, on the step thread, before it queues) is nobody's
prefill: :meth:`PrefillShares.skip` charges it to no one; the request whose door it was
counts it as its own ``door_s``.

Threads: one per host engine, touched only under that engine's record lock.
"""

from __future__ import annotations


class PrefillShares:
    """A clock that runs at ``1 / n`` while ``n`` prefills are in flight (stopped at 0).

    The caller says ``n`` at each reading (the count before the change it is about to
    make), so the count has one owner: the adapter's table of live requests. A prefill's
    share is the clock's reading at its first token minus its reading at admission.
    """

    __slots__ = ("_at", "_value")

    def __init__(self) -> None:
        self._value = 0.0
        self._at: float | None = None

    def read(self, now: float, in_flight: int) -> float:
        """The clock at ``now``, with ``in_flight`` prefills running since the last
        reading. A reading earlier than the last (a step's start, told after the step)
        moves nothing."""
        if self._at is None:
            self._at = now
        elif now > self._at:
            if in_flight > 0:
                self._value += (now - self._at) / in_flight
            self._at = now
        return self._value

    def skip(self, start: float, end: float, in_flight: int) -> None:
        """``[start, end]`` belonged to no prefill in flight (another request's door)."""
        self.read(start, in_flight)
        if self._at is None or end > self._at:
            self._at = end


def admission_shares(
    call_s: float, host_began: float, host_end: float, taken: list[tuple[float | None, float]]
) -> list[float] | None:
    """Each request's seconds of one call that admitted several in turn (oMLX's
    admission call), from the host's stamp of when each finished its prefill.

    ``taken`` is one ``(stamp, tokens)`` per request, in the order the host took them;
    ``stamp`` is None for one the call left prefilling (chunked mode: its first chunk ran
    in the call, and it has no stamp). The time from one stamp to the next belongs to
    the stamped request and any unstamped ones taken just before it, split by tokens;
    the time after the last stamp, to the unstamped ones after it (else to nobody: the
    call's own bookkeeping). ``host_began`` and ``host_end`` are the call's bounds on the
    host's clock; the seconds come back in the order of ``taken``, scaled to ``call_s``,
    the call's length on the adapter's clock. Stamps out of the order given are taken in
    their own order, the unstamped after them. None where a stamp falls outside the
    call (another clock, or a stamp from before it): the caller then splits evenly."""
    span = host_end - host_began
    stamps = [stamp for stamp, _ in taken if stamp is not None]
    if not taken or span <= 0 or any(not host_began <= s <= host_end for s in stamps):
        return None
    order = list(range(len(taken)))
    if stamps != sorted(stamps):
        stamped = sorted((i for i in order if taken[i][0] is not None), key=lambda i: taken[i][0] or 0.0)
        order = stamped + [i for i in order if taken[i][0] is None]
    scale = call_s / span
    shares = [0.0] * len(taken)
    previous = host_began
    members: list[int] = []
    for i in order:
        members.append(i)
        stamp = taken[i][0]
        if stamp is not None:
            _split(shares, members, (stamp - previous) * scale, taken)
            previous, members = stamp, []
    if members:
        _split(shares, members, (host_end - previous) * scale, taken)
    return shares


def _split(shares: list[float], members: list[int], seconds: float, taken: list[tuple[float | None, float]]) -> None:
    """``seconds`` to ``members`` in proportion to their tokens (evenly without any)."""
    weights = [max(0.0, taken[i][1]) for i in members]
    total = sum(weights)
    for i, weight in zip(members, weights, strict=True):
        shares[i] += seconds * (weight / total if total > 0 else 1.0 / len(members))
