"""The out-of-process control channel: a unix socket only the process owner can use.

``mlx-recovery status`` reads the serving process's recovery status and ``mlx-recovery
budget PCT`` changes its budget in place (:mod:`mlx_recovery_plugin.control_cli`).
Nothing listens on a network port. Where the socket lives and how its directory is
guarded: :mod:`.control_paths`; on Linux the peer's uid is checked as well.

Protocol: the client sends one JSON object on one line and reads one JSON object line
back. ``{"op": "status"}`` -> ``{"ok": true, "status": {...}}``; ``{"op": "budget",
"pct": 12.5}`` -> ``{"ok": true, "budget": {...}}``; anything wrong -> ``{"ok": false,
"error": "..."}``. The server never lets a bad request or a failing callback end it.

Threads: the server runs on its own daemon thread and answers each connection on a short
lived thread; ``status`` and ``set_budget`` are called there, so they must be thread-safe.
"""

from __future__ import annotations

import json
import logging
import math
import os
import selectors
import socket
import socketserver
import struct
import threading
import time
from collections.abc import Callable
from enum import Enum
from pathlib import Path
from typing import Any

from ..settings import env_name
from .budget import validate_pct
from .control_paths import (
    CONTROL_SOCKET_OFF,
    MAX_SOCKET_PATH,
    ControlError,
    check_owner_only_dir,
    clear_stale_socket,
    default_socket_path,
    resolve_socket_path,
)

log = logging.getLogger(__name__)

MAX_REQUEST_BYTES = 64 * 1024
CONNECTION_TIMEOUT_S = 5.0
MAX_HANDLERS = 16
OPS = ("status", "budget")

StatusFn = Callable[[], dict[str, Any]]
SetBudgetFn = Callable[[float], dict[str, Any]]


# -- server ------------------------------------------------------------------------------


def _peer_uid(sock: socket.socket) -> int | None:
    opt = getattr(socket, "SO_PEERCRED", None)
    if opt is None:
        return None
    try:
        raw = sock.getsockopt(socket.SOL_SOCKET, opt, struct.calcsize("3i"))
        _pid, uid, _gid = struct.unpack("3i", raw)
    except OSError:
        return None
    return int(uid)


class _Handler(socketserver.StreamRequestHandler):
    timeout = CONNECTION_TIMEOUT_S
    server: _UnixServer

    def handle(self) -> None:
        try:
            peer = _peer_uid(self.connection)
            if peer is not None and peer not in (os.getuid(), 0):
                response = _error(f"uid {peer} may not use this channel")
            else:
                line = self.rfile.readline(MAX_REQUEST_BYTES + 1)
                if not line.strip():
                    return  # a liveness probe, or a client that said nothing
                if len(line) > MAX_REQUEST_BYTES:
                    response = _error(f"request longer than {MAX_REQUEST_BYTES} bytes")
                else:
                    response = self.server.control.answer_line(line)
            self.wfile.write(_encode(response))
        except OSError:
            pass  # the client went away or stalled; nothing to answer


class _UnixServer(socketserver.ThreadingMixIn, socketserver.UnixStreamServer):
    daemon_threads = True
    timeout = 0.5  # handle_request() never blocks the stop long, even if a client vanished
    request_queue_size = 64
    control: ControlServer
    # At most MAX_HANDLERS connections are answered at once; more are refused at once, so
    # slow or silent clients cannot pile up threads in the host's process.
    handlers: threading.BoundedSemaphore

    def process_request(self, request: Any, client_address: Any) -> None:
        if not self.handlers.acquire(blocking=False):
            try:
                request.sendall(_encode(_error(f"busy: {MAX_HANDLERS} requests in progress")))
            except OSError:
                pass
            self.shutdown_request(request)
            return
        try:
            super().process_request(request, client_address)
        except BaseException:
            self.handlers.release()
            raise

    def process_request_thread(self, request: Any, client_address: Any) -> None:
        try:
            super().process_request_thread(request, client_address)
        finally:
            self.handlers.release()


def _error(message: str) -> dict[str, Any]:
    return {"ok": False, "error": message}


def _plain(value: Any) -> Any:
    """``value`` with strict-JSON types only: non-finite floats become strings ("inf"),
    enums their values, tuples and sets lists, anything else unknown its ``str``."""
    if isinstance(value, dict):
        return {str(k): _plain(v) for k, v in value.items()}
    if isinstance(value, (list, tuple, set, frozenset)):
        return [_plain(v) for v in value]
    if isinstance(value, Enum):
        return _plain(value.value)
    if isinstance(value, float) and not math.isfinite(value):
        return str(value)
    if value is None or isinstance(value, (bool, int, float, str)):
        return value
    return str(value)


def _encode(response: dict[str, Any]) -> bytes:
    return json.dumps(_plain(response)).encode() + b"\n"


def _serve(server: _UnixServer, wake_fd: int) -> None:
    """Accept connections until a byte arrives on ``wake_fd``: stopping is immediate,
    and an idle server sleeps instead of polling."""
    with selectors.DefaultSelector() as selector:
        selector.register(server.socket, selectors.EVENT_READ)
        selector.register(wake_fd, selectors.EVENT_READ)
        while True:
            for key, _ in selector.select():
                if key.fileobj == wake_fd:
                    return
                server.handle_request()


class ControlServer:
    """Serves ``status`` and ``budget`` requests on a unix socket at ``path``."""

    def __init__(self, path: str, status: StatusFn, set_budget: SetBudgetFn) -> None:
        self.path = path
        self._status = status
        self._set_budget = set_budget
        self._lock = threading.Lock()  # owns _server, _thread, _wake, _inode
        self._server: _UnixServer | None = None
        self._thread: threading.Thread | None = None
        self._wake: tuple[int, int] | None = None  # (read end, write end) of the stop pipe
        self._inode: int | None = None

    @property
    def running(self) -> bool:
        with self._lock:
            return self._server is not None

    def start(self) -> None:
        """Create the socket (0600, in a 0700 directory) and serve it on a daemon thread.
        Raises :class:`ControlError` when the path is unsafe or already served."""
        with self._lock:
            if self._server is not None:
                return
            if len(os.fsencode(self.path)) > MAX_SOCKET_PATH:
                raise ControlError(
                    f"socket path {self.path} is longer than {MAX_SOCKET_PATH} bytes; "
                    f"choose a shorter {env_name('control_socket')}"
                )
            check_owner_only_dir(Path(self.path).parent)
            clear_stale_socket(self.path)
            server = _UnixServer(self.path, _Handler, bind_and_activate=False)
            server.control = self
            server.handlers = threading.BoundedSemaphore(MAX_HANDLERS)
            try:
                server.server_bind()
                os.chmod(self.path, 0o600)
                self._inode = os.lstat(self.path).st_ino
                server.server_activate()
            except OSError as exc:
                server.server_close()
                self._unlink_own_locked()
                raise ControlError(f"cannot serve control socket {self.path}: {exc}") from exc
            wake = os.pipe()
            thread = threading.Thread(
                target=_serve, args=(server, wake[0]), name="mlx-recovery-control", daemon=True
            )
            self._server, self._thread, self._wake = server, thread, wake
            thread.start()
        log.info("mlx-recovery: control socket at %s", self.path)

    def stop(self) -> None:
        """Stop serving and remove the socket file. Idempotent."""
        with self._lock:
            server, thread, wake = self._server, self._thread, self._wake
            self._server, self._thread, self._wake = None, None, None
            if server is None:
                return
            if wake is not None:
                os.write(wake[1], b"x")
            if thread is not None:
                thread.join(timeout=5.0)
            server.server_close()
            if wake is not None:
                os.close(wake[0])
                os.close(wake[1])
            self._unlink_own_locked()

    def __enter__(self) -> ControlServer:
        self.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self.stop()

    def answer_line(self, line: bytes) -> dict[str, Any]:
        try:
            request = json.loads(line)
        except (ValueError, UnicodeDecodeError, RecursionError) as exc:
            return _error(f"request is not JSON this channel reads: {type(exc).__name__}: {exc}")
        return self.answer(request)

    def answer(self, request: Any) -> dict[str, Any]:
        """The response to one decoded request. Never raises."""
        if not isinstance(request, dict):
            return _error('request must be a JSON object such as {"op": "status"}')
        op = request.get("op")
        if op == "status":
            try:
                return {"ok": True, "status": self._status()}
            except Exception as exc:  # noqa: BLE001 - the channel outlives a failing status
                return _error(f"status failed: {type(exc).__name__}: {exc}")
        if op == "budget":
            try:
                pct = validate_pct(request.get("pct"))  # type: ignore[arg-type]
                return {"ok": True, "budget": self._set_budget(pct)}
            except ValueError as exc:
                return _error(str(exc))
            except Exception as exc:  # noqa: BLE001
                return _error(f"budget change failed: {type(exc).__name__}: {exc}")
        return _error(f"unknown op {op!r}; valid ops: {', '.join(OPS)}")

    def _unlink_own_locked(self) -> None:
        # Remove the file only if it is still the socket this server bound.
        try:
            if self._inode is not None and os.lstat(self.path).st_ino == self._inode:
                os.unlink(self.path)
        except OSError:
            pass
        self._inode = None


# -- client ------------------------------------------------------------------------------


def _connect(sock: socket.socket, path: str, timeout: float) -> None:
    # A full listen backlog makes a unix-socket connect fail at once with EAGAIN (Linux)
    # instead of waiting; wait for room, within the timeout.
    deadline = time.monotonic() + timeout
    while True:
        try:
            sock.connect(path)
            return
        except BlockingIOError:
            if time.monotonic() >= deadline:
                raise TimeoutError from None
            time.sleep(0.01)


def request(path: str, payload: dict[str, Any], timeout: float = 5.0) -> dict[str, Any]:
    """Send one request to the server at ``path`` and return its decoded response.
    Raises :class:`ControlError` when the server cannot be reached or answers garbage."""
    data = json.dumps(payload).encode() + b"\n"
    with socket.socket(socket.AF_UNIX, socket.SOCK_STREAM) as sock:
        sock.settimeout(timeout)
        try:
            _connect(sock, path, timeout)
            sock.sendall(data)
            chunks = []
            while True:
                chunk = sock.recv(65536)
                if not chunk:
                    break
                chunks.append(chunk)
                if chunk.endswith(b"\n"):
                    break
        except FileNotFoundError:
            raise ControlError(f"no control socket at {path}") from None
        except ConnectionRefusedError:
            raise ControlError(f"nothing is serving {path} (a stale socket?)") from None
        except PermissionError:
            raise ControlError(f"not allowed to use {path} (it belongs to another user?)") from None
        except TimeoutError:
            raise ControlError(f"{path} did not answer within {timeout:g} s") from None
        except OSError as exc:
            raise ControlError(f"cannot talk to {path}: {exc}") from None
    try:
        response = json.loads(b"".join(chunks))
    except ValueError:
        raise ControlError(f"{path} answered something that is not JSON") from None
    if not isinstance(response, dict):
        raise ControlError(f"{path} answered something that is not a JSON object")
    return response


__all__ = [
    "CONTROL_SOCKET_OFF",
    "ControlError",
    "ControlServer",
    "SetBudgetFn",
    "StatusFn",
    "default_socket_path",
    "request",
    "resolve_socket_path",
]
