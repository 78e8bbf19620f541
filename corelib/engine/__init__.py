"""The engine core: scheduler, blocks, sequences, runner, sampler, handoff, transport."""

from corelib.engine.api import Engine, RequestOutput
from corelib.engine.sequence import SamplingParams

__all__ = ["Engine", "RequestOutput", "SamplingParams"]
