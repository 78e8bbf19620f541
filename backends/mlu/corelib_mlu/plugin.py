"""Entry point of the mlu plugin (group ``corelib.backends``)."""

from __future__ import annotations

from collections.abc import Sequence

from corelib.backend import Backend
from corelib.plugins import hookimpl
from corelib_mlu.backend import MLUBackend


@hookimpl
def corelib_backends() -> Sequence[Backend]:
    return [MLUBackend()]
