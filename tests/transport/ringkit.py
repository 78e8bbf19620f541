"""Rings wired to pipes inside one process, for transport tests."""

from __future__ import annotations

import os
from dataclasses import dataclass
from multiprocessing.connection import Connection

from corelib.engine.shm import Consumer, Producer, Ring


@dataclass
class Wired:
    ring: Ring
    producer: Producer
    consumers: list[Consumer]


def pipe() -> tuple[Connection, Connection]:
    read, write = os.pipe()
    return Connection(read, writable=False), Connection(write, readable=False)


def wire(num_slots: int = 2, slot_bytes: int = 4096, consumers: int = 1, timeout: float = 2.0,
         name: str = "test ring") -> Wired:
    ring = Ring.create("test", num_slots, slot_bytes)
    bells = [pipe() for _ in range(consumers)]
    releases = [pipe() for _ in range(consumers)]
    producer = Producer(ring, [w for _, w in bells], [r for r, _ in releases], timeout, name=name)
    ends = [Consumer(ring, bells[i][0], releases[i][1], timeout, name=name) for i in range(consumers)]
    return Wired(ring, producer, ends)
