"""The scheduler side of ``engine.transport=shm``: worker processes fed through a shared-memory ring.

Each step's packed inputs go into the input ring (one producer, one consumer per rank);
tokens come back through the result ring from rank 0, which answers every step as soon as its
tokens are there; the scheduler waits for them as the workers wait for frames (a bounded spin,
then a sleep on the doorbell).
Doorbells are counters in the rings and eventfds (:mod:`corelib.transport.doorbell`). Worker
errors arrive on a control pipe, which every wait also watches: a worker that stops or dies is
named at once, and in any case within a quarter second.
"""

from __future__ import annotations

import contextlib
import os
import pickle
import signal
import subprocess
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass
from multiprocessing.connection import Connection, wait

import torch

from corelib.config.options import EngineOptions
from corelib.errors import ConfigError, CorelibError, TransportError, WorkerDied
from corelib.platform.device import MemoryStats
from corelib.startup.start import Startup
from corelib.step.forward_input import ForwardInput
from corelib.step.handoff import StepResult
from corelib.step.layout import EngineLayout
from corelib.transport.doorbell import new_eventfd, spin_for
from corelib.transport.executor import Executor, StepFuture
from corelib.transport.nodes import HEARTBEAT_S, NodeGroup, NodeLink, Topology, engine_digest
from corelib.transport.parallel import rendezvous
from corelib.transport.shm import Consumer, Producer, Ring, sweep_stale
from corelib.transport.wire import HEADER_BYTES, FrameHeader, FrameKind, decode_result, input_header, result_bytes
from corelib.transport.worker import WorkerArgs
from corelib.trust.isolation import worker_command, worker_environment

ROOT_CAUSE_GRACE_S = 0.25  # a failure reported by one rank: how long to look for a peer that died first
STARTUP_TIMEOUT_FACTOR = 10  # a worker builds weights and captures graphs: allow well over one wait
# ...and never less: a worker's start (torch imported) takes what the machine's load makes it; a dead one shows at once
STARTUP_TIMEOUT_MIN_S = 60.0


def startup_timeout(timeout_s: float) -> float:
    """How long workers (and the memory probe before them) may take to start, for ``engine.timeout_s``."""
    return max(timeout_s * STARTUP_TIMEOUT_FACTOR, STARTUP_TIMEOUT_MIN_S)


@dataclass
class _Rank:
    process: subprocess.Popen[bytes]
    control: Connection
    rank: int  # the tensor-parallel rank (across nodes, not the index on this node)
    message: str | None = None  # what the worker reported before it stopped
    ready: bool = False  # the worker said it is ready for steps
    memory: MemoryStats | None = None  # the worker's latest answer to a memory frame
    memory_answers: int = 0


class _ShmFuture(StepFuture):
    def __init__(self, executor: ShmExecutor, step_id: int) -> None:
        self._executor = executor
        self._step_id = step_id

    def result(self, timeout: float) -> StepResult:
        return self._executor.read_result(self._step_id, timeout)


class SlotArenas:
    """The ring's next slot as the arena a step is packed into: the packer writes the frame's payload in place.

    ``acquire`` waits (bounded) until every worker released the slot's previous frame; the slot stays the next
    frame's until a frame is written (the step's, published by ``submit``), so a step that was refused leaves
    it to the next one. ``release`` has nothing to give back: the ring owns its slots."""

    def __init__(self, executor: ShmExecutor, nbytes: int) -> None:
        self._executor = executor
        self.nbytes = nbytes

    def acquire(self) -> torch.Tensor:
        return self._executor.reserve_slot()[: self.nbytes]

    def release(self, arena: torch.Tensor) -> None:
        del arena


class ShmExecutor(Executor):
    """Starts ``engine.tp`` worker processes and talks to them through two rings."""

    def __init__(self, startup: Startup, options: EngineOptions, layout: EngineLayout,
                 topology: Topology | None = None) -> None:
        cfg = startup.config
        # Across nodes (torchrun --nnodes>1): this node's ranks only; node 0 forwards every frame to
        # the others (corelib.transport.nodes), a follower is fed by node 0.
        topology = topology if topology is not None else Topology.from_environment(cfg.engine.tp)
        self.topology = topology
        shm = cfg.engine.shm
        if (spin := spin_for(shm.spin_us, startup.spec.on_host)) < 0:
            raise ConfigError(f"engine.shm.spin_us={shm.spin_us}: must be at least 0 (0: block at once)")
        self.timeout = cfg.engine.timeout_s
        self.startup_timeout_s = startup_timeout(cfg.engine.timeout_s)
        stale = sweep_stale()
        self.notices = [
            f"removed {len(stale)} shared-memory segment(s) left by a run that crashed: " + ", ".join(stale)
        ] if stale else []
        slot_bytes = max(shm.slot_bytes, -(-(HEADER_BYTES + layout.arena_bytes) // 64) * 64)  # rounded up to 64
        result_slot_bytes = -(-(HEADER_BYTES + result_bytes(layout.rows, layout.max_step_tokens)) // 64) * 64
        self.ranks: list[_Rank] = []
        self._eventfds: list[int] = []
        self.in_ring: Ring | None = None
        self.out_ring: Ring | None = None
        self.link: NodeLink | None = None  # node 0 of several: the other nodes
        self.follower_group: NodeGroup | None = None  # a follower node: its line to node 0
        self._liveness = threading.Lock()  # why_gone reads the control pipes, from any thread
        self._gone: str | None = None
        # Set by the first wait that failed: a worker that stopped consuming will not read a
        # stop frame either, so close must not wait for it again, nor for each step in flight.
        self.failure: CorelibError | None = None
        local = topology.local_ranks
        try:
            address, port = rendezvous() if cfg.engine.tp > 1 else ("127.0.0.1", 0)
            if topology.nodes > 1:
                digest = engine_digest(startup, slot_bytes)
                if topology.follower:
                    self.follower_group = NodeGroup(topology, self.timeout, self.startup_timeout_s)
                    address, port = self.follower_group.agree(digest, 0)
                else:
                    self.link = NodeLink(topology, self.timeout, self.startup_timeout_s)
                    address, port = self.link.agree(digest)
            self.in_ring = Ring.create("in", shm.num_slots, slot_bytes, num_consumers=len(local))
            self.out_ring = Ring.create("out", shm.num_slots, result_slot_bytes)
            # Eventfds: each rank sleeps on its doorbell, the scheduler on in_room and out_bell, rank 0 on out_room.
            doorbells = [self._eventfd() for _ in local]
            in_room, out_bell, out_room = self._eventfd(), self._eventfd(), self._eventfd()
            for index, rank in enumerate(local):
                control = os.pipe()
                args = WorkerArgs(
                    rank=rank, world_size=cfg.engine.tp, config=cfg, spec=startup.spec, options=options,
                    input_ring=self.in_ring.segment.name, result_ring=self.out_ring.segment.name,
                    num_slots=shm.num_slots, slot_bytes=slot_bytes, result_slot_bytes=result_slot_bytes,
                    doorbell_fd=doorbells[index], release_fd=in_room,
                    result_doorbell_fd=out_bell if rank == 0 else -1,
                    result_release_fd=out_room if rank == 0 else -1,
                    control_fd=control[1], parent_pid=os.getpid(), register_host=shm.register_host,
                    master_address=address, master_port=port, local_rank=index, local_world=len(local),
                )
                child_ends = [doorbells[index], in_room, control[1]]
                if rank == 0:
                    child_ends += [out_bell, out_room]
                process = subprocess.Popen(
                    worker_command("corelib.transport.worker"), env=worker_environment(), stdin=subprocess.PIPE,
                    pass_fds=child_ends,
                )
                assert process.stdin is not None, "Popen was asked for a stdin pipe"
                process.stdin.write(pickle.dumps(args))
                process.stdin.close()
                os.close(control[1])  # so that a dead worker shows as EOF here
                self.ranks.append(_Rank(process, Connection(control[0], writable=False), rank))
            self._await_ready(self.startup_timeout_s)
            if self.link is not None:
                self.link.start()
            watch = [rank.control.fileno() for rank in self.ranks]
            names = [f"worker rank {rank}" for rank in local]
            self.producer = Producer(self.in_ring, doorbells, in_room, self.timeout, alive=self.why_gone,
                                     name="input ring", consumer_names=names, spin_us=spin, watch=watch,
                                     payload_crc=shm.payload_crc)
            self.arenas = SlotArenas(self, layout.arena_bytes)
            self.consumer = Consumer(self.out_ring, 0, out_bell, out_room, self.timeout, alive=self.why_gone,
                                     name="result ring", spin_us=spin, watch=watch,
                                     payload_crc=shm.payload_crc)
        except BaseException:
            self._stop(graceful=False)
            raise

    def _eventfd(self) -> int:
        fd = new_eventfd()
        self._eventfds.append(fd)
        return fd

    # ------------------------------------------------------------------ liveness
    def why_gone(self) -> str | None:
        """None while every worker runs; else what happened, the root cause first.

        A rank that died without a word (killed, crashed) is named before the ranks that then failed because of it
        (a collective that lost its peer); across nodes, another node that is gone or failed is named before this
        node's ranks."""
        with self._liveness:
            if self._gone is None:
                self._gone = self._why_gone()
            return self._gone

    def _why_gone(self) -> str | None:
        silent: list[str] = []
        reported: list[str] = []
        for rank in self.ranks:
            self._read_control(rank)
        if len(self.ranks) > 1 and any(rank.message is not None for rank in self.ranks):
            # A rank whose collective lost its peer reports at once, while the peer that died may not show as exited
            # yet (its sockets close before it can be waited for): the silent ones get a moment, root cause first.
            deadline = time.monotonic() + ROOT_CAUSE_GRACE_S
            for rank in self.ranks:
                if rank.message is None:
                    with contextlib.suppress(subprocess.TimeoutExpired):
                        rank.process.wait(max(0.0, deadline - time.monotonic()))
        for rank in self.ranks:
            if rank.message is not None:
                reported.append(rank.message)
                continue
            code = rank.process.poll()
            if code is not None:
                how = f"was killed by {signal.Signals(-code).name}" if code < 0 else f"exited with code {code}"
                silent.append(f"worker rank {rank.rank} (pid {rank.process.pid}) {how}")
        local = None
        if silent and reported:
            local = "; ".join(silent) + "; then " + "; ".join(reported)
        elif silent or reported:
            local = "; ".join(silent or reported)
        if self.link is None:
            return local
        # A rank here that lost its peer on another node fails at once; the news of that node
        # comes with its closed connection or its report, a moment later.
        remote = self.link.why_gone(wait_s=2 * HEARTBEAT_S if local is not None else 0.0)
        if remote is None or local is None:
            return remote or local
        return f"{remote}; then {local}"

    @staticmethod
    def _read_control(rank: _Rank) -> None:
        """Take every message the worker sent so far (ready, or the error that stopped it)."""
        while rank.message is None and rank.control.poll():
            try:
                kind, text, detail = rank.control.recv()
            except (EOFError, OSError):
                return
            if kind == "ready":
                rank.ready = True
            elif kind == "memory":
                rank.memory = detail
                rank.memory_answers += 1
            elif kind == "error":
                rank.message = f"worker rank {rank.rank} (pid {rank.process.pid}) stopped: {text}"

    def _await_ready(self, timeout: float) -> None:
        deadline = time.monotonic() + timeout
        while not all(rank.ready for rank in self.ranks):
            reason = self.why_gone()
            if reason is not None:
                raise WorkerDied(reason if "stopped" in reason else f"{reason} while starting")
            left = deadline - time.monotonic()
            if left <= 0:
                late = [rank.rank for rank in self.ranks if not rank.ready]
                raise TransportError(f"workers {late} did not start within {timeout:g} s")
            wait([rank.control for rank in self.ranks if not rank.ready], min(left, 0.25))

    # ------------------------------------------------------------------ steps
    def submit(self, fi: ForwardInput, release: Callable[[], None]) -> StepFuture:
        self._check_usable()
        try:
            self.write_frame(input_header(fi, time.perf_counter()), fi.arena, fi.layout.nbytes)
        except (TransportError, WorkerDied) as error:
            raise self._failed(self._named(error, fi.step_id)) from None
        release()  # published: the ring owns the slot (or holds a copy of an arena packed elsewhere)
        return _ShmFuture(self, fi.step_id)

    def wake(self) -> None:
        """A heads-up for each worker asleep on its doorbell: it spins when the frame comes, instead of waking."""
        if self.failure is None:
            self.producer.nudge()

    def reserve_slot(self) -> torch.Tensor:
        """The next input frame's payload, for the packer to write in place (bounded wait for its release)."""
        self._check_usable()
        try:
            return self.producer.reserve()
        except (TransportError, WorkerDied) as error:
            raise self._failed(self._named(error, "waiting for a free input slot")) from None

    def _named(self, error: CorelibError, step_id: int | str) -> CorelibError:
        """A worker that died, with several ranks: the one that stopped first may only report a peer's silence (a
        collective that timed out), so add how far each rank got, which names the one that stalled."""
        if not isinstance(error, WorkerDied) or len(self.ranks) < 2:
            return error
        when = f"at step {step_id}" if isinstance(step_id, int) else step_id
        return WorkerDied(f"{error}; {when}: {self.producer.progress()}")

    def check_alive(self) -> None:
        """Raise WorkerDied when a worker (or, across nodes, another node) is gone; for an idle engine."""
        self._check_usable()
        reason = self.why_gone()
        if reason is not None:
            raise self._failed(WorkerDied(reason))

    def _failed(self, error: CorelibError) -> CorelibError:
        """``error`` becomes the transport's failure, which every later call raises."""
        self.failure = error
        return error

    def _check_usable(self) -> None:
        if self.failure is not None:
            raise TransportError(f"the SHM transport already failed: {self.failure}")

    def read_result(self, step_id: int, timeout: float) -> StepResult:
        self._check_usable()
        consumer = self.consumer
        try:
            frame = consumer.read(timeout, who=f"the tokens of step {step_id} from worker rank 0")
        except TransportError as error:
            raise self._failed(TransportError(f"{error}; {self.producer.progress()}")) from None
        except WorkerDied as error:
            raise self._failed(self._named(error, step_id)) from None
        try:
            if frame.header.kind is not FrameKind.result or frame.header.step_id != step_id:
                raise self._failed(TransportError(f"result ring: expected the tokens of step {step_id}, got "
                                                  f"{frame.header.kind.name} frame for step {frame.header.step_id}"))
            return decode_result(frame.header, frame.data).step_result()
        finally:
            self.consumer.release(frame)

    def memory_stats(self) -> list[MemoryStats]:
        """Ask every worker what its device holds; answered between steps, in ring order."""
        self._check_usable()
        asked = [rank.memory_answers for rank in self.ranks]
        self.write_frame(FrameHeader(FrameKind.memory, 0))
        deadline = time.monotonic() + self.timeout
        while True:
            reason = self.why_gone()  # also takes the answers off the control pipes
            if reason is not None:
                raise WorkerDied(reason)
            waiting = [rank for rank, before in zip(self.ranks, asked, strict=True) if rank.memory_answers == before]
            if not waiting:
                return [rank.memory for rank in self.ranks if rank.memory is not None]
            left = deadline - time.monotonic()
            if left <= 0:
                raise TransportError(f"workers {[r.rank for r in waiting]} did not report their "
                                     f"memory within {self.timeout:g} s")
            wait([rank.control for rank in waiting], min(left, 0.25))

    def write_frame(self, header: FrameHeader, payload: torch.Tensor | memoryview | None = None,
                    nbytes: int | None = None) -> None:
        """Into this node's ring; on node 0 of several, also to every other node. A payload packed in the reserved
        slot (:class:`SlotArenas`) is published where it is; ``nbytes``: its frame's bytes (None: all of it)."""
        if isinstance(payload, torch.Tensor) and self.producer.is_reserved(payload):
            self.producer.commit(header, payload.numel() if nbytes is None else nbytes)
            if nbytes is not None and self.link is not None:
                payload = payload[:nbytes]  # the frame's bytes, for the other nodes
        else:
            if payload is not None and nbytes is not None:
                payload = payload[:nbytes]
            self.producer.write(header, payload)
        if header.kind is FrameKind.stop:
            self._stop_sent = True
        if self.link is not None:
            self.link.forward(header, payload)

    # ------------------------------------------------------------------ shutdown
    _stop_sent = False

    def close(self, timeout: float) -> None:
        self._stop(graceful=self.failure is None and self.why_gone() is None)

    def stop_now(self) -> None:
        """Stop the workers without a stop frame (they may be the reason to stop)."""
        self._stop(graceful=False)

    def _stop(self, graceful: bool) -> None:
        try:
            if graceful and hasattr(self, "producer") and not self._stop_sent:
                with contextlib.suppress(TransportError, WorkerDied):
                    self.write_frame(FrameHeader(FrameKind.stop, 0))
            deadline = time.monotonic() + (self.timeout if graceful else 0.0)
            for rank in self.ranks:
                with contextlib.suppress(subprocess.TimeoutExpired):
                    rank.process.wait(max(0.0, deadline - time.monotonic()))
            for rank in self.ranks:
                for stop in (rank.process.terminate, rank.process.kill):
                    if rank.process.poll() is None:
                        stop()
                        with contextlib.suppress(subprocess.TimeoutExpired):
                            rank.process.wait(5.0)
        finally:
            for rank in self.ranks:
                rank.control.close()
            for fd in self._eventfds:
                os.close(fd)
            self._eventfds.clear()
            for ring in (self.in_ring, self.out_ring):
                if ring is not None:
                    ring.close()
            if self.link is not None:
                self.link.close(graceful)
            if self.follower_group is not None and not graceful:
                self.follower_group.close()
