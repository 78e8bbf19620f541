"""What a process holds that an engine may leave behind: threads, child processes, SHM segments, fds, memory.

A :class:`Holdings` snapshot taken before and after a piece of work shows what the work
left; :func:`settled` waits (bounded) for threads and processes that are already on their way out.
"""

from __future__ import annotations

import gc
import os
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

from corelib.transport.shm import PREFIX, SHM_DIR

PROC = Path("/proc")


def rss_bytes(pid: int | None = None) -> int:
    """Resident set size of a process (this one by default), from /proc."""
    for line in (PROC / str(pid or os.getpid()) / "status").read_text().splitlines():
        if line.startswith("VmRSS:"):
            return int(line.split()[1]) * 1024
    raise RuntimeError(f"no VmRSS line for pid {pid}")


def _stat_fields(pid: int) -> list[str] | None:
    try:
        text = (PROC / str(pid) / "stat").read_text()
    except OSError:
        return None
    return text.rsplit(")", 1)[1].split()  # the command name may hold spaces and parentheses


def is_running(pid: int) -> bool:
    """The process exists and is not a zombie."""
    fields = _stat_fields(pid)
    return fields is not None and fields[0] != "Z"


def children(pid: int | None = None) -> set[int]:
    """Live (non-zombie) child processes of ``pid`` (this process by default)."""
    parent = str(pid or os.getpid())
    found = set()
    for entry in PROC.iterdir():
        if entry.name.isdigit():
            fields = _stat_fields(int(entry.name))
            if fields is not None and fields[1] == parent and fields[0] != "Z":
                found.add(int(entry.name))
    return found


def segments(pid: int | None = None) -> set[str]:
    """The SHM segments that process ``pid`` (this one by default) created and has not removed."""
    mark = f"{PREFIX}-{pid or os.getpid()}-"
    return {p.name for p in SHM_DIR.iterdir() if p.name.startswith(mark)}


def open_fds() -> set[int]:
    return {int(name) for name in os.listdir("/proc/self/fd")}


@dataclass(frozen=True)
class Holdings:
    threads: frozenset[str]  # "name#ident": a thread started again under the same name is a new one
    children: frozenset[int]
    segments: frozenset[str]
    fds: frozenset[int]

    @classmethod
    def now(cls) -> Holdings:
        gc.collect()  # drop engines whose last reference sits in a cycle, so their pipes close
        threads = frozenset(f"{t.name}#{t.ident}" for t in threading.enumerate() if t.is_alive())
        return cls(threads, frozenset(children()), frozenset(segments()), frozenset(open_fds()))

    def extra_since(self, before: Holdings) -> dict[str, list[str]]:
        """What is held now and was not before, by kind; empty when nothing leaked."""
        extra = {
            "threads": sorted(self.threads - before.threads),
            "child processes": [str(p) for p in sorted(self.children - before.children)],
            "SHM segments": sorted(self.segments - before.segments),
            "file descriptors": [f"{fd} -> {_fd_target(fd)}" for fd in sorted(self.fds - before.fds)],
        }
        return {kind: items for kind, items in extra.items() if items}


def _fd_target(fd: int) -> str:
    try:
        return os.readlink(f"/proc/self/fd/{fd}")
    except OSError:
        return "?"


def settled(before: Holdings, within: float = 5.0) -> dict[str, list[str]]:
    """What is still held beyond ``before`` once ``within`` seconds passed (or sooner, when nothing is)."""
    deadline = time.monotonic() + within
    while True:
        extra = Holdings.now().extra_since(before)
        if not extra or time.monotonic() >= deadline:
            return extra
        time.sleep(0.05)


def timed(fn: Callable[[], object]) -> float:
    """Seconds ``fn`` took."""
    start = time.perf_counter()
    fn()
    return time.perf_counter() - start
