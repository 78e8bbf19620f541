"""The SHM materialization race, reproduced with the engine's own ring and input stagers.

A producer thread rewrites ring slots as early as back-pressure allows, each frame carrying
a step-specific pattern. The consumer reads each frame the way a worker does, stages it
through the ordered or the early stager into a static device arena (a graph's inputs), and a
check launched on the compute stream compares what reached the device with the pattern.
"""

from __future__ import annotations

import functools
import threading
from collections import deque
from collections.abc import Callable, Sequence

import torch
from ringkit import decode_header, wire

from corelib.config.options import Staging
from corelib.platform.device import Device, Event
from corelib.plugins import PluginRegistry
from corelib.startup.compose import compose_config
from corelib.startup.start import start
from corelib.step.layout import EngineLayout
from corelib.step.staging import EarlyStager, Staged, build_stager
from corelib.transport.wire import input_of

PATTERN = 1_000_003


def pattern(step: int, count: int, device: torch.device | str = "cpu") -> torch.Tensor:
    return torch.arange(count, dtype=torch.int64, device=device) + step * PATTERN


def race(
    overrides: Sequence[str],
    ordered: bool,
    steps: int,
    num_slots: int = 2,
    register_host: bool = False,
    widen: Callable[[Device, object], None] | None = None,
    in_place: bool = False,
) -> int:
    """Steps whose device inputs differed from what the producer sent (0 means no race seen).

    ``in_place``: the ordered stager's H2D reads the (registered) ring slot itself, given back once read."""
    cfg = compose_config(["model.num_layers=1", "engine.graph=off", "engine.max_num_seqs=4", "model.max_model_len=64",
                          *overrides])
    startup = start(cfg, PluginRegistry())
    device = startup.backend.open(startup.spec)
    layout = EngineLayout.of(startup.config)
    decode = layout.decode_layout
    words = decode.nbytes // 8
    timeout = startup.config.engine.timeout_s
    wired = wire(num_slots=num_slots, slot_bytes=decode.nbytes + 1024 + 64, timeout=timeout)
    registration = device.register_host(wired.ring.whole) if register_host or in_place else None
    compute = device.stream("compute")
    stager = build_stager(Staging.ordered if ordered else Staging.early, device, compute, decode.nbytes, 4, timeout,
                          in_place=in_place)
    target = device.empty((decode.nbytes,), torch.uint8)  # the static inputs a graph would read
    mismatches = device.zeros((1,), torch.int64)
    failure: list[BaseException] = []

    def produce() -> None:
        try:
            for step in range(steps):
                wired.producer.write(decode_header(decode, step), pattern(step, words).view(torch.uint8))
        except BaseException as error:  # noqa: BLE001 - re-raised by the test thread
            failure.append(error)

    producer = threading.Thread(target=produce, name="race-producer")
    producer.start()
    in_flight: deque[tuple[Event, Staged]] = deque()
    consumer = wired.consumers[0]
    try:
        for step in range(steps):
            stager.release_read()  # as a worker does before it takes the next frame
            while in_place and in_flight and not consumer.available():
                # The producer may wait for a slot whose step still reads it: a worker's answering thread
                # gives it back when that step is done.
                event, done = in_flight.popleft()
                event.synchronize()
                done.release()
                stager.release_read()
            frame = consumer.read()
            if widen is not None and isinstance(stager, EarlyStager):
                widen(device, stager.stream)
            fi = input_of(frame.header, frame.payload, "race frame")
            staged = stager.receive(fi, functools.partial(consumer.release, frame))
            stager.to_device(staged, target)

            def check(step: int = step) -> None:
                seen = target[: decode.nbytes].view(torch.int64)
                mismatches.add_((seen != pattern(step, words, seen.device)).any().to(torch.int64))

            compute.launch(check)
            stager.after_forward()
            in_flight.append((compute.record(device.event()), staged))
            while len(in_flight) > 2:
                event, done = in_flight.popleft()
                event.synchronize()
                done.release()
        device.synchronize()
        for _, done in in_flight:
            done.release()
    finally:
        producer.join(30)
        if registration is not None:
            device.synchronize()
            registration.close()
        stager.close()
        device.close()
        wired.close()
    if failure:
        raise failure[0]
    return int(mismatches.cpu()[0])
