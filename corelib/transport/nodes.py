"""Tensor parallelism across nodes: torchrun starts one corelib per node, and node 0 schedules.

``torchrun --nnodes=N --nproc-per-node=1 ... -m corelib run engine.tp=T`` gives every node the
same command. Node 0 runs the scheduler and its share of the ranks; every other node runs a
*follower*: it starts its own ranks (``T / N`` per node, fed by that node's SHM ring) and
writes into that ring each input frame node 0 sends it. Frames cross nodes through
torch.distributed point-to-point messages on a gloo group of the launcher processes (the
ranks' all-reduces keep the device's own library); nothing here opens a socket itself.

Each direction carries a heartbeat when idle (:data:`HEARTBEAT_S`), so a node that dies is
noticed at once (its connections close) and a node that hangs within ``engine.timeout_s``.
A follower reports a failure of its own ranks to node 0 on a second group, and node 0 names
the node and its ranks first in the error it raises; a follower that loses node 0 stops its
ranks and exits, naming node 0. Either way both nodes stop.

No configuration travels between nodes (nothing is unpickled from the network): each node
composes its own from the same command line, and node 0 refuses to start when a follower's
engine, model or backend digest differs from its own, or its checkpoint's identity does
(:mod:`corelib.models.identity`). Joining waits ``engine.timeout_s`` and names who did not come.
"""

from __future__ import annotations

import contextlib
import dataclasses
import enum
import hashlib
import os
import queue
import socket
import threading
import time
from dataclasses import dataclass
from datetime import timedelta
from typing import TYPE_CHECKING

import torch

from corelib.errors import ConfigError, TransportError, one_line
from corelib.models.identity import checkpoint_identity
from corelib.transport.launch import launched_node, launched_nodes
from corelib.transport.shm import as_bytes
from corelib.transport.wire import FrameHeader, FrameKind

if TYPE_CHECKING:
    from corelib.startup.start import Startup

HEARTBEAT_S = 1.0  # each side sends at least this often, so silence longer than the timeout means a hung node
FOLLOWER_POLL_S = 0.1  # how often a follower looks at its own ranks between heartbeats
STATUS_BYTES = 2048  # a failure message, UTF-8, cut to this


class MessageCode(enum.IntEnum):
    """The first word of every message between nodes."""

    HEARTBEAT = 0
    FRAME = 1  # followed by the frame: packed header, then payload
    DONE = 2  # the sender stops normally
    FAILED = 3  # followed by a message saying why


@dataclass(frozen=True)
class Topology:
    """Which node this process is and which tensor-parallel ranks run here."""

    node: int
    nodes: int
    tp: int

    @property
    def per_node(self) -> int:
        return self.tp // self.nodes

    def ranks_of(self, node: int) -> range:
        return range(node * self.per_node, (node + 1) * self.per_node)

    @property
    def local_ranks(self) -> range:
        return self.ranks_of(self.node)

    @property
    def follower(self) -> bool:
        return self.node > 0

    def name(self, node: int) -> str:
        """``node 1 (worker rank 1)`` or ``node 1 (worker ranks 2-3)``."""
        ranks = self.ranks_of(node)
        which = f"rank {ranks[0]}" if len(ranks) == 1 else f"ranks {ranks[0]}-{ranks[-1]}"
        return f"node {node} (worker {which})"

    @classmethod
    def from_environment(cls, tp: int) -> Topology:
        """From torchrun's variables; one node when not started by torchrun."""
        nodes, local_world = launched_nodes(), os.environ.get("LOCAL_WORLD_SIZE", "1")
        if nodes == 1:
            return cls(0, 1, tp)
        if local_world.isdigit() and int(local_world) > 1:
            raise ConfigError(
                f"torchrun started {local_world} processes per node, but corelib starts one worker process per "
                "rank itself (engine.tp): launch it with torchrun --nproc-per-node=1"
            )
        node = launched_node()
        if tp % nodes:
            raise ConfigError(
                f"engine.tp={tp} cannot be spread over the {nodes} nodes torchrun started: engine.tp must be a "
                f"multiple of the number of nodes (each node runs engine.tp / nodes ranks)"
            )
        return cls(node, nodes, tp)


@dataclass(frozen=True)
class EngineDigest:
    """What every node must agree on: the engine, the model's config, the backend, the plan and the slot size;
    and, apart, the checkpoint's identity (the same ``model.path`` need not hold the same weights everywhere)."""

    config: int
    weights: int

    @classmethod
    def of(cls, startup: Startup, slot_bytes: int) -> EngineDigest:
        cfg, spec = startup.config, startup.spec
        # Where the checkpoint lies may differ between machines; what it holds may not.
        model = dataclasses.replace(cfg.model, path=None)
        text = repr((cfg.engine, model, spec.backend, spec.runtime.value, startup.options, slot_bytes))
        weights = checkpoint_identity(cfg.model.path) if cfg.model.path else "random:" + repr(model)
        return cls(_short(text), _short(weights))


def _short(text: str) -> int:
    return int.from_bytes(hashlib.blake2b(text.encode(), digest_size=7).digest(), "little")


def engine_digest(startup: Startup, slot_bytes: int) -> EngineDigest:
    return EngineDigest.of(startup, slot_bytes)


def _free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as probe:
        probe.bind(("", 0))
        return int(probe.getsockname()[1])


class NodeGroup:
    """The launcher processes' gloo groups: frames on one, status on the other (no two threads share one)."""

    def __init__(self, topology: Topology, timeout_s: float, startup_timeout_s: float) -> None:
        import torch.distributed as dist

        self.topology = topology
        self.timeout = timedelta(seconds=timeout_s)
        self.startup_timeout = timedelta(seconds=startup_timeout_s)
        if dist.is_initialized():
            raise ConfigError("a torch.distributed process group is already set up in this process; corelib "
                              "joins the nodes' group itself")
        # torchrun exported MASTER_ADDR/MASTER_PORT, RANK and WORLD_SIZE for exactly this. Every node gets here
        # seconds after it starts (weights load later), so joining waits engine.timeout_s, not the start's time.
        try:
            dist.init_process_group("gloo", init_method="env://", rank=topology.node, world_size=topology.nodes,
                                    timeout=self.timeout)
            self.frames = dist.group.WORLD
            self.status = dist.new_group(backend="gloo", timeout=self.timeout)
        except Exception as error:  # noqa: BLE001 - DistStoreError and friends: which node, and why
            raise TransportError(self._not_joined(error)) from None

    def _not_joined(self, error: BaseException) -> str:
        topology, waited = self.topology, f"{self.timeout.total_seconds():g} s (engine.timeout_s)"
        cause = " ".join(str(error).split())[:200] or type(error).__name__  # the library's words, not its class
        address = f"{os.environ.get('MASTER_ADDR', '?')}:{os.environ.get('MASTER_PORT', '?')}"
        if topology.follower:
            return (f"{topology.name(topology.node)} could not join node 0 at {address} within {waited}: node 0 "
                    f"did not start, or failed before it could take the others ({cause})")
        others = ", ".join(topology.name(node) for node in range(1, topology.nodes))
        return (f"{others} did not join node 0 within {waited}: a node that fails at start (a bad override, a "
                f"missing checkpoint) never joins; its own log says why ({cause})")

    def agree(self, digest: EngineDigest, port: int) -> tuple[str, int]:
        """Node 0's choice of the ranks' rendezvous port; raises on every node if any node's digest differs."""
        import torch.distributed as dist

        mine = torch.tensor([port, digest.config, digest.weights], dtype=torch.int64)
        chosen = mine.clone()
        dist.broadcast(chosen, src=0)
        same = torch.tensor([int(chosen[1]) == digest.config, int(chosen[2]) == digest.weights], dtype=torch.int64)
        dist.all_reduce(same, op=dist.ReduceOp.MIN)
        if int(same[0]) != 1:
            raise ConfigError(
                "the nodes composed different engines (engine, model, backend or plan differ from node 0's): "
                "start every node with the same command and the same backend"
            )
        if int(same[1]) != 1:
            raise ConfigError(
                "the nodes hold different weights: the checkpoint at model.path is not the same on every node "
                "(its files, their headers or their data differ from node 0's); copy the same checkpoint to each"
            )
        return os.environ.get("MASTER_ADDR", "127.0.0.1"), int(chosen[0])

    def send(self, code: MessageCode, data: torch.Tensor | None, peer: int, status: bool = False,
             first: bool = False) -> None:
        """One message; ``first``: the peer may still be starting (its ranks load weights), so wait longer."""
        import torch.distributed as dist

        group, timeout = self.status if status else self.frames, self.startup_timeout if first else self.timeout
        meta = torch.tensor([int(code), 0 if data is None else data.numel()], dtype=torch.int64)
        _finish(dist.isend(meta, dst=peer, group=group), timeout)
        if data is not None:
            _finish(dist.isend(data, dst=peer, group=group), timeout)

    def receive(self, peer: int, status: bool = False, first: bool = False) -> tuple[MessageCode, torch.Tensor | None]:
        """The next message from ``peer``; raises after the timeout (a healthy peer sends heartbeats)."""
        import torch.distributed as dist

        group, timeout = self.status if status else self.frames, self.startup_timeout if first else self.timeout
        meta = torch.empty(2, dtype=torch.int64)
        _finish(dist.irecv(meta, src=peer, group=group), timeout)
        code, size = MessageCode(int(meta[0])), int(meta[1])
        if size == 0:
            return code, None
        data = torch.empty(size, dtype=torch.uint8)
        _finish(dist.irecv(data, src=peer, group=group), self.timeout)
        return code, data

    def close(self) -> None:
        import torch.distributed as dist

        if dist.is_initialized():
            with contextlib.suppress(Exception):  # a peer that is gone cannot take part in the goodbye
                dist.destroy_process_group()


def lost_reason(error: BaseException) -> str:
    """Why a peer cannot be reached, without the collective library's advice."""
    text = one_line(error)
    if "Connection closed by peer" in text or "Connection reset by peer" in text:
        return "its connection closed (the node stopped, crashed or lost the network)"
    if "Timed out" in text or "timed out" in text:
        return f"it sent nothing within the timeout ({text})"
    return text


def _finish(work: object, timeout: timedelta) -> None:
    """Wait for a point-to-point message (torch types the work as optional)."""
    if work is None:
        raise TransportError("torch.distributed returned no work for a point-to-point message")
    work.wait(timeout)  # type: ignore[attr-defined]


def _frame_bytes(header: FrameHeader, payload: torch.Tensor | bytes | memoryview | None) -> torch.Tensor:
    """The packed header and the payload in one buffer of its own (one copy of the payload). Between nodes the
    CRC-32C always covers the payload: the header is sent with that checksum, whatever the ring's."""
    body = as_bytes(payload).cast("B") if payload is not None else memoryview(b"")
    head = header.packed(header.crc(body))
    frame = bytearray(len(head) + body.nbytes)
    frame[: len(head)] = head
    frame[len(head) :] = body
    return torch.frombuffer(frame, dtype=torch.uint8)


class NodeLink:
    """Node 0's end: every input frame to the other nodes, and their health back."""

    def __init__(self, topology: Topology, timeout_s: float, startup_timeout_s: float) -> None:
        self.topology = topology
        self.timeout = timeout_s
        self.group = NodeGroup(topology, timeout_s, startup_timeout_s)
        self._outbox: queue.Queue[torch.Tensor | None] = queue.Queue()
        self._failures: dict[int, str] = {}  # the first news of each node that failed, in order
        self._failed = threading.Event()
        self._lock = threading.Lock()
        self._done: set[int] = set()
        self._threads = [threading.Thread(target=self._send_loop, name="corelib-node-sender", daemon=True)]
        self._threads += [threading.Thread(target=self._status_loop, args=(node,), name=f"corelib-node-{node}",
                                           daemon=True) for node in range(1, topology.nodes)]

    def agree(self, digest: EngineDigest) -> tuple[str, int]:
        """Check that every node built the same engine; the ranks' rendezvous address and port."""
        return self.group.agree(digest, _free_port())

    def start(self) -> None:
        """Once this node's ranks are ready (so every node's ranks started): frames out, health in."""
        for thread in self._threads:
            thread.start()

    def forward(self, header: FrameHeader, payload: torch.Tensor | bytes | memoryview | None) -> None:
        """Queue a frame just written to this node's ring for every other node (in order, copied now)."""
        if header.kind is FrameKind.memory:
            return  # answered by this node's ranks only
        self._outbox.put(_frame_bytes(header, payload))

    def why_gone(self, wait_s: float = 0.0) -> str | None:
        """What went wrong on another node, or None; waits up to ``wait_s`` for news to arrive."""
        if wait_s > 0:
            self._failed.wait(wait_s)
        with self._lock:
            return "; then ".join(self._failures.values()) if self._failures else None

    def _fail(self, peer: int, message: str) -> None:
        with self._lock:
            self._failures.setdefault(peer, message)
        self._failed.set()

    def _send_loop(self) -> None:
        peers = range(1, self.topology.nodes)
        first = True
        while True:
            try:
                frame = self._outbox.get(timeout=HEARTBEAT_S)
            except queue.Empty:
                frame = torch.empty(0, dtype=torch.uint8)  # a heartbeat
            for peer in peers:
                if peer in self._done:
                    continue
                try:
                    if frame is None:
                        self.group.send(MessageCode.DONE, None, peer, first=first)
                    elif frame.numel() == 0:
                        self.group.send(MessageCode.HEARTBEAT, None, peer, first=first)
                    else:
                        self.group.send(MessageCode.FRAME, frame, peer, first=first)
                except Exception as error:  # noqa: BLE001 - any failure to reach a node means it is gone
                    self._fail(peer, f"{self.topology.name(peer)} is gone: {lost_reason(error)}")
                    self._done.add(peer)
            first = False
            if frame is None:
                return

    def _status_loop(self, peer: int) -> None:
        first = True
        while True:
            try:
                code, data = self.group.receive(peer, status=True, first=first)
                first = False
            except Exception as error:  # noqa: BLE001 - a closed connection or silence past the timeout
                if peer not in self._done:
                    self._fail(peer, f"{self.topology.name(peer)} is gone: {lost_reason(error)}")
                return
            if code is MessageCode.FAILED:
                text = bytes(data.numpy()).decode(errors="replace") if data is not None else "no reason given"
                self._fail(peer, f"{self.topology.name(peer)} stopped: {text}")
                return
            if code is MessageCode.DONE:
                return

    def close(self, graceful: bool) -> None:
        """Tell the other nodes to stop (after the stop frame, when ``graceful``), then leave the group."""
        self._outbox.put(None)
        deadline = time.monotonic() + (self.timeout if graceful else 2 * HEARTBEAT_S)
        for thread in self._threads:
            if thread.is_alive():
                thread.join(max(0.0, deadline - time.monotonic()))
        if not any(thread.is_alive() for thread in self._threads):
            self.group.close()  # a thread still inside a receive would wait on a destroyed group
