"""The wrappers the mlx-lm adapter puts on mlx-lm's server, one factory per method.

Each factory is called as ``factory(adoption, current method, originals)`` and returns
the wrapper (see :class:`~..instrumenting.MethodPatches`). The wrappers only translate:
every decision is :class:`~.adoption.Adoption`'s, which never raises.

Threads: the prompt-cache and ``_tokenize`` wrappers run on mlx-lm's generation thread;
``do_GET`` on an HTTP request thread (it reads a status value).
"""

from __future__ import annotations

import json
from collections.abc import Callable, Mapping
from typing import Any

#: mlx-lm's HTTP route for the adapter's status (a GET; the host's own routes are untouched).
STATUS_PATH = "/v1/mlx-recovery/status"

Factory = Callable[[Any, Any, Mapping[str, Any]], Any]


def _tokenize(life: Any, original: Any, _originals: Mapping[str, Any]) -> Any:
    def wrapper(self: Any, tokenizer: Any, request: Any, args: Any) -> Any:
        result = original(self, tokenizer, request, args)
        # mlx-lm serves a request it cannot batch (a seed, --kv-bits) one by one,
        # ignoring the segments: no cut would happen there.
        batchable = getattr(self, "_is_batchable", None)
        if args is not None and callable(batchable) and not batchable(args):
            return result
        return life.segments(self, result)

    return wrapper


def _insert_cache(life: Any, original: Any, _originals: Mapping[str, Any]) -> Any:
    def wrapper(self: Any, model: Any, tokens: Any, prompt_cache: Any, *, cache_type: str = "assistant") -> Any:
        if life.active and life.takes_insert(cache_type):
            life.snapshot(model, tokens, prompt_cache)
            return None
        before = life.entries(self)
        result = original(self, model, tokens, prompt_cache, cache_type=cache_type)
        life.inserted(self, model, tokens, before)
        return result

    return wrapper


def _fetch_nearest_cache(life: Any, original: Any, _originals: Mapping[str, Any]) -> Any:
    def wrapper(self: Any, model: Any, tokens: Any) -> Any:
        return life.fetch(self, original, model, tokens)

    return wrapper


def _do_get(status: Callable[[], dict[str, Any]]) -> Factory:
    def factory(_life: Any, original: Any, _originals: Mapping[str, Any]) -> Any:
        def wrapper(self: Any) -> Any:
            if self.path != STATUS_PATH:
                return original(self)
            body = json.dumps(status()).encode()
            self._set_completion_headers(200)
            self.end_headers()
            self.wfile.write(body)
            self.wfile.flush()
            return None

        return wrapper

    return factory


#: Wrapped as soon as mlx-lm's prompt cache module is there.
CACHE_FACTORIES: dict[tuple[str, str], Factory] = {
    ("LRUPromptCache", "insert_cache"): _insert_cache,
    ("LRUPromptCache", "fetch_nearest_cache"): _fetch_nearest_cache,
}


def server_factories(status: Callable[[], dict[str, Any]]) -> dict[tuple[str, str], Factory]:
    """Wrapped once the server module's classes exist."""
    return {
        ("ResponseGenerator", "_tokenize"): _tokenize,
        ("APIHandler", "do_GET"): _do_get(status),
    }
