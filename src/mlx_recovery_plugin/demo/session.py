"""A replayable append-heavy agent session: a long system prompt, then turns that each
append the assistant's previous reply, a tool's output and a question.

Replies are scripted, not generated, so every arm of the demo sees exactly the same
prompts (a sparse-served turn generates different tokens than a dense one, and a live
conversation would then diverge). Each turn's prompt starts with the previous turn's
prompt: the session only appends.
"""

from __future__ import annotations

import random
from collections.abc import Callable, Sequence
from dataclasses import dataclass

TOOLS = ("read_file", "grep", "run_tests", "list_dir", "git_diff", "search_docs")
WORDS = ["scheduler", "cache", "block", "prefix", "engine", "token", "request", "slice", "budget", "window", "model", "layer", "stream", "thread", "queue", "arrival", "departure", "lookup", "publish", "probe", "release", "store", "fetch", "recovery", "adopter", "sparse", "dense", "route", "draft", "keep", "ratio", "boundary", "commit", "lineage", "job"]


@dataclass(slots=True, frozen=True)
class SessionSpec:
    """Sizes in characters; the demo's byte-level tokenizer makes that one token each.

    The defaults are what an agent sends, as in the real-server measurement: an
    ~8,500-token system prompt (over the real server's 8,192-token sparse threshold, so
    the first turn takes the sparse route), then 4 more turns of ~600 tokens each: the
    assistant's reply, a tool's output and a question."""

    system_chars: int = 8500
    turns: int = 5
    tool_chars: int = 380
    question_chars: int = 70
    reply_chars: int = 150
    think_time_s: float = 30.0
    seed: int = 7


@dataclass(slots=True, frozen=True)
class Turn:
    index: int
    prompt: tuple[int, ...]
    appended: int  # tokens this turn added after the previous turn's prompt


def _prose(rng: random.Random, chars: int) -> str:
    out: list[str] = []
    size = 0
    while size < chars:
        word = rng.choice(WORDS)
        out.append(word)
        size += len(word) + 1
    return " ".join(out)[:chars]


def _tool_output(rng: random.Random, chars: int) -> str:
    tool = rng.choice(TOOLS)
    lines = [f"$ {tool} src/{rng.choice(WORDS)}.py"]
    while sum(len(x) + 1 for x in lines) < chars:
        lines.append(f"{rng.randint(1, 999):4d}: {_prose(rng, 60)}")
    return "\n".join(lines)[:chars]


def build_session(spec: SessionSpec, encode: Callable[[str], Sequence[int]]) -> list[Turn]:
    """The prompts of every turn, built by appending encoded messages."""
    rng = random.Random(spec.seed)
    tokens: list[int] = list(encode("<|system|>" + _prose(rng, spec.system_chars)))
    turns: list[Turn] = []
    for index in range(spec.turns):
        before = len(tokens)
        if index > 0:
            tokens += encode(_prose(rng, spec.reply_chars))
            tokens += encode("<|tool|>" + _tool_output(rng, spec.tool_chars))
        tokens += encode("<|user|>" + _prose(rng, spec.question_chars) + "<|assistant|>")
        turns.append(Turn(index, tuple(tokens), len(tokens) - before))
    return turns
