"""A replayable append-heavy agent session: a long system prompt, then turns that each
append the assistant's previous reply, a tool's output and a question.

Sizes are in the model's own tokens: each message's content is prose encoded by the
model's tokenizer and cut to its size, and the markup around it (roles, turn ends, the
generation prompt) is the tokenizer's chat template, encoded apart. So a session of a
byte-level tiny model and one of a BPE model cross the same thresholds.

Replies are scripted, not generated, so every arm of the demo sees exactly the same
prompts (a sparse-served turn generates different tokens than a dense one, and a live
conversation would then diverge). Each turn's prompt starts with the previous turn's
prompt: the session only appends.
"""

from __future__ import annotations

import random
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

TOOLS = ("read_file", "grep", "run_tests", "list_dir", "git_diff", "search_docs")
WORDS = ["scheduler", "cache", "block", "prefix", "engine", "token", "request", "slice", "budget", "window", "model", "layer", "stream", "thread", "queue", "arrival", "departure", "lookup", "publish", "probe", "release", "store", "fetch", "recovery", "adopter", "sparse", "dense", "route", "draft", "keep", "ratio", "boundary", "commit", "lineage", "job"]

Encode = Callable[[str], Sequence[int]]


@dataclass(slots=True, frozen=True)
class SessionSpec:
    """Sizes of each message's content, in the model's tokens.

    The defaults are what an agent sends, as in the real-server measurement: an
    ~8,500-token system prompt (over the real server's 8,192-token sparse threshold, so
    the first turn takes the sparse route), then 4 more turns of ~600 tokens each: the
    assistant's reply, a tool's output and a question."""

    system_tokens: int = 8500
    turns: int = 5
    tool_tokens: int = 380
    question_tokens: int = 70
    reply_tokens: int = 150
    think_time_s: float = 30.0
    seed: int = 7


@dataclass(slots=True, frozen=True)
class Turn:
    index: int
    prompt: tuple[int, ...]
    appended: int  # tokens this turn added after the previous turn's prompt


_SENTINEL = "\x00CONTENT\x00"


@dataclass(slots=True, frozen=True)
class ChatFormat:
    """The markup a chat template puts around one message of each role, and the generation
    prompt, as text (encoded apart from the content)."""

    wrap: dict[str, tuple[str, str]]  # role -> (before, after) the content
    generation: str  # what the template adds for the assistant's turn to start

    @classmethod
    def plain(cls) -> ChatFormat:
        """The tiny models' template (``<|role|>content``), for tokenizers without one."""
        return cls({r: (f"<|{r}|>", "") for r in ("system", "user", "assistant", "tool")}, "<|assistant|>")

    @classmethod
    def of(cls, tokenizer: Any) -> ChatFormat:
        """Read from ``tokenizer``'s chat template by rendering a placeholder message of each
        role after a system message; the plain format where there is no template or it
        refuses the session's shape. A template without a tool role wraps tool output as
        a user message."""
        if not getattr(tokenizer, "chat_template", None):
            return cls.plain()
        try:
            return cls._read(tokenizer)
        except Exception:  # noqa: BLE001 - a template's own error (roles, alternation): plain markup
            return cls.plain()

    @classmethod
    def _read(cls, tokenizer: Any) -> ChatFormat:

        def render(messages: list[dict[str, str]], generation: bool = False) -> str:
            return str(tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=generation))

        system = [{"role": "system", "content": "s"}]
        head = render(system)
        wrap: dict[str, tuple[str, str]] = {}
        for role in ("system", "user", "assistant", "tool"):
            messages = [{"role": role, "content": _SENTINEL}] if role == "system" else system + [{"role": role, "content": _SENTINEL}]
            try:
                text = render(messages)
            except Exception:  # the template has no such role
                if role != "tool":
                    raise
                wrap[role] = wrap["user"]
                continue
            piece = text if role == "system" else text[len(head):]
            if role != "system" and not text.startswith(head):
                raise ValueError("the chat template does not only append; the demo's session needs it to")
            before, _, after = piece.partition(_SENTINEL)
            wrap[role] = (before, after)
        generation = render(system, generation=True)[len(head):]
        return cls(wrap, generation)


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


def _content(make: Callable[[int], str], tokens: int, encode: Encode) -> list[int]:
    """``tokens`` tokens of text from ``make(chars)``, asking for more text until enough."""
    chars = max(16, tokens)
    while True:
        encoded = list(encode(make(chars)))
        if len(encoded) >= tokens:
            return encoded[:tokens]
        chars *= 2


def build_session(spec: SessionSpec, encode: Encode, chat: ChatFormat | None = None) -> list[Turn]:
    """The prompts of every turn, built by appending encoded messages."""
    chat = chat or ChatFormat.plain()
    rng = random.Random(spec.seed)

    def message(role: str, content: list[int]) -> list[int]:
        before, after = chat.wrap[role]
        if role == "assistant" and before.startswith(chat.generation):
            # The previous prompt already ends with the generation prompt.
            before = before[len(chat.generation):]
        return list(encode(before)) + content + list(encode(after))

    tokens = message("system", _content(lambda n: _prose(rng, n), spec.system_tokens, encode))
    turns: list[Turn] = []
    for index in range(spec.turns):
        before = len(tokens)
        if index > 0:
            tokens += message("assistant", _content(lambda n: _prose(rng, n), spec.reply_tokens, encode))
            tokens += message("tool", _content(lambda n: _tool_output(rng, n), spec.tool_tokens, encode))
        tokens += message("user", _content(lambda n: _prose(rng, n), spec.question_tokens, encode))
        tokens += list(encode(chat.generation))
        turns.append(Turn(index, tuple(tokens), len(tokens) - before))
    return turns
