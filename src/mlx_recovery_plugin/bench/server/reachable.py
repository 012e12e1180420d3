"""The best reachable: the oracle limited by what recovery can re-read in the idle time.

A later turn counts at the faster of sparse off's and sparse on's time once the re-read
idle time covers the conversation's previous prompt, and at sparse on's time before
that. The idle time is one pool for all conversations: a second of it re-reads one
conversation's tokens, not every conversation's at once. Turns are taken in the order
they were sent, and each is paid for from the pool only when the pool covers it then
(what a scheduler that works on each conversation just before it comes back would
reach; a turn the pool cannot cover takes nothing from it). Before, each conversation
had the whole idle time since its first answer to itself: with three conversations at
once every idle second counted three times, and turns the machine could not all have
recovered in time counted as reachable together (bench server, concurrent, bench model:
all three conversations' turn 3, where the idle time before them re-read about two of
their prefixes).

A turn where recovery did restore about as much as sparse off had cached counts as
reachable whatever the pool says, and is paid for.

Rates: turns one after another, each think time at the rate of the first conversation's
sparse-off first turn; where a competing load ran through a step and its gap
(``--load-first-turn``), that gap at the rate of sparse off's loaded first turn and the
quiet gaps at the cost balance's rate (measured alone). A concurrent session (every step
timed): the time no request was in flight, at the cost balance's unqueued rate if given,
else the fastest sparse-off first turn (the others queued); where the load ran in the
recovery arm (``rec.load_s``), that time at the rate of sparse off's first loaded turn.
Where recovery's own runner re-reads faster than that quiet rate (its slices are longer
than the server's prefill steps: on the bench model 1.3-1.7 ms a token against the cost
balance's 3.3), every rate is scaled by how much faster: the pool is what recovery's
runner re-reads, at the speed its own cost model measured (:func:`runner_rate`).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import TYPE_CHECKING

from ...recovery.costs import pass_seconds
from ...recovery.status import dense_fit

if TYPE_CHECKING:
    from .report import ArmRun

# A later turn whose cached tokens with recovery came within this of sparse off's was
# reachable, whatever the pool says (a block of oMLX's): recovery's slices can run
# faster than the server's own first prefill that rates the pool.
REACHED_SLACK_TOKENS = 256
# Turns sent this close together are one arrival to the pool (a second of idle time
# between them re-reads a few hundred tokens at most).
TOGETHER_S = 1.0


def best_reachable_steps(
    off: ArmRun, on: ArmRun, rec: ArmRun, budget_pct: float, dense_rate: float | None = None,
) -> list[float]:
    """Per step: the oracle's time where the shared pool of re-read idle time (see the
    module docstring) covered the conversation's previous prompt when the turn was sent,
    or recovery did restore it; sparse on's time otherwise and for first turns.
    ``dense_rate``: tokens a second of an unqueued dense prefill, measured alone."""
    if not (len(off.steps) == len(on.steps) == len(rec.steps)):
        raise ValueError("arms served different numbers of steps")
    rereadable, quiet_rate = _rereadable(off, rec, dense_rate)
    runner = runner_rate(rec, max((s.prompt_tokens for s in off.steps), default=0))
    speedup = max(1.0, runner / quiet_rate) if runner is not None and quiet_rate > 0 else 1.0
    out: dict[int, float] = {}
    previous: dict[str, int] = {}
    covered: dict[str, int] = {}
    spent = 0.0
    reached = [a.cached_tokens > 0 and r.cached_tokens >= a.cached_tokens - REACHED_SLACK_TOKENS
               for a, r in zip(off.steps, rec.steps)]
    for index in _sent_order(rec, reached):
        a, b = off.steps[index], on.steps[index]
        conv = a.conversation.rstrip("'")
        if conv not in previous:
            out[index] = b.ttft_s
        else:
            need = max(0, previous[conv] - covered[conv])
            if reached[index] or budget_pct / 100.0 * speedup * rereadable(index) - spent >= need:
                spent += need
                covered[conv] = previous[conv]
                # Reachable: the faster route (a policy may leave a prefix unpublished).
                out[index] = min(a.ttft_s, b.ttft_s)
            else:
                out[index] = b.ttft_s
        covered.setdefault(conv, 0)
        previous[conv] = a.prompt_tokens
    return [out[i] for i in range(len(rec.steps))]


def runner_rate(rec: ArmRun, prompt: int) -> float | None:
    """Tokens a second recovery's runner re-reads a prefix of ``prompt`` tokens at, from the
    dense cost model in the recovery arm's last status (None where it never fitted one)."""
    status = rec.end_status or {}
    policy = status.get("policy") if isinstance(status.get("policy"), dict) else None
    if policy is None or prompt <= 0:
        return None
    fit = dense_fit(policy)
    if fit is None:
        return None
    seconds = pass_seconds(fit, prompt, 0)
    return prompt / seconds if seconds > 0 else None


def _sent_order(rec: ArmRun, reached: list[bool]) -> list[int]:
    """Step indexes in the order the recovery arm sent them (the steps' order where a
    step was not timed). Of turns sent within :data:`TOGETHER_S` of each other, those
    recovery did reach come first: the pool paid for them, so it could not also have paid
    for a turn beside them (real oMLX, concurrent: B's and C's turn 3 sent 52 ms apart,
    B's recovered and C's not; in sent order C's took the pool first and both counted)."""
    indexes = list(range(len(rec.steps)))
    if not (rec.steps and all(s.sent_s is not None for s in rec.steps)):
        return indexes
    sent = [float(s.sent_s) for s in rec.steps]  # type: ignore[arg-type]
    indexes.sort(key=lambda i: (sent[i], i))
    ordered: list[int] = []
    group: list[int] = []
    for i in indexes:
        if group and sent[i] - sent[group[0]] > TOGETHER_S:
            ordered.extend(sorted(group, key=lambda j: not reached[j]))
            group = []
        group.append(i)
    ordered.extend(sorted(group, key=lambda j: not reached[j]))
    return ordered


def _rereadable(
    off: ArmRun, rec: ArmRun, dense_rate: float | None = None,
) -> tuple[Callable[[int], float], float]:
    """Tokens a dense pass with the whole machine could re-read in the idle time the
    recovery arm had from its first answer to when step ``index`` was sent (see the module
    docstring for the rates), and the quiet rate it goes by."""

    def off_rate(i: int) -> float:
        return off.steps[i].prompt_tokens / max(off.steps[i].ttft_s, 1e-9)

    loaded = [i for i, step in enumerate(off.steps) if step.loaded]
    loaded_rate = off_rate(loaded[0]) if loaded else None
    timed = [(s.sent_s, s.done_s) for s in rec.steps]
    if rec.steps and all(sent is not None and done is not None for sent, done in timed):
        busy = [(float(sent), float(done)) for sent, done in timed]  # type: ignore[arg-type]
        start = min(done for _, done in busy)
        fastest = max((off_rate(i) for i, a in enumerate(off.steps) if a.turn == 1 and not a.label), default=0.0)
        if dense_rate is not None:
            fastest = dense_rate
        if rec.load_s is None or loaded_rate is None:
            return (lambda index: fastest * _idle_seconds(busy, start, busy[index][0])), fastest
        slow, (_, until) = loaded_rate, rec.load_s

        def concurrent_loaded(index: int) -> float:
            end = busy[index][0]
            under = _idle_seconds(busy, start, min(end, until)) if start < until else 0.0
            return slow * under + fastest * (_idle_seconds(busy, start, end) - under)

        return concurrent_loaded, fastest

    quiet = dense_rate if loaded and dense_rate is not None else off_rate(0)

    def sequential(index: int) -> float:
        return sum(s.idle_after_s * (loaded_rate if s.loaded and loaded_rate is not None else quiet)
                   for s in rec.steps[:index])

    return sequential, quiet


def _idle_seconds(busy: list[tuple[float, float]], start: float, end: float) -> float:
    """Seconds of ``[start, end]`` that no interval of ``busy`` covers."""
    covered, cursor = 0.0, start
    for a, b in sorted(busy):
        a, b = max(a, cursor), min(b, end)
        if b > a:
            covered += b - a
            cursor = b
    return max(0.0, end - start - covered)
