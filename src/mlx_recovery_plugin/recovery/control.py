"""The out-of-process control channel: a unix socket only the process owner can use.

``mlx-recovery status`` reads the serving process's recovery status and ``mlx-recovery
budget PCT`` changes its budget in place (:mod:`mlx_recovery_plugin.control_cli`).
Nothing listens on a network port. Where the socket lives and how its directory is
guarded: :mod:`.control_paths`; on Linux the peer's uid is checked as well.

Protocol: the client sends one JSON object on one line and reads one JSON object line
back. ``{"op": "status"}`` -> ``{"ok": true, "status": {...}}``; ``{"op": "budget",
"pct": 12.5}`` -> ``{"ok": true, "budget": {...}}``; anything wrong -> ``{"ok": false,
"error": "..."}``. The server never lets a bad request or a failing callback end it.

Limits: at most ``MAX_HANDLERS`` connections are answered at once (more are told "busy"
at once), each request must arrive whole within ``REQUEST_DEADLINE_S`` however its bytes
trickle in, and a listener that cannot accept (out of descriptors) backs off instead of
spinning. Start-up and removal of the socket file are owned (see :mod:`.control_paths`):
of two servers on one path exactly one serves it, a server removes only its own socket,
and a forked child's ``stop`` leaves the parent's alone.

Threads: the server runs on its own daemon thread and answers each connection on a short
lived thread; ``status`` and ``set_budget`` are called there, so they must be thread-safe.
"""

from __future__ import annotations

import contextlib
import errno
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
    SocketId,
    check_owner_only_dir,
    claim_socket,
    clear_stale_socket,
    default_socket_path,
    directory_lock,
    fits,
    release_socket,
    resolve_socket_path,
    sweep_stale_sockets,
    temp_socket_path,
)

log = logging.getLogger(__name__)

MAX_REQUEST_BYTES = 64 * 1024
# A request must arrive whole within this, however its bytes trickle in: a per-read
# timeout let a client sending one byte every few seconds hold a handler for ever.
REQUEST_DEADLINE_S = 5.0
# Writing the answer: a client that does not read cannot hold a handler either.
WRITE_TIMEOUT_S = 2.0
MAX_HANDLERS = 16
# An accept that fails for want of descriptors or memory leaves the listener readable;
# retrying at once would spin the control thread against the engine's. Back off, doubling.
ACCEPT_BACKOFF_S = (0.05, 1.0)
_STARVED = frozenset({errno.EMFILE, errno.ENFILE, errno.ENOBUFS, errno.ENOMEM})
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


class _Handler(socketserver.BaseRequestHandler):
    server: _UnixServer

    def handle(self) -> None:
        sock: socket.socket = self.request
        try:
            peer = _peer_uid(sock)
            if peer is not None and peer not in (os.getuid(), 0):
                response = _error(f"uid {peer} may not use this channel")
            else:
                line = _read_line(sock, self.server.control.request_deadline_s)
                if isinstance(line, dict):
                    response = line
                elif not line.strip():
                    return  # a liveness probe, or a client that said nothing
                else:
                    response = self.server.control.answer_line(line)
            sock.settimeout(WRITE_TIMEOUT_S)
            sock.sendall(_encode(response))
        except OSError:
            pass  # the client went away or does not read; nothing to answer


def _read_line(sock: socket.socket, deadline_s: float) -> bytes | dict[str, Any]:
    """One request line, or the error answer when it is too long or not whole within
    ``deadline_s`` of the connection."""
    deadline = time.monotonic() + deadline_s
    data = bytearray()
    while b"\n" not in data:
        if len(data) > MAX_REQUEST_BYTES:
            return _error(f"request longer than {MAX_REQUEST_BYTES} bytes")
        remaining = deadline - time.monotonic()
        if remaining <= 0:
            return _error(f"request not complete within its {deadline_s:g} s deadline")
        sock.settimeout(remaining)
        try:
            chunk = sock.recv(4096)
        except TimeoutError:
            return _error(f"request not complete within its {deadline_s:g} s deadline")
        if not chunk:
            break
        data += chunk
    line = bytes(data).split(b"\n", 1)[0]
    if len(line) > MAX_REQUEST_BYTES:
        return _error(f"request longer than {MAX_REQUEST_BYTES} bytes")
    return line


class _UnixServer(socketserver.ThreadingMixIn, socketserver.UnixStreamServer):
    daemon_threads = True
    timeout = 0.5  # handle_request() never blocks the stop long, even if a client vanished
    request_queue_size = 64
    control: ControlServer
    # At most MAX_HANDLERS connections are answered at once; more are refused at once, so
    # slow or silent clients cannot pile up threads in the host's process.
    handlers: threading.BoundedSemaphore
    # The last accept failed for want of descriptors or memory (the serve thread's own).
    starved = False

    def get_request(self) -> tuple[socket.socket, Any]:
        try:
            conn = self.socket.accept()
        except OSError as exc:
            self.starved = exc.errno in _STARVED
            raise
        self.starved = False
        return conn

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
            self.starved = True  # no thread to answer on: back off like a failed accept
            raise

    def serve_one(self) -> None:
        """Accept and answer one connection (the listener is readable). Not
        ``handle_request()``: that makes a selector, a descriptor, per call, which fails
        at EMFILE before accept is even tried."""
        try:
            request, client_address = self.get_request()
        except OSError:
            return
        try:
            self.process_request(request, client_address)
        except Exception:  # noqa: BLE001 - as socketserver does: this connection only
            self.handle_error(request, client_address)
            self.shutdown_request(request)

    def handle_error(self, request: Any, client_address: Any) -> None:
        # socketserver prints a traceback to the host's stderr; one debug line instead.
        log.debug("mlx-recovery: control request failed", exc_info=True)

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


def _selectors(server: _UnixServer, wake_fd: int) -> tuple[selectors.BaseSelector, selectors.BaseSelector]:
    """The serve loop's two selectors (listener and stop pipe; the stop pipe alone),
    made by ``start`` so that the serve thread itself never needs a new descriptor."""
    selector, wake_only = selectors.DefaultSelector(), selectors.DefaultSelector()
    selector.register(server.socket, selectors.EVENT_READ)
    selector.register(wake_fd, selectors.EVENT_READ)
    wake_only.register(wake_fd, selectors.EVENT_READ)
    return selector, wake_only


def _serve(server: _UnixServer, wake_fd: int, selector: selectors.BaseSelector, wake_only: selectors.BaseSelector) -> None:
    """Accept connections until a byte arrives on ``wake_fd``: stopping is immediate,
    an idle server sleeps instead of polling, and one that cannot accept (out of
    descriptors) waits, doubling its wait, instead of spinning."""
    first, longest = ACCEPT_BACKOFF_S
    backoff = 0.0
    with selector, wake_only:
        while True:
            for key, _ in selector.select():
                if key.fileobj == wake_fd:
                    return
                try:
                    server.serve_one()
                except Exception as exc:  # noqa: BLE001 - the channel outlives a bad accept
                    server.starved = True
                    log.debug("mlx-recovery: control request failed: %r", exc)
            if not server.starved:
                backoff = 0.0
                continue
            backoff = min(max(backoff * 2, first), longest)
            if wake_only.select(backoff):
                return


class ControlServer:
    """Serves ``status`` and ``budget`` requests on a unix socket at ``path``."""

    def __init__(
        self,
        path: str,
        status: StatusFn,
        set_budget: SetBudgetFn,
        *,
        request_deadline_s: float = REQUEST_DEADLINE_S,
    ) -> None:
        self.path = path
        self.request_deadline_s = request_deadline_s
        self._status = status
        self._set_budget = set_budget
        self._lock = threading.Lock()  # owns _server, _thread, _wake, _owned, _pid
        self._server: _UnixServer | None = None
        self._thread: threading.Thread | None = None
        self._wake: tuple[int, int] | None = None  # (read end, write end) of the stop pipe
        self._owned: SocketId | None = None  # the socket file this server put at path
        self._pid = 0  # the process that started it: a fork's child owns nothing

    @property
    def running(self) -> bool:
        with self._lock:
            return self._server is not None

    def start(self) -> None:
        """Create the socket (0600, in a 0700 directory) and serve it on a daemon thread.
        Raises :class:`ControlError` when the path is unsafe or already served."""
        with self._lock:
            if self._server is not None and self._pid == os.getpid():
                return
            if not fits(self.path):
                raise ControlError(
                    f"socket path {self.path} is longer than {MAX_SOCKET_PATH} bytes; "
                    f"choose a shorter {env_name('control_socket')}"
                )
            directory = Path(self.path).parent
            check_owner_only_dir(directory)
            sweep_stale_sockets(directory)
            temp = temp_socket_path(self.path)
            bound = temp if fits(temp) else self.path
            server = _UnixServer(bound, _Handler, bind_and_activate=False)
            server.control = self
            server.handlers = threading.BoundedSemaphore(MAX_HANDLERS)
            try:
                if bound == self.path:  # no room for a private name: bind in place, locked
                    with directory_lock(directory):
                        clear_stale_socket(self.path)
                        self._bind_and_listen(server, bound)
                        st = os.lstat(bound)
                        owned = (st.st_dev, st.st_ino)
                else:
                    self._bind_and_listen(server, bound)
                    owned = claim_socket(bound, self.path)
            except (ControlError, OSError) as exc:
                server.server_close()
                if bound != self.path:
                    with contextlib.suppress(OSError):
                        os.unlink(bound)
                if isinstance(exc, ControlError):
                    raise
                raise ControlError(f"cannot serve control socket {self.path}: {exc}") from exc
            wake: tuple[int, int] | None = None
            try:
                wake = os.pipe()
                loop = _selectors(server, wake[0])
            except OSError as exc:
                for fd in wake or ():
                    os.close(fd)
                release_socket(self.path, owned)
                server.server_close()
                raise ControlError(f"cannot serve control socket {self.path}: {exc}") from exc
            thread = threading.Thread(
                target=_serve, args=(server, wake[0], *loop), name="mlx-recovery-control", daemon=True
            )
            self._server, self._thread, self._wake = server, thread, wake
            self._owned, self._pid = owned, os.getpid()
            thread.start()
        log.info("mlx-recovery: control socket at %s", self.path)

    @staticmethod
    def _bind_and_listen(server: _UnixServer, bound: str) -> None:
        server.server_bind()
        os.chmod(bound, 0o600)
        server.server_activate()

    def stop(self) -> None:
        """Stop serving and remove the socket file, if it is still this server's.
        Idempotent. In a forked child it only closes the child's copies: the socket,
        its file and the serving thread are the parent's."""
        with self._lock:
            server, thread, wake = self._server, self._thread, self._wake
            owned, forked = self._owned, self._pid != os.getpid()
            self._server, self._thread, self._wake, self._owned = None, None, None, None
            if server is None:
                return
            if wake is not None and not forked:
                os.write(wake[1], b"x")  # the pipe is shared with the parent after a fork
            if thread is not None and not forked:
                thread.join(timeout=5.0)
            # Removed while the listener still holds its inode, so no newer socket can
            # have been given the same inode number and be taken for ours.
            if owned is not None and not forked:
                release_socket(self.path, owned)
            server.server_close()
            if wake is not None:
                os.close(wake[0])
                os.close(wake[1])

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
            try:
                sock.sendall(data)
            except (BrokenPipeError, ConnectionResetError):
                pass  # a busy server answers and hangs up before reading: read its answer
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
    if not chunks:
        raise ControlError(f"{path} closed the connection without answering")
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
