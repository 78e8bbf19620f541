"""Entry point of the npu plugin (group ``corelib.backends``)."""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path

from corelib.backend import Backend
from corelib.plugins import hookimpl
from corelib_npu.backend import NPUBackend


@hookimpl
def corelib_backends() -> Sequence[Backend]:
    return [NPUBackend()]


@hookimpl
def corelib_backend_configs() -> dict[str, str]:
    """The npu backend's YAML (``backend=npu``), shipped with the plugin like any third party's."""
    return {"npu": str(Path(__file__).with_name("npu.yaml"))}
