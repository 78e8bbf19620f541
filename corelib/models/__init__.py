"""Models: a Llama-family decoder in plain torch and its checkpoint loader."""

from corelib.models.facts import ARCHITECTURES, model_facts

__all__ = ["ARCHITECTURES", "model_facts"]
