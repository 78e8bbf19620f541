"""What a frame's H2D costs the receiving thread on arrival, from a ring slot in shared memory, while the device runs.

Early materialization issues the H2D of a frame's arena on the thread that reads the frame
(``EarlyStager.receive``). Over SHM its hop measured 115-270 µs at the median on H100 and H200
hosts while it copied straight from the (pageable) ring slot, against 27-45 µs for ordered
materialization, whose thread copies the slot into a pinned snapshot and issues no device call.
This times, on one thread, the host side of each way the arena can reach the device on arrival,
at the decode layouts' sizes:

- ``pageable``: what ``EarlyStager.receive`` does: device memory, then the copy on the polling
  stream straight from the ring slot (not registered: the driver stages a pageable source), an event;
- ``pinned``: the slot copied into a pinned buffer first (the ordered stager's copy), then the same
  early stager's copy from that buffer;
- ``registered``: the ``pageable`` stager once the ring is registered with the device (what
  ``engine.shm.register_host`` does: the race the early path shows);
- ``snapshot``: the ordered stager without registration: the memcpy into a pinned snapshot alone;

each with the device idle and with its compute stream busy (a sleep kernel covering the whole run,
where the backend has one; the emulator's compute stream is busy with a long host function).

    python3 benchmarks/early_h2d.py backend=cuda backend.runtime=native [--repeats 2000] [--out FILE]

Prints the median and p99 in µs per way, size and load, and writes them as JSON with ``--out``.

On an H200 (BENCHMARKS.md, 2026-12-05) the pageable source was not what the early hop spent: the
pinned bounce took 75 / 80 / 102 µs at the median at bs 1 / 32 / 128 with the device idle, against
54 / 56 / 72 straight from the pageable slot and 12-25 for the snapshot alone. What costs is the
device calls on the receiving thread (allocation, the copy's issue, the event), so the early
stager copies the slot as it is.
"""

from __future__ import annotations

import argparse
import json
import statistics
import time
from collections.abc import Callable
from typing import Any

import torch
from omegaconf import OmegaConf

from corelib.config.options import Staging
from corelib.config.schema import CorelibConfig
from corelib.platform.device import Device
from corelib.plugins import PluginRegistry
from corelib.startup.compose import compose_config, prepare_config_store
from corelib.startup.start import start
from corelib.step import staging
from corelib.step.arena import ArenaLayout
from corelib.step.forward_input import ForwardInput
from corelib.step.layout import EngineLayout
from corelib.step.staging import InputStager, Staged, build_stager
from corelib.transport.shm import Ring
from corelib.transport.wire import HEADER_BYTES, FrameHeader, FrameKind, input_of

ROWS = (1, 32, 128)
SLOTS = 4


def decode_layout(overrides: list[str], rows: int) -> ArenaLayout:
    """The decode arena of ``rows`` rows, as the engine lays it out for the model in ``overrides``."""
    config = OmegaConf.to_object(compose_config([*overrides, f"engine.max_num_seqs={rows}"]))
    assert isinstance(config, CorelibConfig)
    return EngineLayout.of(config).decode_layout


def timed(fn: Callable[[int], None], repeats: int) -> list[float]:
    """The wall time of each call of ``fn(i)``, µs (after 50 warm calls)."""
    for i in range(50):
        fn(i)
    out = []
    clock = time.perf_counter
    for i in range(repeats):
        began = clock()
        fn(i)
        out.append((clock() - began) * 1e6)
    return out


def busy(device: Device, seconds: float) -> Callable[[], None]:
    """Keep the device's compute stream busy for about ``seconds``; returns what waits for the end."""
    compute = device.stream("compute")
    if device.torch_device.type == "cuda":
        properties = torch.cuda.get_device_properties(device.torch_device)
        rate = getattr(properties, "clock_rate", 0) * 1e3 or 2e9  # kHz to Hz; about an H100's, where not said
        compute.launch(lambda: torch.cuda._sleep(int(seconds * rate)))  # type: ignore[no-untyped-call]
    else:
        compute.launch(lambda: time.sleep(seconds))
    return compute.synchronize


def receiving(stager: InputStager, inputs: list[ForwardInput], repeats: int) -> list[float]:
    """``timed`` frames received by ``stager``, frame ``i`` from slot ``i % SLOTS``, whose earlier step is done by
    then; every step done and given back at the end."""
    held: list[Staged | None] = [None] * SLOTS

    def done(staged: Staged | None) -> None:
        if staged is not None:
            if staged.ready is not None:
                staged.ready.synchronize()
            staged.release()  # its buffers go back

    def receive(i: int) -> None:
        slot = i % SLOTS
        done(held[slot])
        held[slot] = stager.receive(inputs[slot], lambda: None)

    try:
        return timed(receive, repeats)
    finally:
        for staged in held:
            done(staged)


class Bounced(InputStager):
    """The early stager fed from a pinned copy of each slot, made on arrival: the staging the driver does for a
    pageable source, done by the receiving thread (the copies go round ``SLOTS`` pinned buffers, each free again
    once the step before on it is done)."""

    mode = Staging.early

    def __init__(self, early: InputStager, pinned: list[ForwardInput]) -> None:
        super().__init__(early.device, early.compute)
        self._early = early
        self._pinned = pinned
        self._next = 0

    def receive(self, fi: ForwardInput, release_ring_slot: Callable[[], None]) -> Staged:
        bounce = self._pinned[self._next]
        self._next = (self._next + 1) % len(self._pinned)
        nbytes = fi.layout.nbytes
        staging._copy_bytes(bounce.arena[:nbytes], fi.arena[:nbytes])  # the ordered stager's own copy
        return self._early.receive(bounce, release_ring_slot)

    def to_device(self, staged: Staged, target: torch.Tensor | None) -> torch.Tensor:
        return self._early.to_device(staged, target)


def measure(device: Device, ring: Ring, layout: ArenaLayout, repeats: int) -> dict[str, list[float]]:
    """Each way's host µs per frame, idle and busy."""
    compute = device.stream("compute")

    def frame(slot: int, arena: torch.Tensor) -> ForwardInput:
        return input_of(FrameHeader(FrameKind.step, slot, step_id=slot, num_seqs=1, bucket=1, kv_blocks=1,
                                    payload_len=layout.nbytes, layout=layout.words, num_tokens=1, max_query_len=1),
                        arena)

    inputs = [frame(slot, ring.payload(slot)[: layout.nbytes]) for slot in range(SLOTS)]
    pinned = [frame(slot, device.host_empty((layout.nbytes,), torch.uint8, pinned=True)) for slot in range(SLOTS)]

    def stager(mode: Staging) -> InputStager:
        return build_stager(mode, device, compute, layout.nbytes, SLOTS, 30.0)

    ways = {"pageable": stager(Staging.early), "pinned": Bounced(stager(Staging.early), pinned),
            "snapshot": stager(Staging.ordered)}
    result: dict[str, list[float]] = {}
    for load in ("idle", "busy"):
        for name, way in ways.items():
            done = busy(device, 0.5 + repeats * 200e-6) if load == "busy" else device.synchronize
            result[f"{name} {load}"] = receiving(way, inputs, repeats)
            done()
    if device.capabilities.host_register:
        registration = device.register_host(ring.whole)
        try:
            for load in ("idle", "busy"):
                done = busy(device, 0.5 + repeats * 200e-6) if load == "busy" else device.synchronize
                result[f"registered {load}"] = receiving(ways["pageable"], inputs, repeats)
                done()
        finally:
            device.synchronize()
            registration.close()
    device.synchronize()
    return result


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("overrides", nargs="*")
    parser.add_argument("--model", default="small-0.6b")
    parser.add_argument("--repeats", type=int, default=2000)
    parser.add_argument("--out", default=None)
    args = parser.parse_args()
    overrides = [*args.overrides, f"model={args.model}"]
    registry = PluginRegistry()
    prepare_config_store(registry)
    startup = start(compose_config(overrides), registry)
    device = startup.backend.open(startup.spec)
    layouts = {rows: decode_layout(overrides, rows) for rows in ROWS}
    slot_bytes = -(-(max(layout.nbytes for layout in layouts.values()) + HEADER_BYTES) // 4096) * 4096
    ring = Ring.create("early-h2d", SLOTS, slot_bytes)
    report: dict[str, Any] = {"device": device.name, "repeats": args.repeats, "points": []}
    try:
        print(f"{device.name}: host µs per frame, median / p99, {args.repeats} frames a point")
        for rows, layout in layouts.items():
            nbytes = layout.nbytes
            for way, samples in measure(device, ring, layout, args.repeats).items():
                samples.sort()
                p50, p99 = statistics.median(samples), samples[int(0.99 * (len(samples) - 1))]
                report["points"].append({"rows": rows, "bytes": nbytes, "way": way, "p50_us": round(p50, 2),
                                         "p99_us": round(p99, 2)})
                print(f"  bs {rows:>3} ({nbytes:>6} B)  {way:<16} {p50:8.1f} / {p99:8.1f}")
    finally:
        ring.close()
        device.close()
    if args.out:
        with open(args.out, "w") as handle:
            json.dump(report, handle, indent=1)


if __name__ == "__main__":
    main()
