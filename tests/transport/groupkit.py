"""Two ranks of a gloo process group in spawned processes, each reporting what its all-reduce did."""

from __future__ import annotations

import contextlib
import io
import os
import socket
from collections.abc import Callable
from typing import Any

import torch
import torch.multiprocessing as mp

from corelib.platform.backend import DeviceSpec
from corelib.platform.device import Capabilities, Runtime
from corelib.transport.parallel import (
    AllReduce,
    collective_all_reduce,
    init_group,
    leave_group,
    symmetric_or_collective,
)

# The cpu profile, claiming symmetric memory: init_group must still keep gloo's collective.
CPU_CLAIMING_SYMMETRIC = Capabilities(events=True, event_query=True, event_timing=True, device_is_host=True,
                                      symmetric_memory=True, comm_backend="gloo")


class Doubling:
    """A stand-in for SymmetricAllReduce: what two ranks holding equal tensors would sum to."""

    def __init__(self) -> None:
        self.calls = 0

    def __call__(self, tensor: torch.Tensor) -> torch.Tensor:
        self.calls += 1
        return tensor.mul_(2)


def _free_port() -> int:
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        return int(probe.getsockname()[1])


def _rank(rank: int, port: int, failing_rank: int, results: Any) -> None:
    from corelib.plugins import PluginRegistry

    os.environ.pop("NCCL_NVLS_ENABLE", None)
    device = PluginRegistry().get("cpu").open(DeviceSpec("cpu", Runtime.native, CPU_CLAIMING_SYMMETRIC))
    said = io.StringIO()
    with contextlib.redirect_stderr(said):
        all_reduce = init_group(device, rank, 2, "127.0.0.1", port, 30.0, fast_allreduce=True)
    summed = all_reduce(torch.full((3, 4), float(rank + 1)))  # 1 + 2 on every rank

    def create(device: torch.device, collective: AllReduce) -> AllReduce:
        if rank == failing_rank:
            raise RuntimeError("CUDA driver error: peer access is not supported")
        return Doubling()

    chosen = symmetric_or_collective(torch.device("cpu"), rank, "gloo", collective_all_reduce(), create)
    routed = chosen(torch.full((2,), float(rank + 1)))
    results.put({
        "rank": rank,
        "init_group_sum": summed.tolist(),
        "init_group_stderr": said.getvalue(),
        "chosen": type(chosen).__name__,
        "routed": routed.tolist(),
        "environment": {name: os.environ.get(name) for name in ("NCCL_NVLS_ENABLE", "TORCH_SYMM_MEM_DISABLE_MULTICAST",
                                                                 "NVSHMEM_DISABLE_NVLS")},
    })
    leave_group()


def run_two_ranks(failing_rank: int) -> dict[int, dict[str, Any]]:
    """Spawn two gloo ranks; ``failing_rank`` cannot set symmetric memory up (-1: neither fails)."""
    context = mp.get_context("spawn")
    results = context.SimpleQueue()
    port = _free_port()
    target: Callable[..., None] = _rank
    processes = [context.Process(target=target, args=(r, port, failing_rank, results)) for r in range(2)]
    for process in processes:
        process.start()
    for process in processes:
        process.join(120)
    codes = [process.exitcode for process in processes]
    if codes != [0, 0]:
        raise AssertionError(f"the ranks exited with {codes}")
    found = [results.get() for _ in processes]
    return {entry["rank"]: entry for entry in found}
