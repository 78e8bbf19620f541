"""Models: the model seam, the architecture registry, the Llama family and its checkpoint loader."""

from corelib.models.base import DecodeBatch, Model, ModelFacts, ModelState, PrefillBatch
from corelib.models.registry import Architecture, architecture, model_facts

__all__ = ["Architecture", "DecodeBatch", "Model", "ModelFacts", "ModelState", "PrefillBatch", "architecture",
           "model_facts"]
