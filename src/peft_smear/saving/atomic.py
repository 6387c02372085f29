"""Atomic saves: a directory is written completely beside its target, then swapped into place in one step; where no
swap can be done, its files are moved in one by one in an order whose interruption never looks like a whole save.

Every save of peft-smear (``save_pretrained`` of a SMEAR model, exports, banks, EMoE files, ``peft-smear train`` runs)
goes through :func:`staged_directory`, so that a process killed at any moment of a save leaves at the target path
the complete old directory (nothing, if there was none), the complete new one, or, in place (step 4b), a directory
without the new save's configs, which no loader takes for a whole save and which the next save completes. How:

1. **Lock, recover and clean.** Saves to one target run one after the other: each holds the lock file
   ``.<name>.peft-smear-lock`` beside it (inside the target where its parent is not writable) from here to the end
   (the last one removes the file; a kill leaves it, and the next save takes it). A save that finds the lock held says
   once on stderr which process holds it, and gives up after ``PEFT_SMEAR_LOCK_TIMEOUT`` seconds (default 60) with an
   error naming that process (see :mod:`peft_smear.saving.locks`, also for filesystems without ``flock``). Then what
   killed saves left is put in order: an old copy whose target is missing is renamed back (a kill inside the
   fallback's two renames, step 4a), an interrupted in-place save is completed (step 4b; unless another save, say plain
   PEFT's, has written the directory since: then it is dropped), and staging directories and old copies are removed.
   A sibling whose save is still running holds a ``flock`` on it and is left alone.
2. **Stage.** A sibling directory ``.<name>.peft-smear-staging-<random>`` is created (same filesystem, so the swap is a
   rename) with the target's mode, owner, group and ACLs. With ``keep_others``, it first receives every entry of the
   current target that the save does not rewrite, as hard links: a checkpoint's optimizer and trainer state, a run's
   report, an adapter beside EMoE files. Files the save rewrites are not carried over (``rewrites``), or carried over
   as copies when the save reads and amends them (``amends``, e.g. ``README.md``): the save then never writes through a
   link into the old copy. Where no sibling can be made (the target is a mount point, its parent is not writable) or
   the target's files cannot be linked, the staging directory is ``<target>/.peft-smear-staging-<random>`` instead,
   and the save goes in place (4b): nothing is copied.
3. **Write and sync.** The caller writes into the staging directory; what it wrote gets the owner, group and mode of
   the file it replaces (of its directory, for a new one), as PEFT's own save leaves them; then every file written and
   every directory is ``fsync``-ed, so that no step publishes data still only in the page cache.
4. **Swap.** a) With a target, ``renameat2(RENAME_EXCHANGE)`` (Linux 3.15, glibc 2.28) exchanges staging and target
   in one step; without one, a plain ``rename``. Where exchange is missing (another OS, an old glibc, a filesystem that
   refuses the flag) the target is renamed aside to ``.<name>.peft-smear-old-<random>`` and the staging directory to
   the target: between those two renames the path is absent for an instant, but the complete old copy is under that
   recognisable name and step 1 of the next save (or :func:`recover`) puts it back.
   b) **In place**, where the directory cannot be renamed (a mount point: ``EBUSY``; a directory of an overlayfs lower
   layer: ``EXDEV``; someone else's directory in a sticky one: ``EPERM``) or was staged inside itself: the staging
   directory is renamed ``...-publishing-<random>`` (complete), the target is locked against loads, the configs it
   replaces (``*config.json``) are deleted, every other file is renamed over its old one, and the new configs come
   last. Interrupted, the target has no config (never a mix that loads) and the next save moves the rest in. Files of
   the old directory that the save does not write stay, as with PEFT's own save. If a move fails, the files stay in
   the publishing directory and the error names it.
5. **Delete the old copy** (now at the staging or old-copy name), once no load reads it: a load through
   :func:`pinned` holds a shared ``flock`` on the directory it reads, so that its config and its weights come from one
   save. Loads are waited for at most ``PEFT_SMEAR_LOCK_TIMEOUT`` seconds; then the old copy is left to the next save.

A load never waits: it reads the last whole save, or fails at once naming the process whose in-place save is moving
files. A symlinked target keeps its link: the directory it points to is replaced. If this process's working directory
is inside the target, it is moved to the same place in the new directory. Files that another process creates in the
target while a save with ``keep_others`` runs are not in the new directory (they were not there when it was staged).

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
import sys
import threading
from collections.abc import Collection, Iterator
from pathlib import Path

from . import locks
from .locks import TIMEOUT_VARIABLE, DirectoryBusyError


try:
    import fcntl
except ImportError:  # Windows: no locks, so a stale sibling is any sibling
    fcntl = None


__all__ = [
    "TIMEOUT_VARIABLE",
    "DirectoryBusyError",
    "UnpublishedSaveError",
    "destination",
    "exchange_supported",
    "interrupted",
    "locked",
    "own_entry",
    "pinned",
    "recover",
    "staged_directory",
    "step",
]

STAGING, OLD, PUBLISHING = "staging", "old", "publishing"
_SIBLING = re.compile(rf"^\.(?P<tag>.+)\.peft-smear-(?P<kind>{STAGING}|{OLD}|{PUBLISHING})-[0-9a-f]{{16}}$")
_INNER = re.compile(rf"^\.peft-smear-(?P<kind>{STAGING}|{PUBLISHING})-[0-9a-f]{{16}}$")
_INNER_LOCK = ".peft-smear-lock"
RECORD_SUFFIX = "config.json"  # adapter_config.json, emoe_config.json: what makes a directory load
_AT_FDCWD, _RENAME_EXCHANGE = -100, 2
_MAX_TAG = 120  # NAME_MAX is 255; the rest of a sibling's name takes 40


class UnpublishedSaveError(OSError):
    """A complete save could not be moved to its target; the message names where its files are."""


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


def own_entry(name: str) -> bool:
    """Whether ``name``, an entry of a target directory, is a save's own (its lock, an in-place save's staging)
    rather than the user's: an output directory holding only these is empty."""
    return name == _INNER_LOCK or _INNER.match(name) is not None


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
    ``target`` (see the module's description). On an error in the block the staging directory is removed and
    ``target`` is untouched; if the final move fails, the complete save stays where the error says.

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
    if real.exists() and not real.is_dir():
        raise NotADirectoryError(f"{target} is a file, not a directory.")
    real.parent.mkdir(parents=True, exist_ok=True)
    with _target_lock(real, target):  # saves to one target run one after the other
        _recover(real, target)
        staging, lock, in_place = _stage(real, keep_others, set(rewrites), set(amends))
        with _live_lock:
            _live[staging] = target
        try:
            try:
                step("staged")
                yield staging
                step("written")
                _adopt(staging, real)
                _sync_tree(staging)
            except BaseException:
                shutil.rmtree(staging, ignore_errors=True)  # unfinished: never the target, never a finished save
                raise
            step("synced")
            held, lock = lock, None
            _publish(staging, real, target, held, in_place)
        finally:
            with _live_lock:
                _live.pop(staging, None)
            locks.unlock(lock)


@contextlib.contextmanager
def locked(target: str | os.PathLike, timeout: float | None = None) -> Iterator[None]:
    """Hold the lock of saves to ``target`` for the block (saves to it in this thread nest inside), e.g. to check
    that an output directory is empty and fill it with no other save in between. ``timeout``: seconds to wait for
    another holder (default: ``PEFT_SMEAR_LOCK_TIMEOUT``); 0 fails at once, naming the holder."""
    real = Path(os.path.realpath(target))
    real.parent.mkdir(parents=True, exist_ok=True)
    with _target_lock(real, Path(target), timeout):
        yield


@contextlib.contextmanager
def pinned(path: str | os.PathLike) -> Iterator[str]:
    """Yield a path through which ``path`` (a directory) reads as one save, however many files are read from it and
    whatever saves replace it meanwhile: on Linux, ``/proc/self/fd/<n>`` of the directory opened once, held with a
    shared ``flock`` that a save waits for before it deletes an old copy (step 5), so its files stay. Never waits: a
    directory whose files an in-place save is moving raises :class:`DirectoryBusyError` naming that process.
    Elsewhere (no ``/proc``, no ``flock``) ``path`` itself."""
    real = os.path.realpath(path)
    for _ in range(100):  # each retry follows a save that replaced the directory while it was being opened
        try:
            fd = os.open(real, os.O_RDONLY | getattr(os, "O_DIRECTORY", 0))
        except OSError:
            break  # let the reader report what is wrong with the path
        if fcntl is None or not os.path.isdir(f"/proc/self/fd/{fd}"):
            os.close(fd)
            break
        busy = False
        try:
            fcntl.flock(fd, fcntl.LOCK_SH | fcntl.LOCK_NB)
        except BlockingIOError:
            busy = True
        except OSError:  # a filesystem without flock: the directory is still read as one
            pass
        opened, current = os.fstat(fd), _stat_or_none(real)
        if current is not None and (current.st_dev, current.st_ino) == (opened.st_dev, opened.st_ino):
            if busy:
                os.close(fd)
                holder = locks.describe_holders(opened, "WRITE")
                raise DirectoryBusyError(
                    f"{path} is being saved in place by {holder}: its files are replaced one by one right now. Load "
                    "it again once that save is done."
                )
            try:
                yield f"/proc/self/fd/{fd}"
            finally:
                os.close(fd)
            return
        os.close(fd)  # a save replaced the directory before it was held: read the new one
    yield str(path)


def interrupted(directory: str | os.PathLike) -> str | None:
    """Why ``directory``, which lacks its config, is not a whole save, where an in-place save (step 4b) is moving
    its files in or was interrupted doing so (its publishing directory is in ``directory``, in its parent for an
    adapter in a subfolder, or beside either); ``None`` where no such save is found."""
    directory = Path(os.path.realpath(directory))
    places = [directory, directory.parent]
    for place in places:
        candidates = []
        with contextlib.suppress(OSError):
            candidates += [Path(e.path) for e in os.scandir(place) if _kind_inside(e.name) == PUBLISHING]
        with contextlib.suppress(OSError):
            tag = _tag(place.name)
            candidates += [Path(e.path) for e in os.scandir(place.parent) if _kind_beside(e.name, tag) == PUBLISHING]
        for publishing in candidates:
            lock = locks.try_lock_directory(publishing)
            if lock is False:
                holder = locks.describe_holders(os.stat(publishing), "WRITE")
                return f"{holder} is moving a save's files into {place} right now"
            locks.unlock(lock)
            return (
                f"an interrupted save left it without its config; the rest of that save's files are in {publishing}, "
                f"and peft_smear.saving.atomic.recover({str(place)!r}) (or the next save to {place}) moves them in"
            )
    return None


def _stat_or_none(path: str | os.PathLike) -> os.stat_result | None:
    try:
        return os.stat(path)
    except OSError:
        return None


def _lstat_or_none(path: str | os.PathLike) -> os.stat_result | None:
    try:
        return os.lstat(path)
    except OSError:
        return None


# --- the lock of saves ------------------------------------------------------------------------------------------


_held_targets: dict[Path, tuple[int, int]] = {}  # target -> (thread id, depth): this thread's saves nest freely
_held_lock = threading.Lock()


@contextlib.contextmanager
def _target_lock(real: Path, shown: Path, timeout: float | None = None) -> Iterator[None]:
    """Hold the exclusive lock of saves to ``real`` (:func:`~peft_smear.saving.locks.save_lock` on the file
    :func:`_lock_path` names); saves to it by this thread nest inside. Without it, one save's recovery (step 1)
    deleted another's staging directory between its creation and its lock."""
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
    with locks.save_lock(_lock_path(real, shown), shown, locks.lock_timeout() if timeout is None else timeout):
        with _held_lock:
            _held_targets[real] = (thread, 1)
        try:
            yield
        finally:
            with _held_lock:
                del _held_targets[real]


def _lock_path(real: Path, shown: Path) -> Path:
    """The lock file of saves to ``real``: beside it where its parent takes a new file (or holds the lock file
    already), else inside it."""
    beside = real.parent / f".{_tag(real.name)}.peft-smear-lock"
    if os.path.lexists(beside) or locks.writable(real.parent):
        return beside
    if real.is_dir() and locks.writable(real):
        return real / _INNER_LOCK
    why = f"Cannot save to {shown}: neither its parent directory nor {shown} itself is writable"
    raise PermissionError(errno.EACCES, why, str(shown))


# --- recovery -----------------------------------------------------------------------------------------------------


def recover(target: str | os.PathLike) -> None:
    """Put ``target`` back in order after saves to it were killed: if it is missing while the complete old copy of an
    interrupted fallback swap sits beside it, rename that back; move in the rest of an interrupted in-place save; then
    remove every sibling those saves left (staging directories, old copies) whose save is not running any more. Every
    save to ``target`` starts with this."""
    real = Path(os.path.realpath(target))
    if not real.parent.is_dir():
        return
    with _target_lock(real, Path(target)):
        _recover(real, Path(target))


def _recover(real: Path, shown: Path) -> None:
    tag = _tag(real.name)
    found = []
    with contextlib.suppress(OSError):
        found += [(Path(e.path), _kind_beside(e.name, tag)) for e in os.scandir(real.parent)]
    if real.is_dir():
        with contextlib.suppress(OSError):
            found += [(Path(e.path), _kind_inside(e.name)) for e in os.scandir(real)]
    siblings = []
    for path, kind in found:
        if kind is not None:
            lock = locks.try_lock_directory(path)
            if lock is not False:  # False: a running save holds it
                siblings.append((path, kind, lock))
    try:
        if not os.path.lexists(real):
            olds = [(path.stat().st_mtime_ns, path) for path, kind, _ in siblings if kind == OLD]
            if olds:
                os.rename(max(olds)[1], real)
                _sync_directory(real.parent)
        for path in sorted((path for path, kind, _ in siblings if kind == PUBLISHING), key=os.path.getmtime):
            if not _superseded(path, real):  # else removed below with the rest: a later save wrote the directory
                where = f"An interrupted save to {shown} left its new files in {path}"
                _move_in_or_say_where(path, real, shown, where)
        for path, _, _ in siblings:
            if path.is_dir() and not path.is_symlink():
                shutil.rmtree(path, ignore_errors=True)
            elif os.path.lexists(path):
                path.unlink()
    finally:
        for _, _, lock in siblings:
            locks.unlock(lock)


def _superseded(publishing: Path, real: Path) -> bool:
    """Whether another save (plain PEFT's, say) wrote ``real`` after the interrupted in-place save in ``publishing``
    stopped: a config it would put in place is already there and newer than that save's last move (the old ones are
    older), so moving it in would put an earlier save over a later one."""
    stopped = publishing.stat().st_ctime_ns
    for config in publishing.rglob(f"*{RECORD_SUFFIX}"):
        there = _stat_or_none(real / config.relative_to(publishing))
        if there is not None and there.st_mtime_ns > stopped:
            return True
    return False


def _kind_beside(name: str, tag: str) -> str | None:
    match = _SIBLING.match(name)
    return match["kind"] if match and match["tag"] == tag else None


def _kind_inside(name: str) -> str | None:
    match = _INNER.match(name)
    return match["kind"] if match else None


def _inside_live_staging(real: Path) -> bool:
    with _live_lock:
        return any(real == staging or real.is_relative_to(staging) for staging in _live)


def _tag(name: str) -> str:
    """The target's name as its siblings spell it: itself, or for a very long name a prefix and a hash."""
    if len(name) <= _MAX_TAG:
        return name
    return name[: _MAX_TAG - 17] + "~" + hashlib.sha256(name.encode()).hexdigest()[:16]


# --- staging ------------------------------------------------------------------------------------------------------


def _stage(real: Path, keep_others: bool, rewrites: set[str], amends: set[str]) -> tuple[Path, int | None, bool]:
    """The staging directory, its lock, and whether the save goes in place (step 2)."""
    if not real.is_dir():
        return (*_make_directory(real.parent, f".{_tag(real.name)}.peft-smear-{STAGING}-"), False)
    if not _is_mount_point(real):
        try:
            staging, lock = _make_directory(real.parent, f".{_tag(real.name)}.peft-smear-{STAGING}-")
        except PermissionError:  # a parent directory this process cannot write to
            pass
        else:
            _adopt_directory(real, staging)
            if not keep_others or _carry_over(real, staging, "", rewrites, amends):
                return staging, lock, False
            shutil.rmtree(staging)  # files that cannot be linked are not copied: the save goes in place
            locks.unlock(lock)
    try:
        staging, lock = _make_directory(real, f".peft-smear-{STAGING}-")
    except PermissionError as error:
        raise PermissionError(error.errno, f"Cannot save to {real}: it is not writable", str(real)) from None
    _adopt_directory(real, staging)
    for name in amends:
        if (real / name).is_file():
            (staging / name).parent.mkdir(parents=True, exist_ok=True)
            shutil.copy2(real / name, staging / name)
    return staging, lock, True


def _make_directory(parent: Path, prefix: str) -> tuple[Path, int | None]:
    while True:
        path = parent / f"{prefix}{secrets.token_hex(8)}"
        try:
            os.mkdir(path)
        except FileExistsError:
            continue
        return path, locks.lock_directory(path)


def _is_mount_point(path: Path) -> bool:
    """Whether ``path`` is a mount point (a bind mount within one filesystem too): renaming it fails with EBUSY."""
    if os.path.ismount(path):
        return True
    with contextlib.suppress(OSError), open("/proc/self/mountinfo", encoding="utf-8", errors="replace") as file:
        escaped = re.compile(r"\\([0-7]{3})")
        for line in file:
            fields = line.split()
            if len(fields) > 4 and escaped.sub(lambda m: chr(int(m[1], 8)), fields[4]) == str(path):
                return True
    return False


def _carry_over(source: Path, staging: Path, prefix: str, rewrites: set[str], amends: set[str]) -> bool:
    """Carry the entries of ``source`` over into ``staging`` (step 2); ``False`` as soon as a file cannot be linked."""
    for entry in os.scandir(source):
        relative = prefix + entry.name
        if relative in rewrites or (not prefix and own_entry(entry.name)):
            continue
        destination_path = staging / entry.name
        if entry.is_symlink():
            os.symlink(os.readlink(entry.path), destination_path)
            _own(destination_path, entry.stat(follow_symlinks=False))
        elif entry.is_dir():
            os.mkdir(destination_path)
            _own(destination_path, entry.stat())
            os.chmod(destination_path, stat.S_IMODE(entry.stat().st_mode))
            if not _carry_over(Path(entry.path), destination_path, relative + "/", rewrites, amends):
                return False
        elif relative in amends:
            shutil.copy2(entry.path, destination_path)
        else:
            try:
                os.link(entry.path, destination_path)
            except OSError:  # another device (a mount point inside), links refused (protected_hardlinks), none at all
                return False
    return True


def _adopt_directory(real: Path, staging: Path) -> None:
    """Give the staging directory the target's mode, owner, group and ACLs (before anything is written in it, so
    that new files inherit a default ACL)."""
    info = os.stat(real)
    _own(staging, info)
    os.chmod(staging, stat.S_IMODE(info.st_mode))
    for name in _xattrs(real):
        if name.startswith(("system.posix_acl_", "user.")):
            with contextlib.suppress(OSError):
                os.setxattr(staging, name, os.getxattr(real, name))


def _xattrs(path: Path) -> list[str]:
    try:
        return os.listxattr(path)
    except (OSError, AttributeError):  # a filesystem without extended attributes, or not Linux
        return []


def _adopt(staging: Path, real: Path) -> None:
    """What the save wrote gets the owner, group and mode PEFT's save, which rewrites files in place, leaves: those
    of the file it replaces; a new file or directory gets the owner and group of the directory it is in."""
    if not real.is_dir():
        return
    for directory, directories, files in os.walk(staging):
        here = Path(directory)
        relative, parent = here.relative_to(staging), os.stat(here)
        for name in directories + files:
            path = here / name
            existing, info = _lstat_or_none(real / relative / name), os.lstat(path)
            if existing is None:
                _own(path, parent)
            elif (existing.st_dev, existing.st_ino) != (info.st_dev, info.st_ino):  # not a carried-over link
                _own(path, existing)
                if not stat.S_ISLNK(info.st_mode) and stat.S_IFMT(existing.st_mode) == stat.S_IFMT(info.st_mode):
                    os.chmod(path, stat.S_IMODE(existing.st_mode))


def _own(path: Path, like: os.stat_result) -> None:
    """Give ``path`` the owner and group of ``like`` where this process may (root; or the group alone, for one of
    its groups); otherwise it stays this process's, as a file PEFT creates would."""
    info = os.lstat(path)
    if not hasattr(os, "lchown") or (info.st_uid, info.st_gid) == (like.st_uid, like.st_gid):
        return
    for uid in (like.st_uid, -1):
        try:
            os.lchown(path, uid, like.st_gid)
            return
        except PermissionError:
            continue


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


# --- publishing ---------------------------------------------------------------------------------------------------


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


def _publish(staging: Path, real: Path, shown: Path, lock: int | None, in_place: bool) -> None:
    """Put the complete ``staging`` directory at ``real`` (step 4), then delete the old copy (step 5). Takes over
    ``lock``, the staging directory's."""
    if in_place:
        _publish_in_place(staging, real, shown, lock)
        return
    cwd = _cwd_inside(real)
    locks.unlock(lock)  # once at the target, the new directory must not look like one an in-place save holds
    try:
        if not os.path.lexists(real):
            os.rename(staging, real)
            old = None
        elif _exchange(staging, real):
            old = staging  # it now holds the old copy
        else:
            old = _fallback_swap(staging, real)
    except OSError:  # EBUSY, EXDEV, EPERM...: the directory cannot be renamed, its files can
        _publish_in_place(staging, real, shown, locks.lock_directory(staging))
        return
    _sync_directory(real.parent)
    step("swapped")
    if cwd is not None:  # this process worked inside the old copy: move it to the same place in the new one
        with contextlib.suppress(OSError):
            os.chdir(cwd if os.path.isdir(cwd) else real)
    if old is not None:
        if old.is_dir() and not old.is_symlink():
            _remove_when_unread(old, shown)
        else:
            old.unlink(missing_ok=True)
        step("old copy removed")


def _publish_in_place(staging: Path, real: Path, shown: Path, lock: int | None) -> None:
    """Step 4b: the complete ``staging`` directory renamed ``...-publishing-...``, then its files moved into
    ``real``; on an error they stay there, and the error says so. Takes over ``lock``."""
    publishing = staging.with_name(staging.name.replace(f"-{STAGING}-", f"-{PUBLISHING}-"))
    try:
        try:
            os.rename(staging, publishing)
        except OSError as error:
            raise UnpublishedSaveError(
                f"Could not put the save to {shown} in place ({error.strerror}); it is complete in {staging}."
            ) from error
        step("publishing")
        _move_in_or_say_where(publishing, real, shown, f"The new files of {shown} are complete in {publishing}")
    finally:
        locks.unlock(lock)
    shutil.rmtree(publishing, ignore_errors=True)
    step("published")


def _move_in_or_say_where(source: Path, real: Path, shown: Path, where: str) -> None:
    """:func:`_move_in` once no load reads ``real``; if it fails, an error that starts with ``where`` and says how the
    files get in."""
    try:
        real.mkdir(exist_ok=True)
        with locks.unread(real, shown):
            _move_in(source, real)
    except OSError as error:
        raise UnpublishedSaveError(
            f"{where}; moving them in failed ({error}). The next save to {shown}, or "
            f"peft_smear.saving.atomic.recover({str(shown)!r}), moves them in."
        ) from error


def _move_in(source: Path, real: Path) -> None:
    """Move every file under ``source`` to the same place under ``real``, replacing what is there: first the configs
    it replaces (``*config.json``) are deleted, then the other files are moved, then the configs; a directory
    interrupted in between has no config, so it never loads as a mix of two saves. Files that are already ``real``'s
    (links carried over) stay."""
    files, configs = [], []
    for directory, directories, names in os.walk(source):
        here = Path(directory)
        there = real / here.relative_to(source)
        for name in list(directories):
            if (here / name).is_symlink():  # moved as a link, not entered
                directories.remove(name)
                names.append(name)
            elif not (there / name).is_dir():
                os.mkdir(there / name)
                info = os.stat(here / name)
                _own(there / name, info)
                os.chmod(there / name, stat.S_IMODE(info.st_mode))
        for name in names:
            old, new = _lstat_or_none(there / name), os.lstat(here / name)
            if old is None or (old.st_dev, old.st_ino) != (new.st_dev, new.st_ino):
                (configs if name.endswith(RECORD_SUFFIX) else files).append((here / name, there / name))
    for _, path in configs:
        with contextlib.suppress(FileNotFoundError):
            os.unlink(path)
    if configs:
        _sync_directories(path.parent for _, path in configs)
        step("removed the configs")
    for moved in (files, configs):
        for source_path, path in moved:
            os.replace(source_path, path)
            step(f"moved {path.relative_to(real).as_posix()}")
        _sync_directories(path.parent for _, path in moved)


def _sync_directories(directories: Iterator[Path]) -> None:
    for directory in set(directories):
        _sync_directory(directory)


def _remove_when_unread(old: Path, shown: Path) -> None:
    """Delete the old copy once no load reads it: each of its directories is locked exclusively first, which waits
    for the shared locks of :func:`pinned` readers (at most ``PEFT_SMEAR_LOCK_TIMEOUT`` seconds; a copy still read
    then is left for the next save to remove)."""
    with contextlib.ExitStack() as stack:
        try:
            for directory, _, _ in os.walk(old):
                stack.enter_context(locks.unread(Path(directory), shown))
        except DirectoryBusyError as error:
            print(f"peft-smear: left the old copy {old} for the next save to remove: {error}", file=sys.stderr)
            return
        except OSError:
            pass
        shutil.rmtree(old, ignore_errors=True)


def _fallback_swap(staging: Path, real: Path) -> Path:
    """Two renames, the old copy kept under a recognisable name in between (what :func:`recover` restores)."""
    old = real.parent / f".{_tag(real.name)}.peft-smear-{OLD}-{secrets.token_hex(8)}"
    os.rename(real, old)
    _sync_directory(real.parent)
    step("old copy moved aside")
    try:
        os.rename(staging, real)
    except BaseException:
        os.rename(old, real)
        raise
    return old


def _cwd_inside(real: Path) -> str | None:
    try:
        cwd = os.getcwd()
    except OSError:
        return None
    return cwd if Path(cwd) == real or Path(cwd).is_relative_to(real) else None
