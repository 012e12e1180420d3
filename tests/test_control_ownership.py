"""Control sockets are owned: two servers on one path, a fork's child, a relative or too
long runtime directory and sockets left by ``kill -9`` (issue 22, 4 and 12)."""

from __future__ import annotations

import os
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import textwrap
import threading
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from mlx_recovery_plugin.recovery import control, control_paths
from mlx_recovery_plugin.recovery.control import ControlError, ControlServer, request


@pytest.fixture
def base() -> Iterator[Path]:
    path = Path(tempfile.mkdtemp(prefix="mlxro-", dir="/tmp"))
    try:
        yield path
    finally:
        shutil.rmtree(path, ignore_errors=True)


def serving(name: str) -> Any:
    return lambda: {"server": name}


def test_of_two_servers_starting_on_one_path_exactly_one_serves_it(
    base: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    path = str(base / "ctl" / "s.sock")
    between_bind_and_listen, go_on = threading.Event(), threading.Event()
    activate = control._UnixServer.server_activate

    def slow_activate(self: Any) -> None:
        if threading.current_thread().name == "first":
            between_bind_and_listen.set()
            go_on.wait(10)
        activate(self)

    monkeypatch.setattr(control._UnixServer, "server_activate", slow_activate)
    first, second = ControlServer(path, serving("first"), dict), ControlServer(path, serving("second"), dict)
    errors: dict[str, BaseException] = {}

    def start_first() -> None:
        try:
            first.start()
        except ControlError as exc:
            errors["first"] = exc

    thread = threading.Thread(target=start_first, name="first")
    thread.start()
    try:
        assert between_bind_and_listen.wait(10)
        try:
            second.start()
        except ControlError as exc:
            errors["second"] = exc
        go_on.set()
        thread.join(10)
        assert len(errors) == 1, f"both started: {first.running}, {second.running}"
        (loser,) = errors
        assert "already served" in str(errors[loser])
        winner = "second" if loser == "first" else "first"
        assert request(path, {"op": "status"})["status"] == {"server": winner}
        (first if loser == "first" else second).stop()  # the loser's stop takes nothing
        assert request(path, {"op": "status"})["status"] == {"server": winner}
    finally:
        go_on.set()
        first.stop()
        second.stop()
    assert not os.path.exists(path)


def test_a_servers_stop_never_removes_a_socket_another_server_put_at_its_path(base: Path) -> None:
    path = str(base / "ctl" / "s.sock")
    first = ControlServer(path, serving("first"), dict)
    first.start()
    os.unlink(path)  # someone removed it; a second server takes the path
    with ControlServer(path, serving("second"), dict):
        first.stop()
        assert request(path, {"op": "status"})["status"] == {"server": "second"}


def test_a_forked_childs_stop_leaves_the_parents_socket_served(base: Path) -> None:
    path = str(base / "ctl" / "s.sock")
    with ControlServer(path, serving("parent"), dict) as server:
        pid = os.fork()
        if pid == 0:  # the child: a host's worker process that cleans up on exit
            try:
                server.stop()
            finally:
                os._exit(0)
        _, status = os.waitpid(pid, 0)
        assert os.WIFEXITED(status)
        assert request(path, {"op": "status"})["status"] == {"server": "parent"}
    assert not os.path.exists(path)


def test_a_socket_with_a_full_backlog_is_live_not_stale(base: Path) -> None:
    directory = base / "ctl"
    directory.mkdir(mode=0o700)
    path = str(directory / "busy.sock")
    listener = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    listener.bind(path)
    listener.listen(0)
    clients = []
    try:
        for _ in range(8):  # fill the backlog: a connect now fails with EAGAIN
            c = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
            c.setblocking(False)
            try:
                c.connect(path)
            except BlockingIOError:
                c.close()
                break
            clients.append(c)
        with pytest.raises(ControlError, match="already served"):
            ControlServer(path, dict, dict).start()
        assert os.path.exists(path)
    finally:
        for c in clients:
            c.close()
        listener.close()


# -- the socket directory (point 12) -----------------------------------------------------


def test_a_relative_runtime_dir_is_ignored(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    monkeypatch.chdir(tmp_path)
    (tmp_path / "run").mkdir()
    monkeypatch.setenv("XDG_RUNTIME_DIR", "run")
    path = control_paths.default_socket_path(123)
    assert os.path.isabs(path)
    assert path == f"/tmp/mlx-recovery-{os.getuid()}/123.sock"
    assert all(os.path.isabs(d) for d in control_paths.socket_dirs())


def test_a_runtime_dir_too_long_for_a_socket_falls_back_to_the_short_one(
    monkeypatch: pytest.MonkeyPatch, base: Path
) -> None:
    runtime = base / ("r" * 110)
    runtime.mkdir(mode=0o700)
    monkeypatch.setenv("XDG_RUNTIME_DIR", str(runtime))
    path = control_paths.default_socket_path(123)
    assert path == f"/tmp/mlx-recovery-{os.getuid()}/123.sock"


def test_a_configured_path_too_long_for_a_socket_falls_back_to_a_short_one_and_serves(
    monkeypatch: pytest.MonkeyPatch, base: Path
) -> None:
    long_dir = base / ("d" * 110)
    monkeypatch.setattr(control_paths, "socket_dirs", lambda: [str(base / "short")])
    configured = str(long_dir / "s.sock")
    path = control_paths.resolve_socket_path(configured, pid=77)
    assert path == str(base / "short" / "77.sock")
    with ControlServer(path, serving("fallback"), dict):
        assert control_paths.find_sockets() == [path]


def test_sockets_left_by_kill_9_are_cleaned_and_a_live_one_is_kept(base: Path) -> None:
    directory = base / "ctl"
    code = textwrap.dedent(
        """
        import sys, time
        from mlx_recovery_plugin.recovery.control import ControlServer
        ControlServer(sys.argv[1], dict, dict).start()
        print("up", flush=True)
        time.sleep(60)
        """
    )
    env = {**os.environ, "PYTHONPATH": str(Path(control.__file__).parents[2])}

    def server_process(name: str) -> subprocess.Popen[str]:
        proc = subprocess.Popen(
            [sys.executable, "-c", code, str(directory / name)], stdout=subprocess.PIPE, text=True, env=env
        )
        assert proc.stdout is not None and proc.stdout.readline().strip() == "up"
        return proc

    killed, alive = server_process("111111.sock"), server_process("222222.sock")
    try:
        killed.send_signal(signal.SIGKILL)
        killed.wait(10)
        assert (directory / "111111.sock").exists()  # kill -9 runs no clean-up
        with ControlServer(str(directory / "333333.sock"), dict, dict):
            assert not (directory / "111111.sock").exists()
            assert (directory / "222222.sock").exists()
            assert request(str(directory / "222222.sock"), {"op": "status"})["ok"]
    finally:
        alive.kill()
        alive.wait(10)
        killed.kill()


def test_the_cli_finds_the_fallback_of_a_configured_path_too_long_for_a_socket(
    monkeypatch: pytest.MonkeyPatch, base: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    import argparse

    from mlx_recovery_plugin import control_cli

    monkeypatch.setattr(control_paths, "socket_dirs", lambda: [str(base / "short")])
    configured = str(base / ("d" * 110) / "s.sock")
    monkeypatch.setenv("MLX_RECOVERY_CONTROL_SOCKET", configured)
    with ControlServer(control_paths.resolve_socket_path(configured), serving("fallback"), dict):
        args = argparse.Namespace(socket=None, json=True)
        assert control_cli.status_command(args) == 0
    assert '"server": "fallback"' in capsys.readouterr().out
