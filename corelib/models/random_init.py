"""Random weights drawn where the model runs: one seeded generator per tensor (``model.init=device``).

The CPU path (:func:`corelib.models.llama.random_state_dict`) draws the whole model from one
float32 stream on the host: the same weights on every device and machine, but 8 B parameters
are 32 GB and minutes of drawing, in every rank. Here each tensor has its own generator,
seeded by (``model.seed``, the tensor's name), on the model's device: every rank draws the
same full tensor in a fraction of a second, keeps its shard, and the host holds none of it.
A device's generator gives the same values on every device of its kind (two H200s agree), not
across kinds, which is why ``model.init`` is a property of the preset, not of the backend.
"""

from __future__ import annotations

import hashlib
import math

import torch

from corelib.config import ModelConfig, WeightInit
from corelib.models.llama import ModelShape, ModelWeights, assemble_weights, hf_parameter_shapes
from corelib.models.sharding import TensorShard
from corelib.progress import current as current_progress

# model.init=auto draws models above this many parameters on the device. Up to it the CPU path
# takes seconds and its weights are the same on every device, which cross-device tests rely on.
DEVICE_INIT_MIN_PARAMETERS = 1_000_000_000


def parameter_count(shape: ModelShape) -> int:
    return sum(math.prod(dims) for dims in hf_parameter_shapes(shape).values())


def init_on_device(cfg: ModelConfig, shape: ModelShape) -> bool:
    """Whether the random weights of ``cfg`` are drawn on the device (``model.init``)."""
    choice = WeightInit(cfg.init)
    if choice is WeightInit.auto:
        return parameter_count(shape) > DEVICE_INIT_MIN_PARAMETERS
    return choice is WeightInit.device


def seeded_tensor(name: str, dims: tuple[int, ...], seed: int, device: torch.device,
                  dtype: torch.dtype) -> torch.Tensor:
    """The parameter ``name`` from its own generator seeded by (``seed``, ``name``), on ``device``.

    Drawn in float32 with the scales of the CPU path (norms near 1, matrices 1/sqrt(fan-in)),
    then cast to ``dtype``; it depends on nothing else drawn, so any rank may draw any subset.
    """
    generator = torch.Generator(device=device).manual_seed(tensor_seed(seed, name))
    values = torch.randn(dims, generator=generator, device=device, dtype=torch.float32)
    if name.endswith("norm.weight"):
        values.mul_(0.1).add_(1.0)
    elif name.endswith("conv.weight"):
        values.div_(dims[0])
    else:
        values.mul_(0.5 if name.endswith(".bias") else 1.0 / dims[-1] ** 0.5)
    return values.to(dtype)


def tensor_seed(seed: int, name: str) -> int:
    """A stable seed per (seed, name): Python's hash() of a str changes from process to process."""
    digest = hashlib.blake2b(f"{seed}:{name}".encode(), digest_size=8).digest()
    return int.from_bytes(digest, "little") & (2**63 - 1)


def seeded_weights(shape: ModelShape, seed: int, device: torch.device,
                   shard: TensorShard | None = None) -> ModelWeights:
    """The model of ``shape`` drawn on ``device``; with ``shard``, this rank's part of the same full tensors."""
    full = hf_parameter_shapes(shape)
    local = shard.shape(shape) if shard is not None else shape
    drawing = current_progress().task("generating random weights on the device", total=len(full), unit="tensors")
    with drawing as task:

        def get(name: str) -> torch.Tensor:
            tensor = seeded_tensor(name, full[name], seed, device, shape.dtype)
            return task.advanced(shard.slice(name, tensor) if shard is not None else tensor)

        return assemble_weights(local, get, device)
