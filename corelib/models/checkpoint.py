"""Load a Hugging Face checkpoint directory: ``config.json`` and ``*.safetensors``, one file or sharded.

Tensors go from their file to the device one at a time through ``safetensors.safe_open``
(memory-mapped), so the host never holds a second full copy of the weights. Names, shapes and
dtypes (which tensors the variant has: its weight map) are checked from the file headers
before any tensor is read.
"""

from __future__ import annotations

import os
import stat
from collections.abc import Iterator
from contextlib import ExitStack, contextmanager
from pathlib import Path, PurePosixPath
from typing import Any, Protocol

import torch

from corelib.config.schema import ModelConfig
from corelib.errors import ConfigError
from corelib.models.llama import ModelWeights, assemble_weights
from corelib.models.shape import ModelShape
from corelib.models.sharding import TensorShard
from corelib.models.weight_map import weight_map
from corelib.support.progress import current as current_progress
from corelib.trust.files import read_json
from corelib.trust.hub import checkpoint_directory

INDEX_FILE = "model.safetensors.index.json"

_FLOAT_DTYPES = {"F64": "float64", "F32": "float32", "BF16": "bfloat16", "F16": "float16"}


class _SafeFile(Protocol):
    """The part of safetensors' ``safe_open`` handle used here."""

    def keys(self) -> list[str]: ...

    def get_tensor(self, name: str) -> torch.Tensor: ...

    def get_slice(self, name: str) -> Any: ...


def load_checkpoint(cfg: ModelConfig, shape: ModelShape, device: torch.device,
                    shard: TensorShard | None = None) -> ModelWeights:
    """The weights of ``cfg.path`` on ``device`` in the model dtype; a ConfigError names what does not fit.

    ``cfg`` is resolved (the checkpoint's config.json values in it: ``corelib.models.hf_config``),
    and ``shape`` is its variant's shape of it. With ``shard``, only this rank's slice of each
    tensor reaches the device.
    """
    if not cfg.path:
        raise ConfigError("model.path is not set; point it at a Hugging Face checkpoint directory")
    directory = checkpoint_directory(cfg.path)
    files = tensor_files(directory)
    sources = weight_map(shape).sources
    expected = {name: source.shape for name, source in sources.items()}
    missing = sorted(set(expected) - set(files))
    if missing:
        more = f" and {len(missing) - 1} more" if len(missing) > 1 else ""
        raise ConfigError(
            f"{directory} lacks tensor {missing[0]!r}{more}, which config.json implies "
            f"({cfg.architecture}, tie_word_embeddings={str(cfg.tie_word_embeddings).lower()})"
        )
    reading = current_progress().task(f"loading weights from {directory.name}", total=len(expected), unit="tensors")
    with _open_all(directory, sorted({files[name] for name in expected}), device) as handles, reading as task:
        held = {shard: set(handle.keys()) for shard, handle in handles.items()}
        for name, dims in expected.items():
            if name not in held[files[name]]:
                raise ConfigError(f"{directory / INDEX_FILE} puts tensor {name!r} in {files[name]}, which has no such "
                                  "tensor; the index and its shards do not belong together")
            _check_tensor(handles[files[name]], name, dims, files[name])

        def get(name: str) -> torch.Tensor:
            tensor = handles[files[name]].get_tensor(name)
            if shard is not None:
                tensor = shard.slice(sources[name], tensor)
            moved = tensor.to(device=device, dtype=shape.dtype)
            _check_finite(moved, tensor, name, directory / files[name])
            task.advance()
            # On the CPU that may still be a view of the memory-mapped file: unaligned (slower,
            # and matmuls round differently) and tied to the file staying unchanged. Own it.
            return moved.clone() if moved.data_ptr() == tensor.data_ptr() else moved

        return assemble_weights(shard.shape(shape) if shard is not None else shape, get, device)


def tensor_files(directory: Path) -> dict[str, str]:
    """Every tensor name of the checkpoint and the file that holds it."""
    index = directory / INDEX_FILE
    if index.is_file():
        return _index_map(index, directory)
    shards = sorted(p.name for p in directory.glob("*.safetensors"))
    if not shards:
        bins = sorted(p.name for p in directory.glob("*.bin"))
        hint = (f" (found {bins[0]}: pickled PyTorch weights are not loaded; save with safe_serialization=True)"
                if bins else "")
        raise ConfigError(f"{directory} has no *.safetensors files; expected model.safetensors or shards "
                          f"with {INDEX_FILE}{hint}")
    files: dict[str, str] = {}
    for shard in shards:
        check_weight_file(directory / shard)
        with _safe_open(directory / shard, "cpu") as handle:
            names = handle.keys()
        for name in names:
            files.setdefault(name, shard)
    return files


def _index_map(index: Path, directory: Path) -> dict[str, str]:
    document = read_json(index, "the checkpoint's index")
    weight_map = document.get("weight_map") if isinstance(document, dict) else None
    if not isinstance(weight_map, dict) or not weight_map:
        raise ConfigError(f"{index} has no weight_map; expected {{\"weight_map\": {{tensor name: shard file}}}}")
    for name, shard in weight_map.items():
        if not isinstance(shard, str) or not _inside(shard):
            raise ConfigError(f"{index}: tensor {name!r} names shard {shard!r}; a shard must be a file name "
                              f"inside {directory} (no absolute path, no '..')")
    for shard in sorted(set(weight_map.values())):
        if not os.path.lexists(directory / shard):
            raise ConfigError(f"{index} names shard {shard}, which is missing from {directory}")
        check_weight_file(directory / shard)
    return {str(name): str(shard) for name, shard in weight_map.items()}


def _inside(shard: str) -> bool:
    """A relative path that stays in the directory as written. Symlinks are followed later on
    purpose: a Hugging Face cache snapshot links every file to ``../../blobs/``."""
    path = PurePosixPath(shard)
    return bool(shard) and not path.is_absolute() and ".." not in path.parts and "\\" not in shard


def check_weight_file(path: Path) -> None:
    """A regular file (after symlinks) that this process can read; else a ConfigError saying what it is.

    Opened without blocking first: safetensors would wait forever, deaf to Ctrl-C, on a FIFO.
    """
    try:
        fd = os.open(path, os.O_RDONLY | os.O_NONBLOCK)
    except OSError as error:
        raise ConfigError(f"{path} cannot be opened: {error.strerror or error}") from None
    try:
        mode = os.fstat(fd).st_mode
    finally:
        os.close(fd)
    if not stat.S_ISREG(mode):
        raise ConfigError(f"{path} is {_kind(mode)}, not a regular file; a checkpoint's weights must be files")


def _kind(mode: int) -> str:
    kinds = [(stat.S_ISFIFO, "a FIFO"), (stat.S_ISDIR, "a directory"), (stat.S_ISCHR, "a character device"),
             (stat.S_ISBLK, "a block device"), (stat.S_ISSOCK, "a socket")]
    return next((name for test, name in kinds if test(mode)), "not a regular file")


def _check_finite(moved: torch.Tensor, source: torch.Tensor, name: str, path: Path) -> None:
    """One reduction per tensor at load: NaN or infinite weights would make every token id 0."""
    if bool(torch.isfinite(moved).all()):
        return
    if bool(torch.isfinite(source).all()):
        raise ConfigError(f"{path}: tensor {name!r} overflows {moved.dtype} (values beyond its range); "
                          "choose a wider model.dtype")
    raise ConfigError(f"{path}: tensor {name!r} has NaN or infinite values; the checkpoint is damaged")


@contextmanager
def _open_all(directory: Path, shards: list[str], device: torch.device) -> Iterator[dict[str, _SafeFile]]:
    target = _safetensors_device(device)
    with ExitStack() as stack:
        yield {shard: stack.enter_context(_safe_open(directory / shard, target)) for shard in shards}


def _safe_open(path: Path, device: str) -> Any:
    from safetensors import SafetensorError, safe_open

    try:
        return safe_open(str(path), framework="pt", device=device)
    except SafetensorError as error:
        if device != "cpu" and "device" in str(error):  # an older safetensors that does not know this device
            return safe_open(str(path), framework="pt", device="cpu")
        raise ConfigError(f"{path} is not a readable safetensors file: {' '.join(str(error).split())}") from None


def _safetensors_device(device: torch.device) -> str:
    # safetensors places tensors itself on the devices it knows; for one it does not know,
    # _safe_open falls back to the CPU and each tensor moves on from there, one at a time.
    return "cpu" if device.type == "cpu" else f"{device.type}:{device.index or 0}"


def _check_tensor(handle: _SafeFile, name: str, dims: tuple[int, ...], shard: str) -> None:
    view = handle.get_slice(name)
    actual = tuple(view.get_shape())
    if actual != dims:
        raise ConfigError(
            f"tensor {name!r} in {shard} has shape {actual}; config.json implies {dims}"
        )
    dtype = view.get_dtype()
    if dtype not in _FLOAT_DTYPES:
        raise ConfigError(
            f"tensor {name!r} in {shard} has dtype {dtype}; expected one of {', '.join(_FLOAT_DTYPES)} "
            "(quantized checkpoints are not supported)"
        )
