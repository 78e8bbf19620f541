"""From a validated OpenAI request to engine requests: prompt token ids and SamplingParams per choice.

Everything a client can get wrong is found here and answered as a 400 naming the field, so
the engine only sees requests it can run.

The sampling parameters are the body's fields named as :class:`corelib.SamplingParams` names
them, with the server's defaults (``api_default``: temperature 1, as OpenAI's); SamplingParams
checks them and the error names the field.

Choices: a completions ``prompt`` that is a list of strings or a list of token-id lists is
several prompts; each gets ``n`` choices, numbered prompt by prompt (prompt 0's choices first,
as OpenAI numbers them). Choice ``i`` samples with ``seed + i``, so ``n`` choices with one
seed differ, and the same request with the same seed gives the same text. Without a seed
each choice draws a random one (:func:`corelib.sampling_params.choices`).

What a request costs is bounded before anything is built from it (:class:`RequestLimits`):
its choices (prompts x ``n``) by what the server holds at once, and its prompt tokens by
``server.max_request_tokens`` (counted from the body where it gives token ids, before any
is read). A body of a few hundred kilobytes can otherwise ask for millions of choices, each
built in full before the engine's own capacity check refused them.
"""

from __future__ import annotations

import random
from collections.abc import Sequence
from dataclasses import dataclass
from typing import cast

from corelib.engine.structured import check_grammar
from corelib.sampling_params import API_FIELDS, SEED_LIMIT, SamplingError, SamplingParams, api_default, choices
from corelib.server.chat import ChatTemplate, ChatTemplateError
from corelib.server.events import EngineInfo
from corelib.server.protocol import (
    ApiError,
    ChatRequest,
    CompletionRequest,
    DetokenizeRequest,
    JsonObject,
    TokenizeRequest,
    bad_request,
)
from corelib.server.render import TemplateRenderer
from corelib.support.structured import StructuredOutputsError, StructuredOutputsParams
from corelib.support.text import Tokenizer

MAX_CHOICES = 128  # n per prompt
# A completion of token ids is prepared on the event loop when it has at most these: a pass over them at C speed
# and a few SamplingParams cost less than the hop to a worker thread and back, which waits for the GIL while the
# loop is busy (streaming, or a burst of requests being parsed).
ON_LOOP_TOKENS = 8192
ON_LOOP_CHOICES = 8
NO_TOKENIZER = (
    "this model has no tokenizer (random weights, or a checkpoint without tokenizer.json), so it takes "
    "token ids only"
)


@dataclass(frozen=True)
class RequestLimits:
    """What one request may ask for, checked before its prompts are tokenized or its choices built."""

    max_choices: int  # prompts x n: engine.max_num_seqs + server.max_waiting, what the server holds at once
    max_prompt_tokens: int  # server.max_request_tokens: every prompt's tokens together


@dataclass(frozen=True)
class Prepared:
    """The engine requests of one HTTP request."""

    prompts: list[list[int]]  # token ids of each prompt
    requests: list[tuple[list[int], SamplingParams]]  # one per choice, in choice order
    prompt_logprobs: int | None = None  # the body's prompt_logprobs: each choice (chat: the response) shows them
    echo_logprobs: bool = False  # completions' echo with logprobs: each choice's logprobs start with its prompt's

    @property
    def num_prompt_tokens(self) -> int:
        return sum(len(p) for p in self.prompts)


def token_text(token_ids: Sequence[int]) -> str:
    """The text of tokens for a model without a tokenizer: each id as ``<id>``, as the engine writes it."""
    return "".join(f"<{t}>" for t in token_ids)


def prepares_on_loop(request: CompletionRequest) -> bool:
    """Whether :func:`prepare_completion` of ``request`` is cheap enough for the event loop: token ids only (nothing
    to tokenize), at most ON_LOOP_TOKENS of them and ON_LOOP_CHOICES choices, and no grammar to compile. Decided at
    the cost of a few ``len``; a request it cannot read at a glance is prepared off the loop."""
    prompt = request.prompt
    n = request.sampling.get("n", api_default("n"))
    if isinstance(prompt, str) or type(n) is not int or request.sampling.get("structured_outputs") is not None:
        return False
    if not prompt or isinstance(prompt[0], int):
        prompts, tokens = 1, len(prompt)
    elif all(isinstance(p, list) for p in prompt[:ON_LOOP_CHOICES + 1]):
        prompts, tokens = len(prompt), sum(len(p) for p in prompt[:ON_LOOP_CHOICES + 1])
    else:
        return False
    return prompts * n <= ON_LOOP_CHOICES and tokens <= ON_LOOP_TOKENS


def prepare_completion(request: CompletionRequest, info: EngineInfo, limits: RequestLimits,
                       seeds: random.Random | None = None) -> Prepared:
    """The engine requests of a completions body; ``seeds`` (``server.seed``) seeds a request that sends none."""
    prompt = request.prompt
    if isinstance(prompt, list) and not prompt:
        raise bad_request("prompt: the list is empty; send at least one prompt", "prompt")
    single = isinstance(prompt, str) or isinstance(prompt[0], int)
    check_choices(request, 1 if single else len(prompt), limits)
    if not isinstance(prompt, str):  # token ids, counted at C speed before any is read
        given = len(prompt) if single else sum(len(p) for p in prompt if isinstance(p, list))
        _check_tokens(given, limits, "prompt")
    raw: list[str | list[int]]
    if isinstance(prompt, str):
        raw = [prompt]
    elif single:
        raw = [list(cast(list[int], prompt))]  # the body's validation let integers only into a list of ids
    else:
        raw = [p if isinstance(p, str) else list(p) for p in prompt if isinstance(p, str | list)]
    prompts = [_encode(p, info) for p in raw]
    _check_tokens(sum(map(len, prompts)), limits, "prompt")  # text prompts are known only now; nothing is built yet
    return _prepared(request, prompts, request.max_tokens, "max_tokens", info, seeds)


def echo_texts(request: CompletionRequest, prepared: Prepared, info: EngineInfo) -> list[str] | None:
    """With ``echo``: each prompt's text, put before its choices' text (a text prompt as sent; token ids decoded).

    With ``logprobs`` too, the engine computes the prompt's own (:func:`_prompt_logprobs`), which the
    choice's logprobs start with.
    """
    if not request.echo:
        return None
    prompt = request.prompt
    given = [prompt] if isinstance(prompt, str) or (prompt and isinstance(prompt[0], int)) else list(prompt)
    texts: list[str] = []
    for raw, ids in zip(given, prepared.prompts, strict=True):
        if isinstance(raw, str):
            texts.append(raw)
        else:
            texts.append(info.tokenizer.decode_special(ids) if info.tokenizer is not None else token_text(ids))
    return texts


def check_tokenize_messages(request: TokenizeRequest) -> None:
    """``/tokenize`` takes a ``prompt`` or ``messages``, not both; the generation prompt goes to the template."""
    if request.prompt is not None:
        raise bad_request("prompt: /tokenize takes a prompt or messages, not both; leave one out", "prompt")
    kwargs = dict(request.chat_template_kwargs or {})
    kwargs.setdefault("add_generation_prompt", request.add_generation_prompt)
    request.chat_template_kwargs = kwargs


def tokenize_prompt(request: TokenizeRequest, info: EngineInfo, limits: RequestLimits) -> list[int]:
    """``/tokenize`` of a prompt: its token ids, with the special tokens completions add unless told not to."""
    if request.prompt is None:
        raise bad_request("prompt: /tokenize needs a prompt (text) or messages (a conversation)", "prompt")
    if info.tokenizer is None:
        raise bad_request(f"prompt: {NO_TOKENIZER}", "prompt")
    add = True if request.add_special_tokens is None else request.add_special_tokens
    ids = _tokenize(info.tokenizer, request.prompt, "prompt", add_special_tokens=add)
    _check_tokens(len(ids), limits, "prompt")
    return ids


def tokenize_chat(text: str, info: EngineInfo, template: ChatTemplate, request: TokenizeRequest,
                  limits: RequestLimits) -> list[int]:
    """``/tokenize`` of a rendered conversation: the token ids chat would feed the model."""
    assert info.tokenizer is not None, "chat_messages refuses a model without a tokenizer"
    add = template.is_fallback if request.add_special_tokens is None else request.add_special_tokens
    ids = _tokenize(info.tokenizer, text, "messages", add_special_tokens=add)
    _check_tokens(len(ids), limits, "messages")
    return ids


def detokenize_ids(request: DetokenizeRequest, info: EngineInfo, limits: RequestLimits) -> str:
    """``/detokenize``: the text of token ids, special tokens kept (as vLLM's)."""
    _check_tokens(len(request.tokens), limits, "tokens")
    bad = [t for t in request.tokens if not 0 <= t < info.vocab_size]
    if bad:
        raise bad_request(f"tokens: token id {bad[0]} is outside the vocabulary [0, {info.vocab_size})", "tokens")
    if info.tokenizer is None:
        return token_text(request.tokens)
    return info.tokenizer.decode_special(request.tokens)


def check_choices(request: CompletionRequest | ChatRequest, num_prompts: int, limits: RequestLimits) -> None:
    """Refuse more choices than the server ever holds, from ``n`` as the body gives it, before they are built.

    A value of ``n`` that is not a positive integer is left to SamplingParams, which names what is wrong.
    """
    n = request.sampling.get("n", api_default("n"))
    if type(n) is not int or n < 1:
        return
    if n > MAX_CHOICES:
        raise bad_request(f"n={n}: at most {MAX_CHOICES} choices per prompt", "n")
    if num_prompts * n > limits.max_choices:
        raise bad_request(f"n={n}: the request asks for {num_prompts * n} choices ({num_prompts} prompts x n); this "
                          f"server holds at most {limits.max_choices} requests at once (engine.max_num_seqs + "
                          "server.max_waiting)", "n")


def _check_tokens(count: int, limits: RequestLimits, param: str) -> None:
    if count > limits.max_prompt_tokens:
        raise bad_request(f"{param}: the prompt tokens of this request number {count}; this server takes at most "
                          f"{limits.max_prompt_tokens} per request (server.max_request_tokens)", param)


def chat_messages(request: ChatRequest, info: EngineInfo) -> list[JsonObject]:
    """The conversation as the chat template gets it; a 400 when this model cannot chat or a part is not text."""
    if info.tokenizer is None:
        raise bad_request(f"messages: chat needs text, but {NO_TOKENIZER}; use /v1/completions with token ids, "
                          "or serve a checkpoint with tokenizer.json (model.path=...)", "messages")
    messages: list[JsonObject] = []
    for position, message in enumerate(request.messages):
        record: JsonObject = message.model_dump(exclude_none=True)
        record["content"] = _text_content(message.content, position)
        messages.append(record)
    return messages


async def render_chat(messages: list[JsonObject], renderer: TemplateRenderer,
                      kwargs: JsonObject | None = None) -> str:
    """The prompt text of a conversation, rendered off the event loop; any failure of the template is a 400.

    ``kwargs``: the request's ``chat_template_kwargs``, more variables for the template.
    """
    try:
        return await renderer.render(messages, kwargs)
    except ValueError as error:  # a variable the template may not take (check_template_kwargs)
        raise bad_request(str(error), "chat_template_kwargs") from None
    except ChatTemplateError as error:
        raise bad_request(f"messages: the chat template refused them: {error}", "messages") from None


def prepare_chat(request: ChatRequest, info: EngineInfo, text: str, template: ChatTemplate,
                 limits: RequestLimits, seeds: random.Random | None = None) -> Prepared:
    """The engine requests of a rendered conversation (tokenizing: run it off the event loop)."""
    assert info.tokenizer is not None, "chat_messages refuses a model without a tokenizer"
    _check_length(text, info, "messages")
    # A checkpoint's template writes the special tokens itself; the fallback is a plain prompt.
    prompt = _tokenize(info.tokenizer, text, "messages", add_special_tokens=template.is_fallback)
    _check_prompt(prompt, info, "messages")
    _check_tokens(len(prompt), limits, "messages")
    param = "max_completion_tokens" if request.max_completion_tokens is not None else "max_tokens"
    return _prepared(request, [prompt], request.max_output_tokens, param, info, seeds)


def _text_content(content: object, position: int) -> str:
    if content is None:
        return ""
    if isinstance(content, str):
        return content
    pieces: list[str] = []
    for part in content if isinstance(content, list) else []:
        kind = getattr(part, "type", None)
        if kind != "text" or getattr(part, "text", None) is None:
            raise bad_request(f"messages.{position}.content: only text parts are supported (got a {kind!r} part)",
                              f"messages.{position}.content")
        pieces.append(str(part.text))
    return "".join(pieces)


def _encode(prompt: str | list[int], info: EngineInfo) -> list[int]:
    if isinstance(prompt, str):
        if info.tokenizer is None:
            raise bad_request(f"prompt: {NO_TOKENIZER}; send a list of token ids", "prompt")
        _check_length(prompt, info, "prompt")
        ids = _tokenize(info.tokenizer, prompt, "prompt")
    else:
        ids = prompt
    _check_prompt(ids, info, "prompt")
    return ids


def _tokenize(tokenizer: Tokenizer, text: str, param: str, add_special_tokens: bool = True) -> list[int]:
    """The token ids of ``text``; a 400 naming ``param`` when the checkpoint's tokenizer cannot encode it.

    The tokenizers library panics on some inputs (a pre-tokenizer regex that backtracks past its
    limit) and a panic reaches Python as a BaseException, which no error handler of the app would
    catch: the client would get a plain-text 500 from the HTTP server itself.
    """
    try:
        return tokenizer.encode(text, add_special_tokens=add_special_tokens)
    except (KeyboardInterrupt, SystemExit):
        raise
    except BaseException as error:  # noqa: BLE001 - a Rust panic is a BaseException; the client hears it in one line
        raise bad_request(f"{param}: this model's tokenizer failed on the text ({type(error).__name__}: "
                          f"{' '.join(str(error).split())[:300]}); send other text, or token ids", param) from None


def _check_length(text: str, info: EngineInfo, param: str) -> None:
    """Before tokenizing: a text no tokenization could fit into the context is refused at the cost of len()."""
    if len(text) > info.max_prompt_chars:
        raise bad_request(f"{param}: the prompt has {len(text)} characters; this model's context of "
                          f"{info.max_model_len} tokens holds at most {info.max_prompt_chars} characters of it "
                          "(prompt and output)", param)


def _check_prompt(ids: list[int], info: EngineInfo, param: str) -> None:
    if not ids:
        raise bad_request(f"{param}: the prompt is empty", param)
    if ids and (min(ids) < 0 or max(ids) >= info.vocab_size):  # at C speed: most prompts have no bad id
        bad = next(t for t in ids if not 0 <= t < info.vocab_size)
        raise bad_request(f"{param}: token id {bad} is outside the vocabulary [0, {info.vocab_size})", param)
    if len(ids) >= info.max_model_len:
        raise bad_request(
            f"{param}: the prompt has {len(ids)} tokens; this model's context is {info.max_model_len} tokens "
            "(prompt and output), which leaves no room for output", param,
        )


def _prepared(
    request: CompletionRequest | ChatRequest, prompts: list[list[int]], max_tokens: int | None, max_param: str,
    info: EngineInfo, seeds: random.Random | None = None,
) -> Prepared:
    if isinstance(request, ChatRequest) and request.top_logprobs and not request.logprobs:
        raise bad_request("top_logprobs: needs logprobs=true", "top_logprobs")
    defaults = dict(info.sampling_defaults)  # the checkpoint's generation_config.json, then OpenAI's (vLLM's order)
    values = {name: request.sampling.get(name, defaults.get(name, api_default(name))) for name in API_FIELDS}
    if seeds is not None and "seed" not in request.sampling:  # server.seed: repeatable in the order requests come
        values["seed"] = seeds.randrange(SEED_LIMIT)
    values["logprobs"] = request.num_logprobs
    values["structured_outputs"] = request.sampling.get("structured_outputs")
    try:  # built and checked once; each prompt's copy below sets its max_tokens
        base = SamplingParams.from_mapping(values)
        if base.structured_outputs is not None:  # compiled here, in a worker thread: once per distinct schema
            check_grammar(StructuredOutputsParams.of(base.structured_outputs))
    except StructuredOutputsError as error:
        raise ApiError(400, f"response_format: {error}", param="response_format") from None
    except SamplingError as error:
        raise ApiError(400, str(error), param=error.field) from None
    if base.n > MAX_CHOICES:
        raise bad_request(f"n={base.n}: at most {MAX_CHOICES} choices per prompt", "n")
    shown, echo_logprobs = base.prompt_logprobs, _echo_logprobs(request)
    computed = _prompt_logprobs(request, shown, base.logprobs if echo_logprobs else None)
    requests: list[tuple[list[int], SamplingParams]] = []
    computing: set[tuple[int, ...]] = set()  # prompts whose logprobs one choice already computes
    for prompt in prompts:
        room = info.max_model_len - len(prompt)
        wanted = min(room, defaults.get("max_tokens", room)) if max_tokens is None else max_tokens
        if wanted > room:
            raise bad_request(
                f"{max_param}={wanted}: the prompt has {len(prompt)} tokens and this model's context is "
                f"{info.max_model_len}, so at most {room} tokens can be generated", max_param,
            )
        try:
            sized = base.replace(max_tokens=wanted, prompt_logprobs=None)
            sized.validate(info.vocab_size)
        except SamplingError as error:
            param = max_param if error.field == "max_tokens" else error.field
            raise ApiError(400, param + str(error).removeprefix(error.field), param=param) from None
        chosen = choices(sized, first=len(requests))
        if computed is not None and tuple(prompt) not in computing:
            # One choice per distinct prompt computes its logprobs: the others take its KV blocks (n), and a
            # prompt sent twice would otherwise be computed twice; the response shows them for each.
            computing.add(tuple(prompt))
            chosen[0] = chosen[0].replace(prompt_logprobs=computed)
        requests += [(prompt, choice) for choice in chosen]
    return Prepared(prompts, requests, shown, echo_logprobs)


def _echo_logprobs(request: CompletionRequest | ChatRequest) -> bool:
    return isinstance(request, CompletionRequest) and request.echo and request.logprobs is not None


def _prompt_logprobs(request: CompletionRequest | ChatRequest, shown: int | None, echoed: int | None) -> int | None:
    """How many alternatives the engine computes at each prompt token: the most that ``prompt_logprobs`` and an
    echo's ``logprobs`` show (the response cuts each to its own); None: the prompt's logprobs are not computed.

    They come with a request's last update, so a stream would show them only after every token it sent
    (vLLM's shows them in each choice's first chunk): refused in one line.
    """
    if shown is None and echoed is None:
        return None
    if request.stream:
        if shown is not None:
            raise bad_request("prompt_logprobs: not streamed; leave stream out, and the whole response carries them",
                              "prompt_logprobs")
        raise bad_request("echo: with logprobs it shows the prompt's logprobs, which are not streamed; leave stream "
                          "out, and the whole response carries them", "echo")
    return max(shown or 0, echoed or 0)
