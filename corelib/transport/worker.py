"""A worker process: owns a device and the model, reads steps from the SHM ring, returns tokens.

Two threads. The receiving thread waits on the input ring's doorbell (a bounded spin, then a
sleep on its eventfd: never a fixed sleep), checks each frame, stages it (the stager the plan
chose: ordered, early or in place), and submits it once one of the pipeline's token buffers is
free, so a frame is taken in while earlier steps still run. The answering thread (the process's
main thread) waits for the oldest submitted step's tokens, the device's own wait, and writes them
to the result ring at once (rank 0), waiting for room there if it must; the receiving thread never
does. Where the device's events can be queried, the receiving thread, waiting for the next frame,
spins on the oldest step's event in the same turns and answers it the moment its tokens are there,
when the result ring has room, while the answering thread waits asleep: two threads spinning would
take turns at one GIL, and the frame's Python would queue behind the other's queries. A step whose
tokens are there the moment it is submitted (a device that computes on the host) is answered by
the receiving thread as well. Any error is raised on the main thread and reported to the scheduler
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
from collections import deque
from collections.abc import Callable
from multiprocessing.connection import Connection

import torch

from corelib.config.options import EngineOptions
from corelib.config.schema import CorelibConfig
from corelib.errors import TransportError, one_line
from corelib.models.sharding import TensorShard
from corelib.platform.backend import DeviceSpec
from corelib.platform.device import MemoryStats
from corelib.step.build import build_device_steps, load_model
from corelib.step.device_steps import DeviceSteps
from corelib.step.forward_input import StepKind
from corelib.step.handoff import StepHandle
from corelib.step.layout import EngineLayout
from corelib.step.staging import reads_ring_in_place
from corelib.support.faults import maybe_fail
from corelib.support.heap import freeze_startup_heap
from corelib.transport.doorbell import CHECK_S, spin_for
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
    doorbell_fd: int  # eventfd this rank's receiving thread sleeps on for input frames
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


@dataclasses.dataclass(frozen=True)
class _Submitted:
    handle: StepHandle
    # From the later of the producer's stamp (taken before it builds the frame's header) and this worker's readiness
    # for the frame, to its inputs staged
    transport_us: float
    wake_us: float  # the part of it until the frame was in this thread's hands (commit, doorbell, the ring's read)


class StepLoop:
    """Receive, stage and submit steps on the receiving thread; wait for their tokens and answer on this one."""

    def __init__(self, consumer: Consumer, steps: DeviceSteps, results: Producer | None, depth: int,
                 timeout_s: float, *, inline_answers: bool = False,
                 on_thread_start: Callable[[], None] = lambda: None) -> None:
        """``inline_answers``: the device's events can be queried, so the receiving thread may answer
        a step that is done when submitted; ``on_thread_start``: runs first on the receiving thread."""
        self.consumer = consumer
        self.steps = steps
        self.results = results
        self.timeout = timeout_s
        self._inline = inline_answers
        self._on_thread_start = on_thread_start
        self._free = threading.Semaphore(depth)  # token buffers holding no unanswered step
        self._submitted: deque[_Submitted | None] = deque()  # oldest first; None: nothing more will come
        self._arrived = threading.Condition()  # the answering thread sleeps here while nothing is submitted
        self._answering = threading.Lock()  # one thread answers at a time, oldest first
        self._stopping = False  # the stop frame came: nobody reads results any more
        self._failure: BaseException | None = None  # what stopped the receiving thread
        self.answered = 0  # steps whose tokens were taken (rank 0: result frames written)
        self.answered_inline = 0  # of those, answered by the receiving thread

    def serve(self, memory: Callable[[], MemoryStats], send: Callable[[str, str | None, object], None]) -> None:
        """Until the stop frame; raises what stopped either thread."""
        receiver = threading.Thread(target=self._receive_guarded, args=(memory, send), name="corelib-receive",
                                    daemon=True)
        receiver.start()
        self.answer()
        receiver.join(self.timeout)

    # ------------------------------------------------------------------ the receiving thread
    def _receive_guarded(self, memory: Callable[[], MemoryStats],
                         send: Callable[[str, str | None, object], None]) -> None:
        try:
            self._on_thread_start()
            self.receive(memory, send)
        except BaseException as error:  # noqa: BLE001 - raised again on the answering thread
            self._failure = error
            self._hand_over(None)

    def receive(self, memory: Callable[[], MemoryStats], send: Callable[[str, str | None, object], None]) -> None:
        """Take frames until the stop frame: memory questions answered, steps staged and submitted."""
        consumer = self.consumer
        stager = self.steps.stager
        while True:
            stager.release_read()  # ring slots whose H2D is done go back before their steps end
            ready_at = time.perf_counter()  # from here the hop is on the step's path; a frame that came earlier
            # waited behind the step in flight (a worker that computes on the host), hidden behind it
            if self._inline and self._submitted and not consumer.available():
                ready_at = self._await_frame()
            frame = consumer.read(IDLE_S, who="the next step")  # spins on the doorbell, then sleeps on it
            read_at = time.perf_counter()
            kind = frame.header.kind
            if kind is FrameKind.stop:
                consumer.release(frame)
                self._stopping = True
                self._hand_over(None)
                return
            if kind is FrameKind.memory:
                consumer.release(frame)
                send("memory", None, memory())
                continue
            maybe_fail("poll")
            if kind is not FrameKind.step:
                raise TransportError(f"{consumer.where(frame.header.seq, frame.slot)}: a {kind.name} frame where a "
                                     "step was expected")
            try:
                fi = input_of(frame.header, frame.payload)
            except TransportError as error:
                raise TransportError(f"{consumer.where(frame.header.seq, frame.slot)}: {error}") from None
            staged = self.steps.stager.receive(fi, functools.partial(consumer.release, frame))
            hop_from = max(frame.header.sent_at, ready_at)
            transport_us = (time.perf_counter() - hop_from) * 1e6
            wake_us = max(0.0, read_at - hop_from) * 1e6
            if not self._free.acquire(timeout=self.timeout):
                raise TransportError(f"{consumer.where(frame.header.seq, frame.slot)}: no token buffer came free "
                                     f"within {self.timeout:g} s: the tokens of step {self._oldest_step()} never came")
            self._hand_over(_Submitted(self.steps.submit(staged), transport_us, wake_us))

    def _await_frame(self) -> float:
        """Spin for the next frame and, in the same turns, for the oldest step's tokens, answered here as they
        come: one thread spins, not two taking turns at the GIL (the answering thread waits asleep meanwhile).
        Returns when a frame is there, or when an answer is left to the other thread (the result ring has no
        room); the time this thread was last ready for the frame."""
        consumer = self.consumer
        ready_at = time.perf_counter()
        while True:
            if consumer.wait(IDLE_S, also=self._oldest_done):  # spins, then sleeps on the doorbell
                return ready_at
            answered = self.answered
            self._answer_here()
            ready_at = time.perf_counter()
            if self.answered == answered or not self._submitted or consumer.available():
                return ready_at

    def _head(self) -> _Submitted | None:
        """The oldest submitted step, unlocked: one call, as the answering thread may take the last one meanwhile."""
        try:
            return self._submitted[0]
        except IndexError:
            return None

    def _oldest_done(self) -> bool:
        head = self._head()
        return head is not None and head.handle.done()

    def _answer_here(self) -> None:
        """Answer the steps whose tokens are there on this (the receiving) thread, unless the other is answering."""
        if self._answering.acquire(blocking=False):
            try:
                self._answer_ready(waited=None)
            finally:
                self._answering.release()

    def _hand_over(self, item: _Submitted | None) -> None:
        with self._arrived:
            self._submitted.append(item)
        if self._inline and item is not None and item.handle.done():
            self._answer_here()
        with self._arrived:
            if self._submitted:
                self._arrived.notify()

    def _oldest_step(self) -> int | None:
        head = self._head()
        return None if head is None else head.handle.step_id

    # ------------------------------------------------------------------ the answering thread
    def answer(self) -> None:
        """Until the stop: wait for the oldest step's tokens, then answer it and every later one that is ready."""
        while True:
            with self._arrived:
                while not self._submitted:
                    self._arrived.wait(CHECK_S)  # woken at once by a submission; bounded all the same
                head = self._submitted[0]
            if head is None:
                if self._failure is not None:
                    raise self._failure
                return
            # Asleep where the receiving thread spins on the same event (``_await_frame``)
            self.steps.wait(head.handle, self.timeout, spin=not self._inline)
            with self._answering:
                self._answer_ready(waited=head)

    def _answer_ready(self, waited: _Submitted | None) -> None:
        """Answer the oldest steps, in order, while their tokens are there (``waited``'s event completed);
        stop at the first whose tokens are not."""
        while True:
            with self._arrived:
                head = self._submitted[0] if self._submitted else None
            if head is None:
                return
            if head is not waited:
                if not self._inline or not head.handle.done():
                    return
                if waited is None and self.results is not None and not self.results.has_room():
                    return  # the receiving thread never waits for the result ring: the other thread will
            with self._arrived:
                self._submitted.popleft()
            result = self.steps.result(head.handle, self.timeout)
            self.answered += 1
            if waited is None:
                self.answered_inline += 1
            self._free.release()  # its token buffer is free: the next step may be submitted
            if self.results is not None and not self._stopping:
                wire = WireResult(result.step_id, result.kind is StepKind.decode, result.graph, result.tokens,
                                  result.busy_ms, result.gap_ms, head.transport_us, result.logprobs,
                                  result.prompt_logprobs, wake_us=head.wake_us)
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
        spin_us = spin_for(args.config.engine.shm.spin_us, args.spec.on_host)
        payload_crc = args.config.engine.shm.payload_crc
        watch = self._parent_watch()
        ring = Ring.attach(args.input_ring, args.num_slots, args.slot_bytes, num_consumers=args.local_world)
        # An ordered stager that reads the slots in place needs them registered (pinned where they are).
        in_place = reads_ring_in_place(options.staging, device)
        registration = device.register_host(ring.whole) if args.register_host or in_place else None
        consumer = Consumer(ring, args.local_rank, args.doorbell_fd, args.release_fd, self.timeout,
                            alive=self.parent_gone, name=f"input ring (rank {args.rank})", spin_us=spin_us, watch=watch,
                            payload_crc=payload_crc)
        results: Producer | None = None
        if args.result_doorbell_fd >= 0 and args.result_release_fd >= 0:
            out = Ring.attach(args.result_ring, args.num_slots, args.result_slot_bytes)
            results = Producer(out, [args.result_doorbell_fd], args.result_release_fd, self.timeout,
                               alive=self.parent_gone, name="result ring", consumer_names=["the scheduler"],
                               spin_us=spin_us, watch=watch, payload_crc=payload_crc)
        loop = StepLoop(consumer, steps, results, options.pipeline_depth, self.timeout,
                        inline_answers=device.capabilities.event_query, on_thread_start=device.bind_thread)
        # The model, its graphs, torch's and Triton's modules live as long as this process: out of the collector's
        # sight, a collection between two frames walks only what the steps made since.
        freeze_startup_heap()
        torch.set_num_threads(serving_threads(torch.get_num_threads(), args.spec.on_host))
        self.send("ready", None, "")
        loop.serve(device.memory_stats, self.send)
        if registration is not None:
            registration.close()
        steps.close()
        leave_group()
        device.close()


def compute_threads(cores: int, local_world: int, device_is_host: bool) -> int:
    """Torch's threads in each worker: the cores shared by this node's ranks. A device that computes on the
    host's cores shares them with the scheduler's process too, which packs the next step while a worker
    computes: it keeps one core of its own (a thread pool that loses a core to it waits at every barrier)."""
    if device_is_host and cores > 1:
        cores -= 1
    return max(1, cores // max(1, local_world))


def serving_threads(loading: int, on_host: bool) -> int:
    """Torch's threads once the worker serves steps, after ``loading`` built the model. A device that is not the
    host gets its inputs copied and its graphs replayed: no step runs a host op worth a thread pool, and a pool
    that some small host op woke spins beside the thread reading the next frame (on the H200, one thread halved
    that thread's Python per frame and the hop's median). A device that computes on the host keeps its pool."""
    return loading if on_host else 1


def main() -> None:
    """Entry point: ``python -m corelib.transport.worker`` with pickled WorkerArgs on stdin."""
    signal.signal(signal.SIGINT, signal.SIG_IGN)  # Ctrl-C reaches the whole group; the scheduler decides
    faulthandler.register(signal.SIGUSR1, all_threads=True)  # `kill -USR1 <pid>`: every thread's stack to stderr
    args: WorkerArgs = pickle.loads(sys.stdin.buffer.read())
    torch.set_num_threads(compute_threads(torch.get_num_threads(), args.local_world,
                                          args.spec.capabilities.device_is_host))
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
