"""What each architecture declares to the feature gates, known without building weights."""

from __future__ import annotations

from corelib.config import ModelConfig
from corelib.errors import ConfigError

ARCHITECTURES = ("llama", "qwen2", "qwen3", "hybrid")


def model_facts(cfg: ModelConfig) -> dict[str, bool | str]:
    """Facts for ``model.*`` requirements: paged KV, device-side decode inputs, recurrent state."""
    if cfg.architecture not in ARCHITECTURES:
        raise ConfigError(
            f"model.architecture={cfg.architecture}: not supported; supported: {', '.join(ARCHITECTURES)}"
        )
    return {
        "architecture": cfg.architecture,
        "paged_kv": True,
        "device_decode_inputs": True,
        "recurrent_state": cfg.architecture == "hybrid",
        "multimodal": bool(cfg.multimodal),
    }
