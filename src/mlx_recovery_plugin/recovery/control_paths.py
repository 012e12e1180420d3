"""Where control sockets live: per-user owner-only directories, found and checked.

The socket lives in an owner-only (0700) directory and is itself 0600: on macOS the
socket file's own mode is not enforced on connect, so the directory is the real guard.
Everything here is plain file-system work, safe from any thread.
"""

from __future__ import annotations

import glob
import os
import socket
import stat
from pathlib import Path

from ..settings import env_name

SOCKET_DIR_NAME = "mlx-recovery"
SOCKET_SUFFIX = ".sock"
# Values of MLX_RECOVERY_CONTROL_SOCKET that mean "no control channel".
CONTROL_SOCKET_OFF = frozenset({"off", "none", "disabled", "false", "0"})
# sun_path is 104 bytes on macOS and 108 on Linux, the terminating NUL included.
MAX_SOCKET_PATH = 103


class ControlError(RuntimeError):
    """The control channel cannot start, or a request could not be made."""


def socket_dirs() -> list[str]:
    """The directories where servers of this user put their default sockets."""
    dirs = []
    runtime = os.environ.get("XDG_RUNTIME_DIR")
    if runtime and os.path.isdir(runtime):
        dirs.append(os.path.join(runtime, SOCKET_DIR_NAME))
    # /tmp literally, not $TMPDIR: a server and a CLI started from different
    # environments must agree on the place.
    dirs.append(os.path.join("/tmp", f"{SOCKET_DIR_NAME}-{os.getuid()}"))
    return dirs


def default_socket_path(pid: int | None = None) -> str:
    """``$XDG_RUNTIME_DIR/mlx-recovery/<pid>.sock``, else ``/tmp/mlx-recovery-<uid>/<pid>.sock``."""
    pid = os.getpid() if pid is None else pid
    return os.path.join(socket_dirs()[0], f"{pid}{SOCKET_SUFFIX}")


def resolve_socket_path(configured: str = "", pid: int | None = None) -> str:
    """The configured path (``RecoverySettings.control_socket``) or the default one."""
    return os.path.expanduser(configured) if configured else default_socket_path(pid)


def _is_live(path: str, timeout: float = 0.5) -> bool:
    with socket.socket(socket.AF_UNIX, socket.SOCK_STREAM) as sock:
        sock.settimeout(timeout)
        try:
            sock.connect(path)
        except OSError:
            return False
    return True


def find_sockets() -> list[str]:
    """Live control sockets of this user's servers, in the default places."""
    uid = os.getuid()
    found = []
    for directory in socket_dirs():
        for path in sorted(glob.glob(os.path.join(glob.escape(directory), "*" + SOCKET_SUFFIX))):
            try:
                st = os.lstat(path)
            except OSError:
                continue
            if stat.S_ISSOCK(st.st_mode) and st.st_uid == uid and _is_live(path):
                found.append(path)
    return found


def check_owner_only_dir(directory: Path) -> None:
    """Create ``directory`` owner-only if missing; refuse one that is not a real
    directory, is someone else's, or lets anyone else in."""
    try:
        st = os.lstat(directory)
    except FileNotFoundError:
        try:
            os.mkdir(directory, 0o700)
            st = os.lstat(directory)
        except OSError as exc:
            raise ControlError(f"cannot create control directory {directory}: {exc}") from exc
    if not stat.S_ISDIR(st.st_mode):
        raise ControlError(f"control directory {directory} is not a directory (or is a link)")
    if st.st_uid != os.getuid():
        raise ControlError(
            f"control directory {directory} is owned by uid {st.st_uid}, not by this user "
            f"(uid {os.getuid()}); refusing to use it"
        )
    if st.st_mode & 0o077:
        raise ControlError(
            f"control directory {directory} must be owner-only (0700), it is "
            f"{stat.S_IMODE(st.st_mode):04o}; fix it or choose another {env_name('control_socket')}"
        )


def clear_stale_socket(path: str) -> None:
    try:
        st = os.lstat(path)
    except FileNotFoundError:
        return
    if st.st_uid != os.getuid():
        raise ControlError(f"{path} is owned by uid {st.st_uid}, not by this user; refusing it")
    if not stat.S_ISSOCK(st.st_mode):
        raise ControlError(f"{path} exists and is not a socket; refusing to replace it")
    if _is_live(path):
        raise ControlError(f"{path} is already served by another process")
    os.unlink(path)
