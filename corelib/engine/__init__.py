"""The request loop: the public :class:`Engine`, the scheduler, KV blocks, sequences, stops and streaming.

One step of the loop: the scheduler picks a batch (pure Python), packing writes it into an arena,
an executor (:mod:`corelib.transport`) runs it on the device side (:mod:`corelib.step`), and the
tokens come back to the scheduler; :mod:`corelib.observe` records what happened.

``Engine``, ``RequestOutput`` and ``SamplingParams`` load on first use, so importing a light
module of this package (``corelib.engine.sequence``) does not import torch.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from corelib.engine.api import Engine
    from corelib.engine.outputs import RequestOutput
    from corelib.engine.sequence import SamplingParams

__all__ = ["Engine", "RequestOutput", "SamplingParams"]


def __getattr__(name: str) -> object:
    if name == "Engine":
        from corelib.engine.api import Engine

        return Engine
    if name == "RequestOutput":
        from corelib.engine.outputs import RequestOutput

        return RequestOutput
    if name == "SamplingParams":
        from corelib.engine.sequence import SamplingParams

        return SamplingParams
    raise AttributeError(f"module 'corelib.engine' has no attribute {name!r}")
