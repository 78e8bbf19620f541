"""Synthetic workloads for `run` and `bench`: seeded prompts, lengths and sampling values."""

from __future__ import annotations

import random
from dataclasses import dataclass

from corelib.config import WorkloadConfig
from corelib.engine.sequence import SamplingParams
from corelib.errors import ConfigError


@dataclass(frozen=True)
class Request:
    prompt_token_ids: list[int]
    sampling: SamplingParams
    multimodal: bool = False


def build_workload(cfg: WorkloadConfig, vocab_size: int, eos_token_id: int | None) -> list[Request]:
    """Requests drawn from the workload config; the same seed gives the same requests."""
    if cfg.num_requests < 0:
        raise ConfigError(f"workload.num_requests={cfg.num_requests}: must be >= 0")
    for low, high, name in ((cfg.prompt_len_min, cfg.prompt_len_max, "prompt_len"),
                            (cfg.output_len_min, cfg.output_len_max, "output_len")):
        if not 1 <= low <= high:
            raise ConfigError(f"workload.{name}_min={low}, workload.{name}_max={high}: need 1 <= min <= max")
    for name in ("stop_string_fraction", "multimodal_fraction"):
        value = getattr(cfg, name)
        if not 0.0 <= value <= 1.0:
            raise ConfigError(f"workload.{name}={value}: must be in [0, 1]")
    rng = random.Random(cfg.seed)
    avoid = {eos_token_id} if eos_token_id is not None else set()
    requests = []
    for index in range(cfg.num_requests):
        length = rng.randint(cfg.prompt_len_min, cfg.prompt_len_max)
        prompt = [t for t in (rng.randrange(vocab_size) for _ in range(length * 2)) if t not in avoid][:length]
        stop_strings = ("<never>",) if rng.random() < cfg.stop_string_fraction else ()
        sampling = SamplingParams(
            max_tokens=rng.randint(cfg.output_len_min, cfg.output_len_max),
            temperature=cfg.temperature,
            top_k=cfg.top_k,
            top_p=cfg.top_p,
            seed=cfg.seed * 1_000_003 + index,
            stop_token_ids=tuple(cfg.stop_token_ids),
            ignore_eos=cfg.ignore_eos,
            stop_strings=stop_strings,
        )
        requests.append(Request(prompt, sampling, multimodal=rng.random() < cfg.multimodal_fraction))
    return requests
