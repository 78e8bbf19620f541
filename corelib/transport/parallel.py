"""Tensor parallelism over torch.distributed: the process group and the all-reduce of each rank.

The communication backend comes from the device: gloo for the CPU and for emulated devices
(their memory is host memory), the device's own ``comm_backend`` (nccl, hccl, cncl)
natively. Rendezvous is over TCP on the address and port the scheduler chose, or the
MASTER_ADDR / MASTER_PORT that torchrun exported.

Where the ``fast_allreduce`` gate allows it (a device with ``symmetric_memory``), small
all-reduces go through :class:`SymmetricAllReduce` instead of the collective library: a
decode step of tp ranks does two all-reduces of a few KiB per layer, and there the library's
fixed cost per call, not bandwidth, is what a step pays.
"""

from __future__ import annotations

import enum
import importlib
import os
import socket
import sys
from collections.abc import Callable
from datetime import timedelta
from typing import Any

import torch

from corelib.errors import one_line
from corelib.platform.device import Device, Runtime
from corelib.trust.isolation import NO_MULTICAST

AllReduce = Callable[[torch.Tensor], torch.Tensor]

# One kernel copies the input in, waits for the peers, reads and sums their copies: the fewest
# steps, but every rank reads world x bytes, so it is for small messages. vLLM's custom
# all-reduce takes its one-shot kernel below 512 KiB on up to 4 ranks (always on 2); a decode
# step of 64 sequences at hidden 4096 in bfloat16 is 512 KiB.
ONE_SHOT_MAX_BYTES = 512 * 1024
# Up to this, two-shot (each rank sums its share and writes it to every peer) through the buffer,
# copied in and out: prefills of up to 1024 tokens at hidden 4096. Longer ones, a step or two
# per request, take the collective library rather than a larger buffer on every device.
SYMMETRIC_BUFFER_BYTES = 8 * 1024 * 1024
# The symmetric-memory kernels sum these dtypes (CUDASymmetricMemoryOps.cu dispatches no others).
SYMMETRIC_DTYPES = (torch.bfloat16, torch.float32)
# The kernels move vectors of up to 16 bytes and refuse a size that is not a multiple of 4 bytes.
_SIZE_ALIGNMENT = 4


def rendezvous() -> tuple[str, int]:
    """torchrun's MASTER_ADDR/MASTER_PORT when set, else a free local port (never a fixed one).

    For one node; across nodes, node 0 chooses the ranks' port and tells the others
    (:mod:`corelib.transport.nodes`), since torchrun's port belongs to the launchers' group.
    """
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
    device: Device, rank: int, world: int, address: str, port: int, timeout_s: float, *,
    fast_allreduce: bool = False,
) -> AllReduce:
    """Join the process group; returns the in-place all-reduce the model's row-parallel layers use.

    ``fast_allreduce`` (``EngineOptions.fast_allreduce``): small messages through symmetric
    memory where the device has it; the collective library otherwise, and if any rank cannot
    set it up (every rank then takes the library, so none waits on the other path).
    """
    import torch.distributed as dist

    os.environ.update(NO_MULTICAST)  # read by NCCL and symmetric memory when they set up, below
    if str(port) != os.environ.get("MASTER_PORT"):
        # Under torchrun this tells rank 0 to join the launcher's store rather than host one; the
        # ranks' own port (chosen by node 0 across nodes) has no store unless rank 0 hosts it.
        os.environ.pop("TORCHELASTIC_USE_AGENT_STORE", None)
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
    collective = collective_all_reduce()
    if fast_allreduce and device.capabilities.symmetric_memory and backend != "gloo":
        return symmetric_or_collective(device.torch_device, rank, backend, collective)
    return collective


def symmetric_or_collective(
    device: torch.device, rank: int, backend: str, collective: AllReduce,
    create: Callable[[torch.device, AllReduce], AllReduce] | None = None,
) -> AllReduce:
    """A :class:`SymmetricAllReduce` if every rank set one up, else ``collective`` on every rank.

    A rank that cannot map its peers' memory says why on stderr; the others follow it, since
    ranks on different paths would each wait for the other forever.
    """
    import torch.distributed as dist

    make = create if create is not None else SymmetricAllReduce.create
    symmetric: AllReduce | None = None
    failure = ""
    try:
        symmetric = make(device, collective)
    except Exception as error:  # noqa: BLE001 - any failure to set up means the collective, on every rank
        failure = one_line(error)
    agreed = torch.tensor([0 if symmetric is None else 1], dtype=torch.int32, device=device)
    dist.all_reduce(agreed, op=dist.ReduceOp.MIN)
    if int(agreed.item()) == 1 and symmetric is not None:
        return symmetric
    if failure:
        print(f"corelib: worker rank {rank}: symmetric memory could not be set up ({failure}); "
              f"all-reduces use {backend}", file=sys.stderr, flush=True)
    return collective


def collective_all_reduce() -> AllReduce:
    """The process group's in-place sum (NCCL, HCCL, CNCL or gloo)."""
    import torch.distributed as dist

    def all_reduce(tensor: torch.Tensor) -> torch.Tensor:
        dist.all_reduce(tensor)
        return tensor

    return all_reduce


def leave_group() -> None:
    import torch.distributed as dist

    if dist.is_available() and dist.is_initialized():
        dist.destroy_process_group()


class Route(str, enum.Enum):
    """How one all-reduce runs."""

    one_shot = "one_shot"  # one symmetric-memory kernel: copy in, read every peer, sum
    two_shot = "two_shot"  # copy into the buffer, reduce-scatter + all-gather through it, copy out
    collective = "collective"  # the process group's library


def route(tensor: torch.Tensor, buffer_bytes: int = SYMMETRIC_BUFFER_BYTES,
          one_shot_max_bytes: int = ONE_SHOT_MAX_BYTES) -> Route:
    """The route for ``tensor``; a function of its size, dtype and layout only, so every rank picks the same."""
    nbytes = tensor.numel() * tensor.element_size()
    if (tensor.dtype not in SYMMETRIC_DTYPES or not tensor.is_contiguous() or nbytes == 0
            or nbytes % _SIZE_ALIGNMENT or nbytes > buffer_bytes):
        return Route.collective
    if nbytes <= one_shot_max_bytes:
        return Route.one_shot
    return Route.two_shot


class SymmetricAllReduce:
    """An in-place sum across ranks through one symmetric buffer every rank maps; the collective beyond it.

    The buffer is allocated and exchanged once (a collective call, before any graph is
    captured); each all-reduce views its first bytes with the tensor's dtype and shape, so
    calls of any size share it. The kernels end with a barrier across ranks, so the next call
    may overwrite the buffer. Captured in a CUDA graph, a call replays as the same kernel.
    """

    def __init__(self, buffer: torch.Tensor, group_name: str, fallback: AllReduce, ops: Any,
                 one_shot_max_bytes: int = ONE_SHOT_MAX_BYTES) -> None:
        """``buffer``: uint8 symmetric memory; ``ops``: ``torch.ops.symm_mem`` (a stand-in in tests)."""
        if buffer.dtype != torch.uint8 or buffer.dim() != 1:
            raise ValueError(f"the symmetric buffer must be 1-D uint8, got {buffer.dtype} {tuple(buffer.shape)}")
        self.buffer = buffer
        self.group_name = group_name
        self.fallback = fallback
        self._ops = ops
        self._one_shot_max_bytes = one_shot_max_bytes
        # torch 2.8+: the copy into the buffer happens inside the one-shot kernel (one launch, not two)
        self._copy_in_kernel = hasattr(ops, "one_shot_all_reduce_copy_out")
        self.calls = {r: 0 for r in Route}  # per route, for tests and benchmarks
        self.handle: object = None  # the rendezvous handle: the peers' mappings live as long as it
        # Under engine.compile the decode layer is compiled with this call inside: run it eagerly
        # (a graph break each) rather than have the compiler trace buffer views and these ops.
        disable: Any = getattr(getattr(torch, "compiler", None), "disable", None)
        self._run: AllReduce = disable(self._all_reduce) if disable is not None else self._all_reduce

    @classmethod
    def create(cls, device: torch.device, fallback: AllReduce,
               buffer_bytes: int = SYMMETRIC_BUFFER_BYTES) -> SymmetricAllReduce:
        """Allocate the buffer on ``device`` and exchange it with every rank of the default group."""
        import torch.distributed as dist

        # Any: its signatures change between torch releases (group names became a NewType in 2.11).
        symm_mem: Any = importlib.import_module("torch.distributed._symmetric_memory")
        group = dist.group.WORLD
        if group is None:
            raise RuntimeError("the default process group is not initialised")
        group_name = str(group.group_name)
        enable = getattr(symm_mem, "enable_symm_mem_for_group", None)
        if enable is not None and getattr(enable, "__deprecated__", None) is None:
            enable(group_name)  # torch < 2.11 needs the group's store registered; later ones find it
        buffer = symm_mem.empty(buffer_bytes, dtype=torch.uint8, device=device)
        handle = symm_mem.rendezvous(buffer, group_name)  # collective: every rank maps every peer's buffer
        if handle is None:
            raise RuntimeError("symmetric memory rendezvous returned no handle")
        instance = cls(buffer, group_name, fallback, torch.ops.symm_mem)
        instance.handle = handle
        return instance

    @property
    def buffer_bytes(self) -> int:
        return int(self.buffer.numel())

    def route(self, tensor: torch.Tensor) -> Route:
        return route(tensor, self.buffer_bytes, self._one_shot_max_bytes)

    def __call__(self, tensor: torch.Tensor) -> torch.Tensor:
        return self._run(tensor)

    def _all_reduce(self, tensor: torch.Tensor) -> torch.Tensor:
        chosen = self.route(tensor)
        self.calls[chosen] += 1
        if chosen is Route.collective:
            return self.fallback(tensor)
        staged = self._view(tensor)  # the buffer's first bytes, shaped like the tensor
        if chosen is Route.one_shot:
            # The copy-in kernel wants the tensor aligned like the buffer's start: a view that
            # starts elsewhere (not what a linear layer returns) is copied in first instead.
            if self._copy_in_kernel and tensor.storage_offset() == 0:
                self._ops.one_shot_all_reduce_copy_out(staged, tensor, "sum", self.group_name, tensor)
            else:
                staged.copy_(tensor)
                self._ops.one_shot_all_reduce_out(staged, "sum", self.group_name, tensor)
            return tensor
        staged.copy_(tensor)
        self._ops.two_shot_all_reduce_(staged, "sum", self.group_name)
        tensor.copy_(staged)
        return tensor

    def _view(self, tensor: torch.Tensor) -> torch.Tensor:
        nbytes = tensor.numel() * tensor.element_size()
        return self.buffer[:nbytes].view(tensor.dtype).view(tensor.shape)

