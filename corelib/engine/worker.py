"""A worker process: owns a device and the model, reads steps from the SHM ring, returns tokens.

Two threads, each doing one thing. The main thread reads a frame, checks it, stages its inputs
(the stager the plan chose: ordered, early or a host copy) and submits the step, keeping at
most the pipeline's depth of steps on the device. The completer waits for each step's tokens,
in order, and writes them to the result ring (rank 0). Any error is reported to the scheduler
on the control pipe, and the process exits; it never computes on a frame that failed its checks.
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

from corelib import faults
from corelib.device import MemoryStats
from corelib.engine.build import EngineLayout, build_device_steps, load_model
from corelib.engine.device_steps import DeviceSteps
from corelib.engine.forward_input import ForwardInput
from corelib.engine.handoff import StepHandle
from corelib.engine.parallel import init_group, leave_group
from corelib.engine.pipeline import StepPipeline
from corelib.engine.scheduler import StepKind
from corelib.engine.shm import Consumer, Frame, Producer, Ring
from corelib.engine.wire import FrameKind, InputFlags, WireResult, WorkerArgs, encode_result, result_header
from corelib.errors import TransportError, one_line
from corelib.models.sharding import TensorShard


def input_of(frame: Frame, where: str) -> ForwardInput:
    """The step a checked input frame describes; its arena views the slot."""
    header = frame.header
    layout = header.input_layout(where)
    kind = StepKind.decode if header.kind is FrameKind.decode else StepKind.prefill
    return ForwardInput(header.step_id, kind, header.num_seqs, header.bucket, header.kv_blocks,
                        InputFlags.SAMPLE in InputFlags(header.flags), layout, frame.payload)


class _InFlight:
    """The worker's step pipeline, shared by the submitting thread and the completer."""

    def __init__(self, depth: int, timeout_s: float, rank: int) -> None:
        self.pipeline: StepPipeline[tuple[StepHandle, float]] = StepPipeline(depth)
        self.depth = depth
        self._cond = threading.Condition()
        self._timeout = timeout_s
        self._rank = rank
        self._closing = False

    def push(self, item: tuple[StepHandle, float]) -> None:
        with self._cond:
            self.pipeline.push(item)
            self._cond.notify_all()

    def close(self) -> None:
        """No more steps: the completer ends once the pipeline is empty."""
        with self._cond:
            self._closing = True
            self._cond.notify_all()

    def wait_for_room(self, step_id: int) -> None:
        """Block (bounded) until fewer than ``depth`` steps are on the device."""
        deadline = time.monotonic() + self._timeout
        with self._cond:
            while len(self.pipeline) >= self.depth:
                left = deadline - time.monotonic()
                if left <= 0 or not self._cond.wait(left):
                    raise TransportError(f"worker rank {self._rank}: step {step_id} waited {self._timeout:g} s for "
                                         f"the tokens of the step {self.depth} back")

    def oldest(self) -> tuple[StepHandle, float] | None:
        """The oldest step in flight; None once closed and empty."""
        with self._cond:
            while not self.pipeline and not self._closing:
                self._cond.wait()
            return self.pipeline.oldest() if self.pipeline else None

    def done(self) -> None:
        with self._cond:
            self.pipeline.pop()
            self._cond.notify_all()


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
        shard = None
        if args.world_size > 1:
            all_reduce = init_group(device, args.rank, args.world_size, args.master_address, args.master_port,
                                    self.timeout, fast_allreduce=args.options.fast_allreduce)
            shard = TensorShard(args.rank, args.world_size, all_reduce)
        model = load_model(args.config, device, shard)
        options = args.options
        steps = build_device_steps(device, backend, args.config, options, layout, model, options.staging)
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
        in_flight = _InFlight(options.pipeline_depth, self.timeout, args.rank)
        completer = threading.Thread(target=self._guard, args=(self._complete, steps, results, in_flight),
                                     name="corelib-completer")
        self.send("ready", None, "")
        completer.start()
        try:
            self._serve(consumer, steps, in_flight, device.memory_stats)
        finally:
            in_flight.close()
        completer.join()
        if registration is not None:
            registration.close()
        steps.close()
        leave_group()
        device.close()

    def _guard(self, target: object, *args: object) -> None:
        try:
            target(*args)  # type: ignore[operator]
        except BaseException as error:  # noqa: BLE001 - reported to the scheduler, then the process ends
            self.report(error)

    def _serve(self, consumer: Consumer, steps: DeviceSteps, in_flight: _InFlight,
               memory: Callable[[], MemoryStats]) -> None:
        """Read frames until the stop frame; submit each step once the pipeline has room."""
        while True:
            frame = consumer.read(timeout=365 * 24 * 3600.0, who="the next step")  # idle is fine
            kind = frame.header.kind
            if kind is FrameKind.stop:
                consumer.release(frame)
                return
            if kind is FrameKind.memory:
                consumer.release(frame)
                self.send("memory", None, memory())
                continue
            faults.maybe_fail("poll")
            where = f"{consumer.name} frame {frame.header.seq} (slot {frame.slot})"
            if kind not in (FrameKind.decode, FrameKind.prefill):
                raise TransportError(f"{where}: a {kind.name} frame where a step was expected")
            fi = input_of(frame, where)
            staged = steps.stager.receive(fi, functools.partial(consumer.release, frame))
            transport_us = (time.perf_counter() - frame.header.sent_at) * 1e6
            in_flight.wait_for_room(fi.step_id)
            in_flight.push((steps.submit(staged), transport_us))

    def _complete(self, steps: DeviceSteps, results: Producer | None, in_flight: _InFlight) -> None:
        while (item := in_flight.oldest()) is not None:
            handle, transport_us = item
            result = steps.result(handle, self.timeout)
            in_flight.done()
            if results is not None:
                wire = WireResult(result.step_id, result.kind is StepKind.decode, result.graph, result.tokens,
                                  result.busy_ms, result.gap_ms, transport_us)
                results.write(result_header(wire, time.perf_counter()), encode_result(wire))


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
