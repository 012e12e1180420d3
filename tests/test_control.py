"""The control channel: status and budget over an owner-only unix socket, never a port."""

from __future__ import annotations

import argparse
import json
import os
import shutil
import socket
import stat
import subprocess
import tempfile
import threading
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest

from mlx_recovery_plugin import control_cli
from mlx_recovery_plugin.recovery import control, control_paths
from mlx_recovery_plugin.recovery.budget import Budget
from mlx_recovery_plugin.recovery.control import ControlError, ControlServer, default_socket_path, request
from mlx_recovery_plugin.recovery.control_paths import find_sockets
from mlx_recovery_plugin.recovery.registry import ArrivalRegistry
from mlx_recovery_plugin.testing.clock import FakeClock

NOBODY = 65534



def budget_setter(budget: Budget) -> Callable[[float], dict[str, Any]]:
    """A ``set_budget`` callback that changes ``budget`` in place and answers with its snapshot."""

    def set_budget(pct: float) -> dict[str, Any]:
        budget.set_pct(pct)
        return budget.snapshot()

    return set_budget


@pytest.fixture
def base() -> Iterator[Path]:
    """A short, world-traversable directory under /tmp (sun_path is short), so that only
    the server's own 0700 directory keeps other users out."""
    path = Path(tempfile.mkdtemp(prefix="mlxrc-", dir="/tmp"))
    path.chmod(0o755)
    try:
        yield path
    finally:
        shutil.rmtree(path, ignore_errors=True)


@pytest.fixture
def budget() -> Budget:
    return Budget(10.0, 10.0, clock=FakeClock())


@pytest.fixture
def registry() -> ArrivalRegistry:
    return ArrivalRegistry()


@pytest.fixture
def server(base: Path, budget: Budget, registry: ArrivalRegistry) -> Iterator[ControlServer]:
    def status() -> dict:
        return {"budget": budget.snapshot(), "registry": registry.snapshot()}

    srv = ControlServer(str(base / "ctl" / "s.sock"), status, budget_setter(budget))
    srv.start()
    try:
        yield srv
    finally:
        srv.stop()


def raw_exchange(path: str, data: bytes) -> dict:
    with socket.socket(socket.AF_UNIX, socket.SOCK_STREAM) as sock:
        sock.settimeout(5.0)
        sock.connect(path)
        try:
            sock.sendall(data)
        except BrokenPipeError:
            pass  # a busy server answers and hangs up before reading, as control.request knows
        reply = b""
        while not reply.endswith(b"\n"):
            chunk = sock.recv(65536)
            if not chunk:
                break
            reply += chunk
    return json.loads(reply)


def test_socket_is_owner_only_inside_an_owner_only_directory(server: ControlServer) -> None:
    sock_stat = os.lstat(server.path)
    dir_stat = os.lstat(os.path.dirname(server.path))
    assert stat.S_ISSOCK(sock_stat.st_mode)
    assert stat.S_IMODE(sock_stat.st_mode) == 0o600
    assert stat.S_IMODE(dir_stat.st_mode) == 0o700
    assert sock_stat.st_uid == dir_stat.st_uid == os.getuid()


def test_status_round_trip(server: ControlServer, registry: ArrivalRegistry) -> None:
    registry.arrived("e1", "r1")
    response = request(server.path, {"op": "status"})
    assert response["ok"] is True
    assert response["status"]["registry"]["active"] == 1
    assert response["status"]["budget"]["pct"] == 10.0


def test_budget_round_trip_changes_the_budget_in_place(
    server: ControlServer, budget: Budget
) -> None:
    response = request(server.path, {"op": "budget", "pct": 12.5})
    assert response == {"ok": True, "budget": response["budget"]}
    assert response["budget"]["pct"] == 12.5
    assert budget.pct == 12.5
    assert request(server.path, {"op": "status"})["status"]["budget"]["pct"] == 12.5


@pytest.mark.parametrize(
    ("data", "needle"),
    [
        (b"not json\n", "not JSON"),
        (b"[1, 2]\n", "JSON object"),
        (b'{"op": "reboot"}\n', "unknown op"),
        (b'{"no_op": 1}\n', "unknown op"),
        (b'{"op": "budget", "pct": -1}\n', "[0, 100]"),
        (b'{"op": "budget", "pct": 100.01}\n', "[0, 100]"),
        (b'{"op": "budget", "pct": "12"}\n', "number"),
        (b'{"op": "budget", "pct": true}\n', "number"),
        (b'{"op": "budget"}\n', "number"),
        (b'{"op": "budget", "pct": NaN}\n', "[0, 100]"),
        (b"\xff\xfe\n", "not JSON"),
        (b"{" + b" " * (70 * 1024) + b"}\n", "longer than"),
    ],
)
def test_bad_requests_get_an_error_answer_and_the_server_keeps_serving(
    server: ControlServer, budget: Budget, data: bytes, needle: str
) -> None:
    response = raw_exchange(server.path, data)
    assert response["ok"] is False
    assert needle in response["error"]
    assert budget.pct == 10.0
    assert request(server.path, {"op": "status"})["ok"] is True


def test_a_failing_status_callback_is_answered_as_an_error(base: Path, budget: Budget) -> None:
    def broken() -> dict:
        raise KeyError("engine gone")

    with ControlServer(str(base / "ctl" / "b.sock"), broken, budget_setter(budget)) as srv:
        response = request(srv.path, {"op": "status"})
        assert response["ok"] is False and "engine gone" in response["error"]
        assert request(srv.path, {"op": "budget", "pct": 5})["ok"] is True


def test_status_values_json_cannot_hold_are_sent_as_text(base: Path, budget: Budget) -> None:
    status = {"wait_s": float("inf"), "ids": ("a", "b"), "obj": object()}
    with ControlServer(str(base / "ctl" / "j.sock"), lambda: status, budget_setter(budget)) as srv:
        got = request(srv.path, {"op": "status"})["status"]
    assert got["wait_s"] == "inf" and got["ids"] == ["a", "b"] and isinstance(got["obj"], str)


def test_stop_removes_the_socket_and_is_idempotent(server: ControlServer) -> None:
    path = server.path
    server.stop()
    server.stop()
    assert not os.path.exists(path)
    with pytest.raises(ControlError, match="no control socket"):
        request(path, {"op": "status"})


def test_a_second_server_on_a_live_socket_is_refused(server: ControlServer, budget: Budget) -> None:
    other = ControlServer(server.path, dict, budget_setter(budget))
    with pytest.raises(ControlError, match="already served"):
        other.start()
    assert request(server.path, {"op": "status"})["ok"] is True


def test_a_stale_socket_left_by_a_dead_server_is_replaced(base: Path, budget: Budget) -> None:
    directory = base / "ctl"
    directory.mkdir(mode=0o700)
    path = str(directory / "stale.sock")
    leftover = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    leftover.bind(path)
    leftover.close()  # the file stays, nobody listens
    with ControlServer(path, lambda: {"fresh": True}, budget_setter(budget)) as srv:
        assert request(srv.path, {"op": "status"})["status"] == {"fresh": True}


def test_a_file_that_is_not_a_socket_is_never_replaced(base: Path, budget: Budget) -> None:
    directory = base / "ctl"
    directory.mkdir(mode=0o700)
    precious = directory / "data.sock"
    precious.write_text("keep me")
    with pytest.raises(ControlError, match="not a socket"):
        ControlServer(str(precious), dict, budget_setter(budget)).start()
    assert precious.read_text() == "keep me"


def test_a_directory_others_can_enter_is_refused(base: Path, budget: Budget) -> None:
    directory = base / "open"
    directory.mkdir()
    directory.chmod(0o755)
    with pytest.raises(ControlError, match="owner-only"):
        ControlServer(str(directory / "s.sock"), dict, budget_setter(budget)).start()


def test_a_symlinked_directory_is_refused(base: Path, budget: Budget) -> None:
    real = base / "real"
    real.mkdir(mode=0o700)
    (base / "link").symlink_to(real)
    with pytest.raises(ControlError, match="not a directory"):
        ControlServer(str(base / "link" / "s.sock"), dict, budget_setter(budget)).start()


@pytest.mark.skipif(os.getuid() != 0, reason="needs root to make a directory another user owns")
def test_a_directory_owned_by_another_user_is_refused(base: Path, budget: Budget) -> None:
    directory = base / "theirs"
    directory.mkdir(mode=0o700)
    os.chown(directory, NOBODY, NOBODY)
    with pytest.raises(ControlError, match="owned by uid"):
        ControlServer(str(directory / "s.sock"), dict, budget_setter(budget)).start()


@pytest.mark.skipif(os.getuid() != 0, reason="needs root to make a socket another user owns")
def test_a_socket_file_owned_by_another_user_is_refused(base: Path, budget: Budget) -> None:
    directory = base / "ctl"
    directory.mkdir(mode=0o700)
    path = str(directory / "s.sock")
    planted = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    planted.bind(path)
    planted.close()
    os.chown(path, NOBODY, NOBODY, follow_symlinks=False)
    with pytest.raises(ControlError, match="owned by uid"):
        ControlServer(path, dict, budget_setter(budget)).start()


@pytest.mark.skipif(os.getuid() != 0, reason="needs root to run a client as another user")
def test_another_user_cannot_connect(server: ControlServer) -> None:
    python = shutil.which("python3", path="/usr/bin:/bin")
    if python is None:
        pytest.skip("no system python to run as another user")
    probe = (
        "import socket, sys\n"
        "s = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)\n"
        "try:\n"
        f"    s.connect({server.path!r})\n"
        "except PermissionError:\n"
        "    sys.exit(3)\n"
        "sys.exit(0)\n"
    )
    try:
        done = subprocess.run([python, "-c", probe], user=NOBODY, cwd="/", timeout=30)
    except PermissionError:
        pytest.skip("cannot start a process as another user here")
    assert done.returncode == 3


def test_default_socket_path_prefers_the_runtime_dir(monkeypatch, tmp_path: Path) -> None:
    monkeypatch.setenv("XDG_RUNTIME_DIR", str(tmp_path))
    assert default_socket_path(123) == str(tmp_path / "mlx-recovery" / "123.sock")
    monkeypatch.delenv("XDG_RUNTIME_DIR")
    assert default_socket_path(123) == f"/tmp/mlx-recovery-{os.getuid()}/123.sock"
    assert default_socket_path().endswith(f"/{os.getpid()}.sock")


def test_a_configured_socket_path_overrides_the_default() -> None:
    assert control.resolve_socket_path("/run/me/x.sock") == "/run/me/x.sock"
    assert control.resolve_socket_path("", pid=7).endswith("/7.sock")


def test_an_overlong_socket_path_is_refused_clearly(base: Path, budget: Budget) -> None:
    path = str(base / ("d" * 120) / "s.sock")
    with pytest.raises(ControlError, match="longer than"):
        ControlServer(path, dict, budget_setter(budget)).start()


# -- discovery and the command line ---------------------------------------------------------


@pytest.fixture
def socket_dirs(monkeypatch, base: Path) -> list[Path]:
    """Point discovery at this test's own directories (other people's servers may run)."""
    dirs = [base / "run" / "mlx-recovery", base / "tmp-fallback"]
    dirs[0].parent.mkdir(mode=0o700)
    monkeypatch.setattr(control_paths, "socket_dirs", lambda: [str(d) for d in dirs])
    monkeypatch.delenv("MLX_RECOVERY_CONTROL_SOCKET", raising=False)
    return dirs


def cli(*argv: str) -> argparse.Namespace:
    parser = argparse.ArgumentParser(prog="mlx-recovery")
    control_cli.add_parser(parser.add_subparsers(dest="command", required=True))
    return parser.parse_args(argv)


def test_find_sockets_lists_only_live_sockets(socket_dirs: list[Path], budget: Budget) -> None:
    assert find_sockets() == []
    with ControlServer(control.default_socket_path(41), dict, budget_setter(budget)) as srv:
        stale = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        stale.bind(str(socket_dirs[0] / "42.sock"))
        stale.close()
        assert find_sockets() == [srv.path]


def test_status_command_finds_the_single_server_and_prints_its_status(
    socket_dirs: list[Path], budget: Budget, capsys
) -> None:
    status = {"engines": {"e1": {"jobs": 2, "debt_tokens": 512}}, "budget": {"share_used": 0.0412}}
    with ControlServer(control.default_socket_path(51), lambda: status, budget_setter(budget)):
        args = cli("status")
        assert args.func(args) == 0
        text = capsys.readouterr().out
        assert "e1:" in text and "debt_tokens: 512" in text and "share_used: 0.0412" in text

        args = cli("status", "--json")
        assert args.func(args) == 0
        assert json.loads(capsys.readouterr().out) == status


def test_budget_command_changes_the_running_budget(
    socket_dirs: list[Path], budget: Budget, capsys
) -> None:
    with ControlServer(control.default_socket_path(61), dict, budget_setter(budget)) as srv:
        args = cli("budget", "7.5", "--socket", srv.path)
        assert args.func(args) == 0
        assert budget.pct == 7.5
        assert "7.5 %" in capsys.readouterr().out
        args = cli("budget", "0")
        assert args.func(args) == 0
        assert budget.pct == 0.0 and not budget.available()


def test_budget_command_refuses_an_out_of_range_value_before_connecting(
    socket_dirs: list[Path], capsys
) -> None:
    args = cli("budget", "150")
    assert args.func(args) == 2
    assert "[0, 100]" in capsys.readouterr().err


def test_commands_explain_when_no_server_is_running(socket_dirs: list[Path], capsys) -> None:
    args = cli("status")
    assert args.func(args) == 1
    err = capsys.readouterr().err
    assert "no running server" in err and "--socket" in err


def test_commands_ask_which_one_when_several_servers_run(
    socket_dirs: list[Path], budget: Budget, capsys
) -> None:
    with (
        ControlServer(control.default_socket_path(71), dict, budget_setter(budget)) as a,
        ControlServer(control.default_socket_path(72), dict, budget_setter(budget)) as b,
    ):
        args = cli("status")
        assert args.func(args) == 1
        err = capsys.readouterr().err
        assert "several" in err and a.path in err and b.path in err


def test_the_configured_socket_is_used_when_none_is_given(
    socket_dirs: list[Path], base: Path, budget: Budget, monkeypatch, capsys
) -> None:
    path = str(base / "cfg" / "c.sock")
    with ControlServer(path, lambda: {"from": "configured"}, budget_setter(budget)):
        monkeypatch.setenv("MLX_RECOVERY_CONTROL_SOCKET", path)
        args = cli("status", "--json")
        assert args.func(args) == 0
        assert json.loads(capsys.readouterr().out) == {"from": "configured"}


def test_a_refusal_from_the_server_is_reported(
    socket_dirs: list[Path], budget: Budget, capsys
) -> None:
    def boom() -> dict:
        raise RuntimeError("kaput")

    with ControlServer(control.default_socket_path(81), boom, budget_setter(budget)):
        args = cli("status")
        assert args.func(args) == 1
        assert "kaput" in capsys.readouterr().err



def test_concurrent_clients_are_all_answered(server: ControlServer, budget: Budget) -> None:
    answers: list[dict] = []
    lock = threading.Lock()

    def client(n: int) -> None:
        payload = {"op": "budget", "pct": float(n)} if n % 2 else {"op": "status"}
        reply = request(server.path, payload)
        with lock:
            answers.append(reply)

    threads = [threading.Thread(target=client, args=(n,)) for n in range(100)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert len(answers) == 100 and all(a["ok"] for a in answers)
    assert budget.pct in {float(n) for n in range(1, 100, 2)}


def test_status_text_shows_nested_engines_and_jobs() -> None:
    status = {
        "enabled": True,
        "engines": [{"engine_id": "e1", "jobs": [{"committed": 512, "live": None}]}],
        "budget": {"share_used": 0.012345},
    }
    assert control_cli.format_tree(status) == [
        "enabled: True",
        "engines:",
        "  - engine_id: e1",
        "    jobs:",
        "      - committed: 512",
        "        live: -",
        "budget:",
        "  share_used: 0.01235",
    ]


def test_commands_say_so_when_the_channel_is_configured_off(
    socket_dirs: list[Path], monkeypatch, capsys
) -> None:
    monkeypatch.setenv("MLX_RECOVERY_CONTROL_SOCKET", "off")
    args = cli("status")
    assert args.func(args) == 1
    assert "control channel is off" in capsys.readouterr().err


def test_deeply_nested_json_is_answered_as_an_error_and_the_server_keeps_serving(server: ControlServer) -> None:
    reply = raw_exchange(server.path, b"[" * 20_000 + b"\n")
    assert reply["ok"] is False and "RecursionError" in reply["error"]
    assert request(server.path, {"op": "status"})["ok"]


def test_silent_clients_cannot_pile_up_handler_threads(server: ControlServer) -> None:
    before = threading.active_count()
    silent = []
    try:
        for _ in range(control.MAX_HANDLERS + 8):
            sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
            sock.connect(server.path)
            silent.append(sock)
        deadline = time.monotonic() + 5
        while threading.active_count() - before < control.MAX_HANDLERS and time.monotonic() < deadline:
            time.sleep(0.01)
        time.sleep(0.2)
        assert threading.active_count() - before <= control.MAX_HANDLERS
        busy = raw_exchange(server.path, b'{"op": "status"}\n')
        assert busy["ok"] is False and "busy" in busy["error"]
    finally:
        for sock in silent:
            sock.close()
    deadline = time.monotonic() + 10
    while time.monotonic() < deadline:
        reply = raw_exchange(server.path, b'{"op": "status"}\n')
        if reply["ok"]:
            break
        time.sleep(0.05)
    assert reply["ok"], "served again once the silent clients left"
