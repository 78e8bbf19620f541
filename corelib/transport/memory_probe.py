"""The device memory the SHM workers will allocate from, read before they start.

Over ``engine.transport=shm`` the scheduler's process never opens the accelerator (a device
context there would cost memory the workers need), yet it must size the KV pool before the
workers build it: every worker derives its layout, the pool included, from the config. So a
short-lived process, started as a worker is (:mod:`corelib.trust.isolation`), opens each device this
node's ranks will open, reads its ``(free, total)`` memory and exits; its device context goes
with it before any worker starts. The pool is then sized as in process
(:mod:`corelib.startup.kv_pool`), with the weights counted from the config and the largest step's
activations estimated from the model's shape.

    python -m corelib.transport.memory_probe   (a pickled (DeviceSpec, ranks) on stdin)
"""

from __future__ import annotations

import dataclasses
import json
import pickle
import subprocess
import sys

from corelib.config.options import EngineOptions
from corelib.platform.backend import DeviceSpec
from corelib.startup.kv_pool import sized_layout
from corelib.startup.start import Startup
from corelib.step.layout import EngineLayout
from corelib.transport.nodes import Topology
from corelib.transport.shm_executor import startup_timeout
from corelib.trust.isolation import worker_command, worker_environment

MODULE = "corelib.transport.memory_probe"


@dataclasses.dataclass(frozen=True)
class Probed:
    """What the probe read: the least free and least total memory over the devices, or why it could not."""

    free: int = 0
    total: int = 0
    reason: str | None = None  # set when nothing was read

    @property
    def info(self) -> tuple[int, int] | None:
        return None if self.reason is not None else (self.free, self.total)


def probe_memory(spec: DeviceSpec, ranks: int, timeout_s: float) -> Probed:
    """The memory of devices ``spec.device_index`` .. ``+ ranks - 1``, read in a process of its own."""
    try:
        done = subprocess.run(worker_command(MODULE), input=pickle.dumps((spec, ranks)), capture_output=True,
                              env=worker_environment(), timeout=timeout_s, check=False)
    except subprocess.TimeoutExpired:
        return Probed(reason=f"the memory probe did not answer within {timeout_s:g} s")
    lines = done.stdout.decode(errors="replace").strip().splitlines()
    if done.returncode != 0 or not lines:
        said = done.stderr.decode(errors="replace").strip().splitlines()
        return Probed(reason=f"the memory probe exited with code {done.returncode}"
                             + (f": {said[-1][:200]}" if said else ""))
    answer = json.loads(lines[-1])
    if answer.get("reason"):
        return Probed(reason=str(answer["reason"]))
    return Probed(int(answer["free"]), int(answer["total"]))


def shm_layout(startup: Startup, options: EngineOptions, layout: EngineLayout,
               topology: Topology) -> tuple[EngineLayout, list[str]]:
    """``layout`` with its KV pool sized for worker processes (written into the config every worker reads), and
    the startup lines: from the memory of this node's ranks' devices read by a probe on an accelerator, from
    the host's where that is the device's. Every node of several sizes its pool so; the nodes' digest holds
    the block count, so nodes that came to different pools refuse to start together."""
    config, spec = startup.config, startup.spec
    probed, notes = None, []
    if not (config.engine.num_kv_blocks or spec.on_host):
        answer = probe_memory(spec, len(topology.local_ranks), startup_timeout(config.engine.timeout_s))
        probed = answer.info
        if answer.reason is not None:
            notes.append(f"KV pool: not sized from memory: {answer.reason}")
    layout, pool = sized_layout(startup, options, layout, probed=probed)
    return layout, [*notes, *pool]


def _read(spec: DeviceSpec, ranks: int) -> dict[str, object]:
    from corelib.plugins import PluginRegistry

    backend = PluginRegistry().get(spec.backend)
    free: list[int] = []
    total: list[int] = []
    for rank in range(ranks):
        device = backend.open(dataclasses.replace(spec, device_index=spec.device_index + rank))
        try:
            info = device.memory_info()
        finally:
            device.close()
        if info is None:
            return {"reason": f"{spec.backend} device {spec.device_index + rank} does not report its memory"}
        free.append(info[0])
        total.append(info[1])
    return {"free": min(free), "total": min(total)}


def main() -> None:
    spec, ranks = pickle.loads(sys.stdin.buffer.read())
    print(json.dumps(_read(spec, ranks)), flush=True)


if __name__ == "__main__":
    main()
