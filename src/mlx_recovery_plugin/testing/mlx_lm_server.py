"""mlx-lm's own server as a subprocess, for the adapter's HTTP tests and the bench.

:func:`serving` starts ``python -m mlx_lm.server`` on 127.0.0.1 with a model directory,
waits (bounded) for ``/health``, yields a :class:`ServerClient`, and always kills the
process afterwards. The plugin attaches from the environment alone (``MLX_RECOVERY_ENABLE``
and the ``.pth`` start-up hook in the interpreter's site-packages), as a user's would.
The client is plain ``urllib`` so the tests need no HTTP library; its ``stream_*`` calls
read the server's event stream and time the first token as a client sees it.
"""

from __future__ import annotations

import json
import os
import socket
import subprocess
import sys
import tempfile
import time
import urllib.error
import urllib.request
from collections.abc import Iterator, Mapping
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Any

STATUS_PATH = "/v1/mlx-recovery/status"


@dataclass(slots=True, frozen=True)
class Reply:
    """One completion: the text, cached and prompt tokens as the server's usage says;
    streamed, the seconds from sending it to the first streamed content (or to the
    stream's end, if no content came)."""

    text: str
    cached_tokens: int
    prompt_tokens: int
    logprobs: tuple[float, ...]
    ttft_s: float | None = None


class ServerClient:
    def __init__(self, base_url: str, model: str, timeout: float = 120.0) -> None:
        self.base_url = base_url
        self.model = model
        self.timeout = timeout

    def _post(self, path: str, body: dict[str, Any]) -> dict[str, Any]:
        request = urllib.request.Request(
            self.base_url + path, data=json.dumps(body).encode(), headers={"Content-Type": "application/json"},
        )
        with urllib.request.urlopen(request, timeout=self.timeout) as response:
            out: dict[str, Any] = json.loads(response.read())
            return out

    def get(self, path: str) -> dict[str, Any]:
        with urllib.request.urlopen(self.base_url + path, timeout=self.timeout) as response:
            out: dict[str, Any] = json.loads(response.read())
            return out

    def chat(self, messages: list[dict[str, str]], max_tokens: int = 8) -> Reply:
        out = self._post("/v1/chat/completions", {
            "model": self.model, "messages": messages, "max_tokens": max_tokens,
            "temperature": 0.0, "logprobs": True,
        })
        choice = out["choices"][0]
        content = (choice.get("logprobs") or {}).get("content") or []
        return _reply(choice["message"]["content"] or "", out["usage"], [c["logprob"] for c in content])

    def complete(self, prompt: str, max_tokens: int = 8) -> Reply:
        out = self._post("/v1/completions", {
            "model": self.model, "prompt": prompt, "max_tokens": max_tokens, "temperature": 0.0,
            "logprobs": True,
        })
        choice = out["choices"][0]
        content = (choice.get("logprobs") or {}).get("content") or []
        return _reply(choice["text"], out["usage"], [c["logprob"] for c in content])

    def stream_chat(self, messages: list[dict[str, str]], max_tokens: int = 8) -> Reply:
        """``chat`` streamed (no logprobs), timed to the first token."""
        return self._stream("/v1/chat/completions", {"messages": messages, "max_tokens": max_tokens})

    def stream_complete(self, prompt: str, max_tokens: int = 8) -> Reply:
        """``complete`` streamed (no logprobs), timed to the first token."""
        return self._stream("/v1/completions", {"prompt": prompt, "max_tokens": max_tokens})

    def _stream(self, path: str, body: dict[str, Any]) -> Reply:
        request = urllib.request.Request(
            self.base_url + path, headers={"Content-Type": "application/json"},
            data=json.dumps({**body, "model": self.model, "temperature": 0.0, "stream": True,
                             "stream_options": {"include_usage": True}}).encode(),
        )
        started = time.perf_counter()
        first: float | None = None
        parts: list[str] = []
        usage: Mapping[str, Any] | None = None
        with urllib.request.urlopen(request, timeout=self.timeout) as response:
            for raw in response:  # server-sent events; ": keepalive" comments carry no data
                line = raw.decode().strip()
                if not line.startswith("data:") or line == "data: [DONE]":
                    continue
                chunk = json.loads(line[len("data:"):])
                usage = chunk.get("usage") or usage
                for choice in chunk.get("choices") or ():
                    text = (choice.get("delta") or {}).get("content") or choice.get("text") or ""
                    if text and first is None:
                        first = time.perf_counter()
                    parts.append(text)
        ended = time.perf_counter()
        if usage is None:
            raise RuntimeError(f"{path}: the stream ended without usage")
        reply = _reply("".join(parts), usage, [])
        return Reply(reply.text, reply.cached_tokens, reply.prompt_tokens, (), (first if first is not None else ended) - started)

    def status(self) -> dict[str, Any] | None:
        """The adapter's status, or None where the plugin is not attached."""
        try:
            return self.get(STATUS_PATH)
        except urllib.error.HTTPError:
            return None


def _reply(text: str, usage: Mapping[str, Any], logprobs: list[Any]) -> Reply:
    details = usage.get("prompt_tokens_details") or {}
    return Reply(text, int(details.get("cached_tokens") or 0), int(usage.get("prompt_tokens") or 0),
                 tuple(float(x) for x in logprobs if x is not None))


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def plugin_environment(adopter: bool, block_tokens: int, snapshot_bytes: int | None = None) -> dict[str, str]:
    """The environment of a server with the plugin attached (or not: ``adopter=False``
    leaves the start-up hook off)."""
    env = {k: v for k, v in os.environ.items() if not k.startswith("MLX_RECOVERY_")}
    if adopter:
        env.update(MLX_RECOVERY_ENABLE="1", MLX_RECOVERY_ADOPTER_ENABLED="1",
                   MLX_RECOVERY_MLXLM_BLOCK_TOKENS=str(block_tokens))
        if snapshot_bytes is not None:
            env["MLX_RECOVERY_MLXLM_SNAPSHOT_BYTES"] = str(snapshot_bytes)
    return env


@contextmanager
def serving(
    model_dir: str | Path, env: Mapping[str, str], *, python: str = sys.executable,
    start_timeout: float = 180.0, extra_args: tuple[str, ...] = (),
) -> Iterator[ServerClient]:
    """``python -m mlx_lm.server`` on a free port; the process is killed on exit."""
    port = free_port()
    with tempfile.TemporaryFile(mode="w+") as log:
        process = subprocess.Popen(
            [python, "-m", "mlx_lm.server", "--model", str(model_dir), "--host", "127.0.0.1",
             "--port", str(port), *extra_args],
            env=dict(env), stdout=log, stderr=subprocess.STDOUT, text=True,
        )
        client = ServerClient(f"http://127.0.0.1:{port}", str(model_dir))
        try:
            _wait_healthy(process, client, log, start_timeout)
            yield client
        finally:
            process.kill()
            process.wait(timeout=30)


def _wait_healthy(process: subprocess.Popen[str], client: ServerClient, log: Any, timeout: float) -> None:
    deadline = time.monotonic() + timeout
    while True:
        if process.poll() is not None:
            log.seek(0)
            raise RuntimeError(f"mlx_lm.server exited with {process.returncode}:\n{log.read()[-3000:]}")
        try:
            if client.get("/health").get("status") == "ok":
                return
        except (urllib.error.URLError, ConnectionError, OSError):
            pass
        if time.monotonic() > deadline:
            raise TimeoutError(f"mlx_lm.server did not answer /health within {timeout} s")
        time.sleep(0.2)
