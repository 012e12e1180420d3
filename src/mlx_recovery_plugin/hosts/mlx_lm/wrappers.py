"""The wrappers the mlx-lm adapter puts on mlx-lm's server, one factory per method.

Each factory is called as ``factory(adoption, current method, originals)`` and returns
the wrapper (see :class:`~..instrumenting.MethodPatches`). The wrappers only translate:
every decision is :class:`~.adoption.Adoption`'s, which never raises.

The lifecycle wrappers (``ResponseGenerator.__init__`` / ``stop_and_join`` /
``_serve_single``, ``BatchGenerator.insert_segments`` / ``next`` / ``remove``) call the
original first or last as the moment needs and report to :class:`~.lifecycle.Requests`.

Threads: the prompt-cache, ``_tokenize``, ``_serve_single`` and ``BatchGenerator``
wrappers run on mlx-lm's generation thread; ``__init__`` and ``stop_and_join`` on the
thread that builds or stops the server; ``do_GET`` on an HTTP request thread (it reads a
status value).
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
        life.requests.arrived(self, request, result[0])
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
        result = life.fetch(self, original, model, tokens)
        life.requests.admitted(tokens, result[1])
        return result

    return wrapper


def _generator_init(life: Any, original: Any, _originals: Mapping[str, Any]) -> Any:
    def wrapper(self: Any, *args: Any, **kwargs: Any) -> None:
        original(self, *args, **kwargs)
        life.requests.attached(self)

    return wrapper


def _stop_and_join(life: Any, original: Any, _originals: Mapping[str, Any]) -> Any:
    def wrapper(self: Any) -> Any:
        life.requests.shutting_down()
        try:
            return original(self)
        finally:  # the generation thread dropped the model as it ended
            life.requests.shut_down()

    return wrapper


def _serve_single(life: Any, original: Any, _originals: Mapping[str, Any]) -> Any:
    def wrapper(self: Any, request: Any, stream: Any) -> Any:
        try:
            return original(self, request, stream)
        finally:
            life.requests.single_done()

    return wrapper


def _next_request(life: Any, original: Any, _originals: Mapping[str, Any]) -> Any:
    def wrapper(self: Any, *args: Any, **kwargs: Any) -> Any:
        life.requests.flush()
        return original(self, *args, **kwargs)

    return wrapper


def _insert_segments(life: Any, original: Any, _originals: Mapping[str, Any]) -> Any:
    def wrapper(self: Any, *args: Any, **kwargs: Any) -> Any:
        uids = original(self, *args, **kwargs)
        life.requests.batched(self, uids)
        return uids

    return wrapper


def _next(life: Any, original: Any, _originals: Mapping[str, Any]) -> Any:
    def wrapper(self: Any) -> Any:
        life.requests.flush()
        responses = original(self)
        life.requests.stepped(self, responses)
        return responses

    return wrapper


def _remove(life: Any, original: Any, _originals: Mapping[str, Any]) -> Any:
    def wrapper(self: Any, uids: Any, *args: Any, **kwargs: Any) -> Any:
        leaving = life.requests.removing(self, uids)
        result = original(self, uids, *args, **kwargs)
        life.requests.removed(leaving)
        return result

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
        ("ResponseGenerator", "__init__"): _generator_init,
        ("ResponseGenerator", "_tokenize"): _tokenize,
        ("ResponseGenerator", "_serve_single"): _serve_single,
        ("ResponseGenerator", "_next_request"): _next_request,
        ("ResponseGenerator", "stop_and_join"): _stop_and_join,
        ("BatchGenerator", "insert_segments"): _insert_segments,
        ("BatchGenerator", "next"): _next,
        ("BatchGenerator", "remove"): _remove,
        ("APIHandler", "do_GET"): _do_get(status),
    }
