"""A worker process: owns a device and the model, reads steps from the SHM ring, returns tokens.

One thread, one loop. It waits for whichever comes first: the next input frame, or the
scheduler's demand for the tokens of the oldest step in flight (the input ring's DEMAND
word: how many result frames the scheduler waits for). A frame is checked, staged (the
stager the plan chose: ordered, early or a host copy) and submitted, keeping at most the
pipeline's depth of steps on the device; a demanded step's tokens are waited for and written
to the result ring (rank 0). While it spins it also answers a step whose tokens are ready
when the result ring has room, so the scheduler finds them there. Answering only on demand or
with room never blocks on a full result ring, whatever the ring and pipeline sizes. A second
thread for the answers measured slower on the CPU: the two handed the GIL to each other on
every step. Any error is reported to the scheduler on the control pipe, and the process
exits; it never computes on a frame that failed its checks.
"""

from __future__ import annotations

import contextlib
import dataclasses
import faulthandler
import functools
import os
import pickle
import signal
import sys
import threading
import time
import traceback
from collections.abc import Callable
from multiprocessing.connection import Connection

import torch

from corelib.backend import DeviceSpec
from corelib.config import CorelibConfig
from corelib.device import MemoryStats
from corelib.errors import TransportError, one_line
from corelib.faults import maybe_fail
from corelib.models.sharding import TensorShard
from corelib.options import EngineOptions
from corelib.step.build import build_device_steps, load_model
from corelib.step.device_steps import DeviceSteps
from corelib.step.forward_input import StepKind
from corelib.step.handoff import StepHandle
from corelib.step.layout import EngineLayout
from corelib.step.pipeline import StepPipeline
from corelib.transport.parallel import init_group, leave_group
from corelib.transport.shm import Consumer, Producer, Ring
from corelib.transport.wire import FrameKind, WireResult, encode_result, input_of, result_header

IDLE_S = 365 * 24 * 3600.0  # waiting for the next step: idle is fine (the scheduler's liveness is checked)


@dataclasses.dataclass
class WorkerArgs:
    """Everything a worker needs; pickled into the spawned process."""

    rank: int
    world_size: int
    config: CorelibConfig
    spec: DeviceSpec
    options: EngineOptions
    input_ring: str
    result_ring: str
    num_slots: int
    slot_bytes: int
    result_slot_bytes: int
    doorbell_fd: int  # eventfd this rank sleeps on for input frames (and the scheduler's demand)
    release_fd: int  # eventfd the scheduler sleeps on for released input slots
    result_doorbell_fd: int  # eventfd the scheduler sleeps on for results (rank 0; -1 elsewhere)
    result_release_fd: int  # eventfd rank 0 sleeps on for released result slots (rank 0; -1 elsewhere)
    control_fd: int  # write: ready / error / memory messages (a pipe: its end also shows an exit)
    parent_pid: int
    register_host: bool
    master_address: str = "127.0.0.1"  # tensor parallelism: the process group's rendezvous
    master_port: int = 0
    local_rank: int = 0  # this rank's place on its node: its device index and its consumer index in the ring
    local_world: int = 1  # ranks on this node (engine.tp / nodes): the ring's consumers


class StepLoop:
    """Receive, stage and submit steps; answer the oldest when asked (or when ready and there is room)."""

    def __init__(self, consumer: Consumer, steps: DeviceSteps, results: Producer | None, depth: int,
                 timeout_s: float) -> None:
        self.consumer = consumer
        self.steps = steps
        self.results = results
        self.timeout = timeout_s
        self.pipeline: StepPipeline[tuple[StepHandle, float]] = StepPipeline(depth)
        self.answered = 0  # steps whose tokens were taken (rank 0: result frames written)

    def _answerable(self) -> bool:
        if not self.pipeline:
            return False
        if self.consumer.demanded() > self.answered:
            return True
        results = self.results
        return (results is None or results.has_room()) and self.pipeline.oldest()[0].done()

    def serve(self, memory: Callable[[], MemoryStats], send: Callable[[str, str | None, object], None]) -> None:
        """Until the stop frame."""
        consumer = self.consumer
        while True:
            if not consumer.wait(IDLE_S, also=self._answerable):
                self.answer_oldest()
                continue
            frame = consumer.read(who="the next step")
            kind = frame.header.kind
            if kind is FrameKind.stop:
                consumer.release(frame)
                while self.pipeline:
                    self.answer_oldest(reply=False)  # nobody reads them: only give the inputs back
                return
            if kind is FrameKind.memory:
                consumer.release(frame)
                send("memory", None, memory())
                continue
            maybe_fail("poll")
            where = f"{consumer.name} frame {frame.header.seq} (slot {frame.slot})"
            if kind is not FrameKind.step:
                raise TransportError(f"{where}: a {kind.name} frame where a step was expected")
            fi = input_of(frame.header, frame.payload, where)
            staged = self.steps.stager.receive(fi, functools.partial(consumer.release, frame))
            transport_us = (time.perf_counter() - frame.header.sent_at) * 1e6
            while not self.pipeline.can_submit():
                self.answer_oldest()
            self.pipeline.push((self.steps.submit(staged), transport_us))

    def answer_oldest(self, reply: bool = True) -> None:
        """Wait (bounded) for the oldest step's tokens and write them to the result ring (rank 0)."""
        handle, transport_us = self.pipeline.pop()
        result = self.steps.result(handle, self.timeout)
        self.answered += 1
        if reply and self.results is not None:
            wire = WireResult(result.step_id, result.kind is StepKind.decode, result.graph, result.tokens,
                              result.busy_ms, result.gap_ms, transport_us, result.logprobs)
            self.results.write(result_header(wire, time.perf_counter()), encode_result(wire))


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

    def _parent_watch(self) -> list[int]:
        """A pidfd of the scheduler: readable the moment it exits, so a waiting worker notices at once."""
        try:
            return [os.pidfd_open(self.args.parent_pid)]
        except (OSError, AttributeError):
            return []  # an old kernel: the wait still checks every quarter second

    def run(self) -> None:
        args = self.args
        from corelib.plugins import PluginRegistry

        backend = PluginRegistry().get(args.spec.backend)
        device = backend.open(dataclasses.replace(args.spec, device_index=args.spec.device_index + args.local_rank))
        layout = EngineLayout.of(args.config)
        shard = None
        if args.world_size > 1:
            all_reduce = init_group(device, args.rank, args.world_size, args.master_address, args.master_port,
                                    self.timeout, fast_allreduce=args.options.fast_allreduce)
            shard = TensorShard(args.rank, args.world_size, all_reduce)
        model = load_model(args.config, device, shard)
        options = args.options
        steps = build_device_steps(device, backend, args.config, options, layout, model, options.staging)
        spin_us = args.config.engine.shm.spin_us
        watch = self._parent_watch()
        ring = Ring.attach(args.input_ring, args.num_slots, args.slot_bytes, num_consumers=args.local_world)
        registration = device.register_host(ring.whole) if args.register_host else None
        consumer = Consumer(ring, args.local_rank, args.doorbell_fd, args.release_fd, self.timeout,
                            alive=self.parent_gone, name=f"input ring (rank {args.rank})", spin_us=spin_us, watch=watch)
        results: Producer | None = None
        if args.result_doorbell_fd >= 0 and args.result_release_fd >= 0:
            out = Ring.attach(args.result_ring, args.num_slots, args.result_slot_bytes)
            results = Producer(out, [args.result_doorbell_fd], args.result_release_fd, self.timeout,
                               alive=self.parent_gone, name="result ring", consumer_names=["the scheduler"],
                               spin_us=spin_us, watch=watch)
        loop = StepLoop(consumer, steps, results, options.pipeline_depth, self.timeout)
        self.send("ready", None, "")
        loop.serve(device.memory_stats, self.send)
        if registration is not None:
            registration.close()
        steps.close()
        leave_group()
        device.close()


def main() -> None:
    """Entry point: ``python -m corelib.transport.worker`` with pickled WorkerArgs on stdin."""
    signal.signal(signal.SIGINT, signal.SIG_IGN)  # Ctrl-C reaches the whole group; the scheduler decides
    faulthandler.register(signal.SIGUSR1, all_threads=True)  # `kill -USR1 <pid>`: every thread's stack to stderr
    args: WorkerArgs = pickle.loads(sys.stdin.buffer.read())
    torch.set_num_threads(max(1, torch.get_num_threads() // max(1, args.local_world)))
    worker = Worker(args)
    try:
        worker.run()
    except BaseException as error:  # noqa: BLE001 - reported to the scheduler
        worker.report(error)
    # Everything the worker holds was released by run(); tearing down the interpreter (torch's
    # modules, about a second) would only make the scheduler's close wait for it.
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(0)


if __name__ == "__main__":
    main()
