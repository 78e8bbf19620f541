"""A request as the caller hands it in: prompts made token ids, checked against the model, text cut at a stop."""

from __future__ import annotations

import logging
import operator
from collections.abc import Iterable, Mapping
from collections.abc import Sequence as Seq

from corelib.config.schema import ModelConfig
from corelib.engine.sequence import FinishReason, Sequence
from corelib.errors import RequestError

log = logging.getLogger("corelib.engine")
Prompt = str | Seq[int]  # text needs the checkpoint's tokenizer


def token_ids(prompt: object) -> list[int]:
    """A prompt of token ids as plain ints (numpy and 0-d tensor integers too); a RequestError names a bad one."""
    if isinstance(prompt, (bytes, bytearray, memoryview, Mapping, set, frozenset)):
        raise RequestError(f"the prompt is {type(prompt).__name__}; pass token ids (a list of int) or text (str)")
    if not isinstance(prompt, Iterable):
        raise RequestError(f"the prompt is {type(prompt).__name__}; pass token ids (a list of int) or text")
    ids = []
    for position, token in enumerate(prompt):
        try:
            ids.append(operator.index(token))
        except TypeError:
            raise RequestError(f"prompt token {token!r} at position {position} is not an integer token id") from None
    return ids


def cut_at_stop(text: str, seq: Sequence) -> str:
    """A request stopped by a stop string returns the text before it (through it with
    ``include_stop_str_in_output``); one that asked for no text (``detokenize=False``), none."""
    if not seq.sampling.detokenize:
        return ""
    stop = seq.stop_reason
    if seq.finish_reason is not FinishReason.stop or not isinstance(stop, str):
        return text
    at = seq.stop_text_at if seq.stop_text_at >= 0 and text.startswith(stop, seq.stop_text_at) else text.find(stop)
    if at < 0:
        return text
    return text[: at + len(stop)] if seq.sampling.include_stop_str_in_output else text[:at]


def check_request(seq: Sequence, model: ModelConfig, vocab_size: int, refuse_overlong: bool) -> None:
    """Raise a RequestError naming what is wrong with ``seq``; warn once about an overlong ``max_tokens``."""
    limit = model.max_model_len
    if not seq.prompt_token_ids:
        raise RequestError("the prompt is empty")
    if len(seq.prompt_token_ids) >= limit:
        raise RequestError(
            f"the prompt has {len(seq.prompt_token_ids)} tokens; model.max_model_len={limit} leaves no room "
            "for output"
        )
    bad = [t for t in seq.prompt_token_ids if not 0 <= t < vocab_size]
    if bad:
        raise RequestError(f"prompt token id {bad[0]} is outside the vocabulary [0, {vocab_size})")
    seq.sampling.validate(vocab_size)
    room = limit - len(seq.prompt_token_ids)
    if seq.sampling.max_tokens is not None and seq.sampling.max_tokens > room:
        overlong = (f"max_tokens={seq.sampling.max_tokens} with a prompt of {len(seq.prompt_token_ids)} tokens "
                    f"exceeds model.max_model_len={limit}")
        if refuse_overlong:
            raise RequestError(f"{overlong}; ask for at most {room} tokens (engine.refuse_overlong=true)")
        log.warning("request %s: %s; it ends after at most %d tokens (engine.refuse_overlong=true refuses it "
                    "instead)", seq.request_id, overlong, room)
