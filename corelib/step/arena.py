"""Step arenas: one step's inputs as named tensors at 64-byte aligned offsets in one uint8 buffer.

One arena per step means one host-to-device copy per step, and the same bytes travel through
the SHM ring unchanged (:mod:`corelib.transport.wire` frames them). The scheduler side packs an
arena (:mod:`corelib.engine.packing`), the device side reads it (:mod:`corelib.step.runner`):
both read the one step layout that :mod:`corelib.step.fields` defines by name, neither imports the
other. An :class:`ArenaPool` keeps the
host buffers arenas are packed into (or copied into, as a step's snapshot of an SHM frame) and
reuses one only once its step has completed.
"""

from __future__ import annotations

import functools
import threading
import time
from collections import deque
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Protocol

import torch

from corelib.errors import DeviceTimeout

ALIGN = 64
RELAY = -1  # a step token's input id: take the token from the device relay, not from the host

_DTYPE_CODES: dict[torch.dtype, int] = {torch.int64: 0, torch.int32: 1, torch.float32: 2, torch.bool: 3}
_CODE_DTYPES = {code: dtype for dtype, code in _DTYPE_CODES.items()}
_ITEM_BYTES = {dtype: torch.empty((), dtype=dtype).element_size() for dtype in _DTYPE_CODES}


@dataclass(frozen=True)
class Field:
    name: str
    dtype: torch.dtype
    shape: tuple[int, ...]

    @property
    def nbytes(self) -> int:
        count = 1
        for dim in self.shape:
            count *= dim
        return count * _ITEM_BYTES[self.dtype]


@dataclass(frozen=True)
class ArenaLayout:
    """Named tensors at 64-byte aligned offsets in one uint8 buffer."""

    fields: tuple[Field, ...]
    offsets: tuple[int, ...]
    nbytes: int

    @classmethod
    def of(cls, fields: Sequence[Field]) -> ArenaLayout:
        offsets = []
        cursor = 0
        for f in fields:
            offsets.append(cursor)
            cursor += -(-f.nbytes // ALIGN) * ALIGN
        return cls(tuple(fields), tuple(offsets), max(cursor, ALIGN))

    @property
    def names(self) -> tuple[str, ...]:
        return tuple(f.name for f in self.fields)

    def views(self, arena: torch.Tensor) -> dict[str, torch.Tensor]:
        """Typed views into ``arena`` (host or device); writes go straight to the arena."""
        self._check(arena)
        return {f.name: _typed(arena, f, offset) for f, offset in zip(self.fields, self.offsets, strict=True)}

    def view(self, arena: torch.Tensor, name: str) -> torch.Tensor:
        """The typed view of field ``name`` alone (``views`` makes every field's, some µs each)."""
        self._check(arena)
        for f, offset in zip(self.fields, self.offsets, strict=True):
            if f.name == name:
                return _typed(arena, f, offset)
        raise KeyError(f"the layout has no field {name!r}")

    def _check(self, arena: torch.Tensor) -> None:
        if arena.dtype != torch.uint8 or arena.numel() < self.nbytes:
            raise ValueError(f"arena must be uint8 with at least {self.nbytes} bytes")

    def encode(self) -> list[int]:
        """The layout as integers, for a frame header: per field a dtype code, rank and dims (a new list)."""
        return list(self.words)

    @functools.cached_property
    def words(self) -> tuple[int, ...]:
        """The layout as integers (what :meth:`encode` lists), made once: a frame header carries this tuple."""
        words = [len(self.fields)]
        for f in self.fields:
            words += [_DTYPE_CODES[f.dtype], len(f.shape), *f.shape]
        return tuple(words)

    @classmethod
    def decode(cls, names: Sequence[str], words: Sequence[int]) -> ArenaLayout:
        """The layout a header describes, its fields named by the frame kind's field names."""
        if not words:
            raise ValueError("the frame carries no layout")
        count, cursor = words[0], 1
        if count != len(names):
            raise ValueError(f"layout has {count} fields; expected {len(names)}")
        fields = []
        for name in names:
            if cursor + 2 > len(words):
                raise ValueError(f"layout ends before field {name!r}")
            code, rank = words[cursor], words[cursor + 1]
            dims = tuple(words[cursor + 2 : cursor + 2 + rank])
            cursor += 2 + rank
            if code not in _CODE_DTYPES:
                raise ValueError(f"field {name!r} has unknown dtype code {code}")
            if len(dims) != rank or any(d < 0 for d in dims):
                raise ValueError(f"field {name!r} has a malformed shape {dims}")
            fields.append(Field(name, _CODE_DTYPES[code], dims))
        return cls.of(fields)


Allocate = Callable[[tuple[int, ...], torch.dtype], torch.Tensor]


class Arenas(Protocol):
    """Where the engine core packs each step: a pool of host arenas, or (over SHM) the ring's next slot."""

    def acquire(self) -> torch.Tensor:
        """An arena to pack the next step into (bounded wait)."""
        ...

    def release(self, arena: torch.Tensor) -> None:
        """``arena`` is not needed any more: its step was refused, or the device is done with it."""
        ...


class ArenaPool:
    """Host arenas (or snapshots of them) reused once the step that read them has completed."""

    def __init__(
        self, allocate: Allocate, nbytes: int, count: int, timeout_s: float, what: str = "arena"
    ) -> None:
        self._free: deque[torch.Tensor] = deque(allocate((nbytes,), torch.uint8) for _ in range(count))
        self._cond = threading.Condition()
        self._timeout = timeout_s
        self._what = what
        self.nbytes = nbytes

    def acquire(self) -> torch.Tensor:
        deadline = time.monotonic() + self._timeout
        with self._cond:
            while not self._free:
                left = deadline - time.monotonic()
                if left <= 0 or not self._cond.wait(left):
                    raise DeviceTimeout(
                        f"no free {self._what} buffer within {self._timeout:g} s: "
                        "every buffer still belongs to a step whose tokens were not read"
                    )
            return self._free.popleft()

    def release(self, arena: torch.Tensor) -> None:
        with self._cond:
            self._free.append(arena)
            self._cond.notify()


def _typed(arena: torch.Tensor, f: Field, offset: int) -> torch.Tensor:
    return arena[offset : offset + f.nbytes].view(f.dtype).view(f.shape)
