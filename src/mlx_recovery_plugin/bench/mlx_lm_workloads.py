"""What ``bench adopter --host mlx_lm`` sends: its workloads, their prompts as the tiny
models' tokenizer sees them, the block floor a partial-prefix adopter could restore, and
the senders that put a request on the wire (the OpenAI SDK when installed, else plain
``urllib``), streamed: each reply carries the seconds from sending the request to its
first streamed content, as the client sees it.

Each workload uses its own text (seeded by its name), so one server serves them all
without cross-talk. The tiny models' byte-level tokenizer gives one token per character,
so a prompt's tokens are known here without loading a tokenizer.
"""

from __future__ import annotations

import json
import random
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

from ..testing.mlx_lm_server import Reply, ServerClient

WORKLOADS = ("shared_document", "completions_prefix", "edited_message", "subagents", "regenerated")
#: Workloads where the prompts diverge inside a segment: the adopter's ground.
PARTIAL_WORKLOADS = ("shared_document", "completions_prefix", "edited_message", "subagents")


@dataclass(slots=True, frozen=True)
class Request:
    kind: str  # "chat" or "completion"
    messages: tuple[tuple[str, str], ...] = ()
    prompt: str = ""


def _text(rng: random.Random, n: int) -> str:
    return "".join(chr(97 + rng.randrange(26)) if rng.random() > 0.15 else " " for _ in range(n))


def workload(name: str, doc_chars: int, requests: int, seed: int) -> list[Request]:
    """The requests of one workload (byte-level tokenizer: one token per character)."""
    rng = random.Random(f"{name}-{seed}")
    doc = _text(rng, doc_chars)
    system = ("system", "You answer briefly.")
    if name == "shared_document":
        return [Request("chat", (system, ("user", f"{doc}\nQuestion {i}: {_text(rng, 20)}?"))) for i in range(requests)]
    if name == "completions_prefix":
        return [Request("completion", prompt=f"{doc}\n{_text(rng, 30)}") for _ in range(requests)]
    if name == "edited_message":
        out, text = [], doc
        for _ in range(requests):
            out.append(Request("chat", (system, ("user", text))))
            at = int(len(text) * 0.8)  # the user edits a late part of the message
            text = text[:at] + _text(rng, 12) + text[at + 12 :]
        return out
    if name == "subagents":
        tools = json.dumps([{"type": "function", "function": {"name": f"tool_{i}", "description": _text(rng, 40),
                                                                  "parameters": {"type": "object"}}} for i in range(6)])
        tools = tools[:doc_chars]
        return [Request("chat", (("system", f"{tools}\nYou are sub-agent {i}: {_text(rng, 30)}"),
                                 ("user", f"Task: {_text(rng, 25)}"))) for i in range(requests)]
    if name == "regenerated":
        messages = (system, ("user", f"{doc}\nSummarise."))
        return [Request("chat", messages) for _ in range(requests)]
    raise ValueError(f"unknown workload {name!r}; valid: {', '.join(WORKLOADS)}")


def _template(messages: Sequence[tuple[str, str]]) -> str:
    # The tiny models' chat template (testing/tiny_model.py), one token per character.
    return "".join(f"<|{role}|>{content}" for role, content in messages) + "<|assistant|>"


def prompt_tokens(request: Request) -> list[str]:
    """The prompt as the tiny tokenizer sees it: one symbol per token."""
    if request.kind == "completion":
        return list(request.prompt)
    out: list[str] = []
    text = _template(request.messages)
    i = 0
    while i < len(text):
        if text.startswith("<|", i) and (end := text.find("|>", i)) > 0:
            out.append(text[i : end + 2])
            i = end + 2
        else:
            out.append(text[i])
            i += 1
    return out


def floor_tokens(requests: Sequence[Request], block: int) -> int:
    """Sum over requests after the first of floor(longest common prefix with an earlier one, block),
    capped where the host must still prefill one token."""
    prompts = [prompt_tokens(r) for r in requests]
    total = 0
    for k in range(1, len(prompts)):
        best = 0
        for earlier in prompts[:k]:
            n = 0
            for a, b in zip(earlier, prompts[k]):
                if a != b:
                    break
                n += 1
            best = max(best, n)
        total += (min(best, len(prompts[k]) - 1) // block) * block
    return total


#: Tokens each request generates: enough for a greedy answer to compare, few enough that
#: the prefill dominates.
MAX_TOKENS = 6


def sdk_sender(client: ServerClient) -> Callable[[Request], Reply] | None:
    """Streamed through the OpenAI SDK, timed to the first streamed content; None without it."""
    try:
        import openai
    except ImportError:
        return None
    sdk = openai.OpenAI(base_url=client.base_url + "/v1", api_key="none", timeout=client.timeout, max_retries=0)

    def send(request: Request) -> Reply:
        started = time.perf_counter()
        common: dict[str, Any] = {"model": client.model, "max_tokens": MAX_TOKENS, "temperature": 0.0,
                                  "stream": True, "stream_options": {"include_usage": True}}
        stream: Any
        if request.kind == "completion":
            stream = sdk.completions.create(prompt=request.prompt, **common)
        else:
            stream = sdk.chat.completions.create(messages=[{"role": r, "content": c} for r, c in request.messages],
                                                 **common)
        first: float | None = None
        parts: list[str] = []
        usage: Any = None
        for chunk in stream:
            for choice in chunk.choices:
                delta = getattr(choice, "delta", None)
                text = (getattr(delta, "content", None) if delta is not None else getattr(choice, "text", None)) or ""
                if text and first is None:
                    first = time.perf_counter()
                parts.append(text)
            usage = chunk.usage or usage
        ended = time.perf_counter()
        if usage is None:
            raise RuntimeError("the stream ended without usage (stream_options include_usage ignored?)")
        details = getattr(usage, "prompt_tokens_details", None)
        cached = int(getattr(details, "cached_tokens", 0) or 0) if details is not None else 0
        return Reply("".join(parts), cached, int(usage.prompt_tokens), (),
                     (first if first is not None else ended) - started)

    return send


def urllib_sender(client: ServerClient) -> Callable[[Request], Reply]:
    """Streamed through plain ``urllib``, timed to the first streamed content."""
    def send(request: Request) -> Reply:
        if request.kind == "completion":
            return client.stream_complete(request.prompt, max_tokens=MAX_TOKENS)
        return client.stream_chat([{"role": r, "content": c} for r, c in request.messages], max_tokens=MAX_TOKENS)

    return send
