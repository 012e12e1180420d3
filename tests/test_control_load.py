"""The control channel under hostile load: a listener that cannot accept, slow clients,
and hundreds at once (issue 22, 5 and 6). Every test here ends by itself."""

from __future__ import annotations

import errno
import shutil
import socket
import tempfile
import threading
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from mlx_recovery_plugin.recovery import control
from mlx_recovery_plugin.recovery.control import ControlError, ControlServer, request


@pytest.fixture
def path() -> Iterator[str]:
    base = Path(tempfile.mkdtemp(prefix="mlxrl-", dir="/tmp"))
    try:
        yield str(base / "ctl" / "s.sock")
    finally:
        shutil.rmtree(base, ignore_errors=True)


def test_a_listener_out_of_file_descriptors_backs_off_instead_of_spinning(
    path: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    attempts = 0
    failing = threading.Event()
    failing.set()
    accept = socket.socket.accept

    def accept_or_emfile(self: socket.socket) -> Any:
        nonlocal attempts
        if failing.is_set() and self.family == socket.AF_UNIX:
            attempts += 1
            raise OSError(errno.EMFILE, "Too many open files")
        return accept(self)

    monkeypatch.setattr(socket.socket, "accept", accept_or_emfile)
    with ControlServer(path, lambda: {"up": True}, dict):
        waiting = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        waiting.connect(path)  # stays in the backlog: the listener stays readable
        waiting.sendall(b'{"op": "status"}\n')
        time.sleep(1.0)
        spun = attempts
        failing.clear()  # descriptors are free again: the waiting client is answered
        waiting.settimeout(10)
        assert b'"up": true' in waiting.makefile("rb").readline()
        waiting.close()
    # Treating a readable listener as accepted retried ~100,000 times a second.
    assert 1 <= spun <= 20


def trickle(path: str, stop: threading.Event, cut_off: list[bool], connected: threading.Barrier) -> None:
    """A client that sends one byte every 0.1 s and never ends its line."""
    with socket.socket(socket.AF_UNIX, socket.SOCK_STREAM) as sock:
        sock.settimeout(10)
        try:
            sock.connect(path)
            connected.wait()
            while not stop.is_set():
                sock.sendall(b" ")
                stop.wait(0.1)
        except OSError:
            cut_off.append(True)  # the server hung up on it


def test_slow_clients_are_cut_off_at_the_request_deadline_and_others_are_answered(path: str) -> None:
    stop = threading.Event()
    cut_off: list[bool] = []
    connected = threading.Barrier(control.MAX_HANDLERS + 1, timeout=30)
    with ControlServer(path, lambda: {"up": True}, dict, request_deadline_s=1.5):
        slow = [
            threading.Thread(target=trickle, args=(path, stop, cut_off, connected))
            for _ in range(control.MAX_HANDLERS)
        ]
        for t in slow:
            t.start()
        connected.wait()
        try:
            answer: dict[str, Any] = {}
            give_up = time.monotonic() + 5.0
            while time.monotonic() < give_up:  # first, every handler is held by a slow client
                answer = request(path, {"op": "status"})
                if not answer["ok"] and answer["error"].startswith("busy"):
                    break
                time.sleep(0.01)
            assert answer["ok"] is False, "the slow clients never filled the channel"
            give_up = time.monotonic() + 5.0  # the slow clients trickle on all along
            while time.monotonic() < give_up:
                answer = request(path, {"op": "status"})
                if answer["ok"]:
                    break
                time.sleep(0.05)
            assert answer == {"ok": True, "status": {"up": True}}
            while not cut_off and time.monotonic() < give_up:
                time.sleep(0.05)
        finally:
            stop.set()
            for t in slow:
                t.join(10)
    assert cut_off, "no slow client was hung up on"


def test_a_slow_client_is_told_it_missed_the_deadline(path: str) -> None:
    with ControlServer(path, dict, dict, request_deadline_s=0.3), socket.socket(socket.AF_UNIX) as sock:
        sock.settimeout(10)
        sock.connect(path)
        sock.sendall(b'{"op": ')
        reply = sock.makefile("rb").readline()
    assert b"deadline" in reply and b'"ok": false' in reply


def test_three_hundred_concurrent_clients_are_answered_or_told_busy_never_a_broken_pipe(
    path: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    connect = control._connect

    def connect_then_stall(sock: socket.socket, where: str, timeout: float) -> None:
        connect(sock, where, timeout)
        time.sleep(0.05)  # a client descheduled between connect and send (a loaded machine)

    monkeypatch.setattr(control, "_connect", connect_then_stall)

    def slow_status() -> dict[str, Any]:
        time.sleep(0.02)  # handlers stay occupied, so most clients find the channel busy
        return {"up": True}

    outcomes: list[str] = []
    lock = threading.Lock()
    start = threading.Barrier(300, timeout=30)

    def client() -> None:
        start.wait()
        try:
            reply = request(path, {"op": "status"}, timeout=20)
            outcome = "ok" if reply["ok"] else ("busy" if reply["error"].startswith("busy") else reply["error"])
        except ControlError as exc:
            outcome = f"failed: {exc}"
        with lock:
            outcomes.append(outcome)

    with ControlServer(path, slow_status, dict):
        threads = [threading.Thread(target=client) for _ in range(300)]
        for t in threads:
            t.start()
        for t in threads:
            t.join(60)
    assert len(outcomes) == 300
    assert [o for o in outcomes if o not in ("ok", "busy")] == []
    assert "ok" in outcomes


def test_a_process_really_out_of_descriptors_backs_off_and_answers_once_they_are_free(path: str) -> None:
    """A real EMFILE (a lowered RLIMIT_NOFILE in a child process), not a patched accept:
    the serve loop's turns are counted while the listener stays readable."""
    import json
    import os
    import subprocess
    import sys
    import textwrap

    code = textwrap.dedent(
        """
        import json, os, resource, selectors, sys, time
        from mlx_recovery_plugin.recovery.control import ControlServer
        turns = 0
        select = selectors.DefaultSelector.select
        def counting(self, timeout=None):
            global turns
            turns += 1
            return select(self, timeout)
        selectors.DefaultSelector.select = counting
        server = ControlServer(sys.argv[1], lambda: {"up": True}, dict)
        server.start()
        resource.setrlimit(resource.RLIMIT_NOFILE, (256, resource.getrlimit(resource.RLIMIT_NOFILE)[1]))
        held = []
        try:
            while True:
                held.append(os.open("/dev/null", os.O_RDONLY))
        except OSError:
            pass
        print("full", flush=True)
        sys.stdin.readline()  # the test has connected a client
        before = turns
        time.sleep(1.0)
        during = turns - before
        for fd in held:
            os.close(fd)
        print(json.dumps({"turns": during}), flush=True)
        sys.stdin.readline()
        server.stop()
        """
    )
    env = {**os.environ, "PYTHONPATH": str(Path(control.__file__).parents[2])}
    proc = subprocess.Popen(
        [sys.executable, "-c", code, path], stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=subprocess.PIPE,
        text=True, env=env,
    )
    assert proc.stdin is not None and proc.stdout is not None
    try:
        assert proc.stdout.readline().strip() == "full"
        with socket.socket(socket.AF_UNIX, socket.SOCK_STREAM) as client:
            client.settimeout(20)
            client.connect(path)
            client.sendall(b'{"op": "status"}\n')
            proc.stdin.write("go\n")
            proc.stdin.flush()
            turns = json.loads(proc.stdout.readline())["turns"]
            answer = client.makefile("rb").readline()
        proc.stdin.write("stop\n")
        proc.stdin.flush()
        proc.wait(20)
    finally:
        proc.kill()
        err = proc.stderr.read() if proc.stderr is not None else ""
        assert "Traceback" not in err, err
    assert b'"up": true' in answer
    # A loop that treats a readable listener as accepted turns ~100,000 times a second.
    assert turns <= 20
