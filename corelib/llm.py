"""The Python API in vLLM's shape, beside :class:`corelib.engine.Engine`: keywords in, outputs in order out.

    from corelib import LLM, SamplingParams

    llm = LLM(model="Qwen/Qwen3-0.6B")  # a hub id, a checkpoint directory, or a preset (tiny, small-0.6b, ...)
    out = llm.generate(["Hello"], SamplingParams(temperature=0.8, max_tokens=16, n=2))
    print(out[0].prompt, [o.text for o in out[0].outputs])

Keywords become config overrides: ``model`` is a preset name (random weights, no tokenizer: token
ids only), a checkpoint directory or a hub id (``model.path``); ``backend`` picks the plugin;
``tensor_parallel_size=N`` sets ``engine.tp=N`` and, above 1, ``engine.transport=shm``;
``dtype`` and ``max_model_len`` set the model's; ``enforce_eager=True`` turns graphs off;
``seed`` makes the seeds of requests that have none repeatable; any other keyword names a key of
the ``engine`` group (``async_token_handoff="on"``, ``max_num_seqs=32``, ``shm={"num_slots": 8}``).
``overrides=[...]`` passes anything else as Hydra overrides. An unknown keyword is a TypeError.

Thread safety: an LLM, like an Engine, is driven by one thread at a time. A second thread
calling ``generate`` while one runs gets a RuntimeError at once instead of corrupting the
loop; use one LLM per thread, or a lock of your own, or the HTTP server for concurrent clients.

Chat templates: a checkpoint's template is code from elsewhere, so ``chat`` renders it as the
server does, in a worker process with a time and memory budget (:mod:`corelib.server.render`),
probed once with a one-message conversation; a template that loops, explodes as it compiles or
fails the probe is one line of error, and the caller's process never compiles it.
"""

from __future__ import annotations

import dataclasses
import random
import threading
import warnings
from collections.abc import Mapping, Sequence
from types import TracebackType
from typing import TYPE_CHECKING, TypeGuard, cast

from rich.console import Console

from corelib.cli.habits import IGNORED_SWITCHES, NO_EQUIVALENT, model_override, model_presets, quoted
from corelib.config.gate_catalog import load_gates
from corelib.config.schema import engine_schema
from corelib.engine.api import Engine
from corelib.engine.outputs import CompletionOutput, RequestOutput
from corelib.errors import RequestError
from corelib.sampling_params import SEED_LIMIT, SamplingParams
from corelib.support.progress import Progress, reporting
from corelib.support.text import Tokenizer

if TYPE_CHECKING:
    from corelib.server.render import TemplateRenderer

__all__ = ["LLM", "CompletionOutput", "RequestOutput", "SamplingParams", "model_presets"]

Prompt = str | Sequence[int]
VLLM_TEMPERATURE = 1.0  # vLLM's SamplingParams() samples at temperature 1 (corelib's is greedy)
PromptInput = Prompt | Mapping[str, object]  # also {"prompt": text} or {"prompt_token_ids": [...]}, as vLLM's
Message = Mapping[str, object]


def override_value(value: object) -> str:
    """A Python value as Hydra's override grammar reads it."""
    if value is None:
        return "null"
    if isinstance(value, bool):
        return "true" if value else "false"
    if isinstance(value, int | float):
        return repr(value)
    if isinstance(value, list | tuple):
        return "[" + ",".join(override_value(v) for v in value) + "]"
    return quoted(str(getattr(value, "value", value)))  # an enum member: its value


def _engine_overrides(options: Mapping[str, object]) -> list[str]:
    # The engine keys of the schema, and those corelib's own gate files declare (a plugin's: overrides=[...]).
    declared = {gate.engine_key for gate in load_gates({}) if gate.engine_key is not None}
    known = {f.name for f in dataclasses.fields(engine_schema())} | declared
    overrides = []
    for name, value in options.items():
        reason = NO_EQUIVALENT.get("--" + name.replace("_", "-"))
        if name not in known and reason is not None:  # a vLLM keyword with no counterpart here
            raise TypeError(f"LLM() got an unexpected keyword argument {name!r}: {reason}")
        if name not in known:
            raise TypeError(
                f"LLM() got an unexpected keyword argument {name!r}; engine options are: {', '.join(sorted(known))} "
                "(anything else goes in overrides=[...])"
            )
        if isinstance(value, Mapping):  # a nested group such as shm={"num_slots": 8}
            overrides += [f"engine.{name}.{key}={override_value(v)}" for key, v in value.items()]
        else:
            overrides.append(f"engine.{name}={override_value(value)}")
    return overrides


def llm_overrides(
    model: str, backend: str | None, tensor_parallel_size: int, dtype: str | None, max_model_len: int | None,
    overrides: Sequence[str], engine_options: Mapping[str, object],
) -> list[str]:
    """The Hydra overrides an ``LLM(...)`` call stands for."""
    result = [model_override(model)]
    if backend is not None:
        result.append(f"backend={backend}")
    if not isinstance(tensor_parallel_size, int) or tensor_parallel_size < 1:
        raise ValueError(f"tensor_parallel_size={tensor_parallel_size!r}: must be an integer >= 1")
    if tensor_parallel_size > 1:
        result.append(f"engine.tp={tensor_parallel_size}")
        if "transport" not in engine_options:
            result.append("engine.transport=shm")  # ranks are worker processes fed over shared memory
    if dtype is not None:
        result.append(f"model.dtype={dtype}")
    if max_model_len is not None:
        result.append(f"model.max_model_len={max_model_len}")
    return [*result, *_engine_overrides(engine_options), *overrides]


def _render(renderer: TemplateRenderer, conversation: Sequence[Message],
            kwargs: Mapping[str, object] | None = None) -> str:
    """One conversation's prompt text, rendered within the renderer's budget (``kwargs``: more template variables)."""
    from corelib.server.chat import ChatTemplateError

    try:
        return renderer.render_blocking([dict(message) for message in conversation], kwargs)
    except ChatTemplateError as error:
        raise ChatTemplateError(f"the chat template from {renderer.template.origin} failed on these messages: "
                                f"{error}") from None
    except TypeError as error:  # not JSON: the messages travel to the renderer's process as JSON
        raise TypeError(f"LLM.chat: messages must hold JSON values (str, int, float, bool, None, list, dict): "
                        f"{error}") from None


def _is_token_ids(prompt: object) -> TypeGuard[Sequence[int]]:
    return isinstance(prompt, Sequence) and not isinstance(prompt, str) and bool(prompt) and all(
        isinstance(t, int) and not isinstance(t, bool) for t in prompt
    )


def _refuse_overlong(engine: Engine, batch: Sequence[Prompt]) -> None:
    """A prompt that leaves no room for output raises ValueError, as vLLM's generate does (the engine alone,
    and the server, finish such a request with its error instead)."""
    limit = engine.startup.config.model.max_model_len
    for index, prompt in enumerate(batch):
        try:
            length = len(engine.encode(prompt))
        except RequestError:
            continue  # not a prompt at all: its request finishes with that error, as before
        if length >= limit:
            raise ValueError(f"prompt {index} has {length} tokens; the model's context (model.max_model_len={limit}) "
                             "leaves no room for output: shorten it, or raise max_model_len")


def _prompt_list(prompts: PromptInput | Sequence[PromptInput]) -> list[Prompt]:
    """One prompt (text, token ids, or vLLM's prompt dict) or a list of them, as a list of text or token ids."""
    if isinstance(prompts, str | Mapping) or _is_token_ids(prompts):
        batch: list[object] = [prompts]
    else:
        batch = list(cast("Sequence[object]", prompts))
    return [_plain_prompt(p) for p in batch]  # the engine names any prompt of the wrong type


def _plain_prompt(prompt: object) -> Prompt:
    if not isinstance(prompt, Mapping):
        return cast(Prompt, prompt)
    if "prompt_token_ids" in prompt:
        return cast("Sequence[int]", prompt["prompt_token_ids"])
    if "prompt" in prompt:
        return cast(str, prompt["prompt"])
    raise ValueError(f"a prompt dict needs 'prompt' (text) or 'prompt_token_ids', got keys {sorted(prompt)}")


class LLM:
    """An engine built from keyword arguments; ``generate`` returns outputs in prompt order."""

    def __init__(
        self,
        model: str = "tiny",
        backend: str | None = None,
        tensor_parallel_size: int = 1,
        *,
        dtype: str | None = None,
        max_model_len: int | None = None,
        seed: int | None = None,
        enforce_eager: bool = False,
        trust_remote_code: bool = False,
        overrides: Sequence[str] = (),
        **engine_options: object,
    ) -> None:
        if trust_remote_code:  # vLLM scripts pass it; the launch goes on, as the CLI's --trust-remote-code does
            warnings.warn("LLM(trust_remote_code=True): " + IGNORED_SWITCHES["--trust-remote-code"], stacklevel=2)
        if enforce_eager:
            engine_options.setdefault("graph", "off")
        self.overrides = llm_overrides(model, backend, tensor_parallel_size, dtype, max_model_len, overrides,
                                       engine_options)
        self.model = model
        self._seeds = random.Random(seed) if seed is not None else None
        self._lock = threading.Lock()
        self._renderer: TemplateRenderer | None = None  # the last chat template's, kept for the next chat
        with reporting(Progress(Console(stderr=True))):  # weights, KV cache, graphs: a bar, or a line every 5 s
            self.engine = Engine.from_overrides(self.overrides)

    def generate(
        self,
        prompts: PromptInput | Sequence[PromptInput],
        sampling_params: SamplingParams | Sequence[SamplingParams] | None = None,
        use_tqdm: bool = True,
    ) -> list[RequestOutput]:
        """Run prompts (text, token ids, or a list of either) to the end; one output per prompt, in order.

        ``use_tqdm``: a progress bar of finished prompts on stderr (on a pipe, a line every 5 s).
        """
        batch = _prompt_list(prompts)
        if isinstance(sampling_params, Sequence):
            sampling = list(sampling_params)
        else:
            sampling = [sampling_params or self.get_default_sampling_params()] * len(batch)
        if len(sampling) != len(batch):
            raise ValueError(f"{len(batch)} prompts but {len(sampling)} sampling_params; pass one, or one per prompt")
        for params in sampling:
            if not isinstance(params, SamplingParams):
                raise TypeError(f"sampling_params must be corelib.SamplingParams, not {type(params).__name__}")
        if self.engine.tokenizer is None and any(isinstance(p, str) for p in batch):
            self.engine.encode("")  # the engine's one line: which model has no tokenizer, and what to do
        _refuse_overlong(self.engine, batch)
        if self._seeds is not None:
            sampling = [p if p.seed is not None else p.replace(seed=self._seeds.randrange(SEED_LIMIT))
                        for p in sampling]
        if not self._lock.acquire(blocking=False):
            raise RuntimeError(
                "LLM.generate is already running in another thread; an LLM is driven by one thread at a time: "
                "wait for that call, or give each thread its own LLM"
            )
        try:
            progress = Progress(Console(stderr=True) if use_tqdm else None)
            with progress.task("generating", total=sum(p.n for p in sampling), unit="samples") as task:
                return self.engine.generate(batch, sampling, on_finish=lambda _: task.advance())
        finally:
            self._lock.release()

    def chat(
        self,
        messages: Sequence[Message] | Sequence[Sequence[Message]],
        sampling_params: SamplingParams | Sequence[SamplingParams] | None = None,
        use_tqdm: bool = True,
        chat_template: str | None = None,
        chat_template_kwargs: Mapping[str, object] | None = None,
    ) -> list[RequestOutput]:
        """Answer one conversation (a list of ``{"role", "content"}`` messages) or a list of them.

        Rendered with the checkpoint's chat template (``chat_template`` names a file to use
        instead), as transformers' ``apply_chat_template`` with ``add_generation_prompt``, in a
        worker process with the server's budget (see the module doc). A template that fails its
        probe raises ConfigError; one that fails on these messages, or outruns its time or memory,
        raises ChatTemplateError (:mod:`corelib.server.chat`); messages hold JSON values.
        ``chat_template_kwargs`` are more variables for the template (``{"enable_thinking": False}``), JSON
        values too, rendered within the same budget.
        """
        tokenizer = self.engine.tokenizer
        if tokenizer is None:
            self.engine.encode("")  # raises the one line: this model has no tokenizer
            raise RuntimeError("unreachable: a model without a tokenizer cannot chat")
        renderer = self._chat_renderer(chat_template, tokenizer)
        conversations = [messages] if messages and isinstance(messages[0], Mapping) else messages
        texts = [_render(renderer, c, chat_template_kwargs)
                 for c in cast("Sequence[Sequence[Message]]", conversations)]
        # A checkpoint's template writes the special tokens itself; the fallback is a plain prompt.
        fallback = renderer.template.is_fallback
        prompts: list[PromptInput] = [tokenizer.encode(t, add_special_tokens=fallback) for t in texts]
        outputs = self.generate(prompts, sampling_params, use_tqdm)
        return [dataclasses.replace(output, prompt=text) for output, text in zip(outputs, texts, strict=True)]

    def _chat_renderer(self, chat_template: str | None, tokenizer: Tokenizer) -> TemplateRenderer:
        """The renderer of this call's template: the last one when the template is the same (its worker started and
        probed once), else a new one, started and probed now (ConfigError when it fails the probe)."""
        from corelib.server.chat import ChatTemplate
        from corelib.server.render import TemplateRenderer

        model = self.engine.startup.config.model
        template = ChatTemplate.load(model.path, chat_template, setting="chat_template")  # parsed, never compiled
        kept = self._renderer
        if kept is not None and (kept.template.source, kept.template.bos_token, kept.template.eos_token) == (
                template.source, template.bos_token, template.eos_token):
            return kept
        self._close_renderer()
        # As the server's: no text longer than any prompt the context could hold.
        renderer = TemplateRenderer(template, model.max_model_len * tokenizer.longest_token_chars, workers=1,
                                    setting="chat_template")
        renderer.start()
        self._renderer = renderer
        return renderer

    def _close_renderer(self) -> None:
        renderer, self._renderer = self._renderer, None
        if renderer is not None:
            renderer.close()

    def get_default_sampling_params(self) -> SamplingParams:
        """What ``generate`` and ``chat`` sample with when given no ``sampling_params``, as vLLM's: vLLM's
        defaults (temperature 1) under the checkpoint's generation_config.json values (``model.sampling_defaults``:
        temperature, top_p, top_k, min_p, repetition_penalty, max_new_tokens as max_tokens).

        ``SamplingParams()`` itself stays greedy (temperature 0): corelib's tests and tools compare tokens
        across engines with it, and a request spelled out is what it says.
        """
        defaults = self.engine.startup.config.model.sampling_defaults
        return SamplingParams(**{"temperature": VLLM_TEMPERATURE, **defaults})

    def get_tokenizer(self) -> Tokenizer | None:
        """The checkpoint's tokenizer (``encode``, ``decode``); None for a preset."""
        return self.engine.tokenizer

    def close(self) -> None:
        """Release the engine's threads, device memory and workers. Safe to call twice."""
        if not self._lock.acquire(blocking=False):
            raise RuntimeError("LLM.close was called while generate runs in another thread; wait for it first")
        try:
            self._close_renderer()
            self.engine.close()
        finally:
            self._lock.release()

    def __enter__(self) -> LLM:
        return self

    def __exit__(
        self, exc_type: type[BaseException] | None, exc: BaseException | None, tb: TracebackType | None
    ) -> None:
        self.close()

    def __repr__(self) -> str:
        return f"LLM(model={self.model!r})"

