"""Named POSIX shared-memory segments: created reserved, leased while mapped, removed when nobody holds them.

Segments are created owner-only (0600) under unique names (the creator's pid, random bits, a
role). Their memory is reserved at creation (``posix_fallocate``): tmpfs hands out pages on
first touch and raises SIGBUS when it has none, so a full /dev/shm fails here with one line
instead of killing the process later. A segment is unlinked on close, on any failure after it
was created, and at a normal interpreter exit without close (``weakref.finalize``).

Every process that maps a segment holds a shared ``flock`` on it for as long as it does: the
lease. :func:`sweep_stale` removes a segment only when it can take the exclusive lock, so a
segment in use by a process of another PID namespace sharing /dev/shm survives, whatever the
pid in its name means here.
"""

from __future__ import annotations

import contextlib
import errno
import fcntl
import mmap
import os
import re
import secrets
import stat
import weakref
from pathlib import Path

import torch

from corelib.errors import TransportError

SHM_DIR = Path("/dev/shm")
PREFIX = "corelib"
_NAME = re.compile(rf"^{PREFIX}-(\d+)-[0-9a-f]+-\w+$")


def segment_name(role: str) -> str:
    """Unique per engine: the owner's pid (shown in /dev/shm), random bits, and a role."""
    return f"{PREFIX}-{os.getpid()}-{secrets.token_hex(4)}-{role}"


def _pid_alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


def _is_own_file(status: os.stat_result) -> bool:
    return stat.S_ISREG(status.st_mode) and status.st_uid == os.getuid()


def sweep_stale() -> list[str]:
    """Unlink this user's corelib segments that no process holds any more; returns their names.

    A segment is in use while a process holds its shared lock, whatever PID namespace that
    process lives in. A segment whose name carries the pid of a live process here is kept too
    (corelib versions before the lock held none).
    """
    removed: list[str] = []
    if not SHM_DIR.is_dir():
        return removed
    for path in SHM_DIR.iterdir():
        match = _NAME.match(path.name)
        if not match or _pid_alive(int(match.group(1))):
            continue
        # Type and owner before opening, and never a blocking open: a FIFO planted under a segment's
        # name would otherwise hold every engine start on the host in open().
        try:
            seen = path.lstat()
        except OSError:
            continue
        if not _is_own_file(seen):
            continue
        try:
            fd = os.open(path, os.O_RDONLY | os.O_NOFOLLOW | os.O_NONBLOCK | os.O_CLOEXEC)
        except OSError:
            continue
        try:
            opened = os.fstat(fd)
            if not _is_own_file(opened) or (opened.st_dev, opened.st_ino) != (seen.st_dev, seen.st_ino):
                continue  # replaced between the look and the open
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
            path.unlink()
            removed.append(path.name)
        except OSError:
            continue  # held by a live process (EWOULDBLOCK), or gone already
        finally:
            os.close(fd)
    return removed


def _unlink(path: Path) -> None:
    with contextlib.suppress(FileNotFoundError):
        path.unlink()


def _free_bytes(directory: Path) -> int:
    stats = os.statvfs(directory)
    return stats.f_bavail * stats.f_frsize


def _mib(nbytes: int) -> str:
    return f"{nbytes / 2**20:.1f} MiB"


class Segment:
    """A named POSIX shared-memory segment mapped into this process, its lease held while mapped."""

    def __init__(self, name: str, size: int, create: bool) -> None:
        self.name = name
        self.size = size
        self.owner = create
        self.path = SHM_DIR / name
        flags = os.O_RDWR | os.O_CLOEXEC | os.O_NOFOLLOW | os.O_NONBLOCK | (os.O_CREAT | os.O_EXCL if create else 0)
        try:
            fd = os.open(self.path, flags, 0o600)
        except OSError as error:
            raise TransportError(f"shared memory segment {name}: {error.strerror}") from error
        try:
            if not _is_own_file(os.fstat(fd)):
                raise TransportError(f"shared memory segment {name} is not a file of this user's; something else "
                                     f"took its name in {SHM_DIR}")
            self._lease(fd)
            if create:
                os.ftruncate(fd, size)
                self._reserve(fd)
            self.map = self._map(fd)
        except BaseException:
            os.close(fd)
            if create:
                _unlink(self.path)
            raise
        self._fd = fd  # open for as long as the mapping: it carries the lease
        self.view = memoryview(self.map)
        # A normal interpreter exit without close() still removes what this process created.
        self._finalizer = weakref.finalize(self, _unlink, self.path) if create else None

    def _lease(self, fd: int) -> None:
        try:
            fcntl.flock(fd, fcntl.LOCK_SH | fcntl.LOCK_NB)
        except OSError as error:
            raise TransportError(f"shared memory segment {self.name} is being removed by a sweep "
                                 f"({error.strerror}); start again") from None
        if os.fstat(fd).st_nlink == 0:
            raise TransportError(f"shared memory segment {self.name} was removed by a sweep; start again")

    def _reserve(self, fd: int) -> None:
        """Take the segment's pages now: tmpfs hands out pages on first touch, and SIGBUS when it has none."""
        try:
            os.posix_fallocate(fd, 0, self.size)
        except OSError as error:
            if error.errno not in (errno.ENOSPC, errno.EFBIG, errno.ENOMEM):
                raise TransportError(f"shared memory segment {self.name}: cannot reserve {_mib(self.size)}: "
                                     f"{error.strerror}") from None
            directory = self.path.parent
            raise TransportError(
                f"shared memory segment {self.name} needs {_mib(self.size)} ({self.size} bytes) but {directory} has "
                f"{_mib(_free_bytes(directory))} free: free space there, or lower engine.shm.num_slots or "
                "engine.shm.slot_bytes"
            ) from None

    def _map(self, fd: int) -> mmap.mmap:
        try:
            return mmap.mmap(fd, self.size)
        except (OSError, ValueError) as error:
            reason = error.strerror if isinstance(error, OSError) else str(error)
            raise TransportError(f"shared memory segment {self.name}: cannot map {_mib(self.size)}: {reason}") from None

    def tensor(self, offset: int, nbytes: int) -> torch.Tensor:
        """A uint8 tensor over part of the segment (no copy)."""
        return torch.frombuffer(self.map, dtype=torch.uint8, count=nbytes, offset=offset)

    def close(self) -> None:
        """Unmap, give the lease back; the owner also unlinks. Tensor views must be gone first."""
        try:
            self.view.release()
            self.map.close()
        except BufferError:
            pass  # a tensor still views the mapping; the OS unmaps at exit
        with contextlib.suppress(OSError):
            os.close(self._fd)
        if self._finalizer is not None:
            if self.owner:
                self._finalizer()  # unlinks, once
            else:
                self._finalizer.detach()  # ownership was handed on (or, in tests, a crash is played)
