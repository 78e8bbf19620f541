"""vLLM's command-line habits: a positional model, --port and friends, --version, hints for other flags."""

from __future__ import annotations

from pathlib import Path

import pytest
from support import Cli

from corelib import __version__
from corelib.cli.habits import FLAG_KEYS, SWITCHES, flag_hint, flags_help, habit_arguments, schema_keys
from corelib.cli.hydra_app import HYDRA_FLAGS, takes_value
from corelib.cli.main import main
from corelib.errors import ConfigError


def habits(*args: str, command: str = "serve", warn: list[str] | None = None) -> list[str]:
    return habit_arguments(list(args), HYDRA_FLAGS, takes_value, command,
                           warn=None if warn is None else warn.append)


def test_vllm_flags_map_onto_their_keys() -> None:
    assert habits("tiny", "--port", "8001", "--host=0.0.0.0", "--api-key", "k", "--max-model-len", "256",
                  "--dtype", "bfloat16", "--max-num-seqs", "8", "--served-model-name", "my model",
                  "--enforce-eager") == [
        "model=tiny", "server.port=8001", "server.host=0.0.0.0", "server.api_key=k", "model.max_model_len=256",
        "model.dtype=bfloat16", "engine.max_num_seqs=8", "server.served_model_name='my model'", "engine.graph=off",
    ]


def test_tensor_parallelism_runs_over_shared_memory_unless_the_transport_is_given() -> None:
    assert habits("--tensor-parallel-size", "2") == ["engine.tp=2", "engine.transport=shm"]
    assert habits("-tp", "2", "engine.transport=inproc") == ["engine.tp=2", "engine.transport=inproc"]
    assert habits("--tensor-parallel-size=1") == ["engine.tp=1"]


def test_the_model_is_a_preset_a_directory_or_a_hub_id(tmp_path: Path) -> None:
    assert habits("small-0.6b") == ["model=small-0.6b"]
    assert habits(str(tmp_path), "backend=cpu") == [f"model.path={tmp_path}", "backend=cpu"]
    assert habits("--model", "Qwen/Qwen3-0.6B") == ["model.path=Qwen/Qwen3-0.6B"]


def test_hydra_flags_and_their_values_pass_untouched() -> None:
    assert habits("--cfg", "job", "tiny", "-m", "backend=cpu,npu") == ["--cfg", "job", "model=tiny", "-m",
                                                                       "backend=cpu,npu"]
    assert habits("--info", "config", "tiny") == ["--info", "config", "model=tiny"]
    assert habits("~engine.shm") == ["~engine.shm"]


@pytest.mark.parametrize(("args", "says"), [
    (["/path/to/model"], "model '/path/to/model' is neither a preset"),
    (["tiny", "small-0.6b"], "two models given ('tiny' and 'small-0.6b')"),
    (["--port"], "--port needs a value: --port VALUE (or server.port=VALUE)"),
    (["--temperature", "0.5"], "did you mean workload.temperature=VALUE or bench.temperature=VALUE?"),
    (["--tokenizer", "x"], "the tokenizer is the checkpoint's tokenizer.json"),
    (["--frobnicate"], "corelib sets keys as key=value"),
    (["workload.prompts=[Hello, world]"], "'Hello' is not quoted, so a comma would split a prompt in two"),
])
def test_what_cannot_be_mapped_is_one_line_naming_the_key(args: list[str], says: str) -> None:
    with pytest.raises(ConfigError) as refused:
        habits(*args)
    assert says in str(refused.value) and "\n" not in str(refused.value)


def test_quoted_prompts_with_commas_are_one_prompt_each() -> None:
    given = """workload.prompts=["Hello, world", 'a, b']"""
    assert habits(given) == [given]
    assert habits("workload.prompts=[hello]") == ["workload.prompts=[hello]"], "one element cannot be split"


def test_a_hint_names_the_closest_keys() -> None:
    assert flag_hint("--num-kv-blocks").endswith("did you mean engine.num_kv_blocks=VALUE?")
    assert "engine.block_size=VALUE" in flag_hint("--block_size")


@pytest.mark.parametrize("args", [["--version"], ["-V"], ["run", "--version"], ["serve", "tiny", "--version"]])
def test_version(args: list[str], capsys: pytest.CaptureFixture[str]) -> None:
    assert main(args) == 0
    assert capsys.readouterr().out == f"corelib {__version__}\n"


def test_serve_a_path_that_is_not_a_model_is_one_line_before_anything_loads(
    capsys: pytest.CaptureFixture[str],
) -> None:
    assert main(["serve", "/path/to/model", "--port", "8001"]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and err.startswith("corelib: error: model '/path/to/model' is neither a preset")
    assert "antlr" not in err.lower() and "Traceback" not in err


def test_the_launch_flags_vllm_users_pass_map_onto_their_keys() -> None:
    assert habits("--gpu-memory-utilization", "0.9", "--seed", "0", "--enable-prefix-caching",
                  "--no-enable-chunked-prefill", "--disable-log-requests") == [
        "engine.gpu_memory_utilization=0.9", "server.seed=0", "engine.prefix_caching=on",
        "engine.chunked_prefill=off", "server.access_log=false"]
    assert habits("--no-enable-prefix-caching", "--enable-chunked-prefill") == [
        "engine.prefix_caching=off", "engine.chunked_prefill=on"]
    assert habits("--seed=3", command="run") == ["workload.seed=3"], "run's requests come from its workload"


def test_every_key_a_flag_names_exists_but_the_pending_ones() -> None:
    keys = set(schema_keys())
    named = {key for key in FLAG_KEYS.values() if key != "model"}
    named |= {o.split("=")[0] for overrides in SWITCHES.values() for o in overrides}
    assert named - keys <= {"engine.gpu_memory_utilization"}


def test_trust_remote_code_is_one_warning_and_the_launch_goes_on() -> None:
    said: list[str] = []
    assert habits("tiny", "--trust-remote-code", "--port", "0", warn=said) == ["model=tiny", "server.port=0"]
    assert len(said) == 1 and said[0].startswith("--trust-remote-code is ignored: corelib never runs")


def test_bench_serve_takes_the_flags_of_vllm_bench_serve() -> None:
    assert habits("--request-rate", "4", "--num-prompts", "20", "--random-input-len", "64",
                  "--random-output-len", "32", "--dataset-name", "random", "--seed", "1", "--save-result",
                  command="bench-serve", warn=[]) == [
        "server.bench.concurrency=[]", "server.bench.rates=[4]", "server.bench.num_requests=20",
        "server.bench.prompt_len=64", "server.bench.output_len=32", "server.bench.seed=1"]
    assert habits("--max-concurrency", "8", "--model", "m", "--request-rate=inf", command="bench-serve") == [
        "server.bench.concurrency=[8]", "server.bench.model=m", "server.bench.rates=[inf]"]
    assert habits("--temperature", "1.0", "--top-p", "0.9", "--top-k", "20", "--min-p", "0.05",
                  command="bench-serve") == ["server.bench.temperature=1.0", "server.bench.top_p=0.9",
                                             "server.bench.top_k=20", "server.bench.min_p=0.05"]
    with pytest.raises(ConfigError, match=r"^--dataset-name sharegpt: bench-serve takes random only"):
        habits("--dataset-name", "sharegpt", command="bench-serve")


def test_a_bench_serve_hint_names_only_keys_bench_serve_reads() -> None:
    hint = flag_hint("--output-len", "bench-serve")
    assert "server.bench.output_len=VALUE" in hint and "workload." not in hint
    assert "workload." not in flag_hint("--temperature", "bench-serve")


def test_help_lists_model_and_every_flag() -> None:
    text = flags_help("serve")
    for flag in [*FLAG_KEYS, *SWITCHES, "--trust-remote-code"]:
        assert f"  {flag} " in text
    assert "--request-rate VALUE" in flags_help("bench-serve") and "--enable-prefix-caching" not in flags_help(
        "bench-serve")


def test_serve_help_lists_model_and_the_flags_it_takes(cli: Cli) -> None:
    result = cli("serve", "--help")
    assert result.returncode == 0, result.stderr
    assert "usage: python -m corelib serve [MODEL] [--flag VALUE ...]" in result.stdout
    assert "MODEL: a preset" in result.stdout
    for flag, key in (("--gpu-memory-utilization VALUE", "engine.gpu_memory_utilization"),
                      ("--enable-prefix-caching", "engine.prefix_caching=on"), ("--seed VALUE", "server.seed")):
        assert any(flag in line and key in line for line in result.stdout.splitlines()), flag
