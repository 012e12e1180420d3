"""Where control sockets live: per-user owner-only directories, found and checked.

The socket lives in an owner-only (0700) directory and is itself 0600: on macOS the
socket file's own mode is not enforced on connect, so the directory is the real guard.
Everything here is plain file-system work, safe from any thread; servers of one
directory (in this process or others) coordinate through the directory's lock file.
"""

from __future__ import annotations

import contextlib
import fcntl
import glob
import logging
import os
import secrets
import socket
import stat
from collections.abc import Iterator
from pathlib import Path

from ..settings import env_name

log = logging.getLogger(__name__)

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
    runtime = os.environ.get("XDG_RUNTIME_DIR", "")
    # The XDG spec: a relative path is invalid and must be ignored (it would put the socket
    # under the host's working directory, where the CLI never looks).
    if runtime and os.path.isabs(runtime) and os.path.isdir(runtime):
        dirs.append(os.path.join(runtime, SOCKET_DIR_NAME))
    # /tmp literally, not $TMPDIR: a server and a CLI started from different
    # environments must agree on the place.
    dirs.append(os.path.join("/tmp", f"{SOCKET_DIR_NAME}-{os.getuid()}"))
    return dirs


def fits(path: str) -> bool:
    """``path`` fits in a unix socket address."""
    return len(os.fsencode(path)) <= MAX_SOCKET_PATH


def default_socket_path(pid: int | None = None) -> str:
    """``$XDG_RUNTIME_DIR/mlx-recovery/<pid>.sock``, else (no usable runtime directory, or
    one too long for a socket address) ``/tmp/mlx-recovery-<uid>/<pid>.sock``."""
    pid = os.getpid() if pid is None else pid
    candidates = [os.path.join(d, f"{pid}{SOCKET_SUFFIX}") for d in socket_dirs()]
    return next((c for c in candidates if fits(c)), candidates[-1])


def resolve_socket_path(configured: str = "", pid: int | None = None) -> str:
    """The configured path (``RecoverySettings.control_socket``) or the default one; a
    configured path too long for a socket address falls back to the default (said once)
    instead of leaving the process without a control channel."""
    if configured:
        path = os.path.expanduser(configured)
        if fits(path):
            return path
        fallback = default_socket_path(pid)
        log.warning(
            "mlx-recovery: %s is longer than %d bytes, too long for a unix socket; serving "
            "the control channel at %s instead (mlx-recovery status finds it there)",
            env_name("control_socket"), MAX_SOCKET_PATH, fallback,
        )
        return fallback
    return default_socket_path(pid)


def is_live(path: str, timeout: float = 0.5) -> bool:
    """Something listens at ``path``. Only a refused connection (or no file) means no:
    a full backlog (EAGAIN), a slow listener or a permission error is a live socket we
    must not remove."""
    with socket.socket(socket.AF_UNIX, socket.SOCK_STREAM) as sock:
        sock.settimeout(timeout)
        try:
            sock.connect(path)
        except (ConnectionRefusedError, FileNotFoundError):
            return False
        except OSError:
            return True
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
            if stat.S_ISSOCK(st.st_mode) and st.st_uid == uid and is_live(path):
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


# -- owning a socket path ------------------------------------------------------------------
#
# Every server binds and listens under a private temporary name first, then, holding the
# directory's lock, checks the real name and hard-links its socket there (``link`` never
# replaces a file). So whatever sits at a real name was listening before it got there: a
# refused connection there means its server is gone, and a server starting at the same
# moment waits for the lock instead of mistaking a half-started socket for a stale one.
# Removal is under the same lock and only of the inode the server itself put there.

LOCK_NAME = ".lock"
TEMP_SUFFIX = ".tmp"

SocketId = tuple[int, int]  # (st_dev, st_ino) of a socket file


@contextlib.contextmanager
def directory_lock(directory: Path) -> Iterator[None]:
    """Hold the socket directory's lock (an advisory ``flock`` on ``.lock``)."""
    fd = os.open(directory / LOCK_NAME, os.O_RDWR | os.O_CREAT | os.O_CLOEXEC, 0o600)
    try:
        fcntl.flock(fd, fcntl.LOCK_EX)
        yield
    finally:
        os.close(fd)  # closing releases the lock


def temp_socket_path(path: str) -> str:
    """A private name beside ``path`` to bind and listen under before taking ``path``
    (``.<pid>.<random>.tmp``: never a ``*.sock`` discovery lists)."""
    directory = os.path.dirname(path)
    return os.path.join(directory, f".{os.getpid()}.{secrets.token_hex(2)}{TEMP_SUFFIX}")


def claim_socket(bound: str, path: str) -> SocketId:
    """Give the listening socket bound at ``bound`` the name ``path`` and return its id.
    Raises :class:`ControlError` when ``path`` is served or is not a socket of ours."""
    with directory_lock(Path(path).parent):
        clear_stale_socket(path)
        try:
            os.link(bound, path)
            os.unlink(bound)
        except FileExistsError:  # put there by a process that does not take the lock
            raise ControlError(f"{path} is already served by another process") from None
        except OSError:
            # A file system without hard links to sockets: the path was checked absent
            # under the lock, so a rename takes it just as safely from cooperating servers.
            os.rename(bound, path)
        st = os.lstat(path)
        return (st.st_dev, st.st_ino)


def release_socket(path: str, owned: SocketId) -> None:
    """Remove ``path`` if it is still the socket ``owned`` names; never another's."""
    try:
        with directory_lock(Path(path).parent):
            st = os.lstat(path)
            if (st.st_dev, st.st_ino) == owned:
                os.unlink(path)
    except OSError:
        pass


def _pid_alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


def _named_pid(name: str) -> int | None:
    head = name.lstrip(".").split(".", 1)[0]
    return int(head) if head.isdigit() else None


def sweep_stale_sockets(directory: Path) -> list[str]:
    """Remove sockets of this user in ``directory`` that nothing serves and whose server
    (named by its pid) is gone, such as those ``kill -9`` leaves; and temporary ones of
    dead processes. A live socket is never removed. Returns what was removed."""
    uid = os.getuid()
    removed = []
    with directory_lock(directory):
        for entry in os.scandir(directory):
            temp = entry.name.startswith(".") and entry.name.endswith(TEMP_SUFFIX)
            if not (temp or entry.name.endswith(SOCKET_SUFFIX)):
                continue
            try:
                st = entry.stat(follow_symlinks=False)
            except OSError:
                continue
            if not stat.S_ISSOCK(st.st_mode) or st.st_uid != uid:
                continue
            pid = _named_pid(entry.name)
            if pid is not None and _pid_alive(pid):
                continue
            if temp and pid is None:
                continue
            if not temp and is_live(entry.path):
                continue
            try:
                os.unlink(entry.path)
                removed.append(entry.path)
            except OSError:
                pass
    return removed


def clear_stale_socket(path: str) -> None:
    """Remove ``path`` if it is a socket of ours that nothing serves; refuse anything
    else there. Call it holding the directory's lock."""
    try:
        st = os.lstat(path)
    except FileNotFoundError:
        return
    if st.st_uid != os.getuid():
        raise ControlError(f"{path} is owned by uid {st.st_uid}, not by this user; refusing it")
    if not stat.S_ISSOCK(st.st_mode):
        raise ControlError(f"{path} exists and is not a socket; refusing to replace it")
    if is_live(path):
        raise ControlError(f"{path} is already served by another process")
    os.unlink(path)
