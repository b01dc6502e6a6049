"""ScratchFile: a private file of the NVMe tiers (optimizer states, stage-3 param shards).

Named by process id and a random id under the user's ``nvme_path`` and created with ``O_EXCL`` and
mode 0600, so two optimizers (or two ranks sharing a folder) never share one and no other user reads
it. It is removed on ``close()``, when its owner is collected, and at exit (``weakref.finalize``),
its descriptors closed first. ``transfer`` moves bytes at an offset and turns a failed or short
transfer into an OSError naming the file and the fix.
"""
from __future__ import annotations

import os
import uuid
import weakref


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
        self.path = os.path.join(folder, f"fused_zero-{os.getpid()}-{uuid.uuid4().hex}.{suffix}")
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
