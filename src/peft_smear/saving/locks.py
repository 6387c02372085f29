"""The locks of saves and loads (:mod:`peft_smear.saving.atomic`), and waits that are announced, bounded and name whom
they wait for.

A save holds an exclusive ``flock`` on its target's lock file; where the filesystem has no ``flock`` (NFS without a
lock daemon answers ``ENOLCK``) the lock file is created exclusively instead and holds the saver's process id, host
and start time, and a lock whose process is gone is taken over. A load holds a shared ``flock`` on the directory it
reads, which a save that deletes or rewrites that directory waits for. Every wait says once on stderr whom it waits
for (from ``/proc/locks``, or the pid lock file), and gives up after ``PEFT_SMEAR_LOCK_TIMEOUT`` seconds (default 60)
with a :class:`DirectoryBusyError` naming them, stopped (Ctrl-Z, SIGSTOP) if they are.
"""

from __future__ import annotations

import contextlib
import errno
import math
import os
import socket
import sys
import time
from collections.abc import Callable, Iterator
from pathlib import Path


try:
    import fcntl
except ImportError:  # Windows: no locks
    fcntl = None


__all__ = [
    "TIMEOUT_VARIABLE",
    "DirectoryBusyError",
    "describe_holders",
    "lock_directory",
    "lock_timeout",
    "save_lock",
    "try_lock_directory",
    "unlock",
    "unread",
    "writable",
]

TIMEOUT_VARIABLE = "PEFT_SMEAR_LOCK_TIMEOUT"
DEFAULT_TIMEOUT = 60.0
_ANNOUNCE_AFTER = 0.5  # seconds of waiting before a wait is announced: saves in quick succession stay quiet
_NO_FLOCK = {errno.ENOLCK, errno.EOPNOTSUPP, errno.ENOTSUP, errno.EINVAL, errno.ENOSYS}


class DirectoryBusyError(TimeoutError):
    """Another process holds the directory: a save waited for it in vain, or a load met an in-place save."""


def lock_timeout() -> float:
    """How long a save waits for another process (seconds): ``PEFT_SMEAR_LOCK_TIMEOUT``, else 60."""
    text = os.environ.get(TIMEOUT_VARIABLE)
    if text is None:
        return DEFAULT_TIMEOUT
    try:
        value = float(text)
    except ValueError:
        value = -1.0
    if not (math.isfinite(value) and value >= 0):
        raise ValueError(f"{TIMEOUT_VARIABLE}={text!r} is not a number of seconds >= 0.")
    return value


def writable(directory: Path) -> bool:
    """Whether this process may create files in ``directory``, by its effective ids and capabilities."""
    return os.access(directory, os.W_OK | os.X_OK, effective_ids=os.access in os.supports_effective_ids)


@contextlib.contextmanager
def save_lock(path: Path, shown: Path, timeout: float) -> Iterator[None]:
    """Hold the lock file ``path`` of saves to ``shown`` for the block, waiting at most ``timeout`` seconds for
    another holder; the holder that releases it removes the file (one waiting on a removed file takes the new one)."""
    release = _acquire(path, shown, timeout) if _flock_works(path.parent) else _acquire_by_pid(path, shown, timeout)
    try:
        yield
    finally:
        release()


def _acquire(path: Path, shown: Path, timeout: float) -> Callable[[], None]:
    """Take the ``flock`` lock file ``path``, waiting at most ``timeout`` seconds; return what releases it."""
    held: list[int] = []

    def attempt() -> str | None:
        fd = _open_lock_file(path)
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            holder = describe_holders(os.fstat(fd), "WRITE")
            os.close(fd)
            return holder
        current = _stat_or_none(path)
        opened = os.fstat(fd)
        if current is None or (current.st_dev, current.st_ino) != (opened.st_dev, opened.st_ino):
            os.close(fd)  # the save that held it removed it: lock the file that is there now
            return attempt()
        held.append(fd)
        return None

    _wait(attempt, shown, "saved", timeout, path)

    def release() -> None:
        with contextlib.suppress(OSError):
            os.unlink(path)
        os.close(held[0])

    return release


def _open_lock_file(path: Path) -> int:
    """A descriptor of the lock file, created if missing; read-only where it is someone else's (a shared sticky
    directory such as /tmp refuses to open another user's file for writing)."""
    nofollow = getattr(os, "O_NOFOLLOW", 0)  # a link planted in a shared directory is not followed
    try:
        return os.open(path, os.O_RDWR | os.O_CREAT | nofollow, 0o644)
    except PermissionError:
        try:
            return os.open(path, os.O_RDONLY | nofollow)
        except OSError as error:
            failure = error
    except OSError as error:
        failure = error
    why = f"Cannot take the lock of saves: its lock file {path} cannot be opened ({failure.strerror})"
    raise type(failure)(failure.errno, why, str(path)) from None


def _flock_works(directory: Path) -> bool:
    """Whether the filesystem of ``directory`` supports ``flock`` (some network filesystems answer ``ENOLCK``)."""
    try:
        fd = os.open(directory, os.O_RDONLY)
    except OSError:
        return True  # the lock file's own error will say what is wrong
    try:
        fcntl.flock(fd, fcntl.LOCK_SH | fcntl.LOCK_NB)
    except BlockingIOError:
        return True
    except OSError as error:
        return error.errno not in _NO_FLOCK
    finally:
        os.close(fd)
    return True


def _acquire_by_pid(path: Path, shown: Path, timeout: float) -> Callable[[], None]:
    """The lock where ``flock`` is missing: ``path`` created exclusively, holding this process's id, host and start
    time; a lock file whose process is gone (on this host) is taken over."""
    me = f"{os.getpid()} {socket.gethostname()} {_start_time(os.getpid())}\n"

    def attempt() -> str | None:
        try:
            fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o644)
        except FileExistsError:
            holder = _pid_lock_holder(path)
            if holder is None:  # its process is gone
                try:
                    os.unlink(path)
                except FileNotFoundError:
                    pass
                except PermissionError:  # another user's, in a sticky directory
                    return "a process that is gone, whose lock file this user may not remove"
                return attempt()
            return holder
        with os.fdopen(fd, "w") as file:
            file.write(me)
        return None

    _wait(attempt, shown, "saved", timeout, path)

    def release() -> None:
        with contextlib.suppress(OSError):
            if Path(path).read_text() == me:
                os.unlink(path)

    return release


def _pid_lock_holder(path: Path) -> str | None:
    """The process named in a pid lock file, described, or ``None`` if it is gone (or the file is)."""
    try:
        text, age = path.read_text(), time.time() - path.stat().st_mtime
    except FileNotFoundError:
        return None
    fields = text.split()
    if len(fields) != 3 or not fields[0].isdigit():
        return None if age > 10 else "another process"  # being written, or left half-written by a kill
    pid, host, started = int(fields[0]), fields[1], fields[2]
    if host != socket.gethostname():
        return f"process {pid} on host {host}"
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return None
    except PermissionError:
        pass
    if started != "?" and _start_time(pid) not in (started, "?"):
        return None  # the id now belongs to another process
    return _describe(pid)


def _start_time(pid: int) -> str:
    try:
        with open(f"/proc/{pid}/stat") as file:
            return file.read().rsplit(")", 1)[1].split()[19]
    except (OSError, IndexError):
        return "?"


def _wait(attempt: Callable[[], str | None], shown: Path, doing: str, timeout: float, lock: Path) -> None:
    """Call ``attempt`` until it succeeds (returns ``None``; otherwise it returns who holds what it wants): says once
    on stderr that it waits and for whom, and gives up after ``timeout`` seconds naming them."""
    start = time.monotonic()
    delay, announced = 0.001, False
    while True:
        holder = attempt()
        if holder is None:
            return
        waited = time.monotonic() - start
        if waited >= timeout:
            if timeout == 0:
                raise DirectoryBusyError(f"{shown} is being {doing} by {holder} (it holds {lock}).")
            raise DirectoryBusyError(
                f"Gave up after {timeout:g} s: {shown} is being {doing} by {holder} (it holds {lock}). Let it finish "
                f"or stop it; {TIMEOUT_VARIABLE} sets how many seconds to wait."
            )
        if not announced and waited >= min(_ANNOUNCE_AFTER, timeout / 2):
            print(
                f"peft-smear: {shown} is being {doing} by {holder}; waiting for it, at most {timeout:g} s "
                f"({TIMEOUT_VARIABLE}).",
                file=sys.stderr,
                flush=True,
            )
            announced = True
        time.sleep(min(delay, max(timeout - waited, 0)))
        delay = min(delay * 2, 0.05)


def describe_holders(info: os.stat_result, kind: str) -> str:
    """The processes holding a ``flock`` of ``kind`` (``WRITE``: exclusive, ``READ``: shared) on the file ``info``
    describes, from ``/proc/locks``, described."""
    key = f"{os.major(info.st_dev):02x}:{os.minor(info.st_dev):02x}:{info.st_ino}"
    pids = []
    with contextlib.suppress(OSError), open("/proc/locks") as file:
        for line in file:
            fields = line.split()  # "1: FLOCK  ADVISORY  WRITE 1234 fe:00:5678 0 EOF"; waiters have "->"
            if len(fields) >= 6 and fields[1] == "FLOCK" and fields[3] == kind and fields[5] == key:
                pid = int(fields[4])  # 0: a process in another pid namespace (another container)
                if pid not in pids and pid not in (0, os.getpid()):
                    pids.append(pid)
    if not pids:
        return "another process"
    return " and ".join(_describe(pid) for pid in pids[:3])


def _describe(pid: int) -> str:
    """``process <pid> (<command line>)``, and whether it is stopped (Ctrl-Z, SIGSTOP)."""
    try:
        with open(f"/proc/{pid}/cmdline", "rb") as file:
            command = file.read().replace(b"\0", b" ").decode(errors="replace").strip()
        with open(f"/proc/{pid}/stat") as file:
            state = file.read().rsplit(")", 1)[1].split()[0]
    except (OSError, IndexError):
        return f"process {pid}"
    command = command if len(command) <= 100 else command[:97] + "..."
    return f"process {pid}" + (f" ({command})" if command else "") + (", which is stopped" if state in "Tt" else "")


def lock_directory(path: Path) -> int | None:
    """Hold an exclusive ``flock`` on ``path`` (a directory) until :func:`unlock`: a running save's sibling is never
    taken for a stale one. ``None`` where locks are unavailable."""
    fd = try_lock_directory(path)
    return None if fd is False else fd


def try_lock_directory(path: Path) -> int | bool | None:
    """A lock on a sibling that no running save holds (``None`` if it cannot be locked at all), or ``False``."""
    if fcntl is None or path.is_symlink() or not path.is_dir():
        return None
    try:
        fd = os.open(path, os.O_RDONLY)
    except OSError:
        return None
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except BlockingIOError:
        os.close(fd)
        return False
    except OSError:  # a filesystem without flock: nothing tells a running save apart
        os.close(fd)
        return None
    return fd


def unlock(fd: int | None) -> None:
    if fd is not None:
        os.close(fd)  # closing the only descriptor releases the flock


@contextlib.contextmanager
def unread(directory: Path, shown: Path) -> Iterator[None]:
    """Hold ``directory`` exclusively once no load reads it (loads hold a shared lock on what they read), waiting for
    loads at most ``PEFT_SMEAR_LOCK_TIMEOUT`` seconds: a load that starts meanwhile fails at once instead of reading a
    directory whose files are being replaced or deleted."""
    fd = os.open(directory, os.O_RDONLY)
    try:

        def attempt() -> str | None:
            try:
                fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
            except BlockingIOError:
                return describe_holders(os.fstat(fd), "READ")
            except OSError:  # a filesystem without flock: loads find a changed config instead (see loading)
                pass
            return None

        if fcntl is not None:
            _wait(attempt, shown, "loaded", lock_timeout(), directory)
        yield
    finally:
        os.close(fd)


def _stat_or_none(path: Path) -> os.stat_result | None:
    try:
        return os.stat(path)
    except OSError:
        return None
