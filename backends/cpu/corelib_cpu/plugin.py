"""Entry point of the cpu plugin (group ``corelib.backends``)."""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path

from corelib.backend import Backend
from corelib.plugins import hookimpl
from corelib_cpu.device import CpuBackend


@hookimpl
def corelib_backends() -> Sequence[Backend]:
    return [CpuBackend()]


@hookimpl
def corelib_backend_configs() -> dict[str, str]:
    """The cpu backend's YAML (``backend=cpu``), shipped with the plugin like any third party's."""
    return {"cpu": str(Path(__file__).with_name("cpu.yaml"))}
