"""The conversations the server bench sends, as an agent sends them.

A conversation starts with a short system message and a long first user message (the
context an agent sends: files, tool descriptions; ~8,500 tokens, above the server's
8,192-token sparse threshold) and each later turn appends the assistant's previous reply,
a tool's output and the user's next question (~600 tokens). The long part is not the
system message because oMLX 0.7.0 protects the system prompt from SpecPrefill: it takes
the sparse route only when the non-system part of the uncached prompt exceeds the
threshold, so an 8,500-token system message with short turns is never served sparse.
Replies are scripted, so every arm sends exactly the same prompts. With the byte-level
tokenizer a character is a token; for any other tokenizer :func:`fit_shape` turns the
sizes, read as the target's tokens, into characters of the text each part is made of, and
:func:`token_sizes` measures what the server will count (the chat template applied).

A session is a list of steps; each step sends one conversation's messages so far and is
followed by ``think_s`` of idle time. In a *concurrent* session each conversation runs on
its own schedule, as several agents on one server do: it starts ``start_s`` into the
session and sends its next turn ``think_s`` after its previous answer, whatever the
others are doing, so turns overlap and queue behind each other.
"""

from __future__ import annotations

import dataclasses
import random
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field

from ...demo.session import _prose, _tool_output

SESSION_NAMES = ("agent", "interleaved", "concurrent", "fork", "gaps", "curve")
DEFAULT_CONVERSATIONS = 3
# A concurrent session's think times vary by this factor either way around think_s (seeded).
THINK_SPREAD = 0.5
# Its later conversations start this share of the stagger early or late (seeded): where a
# first turn takes about the stagger, whether the next arrives during it decides the queue.
START_SPREAD = 0.25
DEFAULT_SEED = 11
DEFAULT_CURVE = (5.0, 10.0, 20.0, 40.0)
GAP_S = 2.0
# Characters of each kind of text measured to find the tokenizer's chars per token.
SAMPLE_CHARS = 20_000
# Chars per token this close to 1 is a byte-level tokenizer: the shape is left as it is.
BYTE_LEVEL_TOLERANCE = 0.02

Encode = Callable[[str], Sequence[int]]
CountPrompt = Callable[[list[dict[str, str]]], int]


@dataclass(slots=True, frozen=True)
class Shape:
    """Sizes in characters of one conversation (= tokens with the byte-level tokenizer;
    :func:`fit_shape` makes them tokens of another)."""

    system_chars: int = 300
    context_chars: int = 8500
    turns: int = 5
    reply_chars: int = 90
    tool_chars: int = 420
    question_chars: int = 90


@dataclass(slots=True, frozen=True)
class Step:
    conversation: str
    turn: int  # 1-based turn of that conversation
    messages: tuple[dict[str, str], ...]
    think_s: float  # idle time after this step (concurrent: before this conversation's next turn)
    label: str = ""
    start_s: float = 0.0  # concurrent: when a conversation's first turn is sent, from the session's start


@dataclass(slots=True)
class Session:
    name: str
    description: str
    steps: list[Step] = field(default_factory=list)
    concurrent: bool = False  # each conversation on its own schedule (see the module docstring)

    @property
    def longest_prompt_chars(self) -> int:
        return max(sum(len(m["content"]) + 1 for m in s.messages) for s in self.steps)


class Conversation:
    """Messages of one conversation, grown turn by turn (seeded, so replayable)."""

    def __init__(self, shape: Shape, seed: int) -> None:
        self.shape = shape
        self._rng = random.Random(seed)
        self.messages: list[dict[str, str]] = [
            {"role": "system", "content": _prose(self._rng, shape.system_chars)},
            {"role": "user", "content": _tool_output(self._rng, shape.context_chars)},
        ]
        self.turn = 0

    def next_turn(self) -> tuple[dict[str, str], ...]:
        """Append one turn (reply + tool output + question after the first) and return
        the whole conversation as sent."""
        if self.turn > 0:
            self.messages.append({"role": "assistant", "content": _prose(self._rng, self.shape.reply_chars)})
            self.messages.append({"role": "user", "content": _tool_output(self._rng, self.shape.tool_chars)})
        self.messages.append({"role": "user", "content": _prose(self._rng, self.shape.question_chars)})
        self.turn += 1
        return tuple(dict(m) for m in self.messages)

    def edited_last_question(self) -> tuple[dict[str, str], ...]:
        """The conversation with its last user question replaced (a fork)."""
        edited = [dict(m) for m in self.messages]
        edited[-1] = {"role": "user", "content": _prose(self._rng, self.shape.question_chars)}
        return tuple(edited)


def agent(shape: Shape, think_s: float, name: str = "agent") -> Session:
    conv = Conversation(shape, seed=1)
    session = Session(name, f"one agent conversation, {shape.turns} turns, {think_s:g} s think time")
    for t in range(shape.turns):
        session.steps.append(Step("A", t + 1, conv.next_turn(), think_s))
    return session


def interleaved(shape: Shape, think_s: float) -> Session:
    a, b = Conversation(shape, seed=1), Conversation(shape, seed=2)
    session = Session("interleaved", f"two conversations taking turns, {shape.turns} turns each, "
                      f"{think_s:g} s think time between requests")
    for t in range(shape.turns):
        session.steps.append(Step("A", t + 1, a.next_turn(), think_s))
        session.steps.append(Step("B", t + 1, b.next_turn(), think_s))
    return session


def concurrent(shape: Shape, think_s: float, conversations: int = DEFAULT_CONVERSATIONS,
               seed: int = DEFAULT_SEED) -> Session:
    """``conversations`` agents at once: each starts about ``think_s / conversations`` after
    the previous one (``1 +- START_SPREAD`` of that stagger, seeded; the first at 0) and
    thinks ``think_s`` times a seeded factor in ``1 +- THINK_SPREAD`` between its turns.
    Steps are listed by their nominal send time (service time not counted); what overlaps
    depends on how long the server takes. Another ``seed``, another schedule of the same
    conversations."""
    if conversations < 1:
        raise ValueError(f"a concurrent session needs at least one conversation; got {conversations}")
    rng = random.Random(seed)
    starts = random.Random(seed + 1000)  # apart, so a seed's think times stay what they were
    stagger = think_s / conversations
    planned: list[tuple[float, int, Step]] = []
    for c in range(conversations):
        name = chr(ord("A") + c) if c < 26 else f"C{c + 1}"
        conv = Conversation(shape, seed=100 + c)
        start = 0.0 if c == 0 else round(stagger * (c + starts.uniform(-START_SPREAD, START_SPREAD)), 2)
        at = start
        for t in range(shape.turns):
            last = t == shape.turns - 1
            think = 0.0 if last else think_s * rng.uniform(1 - THINK_SPREAD, 1 + THINK_SPREAD)
            planned.append((at, c, Step(name, t + 1, conv.next_turn(), round(think, 2), start_s=start)))
            at += think
    planned.sort(key=lambda x: (x[0], x[1]))
    return Session("concurrent", f"{conversations} conversations at once, {shape.turns} turns each, starts "
                   f"about {stagger:g} s apart (+-{START_SPREAD:.0%}), think time {think_s:g} s "
                   f"+-{THINK_SPREAD:.0%} (schedule seed {seed})",
                   [step for _, _, step in planned], concurrent=True)


def fork(shape: Shape, think_s: float) -> Session:
    conv = Conversation(shape, seed=3)
    turns = max(2, shape.turns - 1)
    session = Session("fork", f"{turns} turns, then the last user turn edited and sent again, "
                      f"{think_s:g} s think time")
    for t in range(turns):
        session.steps.append(Step("A", t + 1, conv.next_turn(), think_s))
    session.steps.append(Step("A'", turns, conv.edited_last_question(), think_s, label="fork"))
    return session


def gaps(shape: Shape, gap_s: float = GAP_S) -> Session:
    session = agent(shape, gap_s, name="gaps")
    session.description = f"one conversation, {shape.turns} turns, {gap_s:g} s gaps (recovery cannot finish)"
    return session


def build(name: str, shape: Shape, think_s: float, conversations: int = DEFAULT_CONVERSATIONS,
          seed: int = DEFAULT_SEED) -> Session:
    """One named session (``curve`` is built per think time by the runner with ``agent``);
    ``seed``: the concurrent session's schedule (the others have one schedule)."""
    if name == "agent":
        return agent(shape, think_s)
    if name == "interleaved":
        return interleaved(shape, think_s)
    if name == "concurrent":
        return concurrent(shape, think_s, conversations, seed)
    if name == "fork":
        return fork(shape, think_s)
    if name == "gaps":
        return gaps(shape)
    raise ValueError(f"unknown session {name!r}; valid: {', '.join(SESSION_NAMES)}")


@dataclass(slots=True, frozen=True)
class TokenFit:
    """How a shape was fitted to the target's tokenizer: characters per token of each kind
    of text the conversation is made of (prose: system, replies, questions; tool output:
    the first user message and each turn's tool output)."""

    prose_chars_per_token: float
    tool_chars_per_token: float

    @property
    def byte_level(self) -> bool:
        return all(abs(x - 1.0) <= BYTE_LEVEL_TOLERANCE
                   for x in (self.prose_chars_per_token, self.tool_chars_per_token))


def chars_per_token(encode: Encode, make: Callable[[random.Random, int], str], sample_chars: int = SAMPLE_CHARS,
                    seed: int = 0) -> float:
    """Characters per token of ``sample_chars`` of ``make``'s text (a seed the sessions do
    not use, so the sample is like their text, not it)."""
    text = make(random.Random(seed), sample_chars)
    return len(text) / max(1, len(encode(text)))


def fit_shape(shape: Shape, encode: Encode) -> tuple[Shape, TokenFit]:
    """``shape`` with its sizes read as ``encode``'s tokens: each size is scaled by the
    characters per token of the text it is made of. A byte-level tokenizer keeps the
    shape unchanged (so the byte model's sessions stay what they were)."""
    fit = TokenFit(chars_per_token(encode, _prose), chars_per_token(encode, _tool_output))
    if fit.byte_level:
        return shape, fit

    def prose(n: int) -> int:
        return max(1, round(n * fit.prose_chars_per_token))

    def tool(n: int) -> int:
        return max(1, round(n * fit.tool_chars_per_token))

    return dataclasses.replace(
        shape, system_chars=prose(shape.system_chars), context_chars=tool(shape.context_chars),
        reply_chars=prose(shape.reply_chars), tool_chars=tool(shape.tool_chars),
        question_chars=prose(shape.question_chars),
    ), fit


@dataclass(slots=True, frozen=True)
class TokenSizes:
    """A session's prompts as the server counts them: per step the whole prompt, and what
    a conversation's step added to its previous one (0 for its first turn)."""

    prompts: tuple[int, ...]
    appended: tuple[int, ...]
    first_turns: tuple[int, ...]  # the prompt of each conversation's first turn

    @property
    def longest(self) -> int:
        return max(self.prompts, default=0)

    def describe(self) -> str:
        later = [a for a in self.appended if a > 0]
        firsts = ", ".join(f"{n:,}" for n in self.first_turns)
        grown = f"+{min(later):,}..+{max(later):,}" if later else "none"
        return (f"first turn {firsts} tokens, appended turns {grown} tokens, longest prompt "
                f"{self.longest:,} tokens")


def token_sizes(session: Session, count: CountPrompt) -> TokenSizes:
    """Measure ``session`` with ``count`` (messages -> the prompt's tokens, the chat
    template applied). An edited turn (a fork) counts against its conversation's last
    prompt, so a shorter edit appends 0."""
    prompts: list[int] = []
    appended: list[int] = []
    firsts: list[int] = []
    last: dict[str, int] = {}
    for step in session.steps:
        n = count(list(step.messages))
        conv = step.conversation.rstrip("'")
        prompts.append(n)
        if conv in last:
            appended.append(max(0, n - last[conv]))
        else:
            appended.append(0)
            firsts.append(n)
        last[conv] = n
    return TokenSizes(tuple(prompts), tuple(appended), tuple(firsts))
