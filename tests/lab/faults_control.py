"""The control channel under load, the last part of ``python tests/lab faults``.

One :class:`~..recovery.control.ControlServer` on a private socket, whose status answer
takes ``status_s`` (so handlers stay busy), is put through three loads, each ending by
itself:

* a burst: ``clients`` requests at once, each counted as answered, told "busy", or
  failed (a broken pipe, a timeout, an answer that is no answer): failed must be 0;
* slow clients: ``MAX_HANDLERS`` clients trickle a byte every 0.1 s and never end their
  line, while another client asks again and again: it must be answered within the
  request deadline plus a margin, while the slow ones still trickle;
* no descriptors: the listener's accept fails with EMFILE for ``starve_s`` while a
  client waits; the attempts are counted (a spinning thread makes ~100,000 a second)
  and the waiting client must be answered once accept works again.

Threads: the bench's own; the server's thread and its handlers; one per client.
"""

from __future__ import annotations

import errno
import shutil
import socket
import tempfile
import threading
import time
from contextlib import contextmanager
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any
from unittest import mock

from mlx_recovery_plugin.recovery.control import MAX_HANDLERS, ControlError, ControlServer, request

MAX_STARVED_ATTEMPTS_PER_S = 20


@dataclass(slots=True)
class ControlLoadResult:
    clients: int = 0
    answered: int = 0
    busy: int = 0
    failed: list[str] = field(default_factory=list)
    slowest_s: float = 0.0
    deadline_s: float = 0.0
    slow_clients: int = 0
    answered_past_slow_s: float | None = None  # since the slow clients filled the channel
    slow_cut_off: int = 0
    starve_s: float = 0.0
    starved_attempts: int = 0
    answered_after_starving: bool = False

    @property
    def ok(self) -> bool:
        return (
            not self.failed
            and self.answered_past_slow_s is not None
            and self.answered_after_starving
            and self.starved_attempts <= MAX_STARVED_ATTEMPTS_PER_S * max(self.starve_s, 1.0)
        )


@contextmanager
def _server(status_s: float, deadline_s: float) -> Any:
    base = Path(tempfile.mkdtemp(prefix="mlxrf-", dir="/tmp"))
    path = str(base / "ctl" / "bench.sock")

    def status() -> dict[str, Any]:
        time.sleep(status_s)
        return {"bench": True}

    server = ControlServer(path, status, dict, request_deadline_s=deadline_s)
    server.start()
    try:
        yield server
    finally:
        server.stop()
        shutil.rmtree(base, ignore_errors=True)


def _burst(path: str, clients: int, result: ControlLoadResult) -> None:
    lock = threading.Lock()
    start = threading.Barrier(clients, timeout=60)

    def client() -> None:
        try:
            start.wait()
        except threading.BrokenBarrierError:
            pass
        began = time.perf_counter()
        try:
            reply = request(path, {"op": "status"}, timeout=30)
            outcome = "ok" if reply.get("ok") else ("busy" if str(reply.get("error", "")).startswith("busy") else str(reply))
        except ControlError as exc:
            outcome = str(exc)
        took = time.perf_counter() - began
        with lock:
            result.slowest_s = max(result.slowest_s, took)
            if outcome == "ok":
                result.answered += 1
            elif outcome == "busy":
                result.busy += 1
            else:
                result.failed.append(outcome)

    threads = [threading.Thread(target=client, daemon=True) for _ in range(clients)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(120)
    result.clients = clients


def _slow(path: str, deadline_s: float, result: ControlLoadResult) -> None:
    stop = threading.Event()
    connected = threading.Barrier(MAX_HANDLERS + 1, timeout=60)
    cut: list[bool] = []

    def trickle() -> None:
        with socket.socket(socket.AF_UNIX, socket.SOCK_STREAM) as sock:
            sock.settimeout(10)
            try:
                sock.connect(path)
                connected.wait()
                while not stop.is_set():
                    sock.sendall(b" ")
                    stop.wait(0.1)
            except (OSError, threading.BrokenBarrierError):
                cut.append(True)

    threads = [threading.Thread(target=trickle, daemon=True) for _ in range(MAX_HANDLERS)]
    for t in threads:
        t.start()
    try:
        connected.wait()
        filled = time.perf_counter()
        give_up = filled + deadline_s * 3 + 2.0  # the slow clients trickle on all along
        while time.perf_counter() < give_up:
            try:
                if request(path, {"op": "status"}, timeout=10).get("ok"):
                    result.answered_past_slow_s = time.perf_counter() - filled
                    break
            except ControlError as exc:
                result.failed.append(f"beside slow clients: {exc}")
                break
            time.sleep(0.02)
    finally:
        time.sleep(0.3)  # the cut-off clients notice at their next byte
        stop.set()
        for t in threads:
            t.join(10)
    result.slow_clients = MAX_HANDLERS
    result.slow_cut_off = len(cut)
    result.deadline_s = deadline_s


def _starved(server: ControlServer, starve_s: float, result: ControlLoadResult) -> None:
    # The bench injects the fault into its own server's listener.
    listener = server._server.socket if server._server is not None else None
    if listener is None:
        return
    fileno = listener.fileno()
    real_accept = socket.socket.accept
    starving = threading.Event()
    starving.set()
    attempts = 0

    def accept(self: socket.socket) -> Any:
        nonlocal attempts
        if starving.is_set() and self.fileno() == fileno:
            attempts += 1
            raise OSError(errno.EMFILE, "Too many open files (injected)")
        return real_accept(self)

    with mock.patch.object(socket.socket, "accept", accept):
        waiting = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        try:
            waiting.settimeout(30)
            waiting.connect(server.path)
            waiting.sendall(b'{"op": "status"}\n')
            time.sleep(starve_s)
            result.starved_attempts = attempts
            starving.clear()
            result.answered_after_starving = b'"ok": true' in waiting.makefile("rb").readline()
        except OSError as exc:
            result.failed.append(f"after starving: {exc}")
        finally:
            waiting.close()
    result.starve_s = starve_s


def run_control_load(
    clients: int = 300, *, status_s: float = 0.02, deadline_s: float = 1.5, starve_s: float = 1.0
) -> ControlLoadResult:
    """The three loads, one server each, in turn."""
    result = ControlLoadResult()
    with _server(status_s, deadline_s) as server:
        _burst(server.path, clients, result)
    with _server(status_s, deadline_s) as server:
        _slow(server.path, deadline_s, result)
    with _server(status_s, deadline_s) as server:
        _starved(server, starve_s, result)
    return result


def format_control_load(r: ControlLoadResult) -> str:
    past = "never" if r.answered_past_slow_s is None else f"{r.answered_past_slow_s:.2f} s after they filled it"
    lines = [
        "control channel under load:",
        f"  {r.clients} clients at once: {r.answered} answered, {r.busy} told busy, {len(r.failed)} failed; "
        f"slowest {r.slowest_s:.2f} s",
        f"  {r.slow_clients} slow clients (a byte every 0.1 s, never a whole line): another client answered "
        f"{past} (request deadline {r.deadline_s:g} s); {r.slow_cut_off} cut off",
        f"  accept out of descriptors for {r.starve_s:g} s: {r.starved_attempts} attempts; waiting client "
        + ("answered after" if r.answered_after_starving else "NOT answered"),
    ]
    lines.extend(f"  failed: {f}" for f in r.failed[:10])
    return "\n".join(lines)
