"""Entry point of the cuda plugin (group ``corelib.backends``)."""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path

from corelib.backend import Backend
from corelib.plugins import hookimpl
from corelib_cuda.backend import CUDABackend


@hookimpl
def corelib_backends() -> Sequence[Backend]:
    return [CUDABackend()]


@hookimpl
def corelib_backend_configs() -> dict[str, str]:
    """The cuda backend's YAML (``backend=cuda``), shipped with the plugin like any third party's."""
    return {"cuda": str(Path(__file__).with_name("cuda.yaml"))}
