"""Models: the model seam, the architecture registry, the Llama family and its checkpoint loader."""

from corelib.models.base import Model, ModelFacts, ModelState, StepBatch
from corelib.models.registry import Architecture, architecture, model_facts

__all__ = ["Architecture", "Model", "ModelFacts", "ModelState", "StepBatch", "architecture", "model_facts"]
