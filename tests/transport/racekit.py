"""The SHM materialization race, reproduced with the engine's own ring, materializer and runner.

A producer thread rewrites ring slots as early as back-pressure allows, each frame carrying
a step-specific pattern. The consumer reads each frame through the worker's Materializer
(ordered or early), stages it the way the runner does before a graph replay, and a check
launched on the compute stream compares what reached the device with the pattern.
"""

from __future__ import annotations

import threading
from collections import deque
from collections.abc import Callable, Sequence

import torch
from ringkit import wire

from corelib.compose import compose_config
from corelib.device import Device, Event
from corelib.engine.build import EngineLayout, build_runner, model_weights
from corelib.engine.forward_input import ForwardInput
from corelib.engine.shm import FrameHeader, FrameKind
from corelib.engine.worker import Materializer
from corelib.plugins import PluginRegistry
from corelib.startup import start

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
) -> int:
    """Steps whose device inputs differed from what the producer sent (0 means no race seen)."""
    cfg = compose_config(["model.num_layers=1", "engine.graph=off", "engine.max_num_seqs=4", "model.max_model_len=64",
                          *overrides])
    startup = start(cfg, PluginRegistry())
    device = startup.backend.open(startup.spec)
    layout = EngineLayout.of(startup.config)
    runner = build_runner(device, startup.config, startup.plan, layout, model_weights(startup.config, device),
                          ordered_prepare=ordered)
    decode = layout.builder().decode
    words = decode.nbytes // 8
    wired = wire(num_slots=num_slots, slot_bytes=decode.nbytes + 1024 + 64, timeout=startup.config.engine.timeout_s)
    registration = device.register_host(wired.ring.whole) if register_host else None
    materialize = Materializer(device, runner, ordered, decode.nbytes, startup.config.engine.timeout_s)
    mismatches = device.zeros((1,), torch.int64)
    failure: list[BaseException] = []

    def produce() -> None:
        try:
            for step in range(steps):
                header = FrameHeader(FrameKind.decode, 0, step_id=step, num_seqs=1, bucket=1, kv_blocks=1,
                                     layout=decode.encode())
                wired.producer.write(header, pattern(step, words).view(torch.uint8))
        except BaseException as error:  # noqa: BLE001 - re-raised by the test thread
            failure.append(error)

    producer = threading.Thread(target=produce, name="race-producer")
    producer.start()
    in_flight: deque[tuple[Event, ForwardInput]] = deque()
    target = runner.decode_arena
    if target is None:
        raise RuntimeError("the race needs a device with memory of its own")
    try:
        for step in range(steps):
            frame = wired.consumers[0].read()
            if widen is not None and materialize.stream is not None:
                widen(device, materialize.stream)
            fi = materialize(frame, wired.consumers[0])
            runner._stage(fi, target)

            def check(step: int = step) -> None:
                seen = target[: decode.nbytes].view(torch.int64)
                mismatches.add_((seen != pattern(step, words, seen.device)).any().to(torch.int64))

            runner.compute.launch(check)
            if runner.prepare is not None:
                runner._consumed = runner.compute.record(device.event())
            in_flight.append((runner.compute.record(device.event()), fi))
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
        runner.close()
        device.close()
        wired.ring.close()
    if failure:
        raise failure[0]
    return int(mismatches.cpu()[0])
