"""A recall session: facts placed in a long first turn, later turns asking about them.

What the sparse route does to answers shows where a later turn needs the content of the
long first turn: the first turn's system message is a list of facts (each item kept in a
numbered room), and every later turn asks where one of them is kept. The assistant's
replies are scripted (the right answer to the previous question), so every arm sees the
same prompts; what each arm *generates* is what is compared, greedy, against sparse
off's. Sized in the model's own tokens with its chat template, as the agent session.
Read-only data once built; one thread: the caller's.
"""

from __future__ import annotations

import random
from dataclasses import dataclass

from .session import ChatFormat, Encode, Turn

COLOURS = ("red", "blue", "green", "amber", "silver", "black", "white", "golden", "purple", "orange", "grey", "pink")
THINGS = ("key", "cup", "pen", "map", "box", "coin", "bell", "kite", "jar", "hat", "lamp", "book", "clock", "ring", "shoe", "drum")


@dataclass(slots=True, frozen=True)
class RecallSpec:
    """``system_tokens`` of facts, then ``turns - 1`` questions about them."""

    system_tokens: int = 8500
    turns: int = 5
    think_time_s: float = 30.0
    seed: int = 11


@dataclass(slots=True, frozen=True)
class RecallTurn:
    turn: Turn
    question: str  # empty on the first turn (it asks for nothing the passage holds)
    expected: str  # the room number the passage gives for the item asked about


def _facts(rng: random.Random) -> list[tuple[str, str]]:
    items = [f"{c} {t}" for c in COLOURS for t in THINGS]
    rng.shuffle(items)
    return [(item, str(rng.randint(100, 999))) for item in items]


def build_recall_session(spec: RecallSpec, encode: Encode, chat: ChatFormat | None = None) -> list[RecallTurn]:
    """The prompts of a recall session; later turns ask about facts spread over the passage."""
    chat = chat or ChatFormat.plain()
    rng = random.Random(spec.seed)
    facts = _facts(rng)
    intro = "You keep an inventory. Answer each question with the room number only.\n"
    lines: list[str] = []
    used: list[tuple[str, str]] = []
    tokens_so_far = len(encode(intro))
    for item, room in facts * (1 + spec.system_tokens // 2000):
        if tokens_so_far >= spec.system_tokens:
            break
        line = f"The {item} is kept in room {room}.\n"
        if (item, room) not in used:
            used.append((item, room))
        lines.append(line)
        tokens_so_far += len(encode(line))
    # Ask about facts spread evenly over the passage, from its start to its end.
    questions = max(1, spec.turns - 1)
    asked = [used[int((i + 0.5) * len(used) / questions)] for i in range(spec.turns - 1)]

    def message(role: str, text: str) -> list[int]:
        before, after = chat.wrap[role]
        if role == "assistant" and before.startswith(chat.generation):
            before = before[len(chat.generation):]
        return list(encode(before)) + list(encode(text)) + list(encode(after))

    tokens = message("system", intro + "".join(lines))
    tokens += message("user", "Are you ready for my questions?") + list(encode(chat.generation))
    out = [RecallTurn(Turn(0, tuple(tokens), len(tokens)), "", "")]
    reply = "Yes."
    for index, (item, room) in enumerate(asked, start=1):
        before = len(tokens)
        question = f"In which room is the {item} kept?"
        tokens += message("assistant", reply)
        tokens += message("user", question) + list(encode(chat.generation))
        out.append(RecallTurn(Turn(index, tuple(tokens), len(tokens) - before), question, room))
        reply = f"Room {room}."
    return out
