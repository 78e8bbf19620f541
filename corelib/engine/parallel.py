"""Tensor parallelism over torch.distributed: the process group and the all-reduce of each rank.

The communication backend comes from the device: gloo for the CPU and for emulated devices
(their memory is host memory), the device's own ``comm_backend`` (nccl, hccl, cncl)
natively. Rendezvous is over TCP on the address and port the scheduler chose, or the
MASTER_ADDR / MASTER_PORT that torchrun exported.
"""

from __future__ import annotations

import os
import socket
from collections.abc import Callable
from datetime import timedelta

import torch

from corelib.device import Device, Runtime
from corelib.errors import ConfigError


def check_launcher() -> None:
    """corelib starts its ranks itself: under torchrun, only one launcher process may run it."""
    world = os.environ.get("WORLD_SIZE")
    if world is not None and world.isdigit() and int(world) > 1:
        raise ConfigError(
            f"torchrun started {world} processes, but corelib starts one worker process per rank itself "
            "(engine.tp): launch it with torchrun --nproc-per-node=1; MASTER_ADDR/MASTER_PORT are honoured"
        )


def rendezvous() -> tuple[str, int]:
    """torchrun's MASTER_ADDR/MASTER_PORT when set, else a free local port (never a fixed one)."""
    address, port = os.environ.get("MASTER_ADDR"), os.environ.get("MASTER_PORT")
    if address and port:
        return address, int(port)
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as probe:
        probe.bind(("127.0.0.1", 0))
        return "127.0.0.1", int(probe.getsockname()[1])


def comm_backend(device: Device) -> str:
    if device.runtime is Runtime.emulated or device.capabilities.device_is_host:
        return "gloo"
    return device.capabilities.comm_backend


def init_group(
    device: Device, rank: int, world: int, address: str, port: int, timeout_s: float
) -> Callable[[torch.Tensor], torch.Tensor]:
    """Join the process group; returns the in-place all-reduce the model's row-parallel layers use."""
    import torch.distributed as dist

    backend = comm_backend(device)
    if device.torch_device.type != "cpu" and hasattr(torch, "accelerator"):
        torch.accelerator.set_device_index(device.torch_device.index)
    dist.init_process_group(
        backend=backend,
        init_method=f"tcp://{address}:{port}",
        rank=rank,
        world_size=world,
        timeout=timedelta(seconds=timeout_s),
    )

    def all_reduce(tensor: torch.Tensor) -> torch.Tensor:
        dist.all_reduce(tensor)
        return tensor

    return all_reduce


def leave_group() -> None:
    import torch.distributed as dist

    if dist.is_available() and dist.is_initialized():
        dist.destroy_process_group()
