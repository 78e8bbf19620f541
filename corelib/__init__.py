"""corelib: one LLM decode engine for CUDA GPUs, Ascend NPUs and Cambricon MLUs."""

from __future__ import annotations

import os
from typing import TYPE_CHECKING

# PyTorch imports every installed device extension at `import torch` (device-backend
# autoload). A vendor extension without its driver libraries then breaks torch itself, so
# corelib turns autoload off unless the user chose, and each plugin imports its extension
# explicitly inside its probe, where a failure becomes that plugin's unavailability reason.
os.environ.setdefault("TORCH_DEVICE_BACKEND_AUTOLOAD", "0")

# The environment a worker process gets is the one corelib saw first (see corelib/trust/isolation.py):
# import it here, before a Hydra job's env_set or anything else can change os.environ.
from corelib.trust import isolation as _isolation  # noqa: F401
from corelib.version import __version__

# ``corelib.LLM`` loads the engine (and torch) on first use only, so ``python -m corelib --help``
# and config checks stay quick; ``corelib.SamplingParams`` never needs torch.
if TYPE_CHECKING:
    from corelib.engine.outputs import CompletionOutput, RequestOutput
    from corelib.llm import LLM
    from corelib.sampling_params import SamplingParams

__all__ = ["LLM", "CompletionOutput", "RequestOutput", "SamplingParams", "__version__"]


def __getattr__(name: str) -> object:
    if name == "LLM":
        from corelib.llm import LLM

        return LLM
    if name == "SamplingParams":
        from corelib.sampling_params import SamplingParams

        return SamplingParams
    if name in ("CompletionOutput", "RequestOutput"):
        from corelib.engine import outputs

        return getattr(outputs, name)
    raise AttributeError(f"module 'corelib' has no attribute {name!r}")
