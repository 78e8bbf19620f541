"""A node other than 0 (see :mod:`corelib.transport.nodes`): its ranks' ring, fed with node 0's frames."""

from __future__ import annotations

import contextlib
import threading
import time
from collections.abc import Callable
from typing import Protocol

import torch

from corelib.errors import TransportError, WorkerDied
from corelib.startup.start import Startup
from corelib.step.layout import EngineLayout
from corelib.transport.memory_probe import shm_layout
from corelib.transport.nodes import (
    FOLLOWER_POLL_S,
    HEARTBEAT_S,
    STATUS_BYTES,
    MessageCode,
    Topology,
    lost_reason,
)
from corelib.transport.shm_executor import ShmExecutor
from corelib.transport.wire import FrameHeader, FrameKind


class NodeRing(Protocol):
    """What a follower needs of its node's ring and ranks (an :class:`ShmExecutor`)."""

    @property
    def timeout(self) -> float: ...

    def write_frame(self, header: FrameHeader, payload: memoryview | None) -> None: ...

    def why_gone(self) -> str | None: ...

    def close(self, timeout: float) -> None: ...

    def stop_now(self) -> None: ...


class NodeChannel(Protocol):
    """What a follower needs of its line to node 0 (a :class:`NodeGroup`)."""

    def receive(self, peer: int, status: bool = False, first: bool = False) -> tuple[MessageCode, torch.Tensor | None]:
        ...

    def send(self, code: MessageCode, data: torch.Tensor | None, peer: int, status: bool = False,
             first: bool = False) -> None: ...

    def close(self) -> None: ...


class Follower:
    """A node other than 0: its ranks' ring, fed with the frames node 0 sends, until node 0 says stop."""

    def __init__(self, executor: NodeRing, group: NodeChannel, topology: Topology,
                 announce: Callable[[str], None]) -> None:
        self.topology = topology
        self.announce = announce
        self.executor = executor
        self.group = group
        self._stop = threading.Event()
        self._local_failure: str | None = None  # one of this node's ranks stopped (set by the status thread)
        self._stopping = False  # node 0's stop frame is in the ring: the ranks exit, and node 0 may leave
        self._status = threading.Thread(target=self._report_loop, name="corelib-node-status", daemon=True)

    @classmethod
    def start(cls, startup: Startup, topology: Topology, announce: Callable[[str], None]) -> Follower:
        """This node's ranks started, and the nodes' group joined."""
        layout, lines = shm_layout(startup, startup.options, EngineLayout.of(startup.config), topology)  # as node 0
        for line in lines:
            announce(line)
        executor = ShmExecutor(startup, startup.options, layout, topology=topology)
        group = executor.follower_group
        assert group is not None, "a follower's executor joins the nodes' group"
        return cls(executor, group, topology, announce)

    def run(self) -> None:
        """Until node 0 stops; raises naming node 0 when it is gone, or this node's rank that failed."""
        name0, mine = self.topology.name(0), self.topology.name(self.topology.node)
        self._status.start()
        self.announce(f"{mine} of {self.topology.nodes}: following node 0")
        frames, heard = 0, False
        try:
            while True:
                try:
                    code, data = self.group.receive(0, first=not heard)
                    heard = True
                except Exception as error:  # noqa: BLE001 - node 0 closed its end or went silent
                    if self._stopping:
                        break  # node 0 sent its stop frame and left before its goodbye reached us
                    gone = f"{name0} is gone: {lost_reason(error)}"
                    if self._local_failure is not None:  # this node failed first; node 0 stopped because of it
                        raise WorkerDied(f"{mine}: {self._local_failure}; then {gone}") from None
                    raise WorkerDied(gone) from None
                if self._local_failure is not None and not self._stopping:
                    raise WorkerDied(f"{mine}: {self._local_failure}")
                if code is MessageCode.DONE:
                    break
                if code is MessageCode.HEARTBEAT:
                    continue
                if code is not MessageCode.FRAME or data is None:
                    raise TransportError(f"{name0} sent message code {int(code)} where a frame was expected")
                self._write(data, frames)
                frames += 1
        finally:
            self._stop.set()
            self._status.join(2 * HEARTBEAT_S)
        self.announce(f"{mine}: node 0 finished; {frames} frames followed")

    def _write(self, data: torch.Tensor, index: int) -> None:
        """Check a frame from node 0 (its header and CRC-32C) and write it into this node's ring."""
        view = memoryview(data.numpy().tobytes())
        where = f"frame {index} from node 0"
        header = FrameHeader.unpack_from(view, where)
        start = header.nbytes
        payload = view[start:]
        if len(payload) != header.payload_len or header.crc(payload) != header.checksum:
            raise TransportError(f"{where}: the frame is damaged (its length or CRC-32C does not match)")
        if header.kind is FrameKind.stop:
            self._stopping = True  # before the write: the ranks may exit the moment they read it
        self.executor.write_frame(header, payload if header.payload_len else None)

    def _report_loop(self) -> None:
        """Heartbeats to node 0; this node's failure as soon as one of its ranks stops."""
        last = 0.0
        while not self._stop.is_set():
            reason = None if self._stopping else self.executor.why_gone()
            try:
                if reason is not None:
                    self._local_failure = reason
                    data = torch.frombuffer(bytearray(reason.encode()[:STATUS_BYTES]), dtype=torch.uint8)
                    self.group.send(MessageCode.FAILED, data, 0, status=True)
                    return
                if time.monotonic() - last >= HEARTBEAT_S:
                    self.group.send(MessageCode.HEARTBEAT, None, 0, status=True, first=last == 0.0)
                    last = time.monotonic()
            except Exception:  # noqa: BLE001 - node 0 is gone: the frame loop says so
                return
            self._stop.wait(FOLLOWER_POLL_S)
        with contextlib.suppress(Exception):
            self.group.send(MessageCode.DONE, None, 0, status=True)

    def close(self, graceful: bool) -> None:
        try:
            self.executor.close(self.executor.timeout) if graceful else self.executor.stop_now()
        finally:
            self.group.close()


def follow(startup: Startup, announce: Callable[[str], None]) -> bool:
    """On a follower node, serve node 0 until it stops and return True; on node 0 (or one node), False."""
    topology = Topology.from_environment(startup.config.engine.tp)
    if not topology.follower:
        return False
    follower = Follower.start(startup, topology, announce)
    graceful = False
    try:
        follower.run()
        graceful = True
    finally:
        follower.close(graceful)
    return True
