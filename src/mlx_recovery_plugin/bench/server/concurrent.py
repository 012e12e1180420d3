"""Serving a concurrent session: every conversation on a thread of its own.

Each conversation's thread sends its first turn ``start_s`` into the session and each next
turn ``think_s`` after its previous answer, in every arm (sparse off and sparse on too:
what overlaps, and so what queues behind what, is part of what is measured). Given
``not_before`` (another arm's send times), a turn also waits until the other arm sent it:
with a faster answer before it, it arrives when it arrived there, so both arms see the
same arrivals wherever this one was not slower (``--arrivals sparse-on``), and turns the
other arm sent within ``ORDER_WINDOW_S`` of each other are sent in its order and at
least its spacing apart (each waits at most ``ORDER_WAIT_S`` past its own time). Records land
in the session's step order, whatever order the answers came in, so the arms compare
step by step. A turn's sparse route cannot be told from the log when several run at once;
the arm's total of sparse requests is counted instead. Given a competing ``load``
(``--load-first-turn``), it runs from the session's start until the first conversation
is about to send its second turn, and the turns sent before it stopped are marked loaded.

Threads: one per conversation, each with its own client; ``run.steps`` slots are each
written by one thread and read after every thread has joined. The first error in a
thread stops the others' next sends and is raised on the caller's thread. The load is
started and stopped on the caller's thread only: the first conversation's thread asks for
the stop and waits until it is done.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable, Sequence
from typing import Any

from ..policy.load import CompetingLoad
from .client import send_turn
from .report import ArmRun, StepRecord, status_figures
from .sessions import Session, Step

# Two turns due together reach the host in whichever order their threads send them, and
# the host serves them in that order: on the real server a turn sent 0.1 s after the other
# arm's order took 1.4-1.9x as long while the queue's sum was the same. Turns the other
# arm sent this close keep its order; a turn waits this long at most for those before it
# (a conversation this arm serves more slowly does not hold the others back).
ORDER_WINDOW_S = 0.5
ORDER_WAIT_S = 1.0
# The longest the first conversation's second turn waits for the load to stop.
LOAD_STOP_WAIT_S = 30.0

Progress = Callable[[str], None]
ReadStatus = Callable[[], dict[str, Any]]


def serve_concurrently(
    session: Session, *, make_client: Callable[[], Any], model: str, max_tokens: int, absent_cached_is_zero: bool,
    read_status: ReadStatus | None, progress: Progress, tag: str, run: ArmRun,
    not_before: Sequence[float | None] | None = None, load: CompetingLoad | None = None,
) -> None:
    """Serve ``session`` (``session.concurrent``) into ``run.steps``; ``read_status``: the
    recovery arm's status after each turn and once at the end (``run.final_status``);
    ``not_before``: per step, seconds into the session before which it is not sent (None:
    its own schedule only); ``load``: run from the start until the first conversation's
    second turn (``run.load_s``), and stopped whatever happens."""
    if not_before is not None and len(not_before) != len(session.steps):
        raise ValueError(f"{tag}: {len(not_before)} arrival times for {len(session.steps)} steps")
    by_conversation: dict[str, list[tuple[int, Step]]] = {}
    for index, step in enumerate(session.steps):
        by_conversation.setdefault(step.conversation, []).append((index, step))
    slots: list[StepRecord | None] = [None] * len(session.steps)
    sent_here = [threading.Event() for _ in session.steps]
    # Seconds into the session each step was sent here: written by its thread before its
    # event is set, read by others only after it is.
    sent_at = [0.0] * len(session.steps)
    before = _sent_before(session.steps, not_before)
    errors: list[BaseException] = []
    failed = threading.Event()
    first_conversation = session.steps[0].conversation if session.steps else None
    # Set by the first conversation's thread before its second turn (or when it ends);
    # the caller's thread then stops the load and sets the other.
    stop_load, load_stopped = threading.Event(), threading.Event()
    if load is None:
        load_stopped.set()
    else:
        load.start()
    started = time.monotonic()

    def conversation(steps: list[tuple[int, Step]]) -> None:
        client = make_client()
        wake = started + steps[0][1].start_s
        leads = steps[0][1].conversation == first_conversation  # its second turn ends the load
        try:
            for n, (index, step) in enumerate(steps):
                other = not_before[index] if not_before is not None else None
                if other is not None:
                    wake = max(wake, started + other)
                if failed.wait(max(0.0, wake - time.monotonic())):
                    return
                for earlier in before[index]:
                    if not sent_here[earlier].wait(max(0.0, wake + ORDER_WAIT_S - time.monotonic())):
                        continue
                    # And the other arm's spacing: sent 2 ms apart instead of its 0.1 s,
                    # two turns were still taken in the other order.
                    assert not_before is not None and other is not None
                    gap = other - (not_before[earlier] or 0.0)
                    spaced = min(started + sent_at[earlier] + gap, wake + ORDER_WAIT_S)
                    if failed.wait(max(0.0, spaced - time.monotonic())):
                        return
                if failed.is_set():
                    return
                if leads and n == 1:
                    stop_load.set()
                    load_stopped.wait(LOAD_STOP_WAIT_S)
                sent = time.monotonic() - started
                sent_at[index] = sent
                sent_here[index].set()
                measure = send_turn(client, model, list(step.messages), max_tokens=max_tokens,
                                    absent_cached_is_zero=absent_cached_is_zero)
                done = time.monotonic() - started
                last = n == len(steps) - 1
                figures = status_figures(read_status()) if read_status is not None else None
                progress(f"{tag} {step.conversation} turn {step.turn} at {sent:.1f} s: prompt {measure.prompt_tokens} "
                         f"cached {measure.cached_tokens} ttft {measure.ttft_s:.2f} s"
                         + ("" if last else f"; thinks {step.think_s:g} s"))
                slots[index] = StepRecord(
                    step=index + 1, conversation=step.conversation, turn=step.turn, label=step.label,
                    prompt_tokens=measure.prompt_tokens, cached_tokens=measure.cached_tokens,
                    ttft_s=measure.ttft_s, total_s=measure.total_s, idle_after_s=0.0 if last else step.think_s,
                    status=figures, sparse=None, answer=measure.text, sent_s=round(sent, 3), done_s=round(done, 3),
                )
                wake = time.monotonic() + step.think_s
        except BaseException as exc:  # noqa: BLE001 - raised again on the caller's thread
            errors.append(exc)
            failed.set()
        finally:
            if leads:
                stop_load.set()

    threads = [threading.Thread(target=conversation, args=(steps,), name=f"bench-conv-{name}", daemon=True)
               for name, steps in by_conversation.items()]
    try:
        for thread in threads:
            thread.start()
        if load is not None:
            stop_load.wait()
            load.stop()
            run.load_s = (0.0, round(time.monotonic() - started, 3))
            load_stopped.set()
        for thread in threads:
            thread.join()
    finally:
        if load is not None:
            load.stop()
            load_stopped.set()
    if errors:
        raise errors[0]
    if run.load_s is not None:
        for slot in slots:
            if slot is not None and slot.sent_s is not None and slot.sent_s < run.load_s[1]:
                slot.loaded = True
    run.steps.extend(slot for slot in slots if slot is not None)
    if len(run.steps) != len(session.steps):
        raise RuntimeError(f"{tag}: {len(session.steps) - len(run.steps)} step(s) were not served")
    if read_status is not None:
        run.final_status = status_figures(read_status())


def _sent_before(steps: Sequence[Step], not_before: Sequence[float | None] | None) -> list[list[int]]:
    """Per step, the other conversations' steps the other arm sent at most
    ``ORDER_WINDOW_S`` before it (none without ``not_before``)."""
    before: list[list[int]] = [[] for _ in steps]
    if not_before is None:
        return before
    for i, at in enumerate(not_before):
        if at is None:
            continue
        for j, other in enumerate(not_before):
            if (other is not None and steps[j].conversation != steps[i].conversation
                    and (other, j) < (at, i) and at - other <= ORDER_WINDOW_S):
                before[i].append(j)
    return before
