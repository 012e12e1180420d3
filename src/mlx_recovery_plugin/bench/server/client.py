"""One turn through the OpenAI Python SDK: streamed, with usage, timed to the first token.

The server's own usage is the measurement: prompt tokens and
``usage.prompt_tokens_details.cached_tokens`` from the final stream chunk
(``stream_options={"include_usage": True}``). A missing figure is an error, never 0.
"""

from __future__ import annotations

import time
from dataclasses import dataclass
from typing import Any


class MissingMeasurementError(RuntimeError):
    """The server's answer lacked a figure the bench reports."""


@dataclass(slots=True, frozen=True)
class TurnMeasure:
    prompt_tokens: int
    cached_tokens: int
    ttft_s: float  # request sent -> first streamed content (or the end, if none came)
    total_s: float
    completion_tokens: int
    text: str = ""  # the streamed answer's content


def make_client(base_url: str, timeout_s: float = 900.0, api_key: str = "unused") -> Any:
    from openai import OpenAI

    return OpenAI(base_url=base_url + "/v1", api_key=api_key, timeout=timeout_s, max_retries=0)


def send_turn(
    client: Any, model: str, messages: list[dict[str, str]], max_tokens: int = 2, *, absent_cached_is_zero: bool = False
) -> TurnMeasure:
    """Send ``messages``, stream the answer, and return the server's figures.
    ``absent_cached_is_zero``: the server omits ``prompt_tokens_details`` when it cached
    nothing (rapid-mlx)."""
    started = time.perf_counter()
    first: float | None = None
    usage = None
    parts: list[str] = []
    stream = client.chat.completions.create(
        model=model, messages=messages, max_tokens=max_tokens, temperature=0.0, stream=True,
        stream_options={"include_usage": True},
    )
    for chunk in stream:
        parts.extend(choice.delta.content or "" for choice in chunk.choices)
        if first is None and any(
            (choice.delta.content or getattr(choice.delta, "reasoning_content", None)) for choice in chunk.choices
        ):
            first = time.perf_counter()
        if chunk.usage is not None:
            usage = chunk.usage
    ended = time.perf_counter()
    if usage is None:
        raise MissingMeasurementError("the stream ended without usage (stream_options include_usage ignored?)")
    details = getattr(usage, "prompt_tokens_details", None)
    cached = getattr(details, "cached_tokens", None) if details is not None else None
    if details is None and absent_cached_is_zero:
        cached = 0
    if usage.prompt_tokens is None or cached is None:
        raise MissingMeasurementError(
            f"usage lacks prompt_tokens or prompt_tokens_details.cached_tokens: {usage!r}"
        )
    return TurnMeasure(
        prompt_tokens=int(usage.prompt_tokens),
        cached_tokens=int(cached),
        ttft_s=(first if first is not None else ended) - started,
        total_s=ended - started,
        completion_tokens=int(usage.completion_tokens or 0),
        text="".join(parts),
    )
