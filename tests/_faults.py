"""Faults the offload tests inject: a disk that fills up after a few writes, a file system that cannot reserve."""
from __future__ import annotations

import errno
import os


def full_disk_after(real_pwritev, writes: int):
    """A stand-in for ``os.pwritev`` that makes ``writes`` writes, then raises ENOSPC on every one after."""
    calls = [0]

    def pwritev(fd, buffers, offset):
        calls[0] += 1
        if calls[0] > writes:
            raise OSError(errno.ENOSPC, "No space left on device")
        return real_pwritev(fd, buffers, offset)
    return pwritev


def failing_fallocate(code: int):
    """A stand-in for ``os.posix_fallocate`` that raises ``code`` (ENOSPC: a full disk; EOPNOTSUPP: a file system
    that cannot reserve space)."""
    def posix_fallocate(fd, offset, length):
        raise OSError(code, os.strerror(code))
    return posix_fallocate
