"""A familiar Python API beside :class:`corelib.engine.Engine`: keyword arguments in, outputs in order out.

    import corelib

    llm = corelib.LLM(model="tiny", backend="npu", async_token_handoff="on", max_num_seqs=32)
    outputs = llm.generate([[1, 2, 3], [4, 5]], corelib.SamplingParams(max_tokens=16))
    print(outputs[0].output_token_ids, outputs[0].finish_reason)

Keywords become config overrides: ``model`` is a preset name (``tiny``, ``small-0.6b``, ...)
or a checkpoint directory (``model.path``); ``backend`` picks the plugin;
``tensor_parallel_size=N`` sets ``engine.tp=N`` and, above 1, ``engine.transport=shm``;
``dtype`` and ``max_model_len`` set the model's; any other keyword names a key of the
``engine`` group (``async_token_handoff="on"``, ``max_num_seqs=32``, ``shm={"num_slots": 8}``).
``overrides=[...]`` passes anything else as Hydra overrides. An unknown keyword is a TypeError.

Thread safety: an LLM, like an Engine, is driven by one thread at a time. A second thread
calling ``generate`` while one runs gets a RuntimeError at once instead of corrupting the
loop; use one LLM per thread, or a lock of your own, or the HTTP server for concurrent clients.
"""

from __future__ import annotations

import dataclasses
import importlib.resources
import re
import threading
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from types import TracebackType
from typing import TypeGuard, cast

from corelib.config import engine_schema
from corelib.engine.api import Engine
from corelib.engine.outputs import RequestOutput
from corelib.engine.sequence import SamplingParams as EngineSamplingParams
from corelib.errors import RequestError
from corelib.gate_catalog import load_gates

Prompt = str | Sequence[int]
_PLAIN = re.compile(r"[\w./:+\-]*")  # override values that need no quoting


@dataclass(frozen=True)
class SamplingParams:
    """How one request samples and stops; a wrong value raises ValueError naming the field, here.

    Greedy by default (``temperature=0``), like the engine. ``stop`` is a string or a list of
    strings: the text ends before the first one found (needs a tokenizer to mean text).
    """

    max_tokens: int = 16
    temperature: float = 0.0
    top_k: int = 0  # 0: no cut
    top_p: float = 1.0
    seed: int = 0
    stop: str | Sequence[str] | None = None
    stop_token_ids: Sequence[int] = field(default_factory=tuple)
    ignore_eos: bool = False
    logprobs: int | None = None  # each output token's logprob and the k most likely (k <= 20); None: none

    def __post_init__(self) -> None:
        try:
            # The vocabulary is not known here: token ids are range-checked by the engine.
            self.to_engine().validate(vocab_size=2**62)
        except RequestError as error:
            raise ValueError(str(error).removeprefix("sampling.")) from None

    def to_engine(self) -> EngineSamplingParams:
        stop = () if self.stop is None else (self.stop,) if isinstance(self.stop, str) else tuple(self.stop)
        return EngineSamplingParams(
            max_tokens=self.max_tokens, temperature=self.temperature, top_k=self.top_k, top_p=self.top_p,
            seed=self.seed, stop_token_ids=tuple(self.stop_token_ids), ignore_eos=self.ignore_eos,
            stop_strings=stop, logprobs=self.logprobs,
        )


def model_presets() -> list[str]:
    """The names of the shipped ``model`` options."""
    folder = importlib.resources.files("corelib.conf") / "model"
    return sorted(entry.name.removesuffix(".yaml") for entry in folder.iterdir() if entry.name.endswith(".yaml"))


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
    text = str(getattr(value, "value", value))  # an enum member: its value
    if _PLAIN.fullmatch(text) and text not in ("null", "true", "false"):
        return text
    return "'" + text.replace("\\", "\\\\").replace("'", "\\'") + "'"


def _engine_overrides(options: Mapping[str, object]) -> list[str]:
    # The engine keys of the schema, and those corelib's own gate files declare (a plugin's: overrides=[...]).
    declared = {gate.engine_key for gate in load_gates({}) if gate.engine_key is not None}
    known = {f.name for f in dataclasses.fields(engine_schema())} | declared
    overrides = []
    for name, value in options.items():
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
    result: list[str] = []
    if model in model_presets():
        result.append(f"model={model}")
    elif Path(model).expanduser().is_dir():
        result.append(f"model.path={override_value(str(Path(model).expanduser()))}")
    else:
        raise ValueError(f"model={model!r} is neither a preset ({', '.join(model_presets())}) "
                         "nor a checkpoint directory")
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


def _is_token_ids(prompt: object) -> TypeGuard[Sequence[int]]:
    return isinstance(prompt, Sequence) and not isinstance(prompt, str) and bool(prompt) and all(
        isinstance(t, int) and not isinstance(t, bool) for t in prompt
    )


def _prompt_list(prompts: Prompt | Sequence[Prompt]) -> list[Prompt]:
    """One prompt (text, or token ids) or a list of them, as a list."""
    if isinstance(prompts, str) or _is_token_ids(prompts):
        return [prompts]
    return list(cast("Sequence[Prompt]", prompts))  # the engine names any prompt of the wrong type


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
        overrides: Sequence[str] = (),
        **engine_options: object,
    ) -> None:
        self.overrides = llm_overrides(model, backend, tensor_parallel_size, dtype, max_model_len, overrides,
                                       engine_options)
        self._lock = threading.Lock()
        self.engine = Engine.from_overrides(self.overrides)

    def generate(
        self,
        prompts: Prompt | Sequence[Prompt],
        sampling_params: SamplingParams | EngineSamplingParams | Sequence[SamplingParams | EngineSamplingParams]
        | None = None,
    ) -> list[RequestOutput]:
        """Run prompts (text, token ids, or a list of either) to the end; one output per prompt, in order."""
        batch = _prompt_list(prompts)
        if isinstance(sampling_params, Sequence):
            sampling = [_engine_params(p) for p in sampling_params]
        else:
            sampling = [_engine_params(sampling_params or SamplingParams())] * len(batch)
        if len(sampling) != len(batch):
            raise ValueError(f"{len(batch)} prompts but {len(sampling)} sampling_params; pass one, or one per prompt")
        if not self._lock.acquire(blocking=False):
            raise RuntimeError(
                "LLM.generate is already running in another thread; an LLM is driven by one thread at a time: "
                "wait for that call, or give each thread its own LLM"
            )
        try:
            return self.engine.generate(batch, sampling)
        finally:
            self._lock.release()

    def close(self) -> None:
        """Release the engine's threads, device memory and workers. Safe to call twice."""
        if not self._lock.acquire(blocking=False):
            raise RuntimeError("LLM.close was called while generate runs in another thread; wait for it first")
        try:
            self.engine.close()
        finally:
            self._lock.release()

    def __enter__(self) -> LLM:
        return self

    def __exit__(
        self, exc_type: type[BaseException] | None, exc: BaseException | None, tb: TracebackType | None
    ) -> None:
        self.close()


def _engine_params(params: SamplingParams | EngineSamplingParams) -> EngineSamplingParams:
    return params.to_engine() if isinstance(params, SamplingParams) else params
