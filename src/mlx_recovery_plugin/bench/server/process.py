"""One server of the oMLX family (``omlx serve``, ``fusion-mlx serve``) on a loopback
port: start, readiness, attachment, stop.

The server runs in its own process group (``start_new_session``), so stopping it stops
everything it started, and an error anywhere in the bench still stops every server it
started (:class:`ServerProcess` is a context manager, and ``stop_all`` runs at exit and on
SIGTERM). Its stdout and stderr go to a log file whose tail is shown when it fails.

Threads: all of this runs on the bench's main thread.
"""

from __future__ import annotations

import atexit
import errno
import glob
import json
import os
import shutil
import signal
import socket
import subprocess
import sys
import time
import urllib.error
import urllib.request
from dataclasses import dataclass, field
from pathlib import Path
from typing import IO

from ...recovery.control_paths import SOCKET_DIR_NAME, SOCKET_SUFFIX, socket_dirs
from .hosts import OMLX, ServerHost, serve_argv

HOST = "127.0.0.1"
ADMIN_STATUS_ROUTE = "/admin/api/recovery/status"
PTH_NAME = "mlx_recovery_plugin.pth"
LOG_TAIL_LINES = 40


class ServerError(RuntimeError):
    """The bench could not get a usable server; the message says which and why."""


class PortInUseError(ServerError):
    pass


class ServerStartError(ServerError):
    pass


class PluginNotAttachedError(ServerError):
    pass


def free_port() -> int:
    """A port on 127.0.0.1 that nothing listens on right now."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
        sock.bind((HOST, 0))
        return int(sock.getsockname()[1])


def check_port_free(port: int) -> None:
    """Raise :class:`PortInUseError` when something listens on ``port`` (with
    SO_REUSEADDR, as uvicorn binds, so a previous arm's closing connections do not count)."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        try:
            sock.bind((HOST, port))
        except OSError as exc:
            if exc.errno == errno.EADDRINUSE:
                raise PortInUseError(
                    f"port {port} on {HOST} is in use by another process; pick another "
                    "--port, or leave it out for a free one"
                ) from None
            raise


def host_command(host: ServerHost) -> list[str]:
    """The serve command of ``host``: its console script (``omlx``, ``fusion-mlx``,
    ``rapid-mlx``) of this environment, else the one on PATH."""
    here = Path(sys.executable).parent / host.command
    found = str(here) if here.is_file() else shutil.which(host.command)
    if found is None:
        raise ServerStartError(
            f"no `{host.command}` command: install {host.distribution} into this environment "
            "(see tests/*-requirements.txt and .ci/run)"
        )
    return [found]


def script_python(script: str) -> str:
    """The interpreter a console script runs under (its ``#!`` line), else this one."""
    try:
        with open(script, "rb") as handle:
            first = handle.readline().decode(errors="replace").strip()
    except OSError:
        return sys.executable
    if first.startswith("#!") and "python" in first:
        return first[2:].split()[0]
    return sys.executable


def find_startup_hook(python: str, env: dict[str, str]) -> tuple[Path | None, list[str]]:
    """Where ``python`` would read ``mlx_recovery_plugin.pth`` from, and the site
    directories it looked in."""
    code = "import site, json; print(json.dumps(site.getsitepackages() + [site.getusersitepackages()]))"
    # Without the enable switch, so the check itself attaches nothing.
    quiet = {k: v for k, v in env.items() if k != "MLX_RECOVERY_ENABLE"}
    done = subprocess.run([python, "-c", code], env=quiet, capture_output=True, text=True, timeout=60)
    try:
        dirs = [d for d in json.loads(done.stdout.strip().splitlines()[-1])]
    except (ValueError, IndexError):
        return None, []
    for directory in dirs:
        candidate = Path(directory) / PTH_NAME
        if candidate.is_file():
            return candidate, dirs
    return None, dirs


def missing_hook_advice(python: str, site_dirs: list[str]) -> str:
    target = site_dirs[0] if site_dirs else "<site-packages>"
    hook = Path(__file__).resolve().parents[4] / "hooks" / PTH_NAME
    source = str(hook) if hook.is_file() else f"hooks/{PTH_NAME} of this project"
    return (
        f"the server's Python ({python}) has no {PTH_NAME} in its site-packages "
        f"({', '.join(site_dirs) or 'none found'}), so MLX_RECOVERY_ENABLE=1 attaches nothing. "
        "Editable installs (pip install -e) do not install it. Fix: `pip install .` (not -e) "
        f"into the server's environment, or copy {source} into {target}"
    )


@dataclass(slots=True)
class ServerSpec:
    """What to start. ``command`` is the member's executable (or a stand-in in tests)."""

    model_dir: Path
    base_path: Path
    cache_dir: Path
    log_path: Path
    port: int | None = None
    env: dict[str, str] = field(default_factory=dict)
    command: list[str] | None = None
    start_timeout_s: float = 180.0
    expect_plugin: bool = False
    host: ServerHost = OMLX
    model_id: str = ""  # the target's directory name (rapid-mlx serves one model)
    sparse: bool = True  # rapid-mlx: PFlash on (oMLX: model_settings.json says)

    def argv(self, port: int) -> list[str]:
        return serve_argv(
            self.host, self.command or host_command(self.host), model_dir=self.model_dir, model_id=self.model_id,
            base_path=self.base_path, cache_dir=self.cache_dir, bind=HOST, port=port, sparse=self.sparse,
        )

    def environment(self) -> dict[str, str]:
        """A family member's own variables, then the spec's."""
        member = self.host.member
        return {**(member.server_env(str(self.base_path)) if member else {}), **self.env}


_live: set[ServerProcess] = set()


def stop_all() -> None:
    """Stop every server this process started and has not stopped yet."""
    for server in list(_live):
        server.stop()


def _on_sigterm(signum: int, frame: object) -> None:
    stop_all()
    raise SystemExit(128 + signum)


def stop_all_on_sigterm() -> None:
    """For the command line: a SIGTERM to the bench stops its servers first."""
    signal.signal(signal.SIGTERM, _on_sigterm)


atexit.register(stop_all)


def fallback_socket_path(pid: int) -> str:
    """Where a server's plugin puts its control socket when the runtime directory's path
    is too long for a socket address (see ``control_paths.default_socket_path``)."""
    return os.path.join(socket_dirs()[-1], f"{pid}{SOCKET_SUFFIX}")


class ServerProcess:
    """A running ``omlx serve``; ``with ServerProcess(spec) as server:`` starts it, waits
    until ``/health`` answers (and, with ``expect_plugin``, until the plugin's admin route
    exists), and stops its whole process group on the way out."""

    def __init__(self, spec: ServerSpec) -> None:
        self.spec = spec
        self.port = spec.port if spec.port is not None else free_port()
        self.proc: subprocess.Popen[bytes] | None = None
        self._log: IO[bytes] | None = None

    @property
    def base_url(self) -> str:
        return f"http://{HOST}:{self.port}"

    @property
    def pgid(self) -> int | None:
        return self.proc.pid if self.proc is not None else None

    # -- start -----------------------------------------------------------------------

    def start(self) -> ServerProcess:
        check_port_free(self.port)
        env = {**os.environ, **self.spec.environment()}
        if self.spec.expect_plugin and self.spec.command is None:
            script = host_command(self.spec.host)[0]
            python = script_python(script)
            hook, dirs = find_startup_hook(python, env)
            if hook is None:
                raise PluginNotAttachedError(missing_hook_advice(python, dirs))
        self.spec.log_path.parent.mkdir(parents=True, exist_ok=True)
        self._log = open(self.spec.log_path, "ab")  # noqa: SIM115 - closed in stop(), it outlives this call
        self.proc = subprocess.Popen(
            self.spec.argv(self.port), env=env, stdin=subprocess.DEVNULL,
            stdout=self._log, stderr=subprocess.STDOUT, start_new_session=True,
        )
        _live.add(self)
        try:
            self._wait_ready()
            if self.spec.expect_plugin:
                self._check_attached()
        except BaseException:
            self.stop()
            raise
        return self

    def _wait_ready(self) -> None:
        deadline = time.monotonic() + self.spec.start_timeout_s
        while True:
            code = self.proc.poll() if self.proc is not None else None
            if code is not None:
                tail = self.log_tail()
                if "address already in use" in tail.lower():
                    raise PortInUseError(f"the server could not bind port {self.port}: it is in use\n{tail}")
                raise ServerStartError(f"the server exited with code {code} before it was ready; its log ends:\n{tail}")
            if self._http_status("/health") == 200:
                return
            if time.monotonic() > deadline:
                raise ServerStartError(
                    f"the server did not answer /health within {self.spec.start_timeout_s:g} s; "
                    f"its log ends:\n{self.log_tail()}"
                )
            time.sleep(0.25)

    def _check_attached(self) -> None:
        """The plugin's admin route exists (401 without an admin session) only when the
        start-up hook attached the plugin to this server. A host without those routes is
        checked by its control socket after the first request instead."""
        if not self.spec.host.admin_route:
            return
        status = self._http_status(ADMIN_STATUS_ROUTE)
        if status == 404:
            raise PluginNotAttachedError(
                f"the server runs but the plugin is not attached ({ADMIN_STATUS_ROUTE} is 404): "
                "the start-up hook did not run, or failed (see the log for 'mlx-recovery'); "
                "check MLX_RECOVERY_ENABLE=1 reaches the server and that mlx_recovery_plugin.pth "
                f"is in its site-packages; log tail:\n{self.log_tail()}"
            )

    def _http_status(self, route: str) -> int | None:
        try:
            with urllib.request.urlopen(self.base_url + route, timeout=2.0) as response:
                return int(response.status)
        except urllib.error.HTTPError as exc:
            return int(exc.code)
        except (urllib.error.URLError, OSError):
            return None

    # -- while running ----------------------------------------------------------------

    def control_socket(self, timeout_s: float = 0.0) -> str | None:
        """The plugin's control socket in this server's private runtime directory (it
        appears when the first engine attaches, i.e. at the first request), or where the
        plugin falls back to when that path is too long for a socket address
        (``/tmp/mlx-recovery-<uid>/<pid>.sock``, by this server's pid)."""
        runtime = self.spec.env.get("XDG_RUNTIME_DIR")
        if not runtime:
            return None
        deadline = time.monotonic() + timeout_s
        while True:
            pattern = os.path.join(glob.escape(runtime), SOCKET_DIR_NAME, "*" + SOCKET_SUFFIX)
            found = sorted(glob.glob(pattern))
            pid = self.pgid  # the server process leads its own group
            if not found and pid is not None:
                fallback = fallback_socket_path(pid)
                found = [fallback] if os.path.exists(fallback) else []
            if found or time.monotonic() >= deadline:
                return found[0] if found else None
            time.sleep(0.1)

    def log_text(self) -> str:
        try:
            return self.spec.log_path.read_text(errors="replace")
        except OSError:
            return ""

    def log_tail(self, lines: int = LOG_TAIL_LINES) -> str:
        return "\n".join(self.log_text().splitlines()[-lines:])

    # -- stop ------------------------------------------------------------------------

    def stop(self, grace_s: float = 10.0) -> None:
        """SIGTERM the process group, SIGKILL what is left after ``grace_s``. Idempotent."""
        proc = self.proc
        if proc is not None:
            _signal_group(proc.pid, signal.SIGTERM)
            try:
                proc.wait(timeout=grace_s)
            except subprocess.TimeoutExpired:
                pass
            _signal_group(proc.pid, signal.SIGKILL)
            proc.wait()
            deadline = time.monotonic() + grace_s
            while group_alive(proc.pid) and time.monotonic() < deadline:
                _signal_group(proc.pid, signal.SIGKILL)
                time.sleep(0.05)
        if self._log is not None:
            self._log.close()
            self._log: IO[bytes] | None = None
        _live.discard(self)

    def __enter__(self) -> ServerProcess:
        return self.start()

    def __exit__(self, *exc: object) -> None:
        self.stop()


def _signal_group(pgid: int, sig: int) -> None:
    try:
        os.killpg(pgid, sig)
    except (ProcessLookupError, PermissionError):
        pass


def group_alive(pgid: int) -> bool:
    """Any process left in group ``pgid`` (zombies of other parents count as gone)."""
    try:
        os.killpg(pgid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    # killpg succeeds on zombies; look closer where /proc exists.
    if not os.path.isdir("/proc"):
        return True
    for entry in os.listdir("/proc"):
        if not entry.isdigit():
            continue
        try:
            fields = Path(f"/proc/{entry}/stat").read_text().rsplit(")", 1)[1].split()
        except (OSError, IndexError):
            continue
        if int(fields[2]) == pgid and fields[0] != "Z":
            return True
    return False

