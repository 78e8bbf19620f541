"""Workloads for `run` and `bench`: which requests, and when each arrives.

Prompts come from one of three sources:

- random token ids (the default): ``num_requests`` of them, lengths drawn in the configured ranges;
- ``workload.prompts``: texts, one request each, which need a tokenizer;
- ``workload.dataset``: a JSONL file, one request a line, ``{"prompt": "text"}`` or
  ``{"prompt_token_ids": [1, 2, 3]}``, with an optional ``"max_tokens"``.

Requests of texts and datasets generate up to ``output_len_max`` tokens unless a line says
otherwise (``num_requests``, the prompt lengths and ``output_len_min`` then do not apply).

Arrivals: with ``request_rate`` r > 0 the gaps between requests are exponential with mean
1/r (a Poisson process, seeded), the usual model of independent users; 0 or inf sends every
request at the start. ``max_concurrency`` caps the requests in flight, as a fixed pool of
clients would. The same seed gives the same requests at the same offsets.
"""

from __future__ import annotations

import math
import os
import random
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from corelib.config.schema import WorkloadConfig
from corelib.engine.sequence import SamplingParams
from corelib.errors import ConfigError, RequestError
from corelib.support.text import Tokenizer
from corelib.trust.files import parse_json, read_text

DATASET_LIMIT = 1 << 30  # bytes of a dataset file, read whole


@dataclass(frozen=True)
class Request:
    prompt_token_ids: list[int]
    sampling: SamplingParams
    multimodal: bool = False
    prompt: str | None = None  # the text the ids encode, for text workloads


@dataclass(frozen=True)
class _Line:
    """One request of a dataset file."""

    token_ids: list[int] | None
    text: str | None
    max_tokens: int | None


def build_workload(
    cfg: WorkloadConfig, vocab_size: int, eos_token_id: int | None, tokenizer: Tokenizer | None = None
) -> list[Request]:
    """Requests drawn from the workload config; the same seed gives the same requests."""
    _check(cfg)
    lines = read_dataset(Path(cfg.dataset)) if cfg.dataset else None
    needs_text = bool(cfg.prompts) or any(line.text is not None for line in lines or ())
    if needs_text and tokenizer is None:
        source = "workload.prompts are" if cfg.prompts else f"workload.dataset={cfg.dataset} has prompts in"
        raise ConfigError(
            f"{source} text and need a tokenizer: set model.path to a checkpoint directory "
            "with tokenizer.json, or give token ids instead"
        )
    try:  # the sampling values every request gets: wrong here, every request would fail alone
        SamplingParams(temperature=cfg.temperature, top_k=cfg.top_k, top_p=cfg.top_p,
                       stop_token_ids=tuple(cfg.stop_token_ids)).validate(vocab_size)
    except RequestError as error:
        raise ConfigError(f"workload.{error}") from None
    rng = random.Random(cfg.seed)
    avoid = {eos_token_id} if eos_token_id is not None else set()
    if lines is None:
        texts: list[str | None] = list(cfg.prompts) if cfg.prompts else [None] * cfg.num_requests
        lines = [_Line(None, text, None) for text in texts]
    requests = []
    for index, line in enumerate(lines):
        if line.token_ids is not None:
            prompt = line.token_ids
        elif line.text is not None and tokenizer is not None:
            prompt = tokenizer.encode(line.text)
        else:
            length = rng.randint(cfg.prompt_len_min, cfg.prompt_len_max)
            prompt = [t for t in (rng.randrange(vocab_size) for _ in range(length * 2)) if t not in avoid][:length]
        stop_strings = ("<never>",) if rng.random() < cfg.stop_string_fraction else ()
        if line.max_tokens is not None:
            max_tokens = line.max_tokens
        elif cfg.prompts or cfg.dataset:
            max_tokens = cfg.output_len_max
        else:
            max_tokens = rng.randint(cfg.output_len_min, cfg.output_len_max)
        sampling = SamplingParams(
            max_tokens=max_tokens,
            temperature=cfg.temperature,
            top_k=cfg.top_k,
            top_p=cfg.top_p,
            seed=cfg.seed * 1_000_003 + index,
            stop_token_ids=tuple(cfg.stop_token_ids),
            ignore_eos=cfg.ignore_eos,
            stop=stop_strings,
        )
        requests.append(Request(prompt, sampling, rng.random() < cfg.multimodal_fraction, line.text))
    return requests


def arrival_offsets(cfg: WorkloadConfig, count: int) -> list[float]:
    """Seconds from the start at which each of ``count`` requests arrives (non-decreasing)."""
    rate = cfg.request_rate
    if rate == 0 or math.isinf(rate):
        return [0.0] * count
    rng = random.Random(f"arrivals-{cfg.seed}")  # its own stream: the prompts stay those of a burst run
    offsets, now = [], 0.0
    for _ in range(count):
        offsets.append(now)
        now += rng.expovariate(rate)
    return offsets


def _check(cfg: WorkloadConfig) -> None:
    if cfg.num_requests < 0:
        raise ConfigError(f"workload.num_requests={cfg.num_requests}: must be >= 0")
    if cfg.prompts and cfg.dataset:
        raise ConfigError("workload.prompts and workload.dataset are both set; give the requests one way")
    if (cfg.prompts or cfg.dataset) and cfg.output_len_max < 1:
        raise ConfigError(f"workload.output_len_max={cfg.output_len_max}: must be >= 1")
    lengths = ((cfg.prompt_len_min, cfg.prompt_len_max, "prompt_len"),
               (cfg.output_len_min, cfg.output_len_max, "output_len"))
    for low, high, name in () if cfg.prompts or cfg.dataset else lengths:
        if not 1 <= low <= high:
            raise ConfigError(f"workload.{name}_min={low}, workload.{name}_max={high}: need 1 <= min <= max")
    for name in ("stop_string_fraction", "multimodal_fraction"):
        value = getattr(cfg, name)
        if not 0.0 <= value <= 1.0:
            raise ConfigError(f"workload.{name}={value}: must be in [0, 1]")
    if not cfg.request_rate >= 0:  # also refuses nan
        raise ConfigError(f"workload.request_rate={cfg.request_rate}: must be >= 0 requests/s (0 or inf: all at once)")
    if cfg.max_concurrency < 0:
        raise ConfigError(f"workload.max_concurrency={cfg.max_concurrency}: must be >= 0 (0: no limit)")


def read_dataset(path: Path) -> list[_Line]:
    """The requests of a JSONL file; a ConfigError names the file, the line and what is wrong."""
    where = f"workload.dataset={path}"
    if not os.path.lexists(path):
        raise ConfigError(f"{where}: no such file; give a JSONL file with one request a line")
    text = read_text(path, "workload.dataset", DATASET_LIMIT)  # a regular file: /dev/zero or a FIFO never ends
    lines = []
    for number, raw in enumerate(text.splitlines(), 1):
        if raw.strip():
            lines.append(_parse_line(raw, f"{where}, line {number}"))
    if not lines:
        raise ConfigError(f"{where} holds no requests; expected one JSON object a line")
    return lines


def _parse_line(raw: str, where: str) -> _Line:
    expected = 'expected {"prompt": "text"} or {"prompt_token_ids": [ids]}, and optionally "max_tokens"'
    try:
        entry: Any = parse_json(raw, where)  # nested 50 000 deep, or a 5 000-digit integer: one line too
    except ValueError as error:
        raise ConfigError(f"{error}; {expected}") from None
    if not isinstance(entry, dict):
        raise ConfigError(f"{where} is a JSON {type(entry).__name__}; {expected}")
    text, ids, max_tokens = entry.get("prompt"), entry.get("prompt_token_ids"), entry.get("max_tokens")
    if (text is None) == (ids is None):
        raise ConfigError(f"{where} has {'both' if text is not None else 'neither'} prompt and prompt_token_ids; "
                          f"{expected}")
    if text is not None and not isinstance(text, str):
        raise ConfigError(f"{where}: prompt must be a string; {expected}")
    if ids is not None and (not isinstance(ids, list) or not all(_is_int(t) and t >= 0 for t in ids)):
        raise ConfigError(f"{where}: prompt_token_ids must be a list of token ids (integers >= 0)")
    if max_tokens is not None and not (_is_int(max_tokens) and max_tokens >= 1):
        raise ConfigError(f"{where}: max_tokens={max_tokens!r} must be an integer >= 1")
    return _Line(ids, text, max_tokens)


def _is_int(value: object) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)
