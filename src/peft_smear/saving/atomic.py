"""Atomic saves: a directory is written completely beside its target, then swapped into place in one step.

Every save of peft-smear (``save_pretrained`` of a SMEAR model, exports, banks, EMoE files, ``peft-smear train`` runs)
goes through :func:`staged_directory`, so that a process killed at any moment of a save leaves at the target path
either the complete old directory (nothing, if there was none) or the complete new one: never a mix of the two, and
never a moment without a directory at the path where ``RENAME_EXCHANGE`` works (for the fallback, see step 4). How:

1. **Lock, recover and clean.** Saves to one target run one after the other: each holds an exclusive ``flock`` on
   ``.<name>.peft-smear-lock`` beside it from here to the end (the last one removes the file; a kill leaves it, and
   the next save takes it). Siblings left by killed saves to the same target (see the names below) are removed; in the
   one state where the target itself is missing (a kill inside the fallback's two renames, step 4) the old copy is
   renamed back first. A sibling whose save is still running holds a ``flock`` on it and is left alone.
2. **Stage.** A sibling directory ``.<name>.peft-smear-staging-<random>`` is created (same filesystem, so the swap is a
   rename) with the target's permissions. With ``keep_others``, it first receives every entry of the current target
   that the save does not rewrite, as hard links (copies where the filesystem refuses links): a checkpoint's
   optimizer and trainer state, a run's report, an adapter beside EMoE files. Files the save rewrites are not carried
   over (``rewrites``), or carried over as independent copies when the save reads and amends them (``amends``, e.g.
   ``README.md``): the save then never writes through a link into the old copy.
3. **Write and sync.** The caller writes into the staging directory; then every file written there and every directory
   of it is ``fsync``-ed, so that the swap never publishes data still only in the page cache.
4. **Swap.** With a target, ``renameat2(RENAME_EXCHANGE)`` (Linux 3.15, glibc 2.28) exchanges staging and target in
   one step; without one, a plain ``rename``. Where exchange is missing (another OS, an old glibc, a filesystem that
   refuses the flag, such as some network filesystems) the fallback renames the target aside to
   ``.<name>.peft-smear-old-<random>`` and the staging directory to the target: between those two renames the path is
   absent for an instant, but the complete old copy is under that recognisable name and step 1 of the next save to
   the path (or :func:`recover`) puts it back. No atomic directory replace exists without exchange.
5. **Delete the old copy** (now at the staging or old-copy name), once no load reads it: a load through
   :func:`pinned` holds a shared ``flock`` on the directory it reads, so that its config and its weights come from one
   save. A kill before the deletion ends leaves a sibling that step 1 of the next save removes. The parent directory
   is ``fsync``-ed after the swap.

A symlinked target keeps its link: the directory it points to is replaced. If this process's working directory is
inside the target, it is moved to the same place in the new directory. Files that another process creates in the target
while a save with ``keep_others`` runs are not in the new directory (they were not there when it was staged).

A save whose target is inside a directory being staged by this process (``save_pretrained`` into the staging directory
of a ``peft-smear train`` run, an export inside an ``export-tasks`` task directory) writes directly: the enclosing save
publishes it. :func:`destination` tells such code the path it will end up at (e.g. for a model card's load snippet).

:func:`step` is the one seam for tests: it is called after each step above and after each file the callers write; a
test process replaces it to kill itself there.
"""

from __future__ import annotations

import contextlib
import ctypes
import errno
import hashlib
import os
import re
import secrets
import shutil
import stat
import threading
from collections.abc import Collection, Iterator
from pathlib import Path


try:
    import fcntl
except ImportError:  # Windows: no locks, so a stale sibling is any sibling
    fcntl = None


__all__ = ["destination", "exchange_supported", "pinned", "recover", "staged_directory", "step"]

STAGING, OLD = "staging", "old"
_SIBLING = re.compile(r"^\.(?P<tag>.+)\.peft-smear-(?P<kind>staging|old)-[0-9a-f]{16}$")
_AT_FDCWD, _RENAME_EXCHANGE = -100, 2
_MAX_TAG = 120  # NAME_MAX is 255; the rest of a sibling's name takes 40


def step(name: str) -> None:
    """Called after each step of a save (``name`` says which). Does nothing: it is the seam where a test process
    stops itself (e.g. ``os.kill(os.getpid(), signal.SIGKILL)`` at the k-th call) to check what a kill there leaves.
    Callers call it as ``atomic.step(...)``, so that replacing this module attribute reaches every one of them."""


def _load_renameat2():
    try:
        function = ctypes.CDLL(None, use_errno=True).renameat2
    except (OSError, AttributeError, TypeError):  # not Linux, or a C library without it (glibc < 2.28, musl < 1.2.?)
        return None
    function.argtypes = [ctypes.c_int, ctypes.c_char_p, ctypes.c_int, ctypes.c_char_p, ctypes.c_uint]
    function.restype = ctypes.c_int
    return function


_renameat2 = _load_renameat2()
_live: dict[Path, Path] = {}  # staging directory (real path) -> target as the caller named it, for this process
_live_lock = threading.Lock()


def exchange_supported() -> bool:
    """Whether this C library offers ``renameat2`` (a filesystem may still refuse the exchange: then the fallback)."""
    return _renameat2 is not None


def destination(path: str | os.PathLike) -> Path:
    """Where ``path`` will be once the saves staging it are published: ``path`` itself unless it is (inside) a
    directory this process is staging, in which case the same place under that save's target."""
    path = Path(path)
    real = Path(os.path.realpath(path))
    with _live_lock:
        live = dict(_live)
    for staging, target in live.items():
        if real == staging or real.is_relative_to(staging):
            return destination(target / real.relative_to(staging))
    return path


@contextlib.contextmanager
def staged_directory(
    target: str | os.PathLike,
    *,
    keep_others: bool = False,
    rewrites: Collection[str] = (),
    amends: Collection[str] = (),
) -> Iterator[Path]:
    """Yield a staging directory to write the new ``target`` into; when the block ends without an error, put it at
    ``target`` in one step (see the module's description). On an error the staging directory is removed and
    ``target`` is untouched.

    Without ``keep_others`` the new directory replaces the old one whole (an export, a bank, a run). With it, the
    entries of the old directory are carried over except the relative paths (``/``-separated) in ``rewrites``, which
    the save writes anew, and those in ``amends`` are carried over as copies the save may rewrite in place; everything
    else becomes a hard link, which the save must not write to. Inside a directory this process is staging, the
    block gets ``target`` itself."""
    target = Path(target)
    real = Path(os.path.realpath(target))  # a symlinked target: the directory it points to is replaced
    if not real.name or real.parent == real:
        raise ValueError(f"Cannot save atomically to {target}: it has no parent directory to stage in.")
    if _inside_live_staging(real):
        real.mkdir(parents=True, exist_ok=True)
        yield real
        return
    if keep_others and real.exists() and not real.is_dir():
        raise NotADirectoryError(f"{target} is a file, not a directory.")
    real.parent.mkdir(parents=True, exist_ok=True)
    with _target_lock(real):  # saves to one target run one after the other
        _recover(real)
        staging, lock = _make_sibling(real, STAGING)
        with _live_lock:
            _live[staging] = target
        try:
            try:
                if real.is_dir():
                    os.chmod(staging, stat.S_IMODE(os.stat(real).st_mode))
                    if keep_others:
                        _carry_over(real, staging, "", set(rewrites), set(amends))
                step("staged")
                yield staging
                step("written")
                _sync_tree(staging)
                step("synced")
                _publish(staging, real)
            except BaseException:
                # Before the swap this is the unfinished new copy; after it, the old copy or nothing. Never the target.
                shutil.rmtree(staging, ignore_errors=True)
                raise
        finally:
            with _live_lock:
                _live.pop(staging, None)
            _unlock(lock)


@contextlib.contextmanager
def pinned(path: str | os.PathLike) -> Iterator[str]:
    """Yield a path through which ``path`` (a directory) reads as one save, however many files are read from it and
    whatever saves replace it meanwhile: on Linux, ``/proc/self/fd/<n>`` of the directory opened once, held with a
    shared ``flock`` that a save waits for before it deletes an old copy (step 5), so its files stay. Elsewhere (no
    ``/proc``, no ``flock``) ``path`` itself."""
    real = os.path.realpath(path)
    while True:
        try:
            fd = os.open(real, os.O_RDONLY | getattr(os, "O_DIRECTORY", 0))
        except OSError:
            yield str(path)  # let the reader report what is wrong with the path
            return
        if fcntl is None or not os.path.isdir(f"/proc/self/fd/{fd}"):
            os.close(fd)
            yield str(path)
            return
        with contextlib.suppress(OSError):  # a filesystem without flock: the directory is still read as one
            fcntl.flock(fd, fcntl.LOCK_SH)
        opened, current = os.fstat(fd), _stat_or_none(real)
        if current is not None and (current.st_dev, current.st_ino) == (opened.st_dev, opened.st_ino):
            break
        os.close(fd)  # a save replaced the directory before it was held: read the new one
    try:
        yield f"/proc/self/fd/{fd}"
    finally:
        os.close(fd)


def _stat_or_none(path: str) -> os.stat_result | None:
    try:
        return os.stat(path)
    except OSError:
        return None


_held_targets: dict[Path, tuple[int, int]] = {}  # target -> (thread id, depth): this thread's saves nest freely
_held_lock = threading.Lock()


@contextlib.contextmanager
def _target_lock(real: Path) -> Iterator[None]:
    """Hold the exclusive lock of saves to ``real``: a ``flock`` on ``.<name>.peft-smear-lock`` beside it, removed
    by the save that releases it (a save waiting on a removed lock file takes the new one). Without it, one save's
    recovery (step 1) deleted another's staging directory between its creation and its lock."""
    thread = threading.get_ident()
    with _held_lock:
        owner, depth = _held_targets.get(real, (None, 0))
        if owner == thread:
            _held_targets[real] = (thread, depth + 1)
    if owner == thread:
        try:
            yield
        finally:
            with _held_lock:
                _held_targets[real] = (thread, _held_targets[real][1] - 1)
        return
    if fcntl is None:
        yield
        return
    path = real.parent / f".{_tag(real.name)}.peft-smear-lock"
    while True:
        fd = os.open(path, os.O_RDWR | os.O_CREAT, 0o644)
        fcntl.flock(fd, fcntl.LOCK_EX)
        current = _stat_or_none(str(path))
        opened = os.fstat(fd)
        if current is not None and (current.st_dev, current.st_ino) == (opened.st_dev, opened.st_ino):
            break
        os.close(fd)  # the save that held it removed it: lock the file that is there now
    with _held_lock:
        _held_targets[real] = (thread, 1)
    try:
        yield
    finally:
        with _held_lock:
            del _held_targets[real]
        with contextlib.suppress(OSError):
            os.unlink(path)
        os.close(fd)


def recover(target: str | os.PathLike) -> None:
    """Put ``target`` back in order after saves to it were killed: if it is missing while the complete old copy of an
    interrupted fallback swap sits beside it, rename that back; then remove every sibling those saves left (staging
    directories, old copies) whose save is not running any more. Every save to ``target`` starts with this."""
    real = Path(os.path.realpath(target))
    if not real.parent.is_dir():
        return
    with _target_lock(real):
        _recover(real)


def _recover(real: Path) -> None:
    tag = _tag(real.name)
    siblings = []
    for entry in os.scandir(real.parent):
        match = _SIBLING.match(entry.name)
        if match and match["tag"] == tag:
            lock = _try_lock(Path(entry.path))
            if lock is not False:  # False: a running save holds it
                siblings.append((Path(entry.path), match["kind"], lock))
    try:
        if not os.path.lexists(real):
            olds = [(path.stat().st_mtime_ns, path) for path, kind, _ in siblings if kind == OLD]
            if olds:
                os.rename(max(olds)[1], real)
                _sync_directory(real.parent)
        for path, _, _ in siblings:
            if path.is_dir() and not path.is_symlink():
                shutil.rmtree(path, ignore_errors=True)
            elif os.path.lexists(path):
                path.unlink()
    finally:
        for _, _, lock in siblings:
            _unlock(lock)


def _inside_live_staging(real: Path) -> bool:
    with _live_lock:
        return any(real == staging or real.is_relative_to(staging) for staging in _live)


def _tag(name: str) -> str:
    """The target's name as its siblings spell it: itself, or for a very long name a prefix and a hash."""
    if len(name) <= _MAX_TAG:
        return name
    return name[: _MAX_TAG - 17] + "~" + hashlib.sha256(name.encode()).hexdigest()[:16]


def _make_sibling(real: Path, kind: str) -> tuple[Path, int | None]:
    while True:
        path = real.parent / f".{_tag(real.name)}.peft-smear-{kind}-{secrets.token_hex(8)}"
        try:
            os.mkdir(path)
        except FileExistsError:
            continue
        return path, _lock(path)


def _lock(path: Path) -> int | None:
    """Hold an exclusive ``flock`` on ``path`` (a directory) until :func:`_unlock`: a running save's sibling is never
    taken for a stale one. ``None`` where locks are unavailable."""
    fd = _try_lock(path)
    return None if fd is False else fd


def _try_lock(path: Path) -> int | bool | None:
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


def _unlock(fd: int | None) -> None:
    if fd is not None:
        os.close(fd)  # closing the only descriptor releases the flock


def _carry_over(source: Path, staging: Path, prefix: str, rewrites: set[str], amends: set[str]) -> None:
    for entry in os.scandir(source):
        relative = prefix + entry.name
        if relative in rewrites:
            continue
        destination_path = staging / entry.name
        if entry.is_symlink():
            os.symlink(os.readlink(entry.path), destination_path)
        elif entry.is_dir():
            os.mkdir(destination_path)
            os.chmod(destination_path, stat.S_IMODE(entry.stat().st_mode))
            _carry_over(Path(entry.path), destination_path, relative + "/", rewrites, amends)
        elif relative in amends:
            shutil.copy2(entry.path, destination_path)
        else:
            try:
                os.link(entry.path, destination_path)
            except OSError:  # another device (a mount point inside), or a filesystem without hard links
                shutil.copy2(entry.path, destination_path)


def _sync_tree(root: Path) -> None:
    """``fsync`` every file written under ``root`` (hard links to the old copy are already on disk) and every
    directory, deepest first."""
    for directory, _, files in os.walk(root, topdown=False):
        for name in files:
            path = os.path.join(directory, name)
            info = os.lstat(path)
            if stat.S_ISREG(info.st_mode) and info.st_nlink == 1:
                fd = os.open(path, os.O_RDONLY)
                try:
                    os.fsync(fd)
                finally:
                    os.close(fd)
        _sync_directory(Path(directory))


def _sync_directory(directory: Path) -> None:
    try:
        fd = os.open(directory, os.O_RDONLY)
    except OSError:  # Windows cannot open a directory; its renames are durable on their own
        return
    try:
        os.fsync(fd)
    except OSError:
        pass
    finally:
        os.close(fd)


def _exchange(first: Path, second: Path) -> bool:
    """Swap two existing paths in one step; ``False`` where this system or filesystem cannot."""
    if _renameat2 is None:
        return False
    if _renameat2(_AT_FDCWD, os.fsencode(first), _AT_FDCWD, os.fsencode(second), _RENAME_EXCHANGE) == 0:
        return True
    error = ctypes.get_errno()
    if error in (errno.EINVAL, errno.ENOSYS, errno.EOPNOTSUPP, errno.ENOTSUP):
        return False
    raise OSError(error, os.strerror(error), str(first), None, str(second))


def _publish(staging: Path, real: Path) -> None:
    """Put the complete ``staging`` directory at ``real``, then delete the old copy (steps 4 and 5)."""
    cwd = _cwd_inside(real)
    if not os.path.lexists(real):
        os.rename(staging, real)
        old = None
    elif _exchange(staging, real):
        old = staging  # it now holds the old copy
    else:
        old = _fallback_swap(staging, real)
    _sync_directory(real.parent)
    step("swapped")
    if cwd is not None:  # this process worked inside the old copy: move it to the same place in the new one
        with contextlib.suppress(OSError):
            os.chdir(cwd if os.path.isdir(cwd) else real)
    if old is not None:
        if old.is_dir() and not old.is_symlink():
            _remove_when_unread(old)
        else:
            old.unlink(missing_ok=True)
        step("old copy removed")


def _remove_when_unread(old: Path) -> None:
    """Delete the old copy once no load reads it: each of its directories is locked exclusively first, which waits
    for the shared locks of :func:`pinned` readers."""
    locks = []
    try:
        if fcntl is not None:
            for directory, _, _ in os.walk(old):
                with contextlib.suppress(OSError):
                    fd = os.open(directory, os.O_RDONLY)
                    locks.append(fd)
                    fcntl.flock(fd, fcntl.LOCK_EX)
        shutil.rmtree(old, ignore_errors=True)
    finally:
        for fd in locks:
            os.close(fd)


def _fallback_swap(staging: Path, real: Path) -> Path:
    """Two renames, the old copy kept under a recognisable, locked name in between (what :func:`recover` restores)."""
    old = real.parent / f".{_tag(real.name)}.peft-smear-{OLD}-{secrets.token_hex(8)}"
    lock = _lock(real) if real.is_dir() else None  # the lock moves with the directory: recover leaves it alone
    try:
        os.rename(real, old)
        _sync_directory(real.parent)
        step("old copy moved aside")
        try:
            os.rename(staging, real)
        except BaseException:
            os.rename(old, real)
            raise
    finally:
        _unlock(lock)
    return old


def _cwd_inside(real: Path) -> str | None:
    try:
        cwd = os.getcwd()
    except OSError:
        return None
    return cwd if Path(cwd) == real or Path(cwd).is_relative_to(real) else None
