"""ScratchFile: a private file of the NVMe tiers (optimizer states, stage-3 param shards).

Named by host, process id and a random id under the user's ``nvme_path`` and created with ``O_EXCL`` and
mode 0600, so two optimizers (or two ranks sharing a folder) never share one and no other user reads
it. It is removed on ``close()``, when its owner is collected, and at exit (``weakref.finalize``),
its descriptors closed first. A process killed by a signal (SIGTERM, which torchrun and mp.spawn send
the other ranks when one fails; SIGKILL; the OOM killer) removes nothing: the next scratch file made
in that folder on the same host first removes the files of this host's processes that are gone
(``sweep``; a process id alive again, reused, keeps its files). ``transfer`` moves bytes at an offset
and turns a failed or short transfer into an OSError naming the file and the fix.
"""
from __future__ import annotations

import os
import socket
import uuid
import weakref

#: this host in scratch file names ("-" taken out: the name's fields are split at "-")
_HOST = "".join(c if c.isalnum() or c in "._" else "_" for c in socket.gethostname()) or "host"
_PREFIX = f"fused_zero-{_HOST}-"


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except OSError:  # (EPERM: another user's process)
        return True
    return True


def sweep(folder: str) -> list[str]:
    """Remove the scratch files in ``folder`` left by processes of this host that are gone; their names."""
    try:
        names = os.listdir(folder)
    except OSError:
        return []
    removed = []
    for name in names:
        pid = name[len(_PREFIX):].split("-", 1)[0] if name.startswith(_PREFIX) else ""
        if not pid.isdigit() or int(pid) == os.getpid() or _alive(int(pid)):
            continue
        try:
            os.remove(os.path.join(folder, name))
            removed.append(name)
        except OSError:
            pass
    return removed


def _remove(path: str, fds: list) -> None:
    while fds:
        os.close(fds.pop())
    try:
        os.remove(path)
    except FileNotFoundError:
        pass


class ScratchFile:
    """One private file; ``what`` names it in errors ("NVMe store"), ``label`` and ``hint`` word them."""

    def __init__(self, folder: str, suffix: str, *, what: str, label: str, hint: str) -> None:
        sweep(folder)
        self.path = os.path.join(folder, f"{_PREFIX}{os.getpid()}-{uuid.uuid4().hex}.{suffix}")
        self.what, self.label, self.hint = what, label, hint
        self._fds = [os.open(self.path, os.O_RDWR | os.O_CREAT | os.O_EXCL, 0o600)]
        self._finalizer = weakref.finalize(self, _remove, self.path, self._fds)

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

    def error(self, doing: str, e: OSError) -> OSError:
        return OSError(e.errno, f"fused_zero {self.label}: {doing} {self.path} failed ({e.strerror}); {self.hint}")

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
