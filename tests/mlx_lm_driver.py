"""Drive mlx-lm's prompt cache the way ``mlx_lm.server`` does, in process, for the adapter's
parity tests: the real (instrumented) ``LRUPromptCache`` and ``ResponseGenerator._tokenize``,
the real model; prefill segment by segment with an insert at each segment end, as
``ResponseGenerator._generate`` and ``BatchGenerator.insert_segments`` do."""

from __future__ import annotations

import copy
from dataclasses import dataclass
from types import SimpleNamespace
from typing import Any

import mlx.core as mx
from mlx_lm.models.cache import make_prompt_cache

MODEL_KEY = ("tiny", None, None)


@dataclass(slots=True)
class Served:
    cached_tokens: int
    logits: Any  # the last prompt position's logits
    tokens: list[int]  # greedy continuation


def tokenize(model: Any, prompt: list[int]) -> tuple[list[int], list[list[int]], list[str]]:
    """The server's ``_tokenize`` for a text completion (one segment), through its wrapper."""
    from mlx_lm import server

    generator = SimpleNamespace(model_provider=SimpleNamespace(model=model, model_key=MODEL_KEY))
    tokenizer = SimpleNamespace(encode=lambda _text: list(prompt))
    request = SimpleNamespace(request_type="text", prompt="")
    out = server.ResponseGenerator._tokenize(generator, tokenizer, request, None)
    return out[0], out[1], out[2]


def serve(lru: Any, model: Any, prompt: list[int], max_tokens: int = 6) -> Served:
    prompt, segments, types = tokenize(model, prompt)
    segments, types = [list(s) for s in segments], list(types)
    cache, rest = lru.fetch_nearest_cache(MODEL_KEY, prompt)
    cached = len(prompt) - len(rest)
    n = cached
    while n > 0:  # the server's own loop: drop what the cache covers
        if n >= len(segments[0]):
            n -= len(segments.pop(0))
            types.pop(0)
        else:
            segments[0] = segments[0][n:]
            break
    if cache is None:
        cache = make_prompt_cache(model)
    seq = [s for s in segments if s]
    if len(seq[-1]) != 1:
        seq.append(seq[-1][-1:])
        seq[-2] = seq[-2][:-1]
    pending = types[::-1]
    processed = list(prompt[:cached])
    for piece in seq[:-1]:
        mx.eval([c.state for c in cache], model(mx.array([piece]), cache=cache))
        processed += piece
        if pending:
            lru.insert_cache(MODEL_KEY, list(processed), copy.deepcopy(cache), cache_type=pending.pop())
    logits = model(mx.array([seq[-1]]), cache=cache)[0, -1]
    out = [int(mx.argmax(logits).item())]
    first = logits
    for _ in range(max_tokens - 1):
        logits = model(mx.array([[out[-1]]]), cache=cache)[0, -1]
        out.append(int(mx.argmax(logits).item()))
    lru.insert_cache(MODEL_KEY, list(prompt) + out[:-1], cache, cache_type="assistant")
    return Served(cached, first, out)


def cold(model: Any, prompt: list[int], max_tokens: int = 6) -> Served:
    cache = make_prompt_cache(model)
    logits = model(mx.array([prompt]), cache=cache)[0, -1]
    out = [int(mx.argmax(logits).item())]
    first = logits
    for _ in range(max_tokens - 1):
        logits = model(mx.array([[out[-1]]]), cache=cache)[0, -1]
        out.append(int(mx.argmax(logits).item()))
    return Served(0, first, out)
