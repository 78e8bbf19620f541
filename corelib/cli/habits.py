"""The command-line habits a vLLM user brings, on corelib's Hydra commands: ``serve MODEL --port 8001``.

A positional argument that is not an override names the model: a preset (``model=NAME``), a
checkpoint directory or a hub id (``model.path=...``), as ``LLM(model=...)`` takes it. The flags
of :data:`FLAG_KEYS` become their keys (``--port 8001`` is ``server.port=8001``); any other
``--flag`` is refused in one line that names the key it may mean. Torch-free, like the CLI's
first steps.
"""

from __future__ import annotations

import dataclasses
import difflib
import importlib.resources
import re
import typing
from collections.abc import Callable, Sequence
from pathlib import Path

from corelib.config.schema import CorelibConfig
from corelib.errors import ConfigError
from corelib.trust.hub import is_hub_id

MODEL = "model"  # the flag's value names the model, as a positional argument does
#: vLLM's flags and the key each one sets
FLAG_KEYS: dict[str, str] = {
    "--model": MODEL,
    "--port": "server.port",
    "--host": "server.host",
    "--api-key": "server.api_key",
    "--served-model-name": "server.served_model_name",
    "--chat-template": "server.chat_template",
    "--uvicorn-log-level": "server.log_level",
    "--seed": "server.seed",
    "--tensor-parallel-size": "engine.tp",
    "-tp": "engine.tp",
    "--max-model-len": "model.max_model_len",
    "--dtype": "model.dtype",
    "--max-num-seqs": "engine.max_num_seqs",
    "--max-num-batched-tokens": "engine.max_num_batched_tokens",
    "--block-size": "engine.block_size",
    "--gpu-memory-utilization": "engine.gpu_memory_utilization",
    "--num-gpu-blocks-override": "engine.num_kv_blocks",
}
#: flags without a value, and the overrides they stand for
SWITCHES: dict[str, tuple[str, ...]] = {
    "--enforce-eager": ("engine.graph=off",),
    "--enable-prefix-caching": ("engine.prefix_caching=on",),
    "--no-enable-prefix-caching": ("engine.prefix_caching=off",),
    "--enable-chunked-prefill": ("engine.chunked_prefill=on",),
    "--no-enable-chunked-prefill": ("engine.chunked_prefill=off",),
    "--enable-log-requests": ("server.access_log=true",),
    "--disable-log-requests": ("server.access_log=false",),
}
#: flags vLLM takes that change nothing here (the behaviour they ask for is corelib's own), and why
IGNORED_SWITCHES: dict[str, str] = {
    "--trust-remote-code": "corelib never runs a checkpoint's code (its architectures are built in), so the "
                           "launch goes on without it",
    "--disable-log-stats": "corelib logs no periodic stats line; /metrics has the figures",
    "--disable-uvicorn-access-log": "the access log is off unless server.access_log=true",
}
#: bench-serve's flags (vLLM's ``vllm bench serve``) and the key each one sets
BENCH_FLAG_KEYS: dict[str, str] = {
    "--base-url": "server.bench.url",
    "--model": "server.bench.model",
    "--request-rate": "server.bench.rates",
    "--max-concurrency": "server.bench.concurrency",
    "--num-prompts": "server.bench.num_requests",
    "--random-input-len": "server.bench.prompt_len",
    "--random-output-len": "server.bench.output_len",
    "--random-prefix-len": "server.bench.shared_prefix_len",
    "--seed": "server.bench.seed",
    "--temperature": "server.bench.temperature",
    "--top-p": "server.bench.top_p",
    "--top-k": "server.bench.top_k",
    "--min-p": "server.bench.min_p",
    "--port": "server.port",
    "--host": "server.host",
    "--api-key": "server.bench.api_key",
}
#: bench-serve's keys that hold a list: one flag value is one point
_LIST_KEYS = frozenset({"server.bench.rates", "server.bench.concurrency"})
#: vLLM bench flags whose only value here is the one corelib always uses
BENCH_FIXED: dict[str, tuple[str, ...]] = {
    "--dataset-name": ("random",),
    "--backend": ("vllm", "openai"),
}
#: bench-serve switches that change nothing: what they ask for is always done
BENCH_IGNORED_SWITCHES: dict[str, str] = {
    "--save-result": "bench-serve always writes bench_serve.json (and its plot) into the run directory",
    "--ignore-eos": "bench-serve always asks with ignore_eos, so each request has its asked length",
    "--disable-tqdm": "the progress lines go to stderr",
}
#: flags with no key here, and why
NO_EQUIVALENT: dict[str, str] = {
    "--tokenizer": "the tokenizer is the checkpoint's tokenizer.json (model.path)",
    "--dataset-path": "bench-serve reads a JSONL file of prompts: server.bench.dataset=FILE",
}
_PLAIN = re.compile(r"[\w./:+\-]*")


def model_presets() -> list[str]:
    """The names of the shipped ``model`` options."""
    folder = importlib.resources.files("corelib.conf") / "model"
    return sorted(entry.name.removesuffix(".yaml") for entry in folder.iterdir() if entry.name.endswith(".yaml"))


def quoted(text: str) -> str:
    """``text`` as a value of Hydra's override grammar."""
    if _PLAIN.fullmatch(text) and text not in ("null", "true", "false"):
        return text
    return "'" + text.replace("\\", "\\\\").replace("'", "\\'") + "'"


def model_override(model: str) -> str:
    """The override a model argument stands for: a preset, a checkpoint directory or a hub id."""
    if model in model_presets():
        return f"model={model}"
    if Path(model).expanduser().is_dir():
        return f"model.path={quoted(str(Path(model).expanduser()))}"
    if is_hub_id(model):
        return f"model.path={quoted(model)}"  # found in the Hugging Face cache, or downloaded
    raise ValueError(f"model {model!r} is neither a preset ({', '.join(model_presets())}), a checkpoint "
                     "directory nor a hub id (org/name)")


def habit_arguments(
    args: Sequence[str], hydra_flags: frozenset[str], takes_value: Callable[[str, str], bool],
    command: str = "serve", warn: Callable[[str], None] | None = None,
) -> list[str]:
    """``args`` with a positional model and vLLM's flags turned into overrides; Hydra's own flags pass.

    ``hydra_flags`` are the flags Hydra takes; ``takes_value(flag, next_arg)`` says whether the
    argument after one of them is its value. ``command`` picks the flags: ``bench-serve`` takes
    those of ``vllm bench serve`` (:data:`BENCH_FLAG_KEYS`), every other command those of
    ``vllm serve``. A flag that changes nothing here (``--trust-remote-code``) is said once to
    ``warn``, and the command goes on: a vLLM command line runs unchanged.
    """
    flag_keys, switches, ignored = command_flags(command)
    result: list[str] = []
    model_given: str | None = None
    rate_given = concurrency_given = False
    index = 0
    while index < len(args):
        arg = args[index]
        index += 1
        name, has_value, inline = arg.partition("=")
        if arg.startswith("-") and name in hydra_flags:
            result.append(arg)
            if not has_value and index < len(args) and takes_value(name, args[index]):
                result.append(args[index])  # the flag's value; Hydra's parser checks it
                index += 1
            continue
        if arg.startswith("-") and name in switches and not has_value:
            result += switches[name]
            continue
        if arg.startswith("-") and name in ignored and not has_value:
            if warn is not None:
                warn(f"{name} is ignored: {ignored[name]}")
            continue
        if arg.startswith("-") and (name in flag_keys or (command == "bench-serve" and name in BENCH_FIXED)):
            key = flag_keys.get(name, name)
            if not has_value:
                if index == len(args) or args[index].startswith("--"):
                    raise ConfigError(f"{name} needs a value: {name} VALUE" + ("" if key == name else
                                                                               f" (or {key}=VALUE)"))
                inline = args[index]
                index += 1
            if name in BENCH_FIXED:
                if inline not in BENCH_FIXED[name]:
                    raise ConfigError(f"{name} {inline}: bench-serve takes {' or '.join(BENCH_FIXED[name])} only "
                                      "(random token-id prompts, or server.bench.dataset=FILE of JSONL prompts)")
                continue
            if key == MODEL:
                model_given = _once(model_given, inline)
                result.append(_model(inline))
            elif key in _LIST_KEYS:  # vLLM's one value is one point of the sweep
                rate_given = rate_given or key == "server.bench.rates"
                concurrency_given = concurrency_given or key == "server.bench.concurrency"
                result.append(f"{key}=[{quoted(inline)}]")
            else:
                result.append(f"{key}={quoted(inline)}")
            continue
        if arg.startswith("-"):
            raise ConfigError(flag_hint(name, command))
        if "=" not in arg and not arg.startswith("~"):  # a positional argument: the model
            model_given = _once(model_given, arg)
            result.append(_model(arg))
            continue
        if name.lstrip("+") == "workload.prompts":
            check_quoted_prompts(inline)
        result.append(arg)
    if rate_given and not concurrency_given:
        result.insert(0, "server.bench.concurrency=[]")  # vLLM's --request-rate alone: that rate, no client cap
    tp = [a for a in result if a.startswith("engine.tp=")]
    if tp and tp[-1] != "engine.tp=1" and not any(a.startswith("engine.transport=") for a in result):
        result.append("engine.transport=shm")  # ranks are worker processes fed through shared memory
    return result


def command_flags(command: str) -> tuple[dict[str, str], dict[str, tuple[str, ...]], dict[str, str]]:
    """The flags ``command`` takes: those with a value and their keys, the switches, the ignored switches."""
    if command == "bench-serve":
        return BENCH_FLAG_KEYS, {}, BENCH_IGNORED_SWITCHES
    if command == "serve":
        return FLAG_KEYS, SWITCHES, IGNORED_SWITCHES
    # run, plan and bench have a workload of their own, whose seed --seed sets
    return {**FLAG_KEYS, "--seed": "workload.seed"}, SWITCHES, IGNORED_SWITCHES


def flags_help(command: str) -> str:
    """The vLLM flags ``command`` takes, one line each, for its ``--help``."""
    flag_keys, switches, ignored = command_flags(command)
    rows = [(f"{flag} VALUE", "the model (as MODEL)" if key == MODEL else key) for flag, key in flag_keys.items()]
    if command == "bench-serve":
        rows += [(f"{flag} {'|'.join(values)}", "the only choice here") for flag, values in BENCH_FIXED.items()]
    rows += [(flag, " ".join(overrides)) for flag, overrides in switches.items()]
    rows += [(flag, "ignored: " + why) for flag, why in ignored.items()]
    width = max(len(flag) for flag, _ in rows) + 2
    lines = [f"  {flag.ljust(width)}{meaning}" for flag, meaning in rows]
    return "\n".join(lines)


def check_quoted_prompts(value: str) -> None:
    """Refuse ``workload.prompts=[Hello, world]``: Hydra reads two prompts where one was meant.

    A list of more than one element must quote each (``[hello]`` alone is unambiguous).
    """
    text = value.strip()
    if not (text.startswith("[") and text.endswith("]")):
        return  # not a list: composing names the type error
    elements, quote, start = [], "", 1
    for position, char in enumerate(text[1:-1], 1):
        if quote:
            quote = "" if char == quote and text[position - 1] != "\\" else quote
        elif char in "'\"":
            quote = char
        elif char == ",":
            elements.append(text[start:position].strip())
            start = position + 1
    elements.append(text[start:-1].strip())
    bare = [e for e in elements if e and e[0] not in "'\""]
    if bare and len(elements) > 1:
        raise ConfigError(
            f"workload.prompts={value}: {bare[0]!r} is not quoted, so a comma would split a prompt in two; "
            """quote each prompt: 'workload.prompts=["Hello, world", "Another prompt"]'"""
        )


def _once(before: str | None, model: str) -> str:
    if before is not None:
        raise ConfigError(f"two models given ({before!r} and {model!r}); name one, as MODEL or --model MODEL")
    return model


def _model(value: str) -> str:
    try:
        return model_override(value)
    except ValueError as error:
        raise ConfigError(f"{error}; or set a key as key=value (COMMAND --help lists them)") from None


def flag_hint(flag: str, command: str = "serve") -> str:
    """One line for a flag that is neither Hydra's nor a known habit: the key it may mean.

    bench-serve reads only ``server.*`` keys (its load is ``server.bench.*``), so its hints name no other; the other
    commands never read ``server.bench.*``.
    """
    if flag in NO_EQUIVALENT:
        return f"unknown flag {flag}: {NO_EQUIVALENT[flag]}"
    word = flag.lstrip("-").replace("-", "_")
    keys = [key for key in schema_keys()
            if (key.startswith("server.") if command == "bench-serve" else not key.startswith("server.bench."))]
    exact = [key for key in keys if key.rsplit(".", 1)[-1] == word]
    close = exact or difflib.get_close_matches(word, keys, n=3, cutoff=0.75) or [
        key for key in keys if difflib.get_close_matches(word, [key.rsplit(".", 1)[-1]], n=1, cutoff=0.8)]
    if close:
        options = " or ".join(f"{key}=VALUE" for key in close[:3])
        return f"unknown flag {flag}; corelib sets keys as key=value: did you mean {options}?"
    return (f"unknown flag {flag}; corelib sets keys as key=value (COMMAND --help lists them; Hydra's flags: "
            "--hydra-help)")


def schema_keys(schema: type = CorelibConfig, prefix: str = "") -> list[str]:
    """Every leaf key of the config schema, dotted (``server.port``)."""
    keys: list[str] = []
    hints = typing.get_type_hints(schema)
    for f in dataclasses.fields(schema):
        kind = hints[f.name]
        if dataclasses.is_dataclass(kind) and isinstance(kind, type):
            keys += schema_keys(kind, f"{prefix}{f.name}.")
        else:
            keys.append(f"{prefix}{f.name}")
    return keys
