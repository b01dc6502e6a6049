"""ScratchFile: a private file of the NVMe tiers (optimizer states, stage-3 param shards).

Named by host, process id and a random id under the user's ``nvme_path`` and created with ``O_EXCL`` and
mode 0600, so two optimizers (or two ranks sharing a folder) never share one and no other user reads
it. It is removed on ``close()``, when its owner is collected, and at exit (``weakref.finalize``),
its descriptors closed first. A process killed by a signal (SIGTERM, which torchrun and mp.spawn send
the other ranks when one fails; SIGKILL; the OOM killer) removes nothing; but each file is locked
(``flock``) by its process from before it bears its name, and the kernel drops the lock when the
process ends, however it ends. So the first scratch file a process makes in a folder first removes the
scratch files there that nobody holds (``sweep``): a live process's are locked, whatever host or PID
namespace it runs in (where the file system shares locks: local disks, NFS); other users' cannot be
opened; where the file system takes no locks, nothing is removed. ``transfer`` moves bytes at an offset
and turns a failed or short transfer into an OSError naming the file and the fix.
"""
from __future__ import annotations

import errno
import fcntl
import os
import re
import socket
import uuid
import warnings
import weakref

from ..user_frames import user_stacklevel

#: this host in scratch file names (for people reading the folder; liveness is the lock's)
_HOST = "".join(c if c.isalnum() or c in "._" else "_" for c in socket.gethostname()) or "host"
_PREFIX = f"fused_zero-{_HOST}-"
#: what a scratch file's name is, exactly (host, process id, 32 hex digits, its kind)
_NAME = re.compile(r"fused_zero-[A-Za-z0-9._]+-\d+-[0-9a-f]{32}\.(?:states|params)")
_swept: set[str] = set()  # the folders this process swept


def _lock(fd: int) -> bool:
    """An exclusive lock on ``fd``'s file, or False where it is held (or the file system takes no locks)."""
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except OSError:
        return False
    return True


def sweep(folder: str) -> list[str]:
    """Remove the scratch files in ``folder`` that no process holds (their process ended without removing them:
    killed by a signal); once per folder and process. Returns their names."""
    key = os.path.realpath(folder)
    if key in _swept:
        return []
    _swept.add(key)
    try:
        names = [n for n in os.listdir(folder) if _NAME.fullmatch(n)]
    except OSError:
        return []
    removed = []
    for name in names:
        path = os.path.join(folder, name)
        try:
            fd = os.open(path, os.O_RDWR | os.O_NOFOLLOW)  # (another user's: not ours to open, kept)
        except OSError:
            continue
        try:
            if _lock(fd):  # nobody holds it
                os.remove(path)
                removed.append(name)
        except OSError:
            pass
        finally:
            os.close(fd)
    return removed


def _remove(path: str, fds: list, owner: int | None = None) -> None:
    """Close ``fds`` and remove ``path``; in a child that ``os.fork()`` made of ``owner`` (a process id), which ends
    running the parent's finalizers at its exit, only close its copies of the descriptors: the file stays the
    parent's (it still uses it, and removes it itself)."""
    while fds:
        os.close(fds.pop())
    if owner is not None and os.getpid() != owner:
        return
    try:
        os.remove(path)
    except FileNotFoundError:
        pass


def size_text(nbytes: int) -> str:
    """``nbytes`` in MiB, or KiB below one MiB."""
    return f"{nbytes / 2**20:.1f} MiB" if nbytes >= 2**20 else f"{nbytes / 2**10:.1f} KiB"


class ScratchFile:
    """One private file; ``what`` names it in errors ("NVMe store"), ``label`` and ``hint`` word them (``hint``:
    what follows the fix an error names, e.g. " (the states are as before this step)")."""

    def __init__(self, folder: str, suffix: str, *, what: str, label: str, hint: str = "") -> None:
        sweep(folder)
        name = f"{_PREFIX}{os.getpid()}-{uuid.uuid4().hex}.{suffix}"
        self.path = os.path.join(folder, name)
        self.what, self.label, self.hint = what, label, hint
        # made under a name no sweep takes, locked, then given its own: never seen unlocked while its process lives
        hidden = os.path.join(folder, f".{name}.new")
        self._fds = [os.open(hidden, os.O_RDWR | os.O_CREAT | os.O_EXCL, 0o600)]
        try:
            _lock(self._fds[0])
            os.rename(hidden, self.path)
        except OSError:
            _remove(hidden, self._fds)
            raise
        self._finalizer = weakref.finalize(self, _remove, self.path, self._fds, os.getpid())

    def open_direct(self) -> None:
        """A second descriptor that bypasses the page cache (``direct_fd``)."""
        self._fds.append(os.open(self.path, os.O_RDWR | os.O_DIRECT))

    @property
    def fd(self) -> int:
        if not self._fds:
            raise RuntimeError(f"the {self.what} {self.path} is closed")
        return self._fds[0]

    @property
    def direct_fd(self) -> int:
        return self._fds[1]

    def reserve(self, nbytes: int, needs: str, why: str = "") -> None:
        """Size the file to ``nbytes`` (reads as zeros) with its space reserved, so that nothing written on the
        disk later (checkpoints, logs) can take the room mid-run. A disk without the room raises (the caller
        names the file; the build agrees on it, so every rank raises: ``stages._new_partition``). Where the file
        system cannot reserve (glibc emulates posix_fallocate on most that cannot), the file is sparse and a
        warning says so: a write that then finds the disk full fails as an I/O error does.
        ``needs`` and ``why`` word the size in errors ("the states need" 12 MiB "(two slots of each kind)")."""
        if nbytes == 0:
            return
        try:
            os.posix_fallocate(self.fd, 0, nbytes)
            return
        except OSError as e:
            if e.errno in (errno.ENOSPC, errno.EDQUOT):
                raise OSError(e.errno, f"{e.strerror}: {needs} {size_text(nbytes)} there{why}") from None
            if e.errno not in (errno.EOPNOTSUPP, errno.ENOSYS, errno.EINVAL):
                raise
            reason = e.strerror
        os.ftruncate(self.fd, nbytes)
        warnings.warn(f"fused_zero {self.label}: could not reserve {size_text(nbytes)} for the {self.what} "
                      f"{self.path} ({reason}); the file grows as the steps write it, and a write that finds the "
                      "disk full fails as an I/O error does (README: Failures)", RuntimeWarning,
                      stacklevel=user_stacklevel())

    def error(self, doing: str, e: OSError) -> OSError:
        full = e.errno in (errno.ENOSPC, errno.EDQUOT, errno.EFBIG)
        fix = "free space there" if full else "check that disk (it reported an error, not a full disk)"
        return OSError(e.errno, f"fused_zero {self.label}: {doing} {self.path} failed ({e.strerror}); {fix}, or pass "
                                f"another nvme_path{self.hint}")

    def transfer(self, write: bool, view: memoryview, offset: int, fd: int | None = None) -> None:
        """Write ``view`` at byte ``offset`` (or read into it), whole or an OSError naming the file."""
        doing = "writing" if write else "reading"
        try:
            done = (os.pwritev if write else os.preadv)(self.fd if fd is None else fd, [view], offset)
        except OSError as e:
            raise self.error(doing, e) from None
        if done != len(view):
            raise self.error(doing, OSError(28 if write else 5, "short transfer"))

    def close(self) -> None:
        self._finalizer()
