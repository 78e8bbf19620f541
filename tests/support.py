"""Support for the tests: the CLI in a subprocess, fake installed distributions, fixture plugins."""

from __future__ import annotations

import importlib.metadata
import importlib.util
import os
import subprocess
import sys
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from types import ModuleType
from typing import TYPE_CHECKING

import forkrun
import pytest

if TYPE_CHECKING:
    import torch

    from corelib.engine import Engine, SamplingParams
    from corelib.models.llama import ModelWeights
    from corelib.ops import Ops
    from corelib.testing.op_cases import Case

FIXTURES = Path(__file__).parent / "fixtures"
PLUGIN_FIXTURES = FIXTURES / "plugins"
BROKEN_VENDOR = FIXTURES / "broken_vendor"
#: a small float32 model on the GPU's native runtime: the engine's GPU tests compare its tokens between paths
GPU_SMALL_FLOAT32 = ("backend=cuda", "backend.runtime=native", "model.hidden_size=512", "model.num_layers=4",
                     "model.num_heads=8", "model.num_kv_heads=4", "model.intermediate_size=1536", "model.dtype=float32",
                     "model.max_model_len=1024")

# Variables of the developer's shell that would change what the CLI does.
HERMETIC_VARIABLES = (
    "CORELIB_PLUGINS",
    "CORELIB_BLOCK_PLUGINS",
    "HYDRA_FULL_ERROR",
    "TORCH_DEVICE_BACKEND_AUTOLOAD",
)

# Entry points of the fixture plugins, by entry-point name.
FIXTURE_PLUGINS = {
    "toy": "corelib_toy.plugin",
    "broken": "corelib_oddities.broken",
    "second_cpu": "corelib_oddities.second_cpu",
    "misspelled_hook": "corelib_oddities.misspelled_hook",
    "no_backends": "corelib_oddities.no_backends",
    "wrong_type": "corelib_oddities.wrong_type",
    "foreign_config": "corelib_oddities.foreign_config",
    "badcaps": "corelib_oddities.badcaps",
    "evil": "corelib_oddities.evil",
    "exits": "corelib_oddities.exits",
    "interrupts": "corelib_oddities.interrupts",
    "hook_exits": "corelib_oddities.hook_exits",
    "sleeps": "corelib_oddities.sleeps",
    "gates": "corelib_oddities.gates",
    "clashing_gate": "corelib_oddities.clashing_gate",
}


def write_dist_info(
    site: Path, name: str, entry_points: Mapping[str, Mapping[str, str]], version: str = "0.1.0"
) -> Path:
    """Make ``site`` look like a site-packages holding distribution ``name`` with these entry points."""
    dist_info = site / f"{name.replace('-', '_')}-{version}.dist-info"
    dist_info.mkdir(parents=True)
    (dist_info / "METADATA").write_text(f"Metadata-Version: 2.1\nName: {name}\nVersion: {version}\n")
    sections = []
    for group, points in entry_points.items():
        sections.append(f"[{group}]\n" + "".join(f"{key} = {value}\n" for key, value in points.items()))
    (dist_info / "entry_points.txt").write_text("\n".join(sections))
    return site


def install_fixture_plugins(site: Path, *names: str) -> list[Path]:
    """A PYTHONPATH on which the named fixture plugins are installed (one distribution each)."""
    for name in names:
        write_dist_info(site, f"corelib-fixture-{name}", {"corelib.backends": {name: FIXTURE_PLUGINS[name]}})
    return [site, PLUGIN_FIXTURES]


def fixture_entry_points(*names: str) -> list[importlib.metadata.EntryPoint]:
    """In-process entry points of fixture plugins (needs PLUGIN_FIXTURES on sys.path)."""
    return [importlib.metadata.EntryPoint(n, FIXTURE_PLUGINS[n], "corelib.backends") for n in names]


def builtin_entry_points() -> list[importlib.metadata.EntryPoint]:
    return list(importlib.metadata.entry_points(group="corelib.backends"))


@dataclass(frozen=True)
class CliResult:
    returncode: int
    stdout: str
    stderr: str

    @property
    def error_lines(self) -> list[str]:
        return error_lines(self.stderr)


def every(keep: int, cases: Sequence[object], arguments: int = 1) -> list[object]:
    """``cases`` as parameters of which every ``keep``-th (the first included) runs in the default run and the
    rest with the long checks: for sweeps that run the CLI once a case, which CI runs whole (pytest -m long).
    ``arguments``: the parametrized names; past one, each case is the tuple of their values."""
    def value(case: object) -> tuple[object, ...]:
        return tuple(case) if arguments > 1 and isinstance(case, tuple) else (case,)

    return [case if i % keep == 0 else pytest.param(*value(case), marks=pytest.mark.long)
            for i, case in enumerate(cases)]


def error_lines(stderr: str) -> list[str]:
    """stderr without its status lines (``corelib: ...`` that are not errors): the errors, and anything stray."""
    return [line for line in stderr.splitlines()
            if line.strip() and (line.startswith("corelib: error:") or not line.startswith("corelib: "))]


def run_python(
    args: Sequence[str],
    cwd: Path,
    env: Mapping[str, str] | None = None,
    pythonpath: Sequence[Path] = (),
    timeout: float = 120,
) -> CliResult:
    """Run ``python ARGS`` as a fresh interpreter would, with a clean corelib-related environment.

    ``python -m MODULE`` is forked from a server that has imported torch (tests/forkrun.py says
    what it reproduces, and what still goes to a fresh interpreter).
    """
    full_env = {k: v for k, v in os.environ.items() if k not in HERMETIC_VARIABLES}
    paths = [str(p) for p in pythonpath]
    if full_env.get("PYTHONPATH"):
        paths.append(full_env["PYTHONPATH"])
    if paths:
        full_env["PYTHONPATH"] = os.pathsep.join(paths)
    full_env.update(env or {})
    if forkrun.eligible(args, full_env):  # two seconds less a run: torch is imported once per test process
        return CliResult(*forkrun.run_module(args, cwd, full_env, timeout))
    done = subprocess.run(
        [sys.executable, *args],
        cwd=cwd,
        env=full_env,
        capture_output=True,
        text=True,
        timeout=timeout,
        check=False,
    )
    return CliResult(done.returncode, done.stdout, done.stderr)


Cli = Callable[..., CliResult]


def assert_user_error(result: CliResult, *fragments: str, lines: int = 1, code: int = 2) -> None:
    """Exit ``code``, exactly ``lines`` lines on stderr, each a corelib error, no traceback."""
    assert result.returncode == code, f"exit {result.returncode}, stderr:\n{result.stderr}"
    assert "Traceback" not in result.stderr, result.stderr
    assert len(result.error_lines) == lines, f"expected {lines} line(s) on stderr:\n{result.stderr}"
    assert all(line.startswith("corelib: error: ") for line in result.error_lines), result.stderr
    for fragment in fragments:
        assert fragment in result.stderr, f"{fragment!r} not in:\n{result.stderr}"


EngineFactory = Callable[[Sequence[str]], "Engine"]
"""``make_engine(["backend=npu", ...])``: an engine closed after the test (fixture in conftest)."""


def local_weights(engine: Engine) -> ModelWeights:
    """The weights of an in-process engine's model (the plain reference runs on them)."""
    from corelib.models.llama import ModelWeights

    weights = getattr(engine.local_runner.model, "weights", None)
    if not isinstance(weights, ModelWeights):
        raise TypeError(f"{type(engine.local_runner.model).__name__} is not of the Llama family")
    return weights


def seeded_weights(overrides: Sequence[str]) -> ModelWeights:
    """The seeded random weights an engine built with ``overrides`` runs, on the CPU, for the reference.

    Built from the model config alone, not taken from an engine, so a test needs nothing of the
    engine's insides: Hugging Face tensors from ``random_state_dict``, or drawn tensor by tensor
    where ``model.init`` says so (``corelib.models.random_init``; the CPU is the device here).
    """
    import torch
    from omegaconf import OmegaConf

    from corelib.config.schema import CorelibConfig
    from corelib.models import random_init
    from corelib.models.llama import build_weights
    from corelib.models.random_init import random_state_dict
    from corelib.models.registry import model_shape
    from corelib.startup.compose import compose_config

    config = OmegaConf.to_object(compose_config(list(overrides)))
    assert isinstance(config, CorelibConfig), "the composed config must follow the schema"
    if config.model.path:
        raise ValueError("seeded_weights builds random weights; this config names a checkpoint (model.path)")
    shape = model_shape(config.model)
    if random_init.init_on_device(config.model, shape):
        return random_init.seeded_weights(shape, config.model.seed, torch.device("cpu"))
    return build_weights(shape, random_state_dict(shape, config.model.seed), torch.device("cpu"))


def reference_sampled(weights: ModelWeights, prompt: Sequence[int], sampling: SamplingParams,
                      eos: Sequence[int] = ()) -> list[int]:
    """What a request samples, computed one full forward per token by the plain reference.

    ``max_tokens`` tokens, or fewer where a stop id (``stop_token_ids``, and ``eos`` unless ``ignore_eos``)
    is sampled after ``min_tokens`` outputs. The tokens are drawn by ``samplerkit``, which shares no code
    with the engine's sampler: its penalties, cuts and noise (a function of the seed, the position
    of the new token and the token id, so the same draws follow from the reference logits) are
    written from their definitions, and a mistake in the engine's shows as a difference.
    """
    import torch
    from samplerkit import Sampling, sample

    from corelib.models.reference import reference_logits

    settings = Sampling.of(sampling, eos)
    stops = set(settings.stop_ids)
    output: list[int] = []
    assert sampling.max_tokens is not None, "the reference runs a request of a set length"
    with torch.inference_mode():
        for _ in range(sampling.max_tokens):
            output.append(sample(reference_logits(weights, [*prompt, *output]), prompt, output, settings))
            if output[-1] in stops and len(output) > sampling.min_tokens:
                break
    return output


def counted_sorts(monkeypatch: pytest.MonkeyPatch) -> list[int]:
    """The last dimension's width of every ``Tensor.sort`` from now on (a spy: each sort still runs)."""
    import torch

    widths: list[int] = []
    sort = torch.Tensor.sort

    def counted(self: torch.Tensor, *args: object, **kwargs: object) -> object:
        widths.append(self.shape[-1])
        return sort(self, *args, **kwargs)  # type: ignore[call-overload]

    monkeypatch.setattr(torch.Tensor, "sort", counted)
    return widths


BENCHMARKS = Path(__file__).resolve().parents[1] / "benchmarks"


def load_benchmark(name: str) -> ModuleType:
    """benchmarks/NAME.py imported as module NAME (registered in ``sys.modules``: a dataclass there looks its module
    up by name)."""
    script = BENCHMARKS / f"{name}.py"
    spec = importlib.util.spec_from_file_location(name, script)
    assert spec is not None and spec.loader is not None, f"cannot load {script}"
    module = importlib.util.module_from_spec(spec)
    sys.modules[name] = module
    spec.loader.exec_module(module)
    return module


def assert_weights_through_descriptors(ops: Ops, op: str, case: Case, device: torch.device,
                                       monkeypatch: pytest.MonkeyPatch) -> None:
    """``op`` on ``case`` with the tensor-core kernel at every row past the GEMV's and its weight tiles through TMA
    descriptors (``Tuning.gemm_tma``): the reference's results, and a descriptor made for every product but ROPE's
    (paired halves unstacked: a stacked tile's rows are not one run)."""
    import dataclasses

    from corelib_cuda.triton_ops import linear as projections
    from triton.tools.tensor_descriptor import TensorDescriptor

    from corelib.testing.op_conformance import assert_like_reference

    made: list[list[int]] = []

    class Spy(TensorDescriptor):  # type: ignore[misc]
        @staticmethod
        def from_tensor(tensor: torch.Tensor, block_shape: list[int]) -> TensorDescriptor:
            made.append(block_shape)
            return TensorDescriptor.from_tensor(tensor, block_shape)

    monkeypatch.setattr(projections, "TUNING", dataclasses.replace(projections.TUNING, gemm_max_m=1024, gemm_tma=True,
                                                                      gemm_paired_stacked=False))
    monkeypatch.setattr(projections, "TensorDescriptor", Spy)
    assert_like_reference(ops, case, device, f"{op} with its weight through a descriptor", op=op)
    assert bool(made) is (op != "norm_qkv_rope_kv_write"), made
