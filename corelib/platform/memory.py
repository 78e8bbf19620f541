"""Bookkeeping of the memory a device handed out or pinned, keyed by tensor storage; host registrations.

Keyed by storage, not by tensor, so a view of a registered buffer counts as registered and
an entry disappears when the last tensor using the storage is freed (storage Python objects
are preserved by torch while the storage lives, so a weak reference to one dies exactly when
the memory is released).
"""

from __future__ import annotations

import contextlib
import enum
import itertools
import threading
import weakref
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import torch

MEMINFO = Path("/proc/meminfo")
CGROUP = Path("/sys/fs/cgroup")


class MemoryKind(str, enum.Enum):
    """What a block of memory is, as far as copies are concerned."""

    device = "device"  # handed out by Device.empty (on the emulator: CPU tensors it owns)
    pinned = "pinned"  # page-locked host memory allocated pinned
    registered = "registered"  # existing host memory pinned in place
    claims_pinned = "claims_pinned"  # host memory that says it is pinned and is not (emulator only)
    pageable = "pageable"  # any other host memory


@dataclass(frozen=True)
class _Entry:
    kind: MemoryKind
    nbytes: int
    token: int


class MemoryLedger:
    """Thread-safe map from a storage to its kind and size."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._entries: dict[int, _Entry] = {}
        self._tokens = itertools.count(1)

    @staticmethod
    def key(tensor: torch.Tensor) -> int:
        return int(tensor.untyped_storage().data_ptr())

    def add(self, tensor: torch.Tensor, kind: MemoryKind) -> int:
        """Track the storage of ``tensor`` as ``kind``, counting the bytes ``tensor`` spans.

        Returns a token for :meth:`remove`.
        """
        storage = tensor.untyped_storage()
        key, nbytes = int(storage.data_ptr()), tensor.numel() * tensor.element_size()
        if nbytes == 0:
            return 0
        with self._lock:
            known = self._entries.get(key)
            if known is not None:
                raise ValueError(f"this host memory is already tracked as {known.kind.value} memory")
            token = next(self._tokens)
            self._entries[key] = _Entry(kind, nbytes, token)
        weakref.finalize(storage, self.remove, token, key)
        return token

    def remove(self, token: int, key: int | None = None) -> None:
        """Forget the entry made with ``token`` (a no-op if it is already gone)."""
        with self._lock:
            keys = [key] if key is not None else list(self._entries)
            for candidate in keys:
                entry = self._entries.get(candidate)
                if entry is not None and entry.token == token:
                    del self._entries[candidate]
                    return

    def kind_of(self, tensor: torch.Tensor) -> MemoryKind:
        """The kind of memory ``tensor`` lives in; untracked CPU memory is pageable."""
        if tensor.device.type != "cpu":
            return MemoryKind.device
        with self._lock:
            entry = self._entries.get(self.key(tensor))
        return entry.kind if entry is not None else MemoryKind.pageable

    def nbytes(self, kind: MemoryKind) -> int:
        with self._lock:
            return sum(entry.nbytes for entry in self._entries.values() if entry.kind is kind)


class HostRegistration:
    """Host memory made pinned in place (cudaHostRegister-style); unregister on close."""

    def __init__(self, tensor: torch.Tensor, release: Callable[[], None]) -> None:
        self.tensor = tensor
        self._release: Callable[[], None] | None = release

    @property
    def is_active(self) -> bool:
        return self._release is not None

    def close(self) -> None:
        release, self._release = self._release, None
        if release is not None:
            release()

    def __enter__(self) -> HostRegistration:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


def host_memory() -> tuple[int, int] | None:
    """(free, total) bytes of the host's memory this process may use: MemAvailable and MemTotal, each capped by
    a cgroup v2 limit (a container's); None where neither can be read.

    What the cpu backend and the stream emulator report as their device's memory
    (:meth:`corelib.platform.device.Device.memory_info`).
    """
    fields: dict[str, int] = {}
    with contextlib.suppress(OSError, ValueError, IndexError):
        for line in MEMINFO.read_text().splitlines():
            name, _, rest = line.partition(":")
            if name in ("MemAvailable", "MemTotal"):
                fields[name] = int(rest.split()[0]) * 1024
    if len(fields) < 2:
        return None
    free, total = fields["MemAvailable"], fields["MemTotal"]
    with contextlib.suppress(OSError, ValueError):
        limit = (CGROUP / "memory.max").read_text().strip()
        if limit != "max":
            total = min(total, int(limit))
            free = min(free, max(0, int(limit) - int((CGROUP / "memory.current").read_text().strip())))
    return free, total
