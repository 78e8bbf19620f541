"""What a frame's H2D costs the receiving thread on arrival, from a ring slot in shared memory, while the device runs.

Early materialization issues the H2D of a frame's arena on the thread that reads the frame
(``EarlyStager.receive``). Over SHM its hop has measured 115-270 µs at the median on H100 and H200
hosts, against 27-45 µs for ordered materialization, whose thread copies the slot into a pinned
snapshot and issues no device call. This times, on one thread, the host side of each way the
arena can reach the device on arrival, at the decode layouts' sizes:

- ``pageable``: what ``EarlyStager.receive`` does: device memory, then the copy on the polling
  stream straight from the ring slot (not registered: the driver stages a pageable source), an event;
- ``pinned``: a memcpy of the slot into a pinned buffer first, then the same copy from that buffer;
- ``registered``: the ring registered with the device, the copy straight from the slot (what
  ``engine.shm.register_host`` does: the race the early path shows);
- ``snapshot``: ordered materialization's side on arrival, the memcpy into a pinned buffer alone;

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

from corelib.config.schema import CorelibConfig
from corelib.platform.device import Device
from corelib.plugins import PluginRegistry
from corelib.startup.compose import compose_config, prepare_config_store
from corelib.startup.start import start
from corelib.step import staging
from corelib.step.layout import EngineLayout
from corelib.transport.shm import Ring

ROWS = (1, 32, 128)
SLOTS = 4


def arena_bytes(overrides: list[str], rows: int) -> int:
    """The decode arena of ``rows`` rows, as the engine lays it out for the model in ``overrides``."""
    config = OmegaConf.to_object(compose_config([*overrides, f"engine.max_num_seqs={rows}"]))
    assert isinstance(config, CorelibConfig)
    return EngineLayout.of(config).decode_layout.nbytes


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


def measure(device: Device, ring: Ring, nbytes: int, repeats: int) -> dict[str, list[float]]:
    stream = device.stream("polling")
    events = [device.event(name=f"early_h2d[{i}]") for i in range(SLOTS)]
    pinned = [device.host_empty((nbytes,), torch.uint8, pinned=True) for _ in range(SLOTS)]
    target = device.empty((nbytes,), torch.uint8)
    slots = [ring.payload(i)[:nbytes] for i in range(SLOTS)]
    kept: list[Any] = [None] * SLOTS  # each way's device buffer lives until its slot comes round again

    def pageable(i: int) -> None:
        slot = i % SLOTS
        events[slot].synchronize()
        out = device.empty((nbytes,), torch.uint8)
        stream.copy(out, slots[slot])
        stream.record(events[slot])
        kept[slot] = out

    def bounced(i: int) -> None:
        slot = i % SLOTS
        events[slot].synchronize()  # the pinned buffer is free again
        staging._copy_bytes(pinned[slot], slots[slot])  # the ordered stager's own copy
        out = device.empty((nbytes,), torch.uint8)
        stream.copy(out, pinned[slot])
        stream.record(events[slot])
        kept[slot] = out

    def snapshot(i: int) -> None:
        slot = i % SLOTS
        staging._copy_bytes(pinned[slot], slots[slot])  # the ordered stager's own copy

    def registered(i: int) -> None:
        slot = i % SLOTS
        events[slot].synchronize()
        stream.copy(target, slots[slot])
        stream.record(events[slot])

    ways: dict[str, Callable[[int], None]] = {"pageable": pageable, "pinned": bounced, "snapshot": snapshot}
    result: dict[str, list[float]] = {}
    for load in ("idle", "busy"):
        for name, fn in ways.items():
            done = busy(device, 0.5 + repeats * 200e-6) if load == "busy" else device.synchronize
            result[f"{name} {load}"] = timed(fn, repeats)
            done()
    if device.capabilities.host_register:
        registration = device.register_host(ring.whole)
        try:
            for load in ("idle", "busy"):
                done = busy(device, 0.5 + repeats * 200e-6) if load == "busy" else device.synchronize
                result[f"registered {load}"] = timed(registered, repeats)
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
    sizes = {rows: arena_bytes(overrides, rows) for rows in ROWS}
    slot_bytes = -(-(max(sizes.values()) + 1024) // 4096) * 4096
    ring = Ring.create("early-h2d", SLOTS, slot_bytes)
    report: dict[str, Any] = {"device": device.name, "repeats": args.repeats, "points": []}
    try:
        print(f"{device.name}: host µs per frame, median / p99, {args.repeats} frames a point")
        for rows, nbytes in sizes.items():
            for way, samples in measure(device, ring, nbytes, args.repeats).items():
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
