"""A completions body's prompts become one engine request per choice, numbered prompt by prompt: pure, no server."""

from __future__ import annotations

from corelib.server.events import EngineInfo
from corelib.server.inputs import RequestLimits, prepare_completion
from corelib.server.protocol import CompletionRequest, parse_body

INFO = EngineInfo(tokenizer=None, vocab_size=100, max_model_len=32, max_num_seqs=8, model_name="m", model_path=None)
LIMITS = RequestLimits(max_choices=64, max_prompt_tokens=1024)


def test_a_later_prompts_choices_continue_the_seeds_after_the_earlier_prompts() -> None:
    body = b'{"prompt": [[5, 6], [7, 8, 9], [10]], "n": 2, "seed": 40, "max_tokens": 3}'
    prepared = prepare_completion(parse_body(body, CompletionRequest), INFO, LIMITS)
    assert [prompt for prompt, _ in prepared.requests] == [[5, 6], [5, 6], [7, 8, 9], [7, 8, 9], [10], [10]]
    seeds = [params.seed for _, params in prepared.requests]
    assert seeds == [40, 41, 42, 43, 44, 45], "choice i of the whole request samples with seed + i: none share a seed"
    assert all(params.n == 1 and params.max_tokens == 3 for _, params in prepared.requests)
