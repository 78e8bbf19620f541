"""Workloads for `run` and `bench`: seeded prompts, lengths and sampling values.

Prompts are random token ids, or the texts of ``workload.prompts``, which need a tokenizer:
one request each, generating up to ``output_len_max`` tokens (``num_requests``, the prompt
lengths and ``output_len_min`` then do not apply).
"""

from __future__ import annotations

import random
from dataclasses import dataclass

from corelib.config import WorkloadConfig
from corelib.engine.sequence import SamplingParams
from corelib.errors import ConfigError, RequestError
from corelib.text import Tokenizer


@dataclass(frozen=True)
class Request:
    prompt_token_ids: list[int]
    sampling: SamplingParams
    multimodal: bool = False
    prompt: str | None = None  # the text the ids encode, for text workloads


def build_workload(
    cfg: WorkloadConfig, vocab_size: int, eos_token_id: int | None, tokenizer: Tokenizer | None = None
) -> list[Request]:
    """Requests drawn from the workload config; the same seed gives the same requests."""
    if cfg.prompts and tokenizer is None:
        raise ConfigError(
            "workload.prompts are text and need a tokenizer: set model.path to a checkpoint directory "
            "with tokenizer.json, or leave workload.prompts empty for random token ids"
        )
    if cfg.num_requests < 0:
        raise ConfigError(f"workload.num_requests={cfg.num_requests}: must be >= 0")
    lengths = ((cfg.prompt_len_min, cfg.prompt_len_max, "prompt_len"),
               (cfg.output_len_min, cfg.output_len_max, "output_len"))
    if cfg.prompts and cfg.output_len_max < 1:
        raise ConfigError(f"workload.output_len_max={cfg.output_len_max}: must be >= 1")
    for low, high, name in () if cfg.prompts else lengths:
        if not 1 <= low <= high:
            raise ConfigError(f"workload.{name}_min={low}, workload.{name}_max={high}: need 1 <= min <= max")
    for name in ("stop_string_fraction", "multimodal_fraction"):
        value = getattr(cfg, name)
        if not 0.0 <= value <= 1.0:
            raise ConfigError(f"workload.{name}={value}: must be in [0, 1]")
    try:  # the sampling values every request gets: wrong here, every request would fail alone
        SamplingParams(temperature=cfg.temperature, top_k=cfg.top_k, top_p=cfg.top_p,
                       stop_token_ids=tuple(cfg.stop_token_ids)).validate(vocab_size)
    except RequestError as error:
        raise ConfigError(str(error).replace("sampling.", "workload.", 1)) from None
    rng = random.Random(cfg.seed)
    avoid = {eos_token_id} if eos_token_id is not None else set()
    requests = []
    texts: list[str | None] = list(cfg.prompts) if cfg.prompts else [None] * cfg.num_requests
    for index, text in enumerate(texts):
        if text is not None and tokenizer is not None:
            prompt = tokenizer.encode(text)
        else:
            length = rng.randint(cfg.prompt_len_min, cfg.prompt_len_max)
            prompt = [t for t in (rng.randrange(vocab_size) for _ in range(length * 2)) if t not in avoid][:length]
        stop_strings = ("<never>",) if rng.random() < cfg.stop_string_fraction else ()
        max_tokens = cfg.output_len_max if text is not None else rng.randint(cfg.output_len_min, cfg.output_len_max)
        sampling = SamplingParams(
            max_tokens=max_tokens,
            temperature=cfg.temperature,
            top_k=cfg.top_k,
            top_p=cfg.top_p,
            seed=cfg.seed * 1_000_003 + index,
            stop_token_ids=tuple(cfg.stop_token_ids),
            ignore_eos=cfg.ignore_eos,
            stop_strings=stop_strings,
        )
        requests.append(Request(prompt, sampling, rng.random() < cfg.multimodal_fraction, text))
    return requests
