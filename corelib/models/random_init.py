"""Random weights: from one float32 stream on the host, or drawn where the model runs.

The CPU path (:func:`random_state_dict`, ``model.init=cpu``) draws the whole model from one
float32 stream on the host: the same weights on every device and machine, but 8 B parameters
are 32 GB and minutes of drawing, in every rank. The device path (:func:`seeded_weights`,
``model.init=device``) gives each tensor its own generator, seeded by (``model.seed``, the
tensor's name), on the model's device: every rank draws the same full tensor in a fraction of
a second, keeps its shard, and the host holds none of it.
A device's generator gives the same values on every device of its kind (two H200s agree), not
across kinds, which is why ``model.init`` is a property of the preset, not of the backend.
"""

from __future__ import annotations

import hashlib

import torch

from corelib.config.schema import ModelConfig, WeightInit
from corelib.models.llama import ModelWeights, assemble_weights
from corelib.models.shape import ModelShape
from corelib.models.sharding import TensorShard
from corelib.models.weight_map import Init, Source, weight_map
from corelib.support.progress import current as current_progress

# model.init=auto draws models above this many parameters on the device. Up to it the CPU path
# takes seconds and its weights are the same on every device, which cross-device tests rely on.
DEVICE_INIT_MIN_PARAMETERS = 1_000_000_000


def parameter_count(shape: ModelShape) -> int:
    return weight_map(shape).parameter_count()


def init_on_device(cfg: ModelConfig, shape: ModelShape) -> bool:
    """Whether the random weights of ``cfg`` are drawn on the device (``model.init``)."""
    choice = WeightInit(cfg.init)
    if choice is WeightInit.auto:
        return parameter_count(shape) > DEVICE_INIT_MIN_PARAMETERS
    return choice is WeightInit.device


def random_state_dict(shape: ModelShape, seed: int) -> dict[str, torch.Tensor]:
    """Seeded random weights in Hugging Face names, generated on the CPU in float32.

    Generating on the CPU makes the weights identical on every device and machine.
    """
    generator = torch.Generator().manual_seed(seed)
    state: dict[str, torch.Tensor] = {}
    sources = weight_map(shape).sources
    with current_progress().task("generating random weights", total=len(sources), unit="tensors") as task:
        for name, source in sources.items():
            state[name] = _scaled(torch.randn(source.shape, generator=generator), source)
            task.advance()
    return state


def _scaled(values: torch.Tensor, source: Source) -> torch.Tensor:
    """Standard normal ``values`` scaled in place the way ``source`` is drawn: norms near 1, matrices 1/sqrt(fan-in)."""
    if source.init is Init.norm:
        return values.mul_(0.1).add_(1.0)
    if source.init is Init.conv:
        return values.div_(source.shape[0])
    return values.mul_(0.5 if source.init is Init.bias else 1.0 / source.shape[-1] ** 0.5)


def seeded_tensor(source: Source, seed: int, device: torch.device, dtype: torch.dtype) -> torch.Tensor:
    """The checkpoint tensor ``source`` from its own generator seeded by (``seed``, its name), on ``device``.

    Drawn in float32 with the scales of the CPU path, then cast to ``dtype``; it depends on
    nothing else drawn, so any rank may draw any subset.
    """
    generator = torch.Generator(device=device).manual_seed(tensor_seed(seed, source.name))
    values = torch.randn(source.shape, generator=generator, device=device, dtype=torch.float32)
    return _scaled(values, source).to(dtype)


def tensor_seed(seed: int, name: str) -> int:
    """A stable seed per (seed, name): Python's hash() of a str changes from process to process."""
    digest = hashlib.blake2b(f"{seed}:{name}".encode(), digest_size=8).digest()
    return int.from_bytes(digest, "little") & (2**63 - 1)


def seeded_weights(shape: ModelShape, seed: int, device: torch.device,
                   shard: TensorShard | None = None) -> ModelWeights:
    """The model of ``shape`` drawn on ``device``; with ``shard``, this rank's part of the same full tensors."""
    full = weight_map(shape).sources
    local = shard.shape(shape) if shard is not None else shape
    drawing = current_progress().task("generating random weights on the device", total=len(full), unit="tensors")
    with drawing as task:

        def get(name: str) -> torch.Tensor:
            tensor = seeded_tensor(full[name], seed, device, shape.dtype)
            return task.advanced(shard.slice(full[name], tensor) if shard is not None else tensor)

        return assemble_weights(local, get, device)
