"""Entry point of the mlu plugin (group ``corelib.backends``)."""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path

from corelib.backend import Backend
from corelib.plugins import hookimpl
from corelib_mlu.backend import MLUBackend


@hookimpl
def corelib_backends() -> Sequence[Backend]:
    return [MLUBackend()]


@hookimpl
def corelib_backend_configs() -> dict[str, str]:
    """The mlu backend's YAML (``backend=mlu``), shipped with the plugin like any third party's."""
    return {"mlu": str(Path(__file__).with_name("mlu.yaml"))}
