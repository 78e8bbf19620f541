"""A worker process: owns a device and the model, reads steps from the SHM ring, returns tokens.

Three threads: the polling thread reads and checks frames and materializes their inputs;
the main thread submits steps to the device; the completer waits for each step's tokens
and writes them to the result ring (rank 0). Any error is reported to the scheduler on the
control pipe, and the process exits; it never computes on a frame that failed its checks.

Materialization, decided by the ``shm_ordered_materialization`` gate:

- ordered: the polling thread copies the frame into a pinned snapshot owned by the step,
  then releases the slot; the runner issues the H2D on its prepare stream and a ready event
  gates the compute stream (graph update and replay).
- early: the polling thread issues the H2D itself, on its own stream, straight from the
  shared segment, and releases the slot at once. Nothing orders that copy with the compute
  stream, and the producer may already be rewriting the slot when the copy reads it.
- a device that reads host memory (cpu): a plain host copy, no pinned memory, no H2D.
"""

from __future__ import annotations

import contextlib
import dataclasses
import faulthandler
import os
import pickle
import queue
import signal
import struct
import sys
import threading
import time
import traceback
from dataclasses import dataclass
from multiprocessing.connection import Connection

import torch

from corelib import faults
from corelib.backend import DeviceSpec
from corelib.config import CorelibConfig
from corelib.device import Device
from corelib.engine.build import EngineLayout, build_runner, model_weights
from corelib.engine.forward_input import PREFILL_FIELD_NAMES, ArenaLayout, ForwardInput
from corelib.engine.handoff import StagingPool
from corelib.engine.metrics import StepResult
from corelib.engine.parallel import init_group, leave_group
from corelib.engine.runner import ModelRunner, StepHandle
from corelib.engine.scheduler import StepKind
from corelib.engine.shm import Consumer, Frame, FrameHeader, FrameKind, Producer, Ring
from corelib.errors import TransportError, one_line
from corelib.features import Plan
from corelib.models.sharding import TensorShard

DECODE_FIELD_NAMES = ("ints", "floats", "block_tables")
SNAPSHOTS = 4  # steps a worker holds at once: one running, one queued, one being read, a spare
RESULT_TAIL = struct.Struct("<ddd")  # busy ms, gap ms (-1: none), transport µs


@dataclass
class WorkerArgs:
    """Everything a worker needs; pickled into the spawned process."""

    rank: int
    world_size: int
    config: CorelibConfig
    spec: DeviceSpec
    plan: Plan
    input_ring: str
    result_ring: str
    num_slots: int
    slot_bytes: int
    result_slot_bytes: int
    doorbell_fd: int  # read: frames to read
    release_fd: int  # write: slots given back
    result_doorbell_fd: int  # write: results written (rank 0; -1 elsewhere)
    result_release_fd: int  # read: result slots given back (rank 0; -1 elsewhere)
    control_fd: int  # write: ready / error messages
    parent_pid: int
    register_host: bool
    master_address: str = "127.0.0.1"  # tensor parallelism: the process group's rendezvous
    master_port: int = 0


def frame_layout(header: FrameHeader) -> ArenaLayout:
    names = DECODE_FIELD_NAMES if header.kind is FrameKind.decode else PREFILL_FIELD_NAMES
    return ArenaLayout.decode(names, header.layout)


def encode_result(result: StepResult, transport_us: float) -> bytes:
    tokens = struct.pack(f"<{len(result.tokens)}q", *result.tokens)
    gap = -1.0 if result.gap_ms is None else result.gap_ms
    return tokens + RESULT_TAIL.pack(result.busy_ms or 0.0, gap, transport_us)


def decode_result(header: FrameHeader, payload: bytes) -> StepResult:
    n = header.num_seqs
    tokens = list(struct.unpack_from(f"<{n}q", payload, 0))
    busy, gap, transport = RESULT_TAIL.unpack_from(payload, 8 * n)
    kind = StepKind.decode if header.flags & 2 else StepKind.prefill
    return StepResult(header.step_id, kind, tokens, busy or None, None if gap < 0 else gap, bool(header.flags & 1),
                      transport)


class Materializer:
    """Turns a checked frame into a ForwardInput whose inputs no longer depend on the slot."""

    def __init__(self, device: Device, runner: ModelRunner, ordered: bool, snapshot_bytes: int, timeout: float):
        self.device = device
        self.runner = runner
        self.host_device = device.capabilities.device_is_host
        self.ordered = ordered and not self.host_device
        self.early = not ordered and not self.host_device
        self.stream = device.stream("polling") if self.early else None
        allocate = (lambda shape, dtype: device.host_empty(shape, dtype, pinned=True)) if self.ordered else (
            lambda shape, dtype: torch.empty(shape, dtype=dtype))
        self.pool = StagingPool(allocate, snapshot_bytes, SNAPSHOTS, timeout)

    def __call__(self, frame: Frame, consumer: Consumer) -> ForwardInput:
        header = frame.header
        layout = frame_layout(header)
        if layout.nbytes > header.payload_len:
            raise TransportError(f"{consumer.name} frame {header.seq} (slot {frame.slot}): payload of "
                                 f"{header.payload_len} bytes is shorter than its layout ({layout.nbytes} bytes)")
        kind = StepKind.decode if header.kind is FrameKind.decode else StepKind.prefill
        fi = ForwardInput(header.step_id, kind, header.num_seqs, header.bucket, header.kv_blocks,
                          bool(header.flags & 1), layout, frame.payload)
        if self.early and self.stream is not None:
            fi = self.runner.materialize_early(fi, self.stream)
            consumer.release(frame)  # the copy may not have read the slot yet: the hazard
            return fi
        snapshot = self.pool.acquire()
        snapshot[: layout.nbytes].copy_(frame.payload[: layout.nbytes])
        consumer.release(frame)  # the producer may reuse the slot: the step owns its snapshot
        fi.arena = snapshot
        fi.on_release = lambda: self.pool.release(snapshot)
        return fi


class Worker:
    def __init__(self, args: WorkerArgs) -> None:
        self.args = args
        self.timeout = args.config.engine.timeout_s
        self.control = Connection(args.control_fd, readable=False)
        self.failed = threading.Event()
        self._reported = threading.Lock()
        self._sending = threading.Lock()  # one message at a time on the control pipe, from any thread

    def send(self, kind: str, text: str | None, detail: object) -> None:
        with self._sending:
            self.control.send((kind, text, detail))

    def report(self, error: BaseException) -> None:
        """Tell the scheduler once, then exit: nothing here may go on after an error."""
        if self._reported.acquire(blocking=False):
            with contextlib.suppress(OSError):
                self.send("error", one_line(error), "".join(traceback.format_exception(error)))
        self.failed.set()
        os._exit(1)

    def parent_gone(self) -> str | None:
        if os.getppid() != self.args.parent_pid:
            return f"worker rank {self.args.rank}: the scheduler process {self.args.parent_pid} is gone"
        return None

    def run(self) -> None:
        args = self.args
        from corelib.plugins import PluginRegistry

        backend = PluginRegistry().get(args.spec.backend)
        device = backend.open(dataclasses.replace(args.spec, device_index=args.spec.device_index + args.rank))
        layout = EngineLayout.of(args.config)
        ordered = args.plan.is_enabled("shm_ordered_materialization")
        shard = None
        all_reduce = None
        if args.world_size > 1:
            all_reduce = init_group(device, args.rank, args.world_size, args.master_address, args.master_port,
                                    self.timeout)
            shard = TensorShard(args.rank, args.world_size)
        weights = model_weights(args.config, device, shard)
        weights.all_reduce = all_reduce
        runner = build_runner(device, args.config, args.plan, layout, weights, ordered_prepare=ordered)
        ring = Ring.attach(args.input_ring, args.num_slots, args.slot_bytes)
        registration = device.register_host(ring.whole) if args.register_host else None
        consumer = Consumer(ring, Connection(args.doorbell_fd, writable=False),
                            Connection(args.release_fd, readable=False), self.timeout, alive=self.parent_gone,
                            name=f"input ring (rank {args.rank})")
        results: Producer | None = None
        if args.result_doorbell_fd >= 0 and args.result_release_fd >= 0:
            out = Ring.attach(args.result_ring, args.num_slots, args.result_slot_bytes)
            results = Producer(out, [Connection(args.result_doorbell_fd, readable=False)],
                               [Connection(args.result_release_fd, writable=False)], self.timeout,
                               alive=self.parent_gone, name="result ring")
        materialize = Materializer(device, runner, ordered, layout.staging_bytes, self.timeout)
        steps: queue.SimpleQueue[tuple[ForwardInput, float] | None] = queue.SimpleQueue()
        handles: queue.SimpleQueue[tuple[StepHandle, float] | None] = queue.SimpleQueue()
        poller = threading.Thread(target=self._guard, args=(self._poll, consumer, materialize, steps, device),
                                  name="corelib-polling")
        # The runner double-buffers its token outputs: at most two steps in flight. Rank 0's
        # scheduler already keeps to that; the other ranks are held here.
        slots = threading.Semaphore(2)
        completer = threading.Thread(target=self._guard, args=(self._complete, runner, results, handles, slots),
                                     name="corelib-completer")
        self.send("ready", None, "")
        poller.start()
        completer.start()
        try:
            while (item := steps.get()) is not None:
                fi, transport_us = item
                if not slots.acquire(timeout=self.timeout):
                    raise TimeoutError(f"worker rank {args.rank}: step {fi.step_id} waited {self.timeout:g} s for "
                                       "the tokens of the step two back")
                handles.put((runner.submit(fi), transport_us))
        finally:
            handles.put(None)
        completer.join()
        poller.join()
        if registration is not None:
            registration.close()
        runner.close()
        leave_group()
        device.close()

    def _guard(self, target: object, *args: object) -> None:
        try:
            target(*args)  # type: ignore[operator]
        except BaseException as error:  # noqa: BLE001 - reported to the scheduler, then the process ends
            self.report(error)

    def _poll(self, consumer: Consumer, materialize: Materializer,
              steps: queue.SimpleQueue[tuple[ForwardInput, float] | None], device: Device) -> None:
        while True:
            frame = consumer.read(timeout=365 * 24 * 3600.0, who="the next step")  # idle is fine
            if frame.header.kind is FrameKind.stop:
                consumer.release(frame)
                steps.put(None)
                return
            if frame.header.kind is FrameKind.memory:
                consumer.release(frame)
                self.send("memory", None, device.memory_stats())
                continue
            faults.maybe_fail("poll")
            fi = materialize(frame, consumer)
            steps.put((fi, (time.perf_counter() - frame.header.sent_at) * 1e6))

    def _complete(self, runner: ModelRunner, results: Producer | None,
                  handles: queue.SimpleQueue[tuple[StepHandle, float] | None], slots: threading.Semaphore) -> None:
        while (item := handles.get()) is not None:
            handle, transport_us = item
            result = runner.result(handle, self.timeout)
            slots.release()
            if results is not None:
                flags = int(result.graph) | (2 if result.kind is StepKind.decode else 0)
                header = FrameHeader(FrameKind.result, 0, result.step_id, len(result.tokens), flags=flags,
                                     sent_at=time.perf_counter())
                results.write(header, encode_result(result, transport_us))


def main() -> None:
    """Entry point: ``python -m corelib.engine.worker`` with pickled WorkerArgs on stdin."""
    signal.signal(signal.SIGINT, signal.SIG_IGN)  # Ctrl-C reaches the whole group; the scheduler decides
    faulthandler.register(signal.SIGUSR1, all_threads=True)  # `kill -USR1 <pid>`: every thread's stack to stderr
    args: WorkerArgs = pickle.loads(sys.stdin.buffer.read())
    torch.set_num_threads(max(1, torch.get_num_threads() // max(1, args.world_size)))
    worker = Worker(args)
    try:
        worker.run()
    except BaseException as error:  # noqa: BLE001 - reported to the scheduler
        worker.report(error)
    sys.exit(0)


if __name__ == "__main__":
    main()
