"""The pdl gate: what the cuda probe narrows, what plan shows, and how the choice reaches the provider."""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any, cast

import pytest
from corelib_cuda.backend import CUDABackend
from corelib_cuda.triton_ops import TritonOps
from omegaconf import OmegaConf

from corelib.config.features import evaluate
from corelib.config.options import EngineOptions
from corelib.config.schema import CorelibConfig
from corelib.models import model_facts
from corelib.ops import load_provider
from corelib.platform.device import Capabilities, Device
from corelib.plugins import PluginRegistry
from corelib.startup.compose import compose_config
from corelib.startup.start import start


class FakeCuda:
    """torch.cuda as far as the probe's narrowing reads it."""

    def __init__(self, capability: tuple[int, int]) -> None:
        self.capability = capability

    def get_device_capability(self, index: int) -> tuple[int, int]:
        return self.capability


@pytest.mark.parametrize(("capability", "narrowed"),
                         [((8, 0), True), ((8, 9), True), ((9, 0), False), ((10, 0), False)])
def test_the_cuda_probe_narrows_programmatic_launch_below_compute_capability_9(
    monkeypatch: pytest.MonkeyPatch, capability: tuple[int, int], narrowed: bool
) -> None:
    monkeypatch.setattr(TritonOps, "pdl_missing", lambda self: None)
    narrow = CUDABackend()._narrow(FakeCuda(capability))
    assert ("programmatic_launch" in narrow) is narrowed
    assert "programmatic_launch_kernels" not in narrow


def test_the_cuda_probe_narrows_the_kernels_where_triton_cannot_launch_them_so(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(TritonOps, "pdl_missing", lambda self: "Triton 3.2.0 lacks gdc_wait")
    assert CUDABackend()._narrow(FakeCuda((9, 0)))["programmatic_launch_kernels"] is False


def test_pdl_missing_names_what_the_installed_triton_lacks(monkeypatch: pytest.MonkeyPatch) -> None:
    pytest.importorskip("triton", reason="Triton is not installed")
    import triton.language as tl

    monkeypatch.setattr(TritonOps, "available", lambda self: None)
    assert TritonOps().pdl_missing() is None, "Triton 3.3 and newer have gdc_wait and launch_pdl"
    monkeypatch.delattr(tl.extra.cuda, "gdc_wait")
    reason = TritonOps().pdl_missing()
    assert reason is not None and "gdc_wait" in reason and "\n" not in reason


def test_the_emulator_has_no_programmatic_launch_and_the_plan_says_why() -> None:
    startup = start(compose_config(["backend=cuda", "backend.runtime=emulated"]), PluginRegistry())
    assert not startup.spec.capabilities.programmatic_launch
    assert not startup.spec.capabilities.programmatic_launch_kernels
    decision = startup.plan.decisions["pdl"]
    assert not decision.enabled and not startup.options.pdl
    assert any("capabilities.programmatic_launch is false" in reason for reason in decision.reasons)


def _options(*overrides: str) -> EngineOptions:
    cfg = compose_config(["backend=cuda", *overrides])
    typed = OmegaConf.to_object(cfg)
    assert isinstance(typed, CorelibConfig)
    declared = cast(dict[str, Any], OmegaConf.to_container(cfg.backend.capabilities))
    plan = evaluate(cfg.features, cfg, declared, model_facts(typed.model))
    return EngineOptions.from_startup(typed, plan, Capabilities(**declared), TritonOps())


def test_the_options_carry_pdl_only_with_fused_ops() -> None:
    assert _options().pdl
    assert not _options("engine.pdl=off").pdl
    assert not _options("engine.fused_ops=off").pdl


def test_the_options_fold_the_norms_only_with_the_fused_norm_ops() -> None:
    # The Triton provider declares folded_norms: the engine folds where its fused norm ops run, never without them.
    assert _options().fold_norms
    assert not _options("engine.fused_ops=off").fold_norms


class RecordingProvider:
    name = "recording"
    live_blocks_only = True
    folded_norms = False

    def __init__(self) -> None:
        self.calls: list[dict[str, Any]] = []

    def available(self) -> str | None:
        return None

    def op_names(self) -> tuple[str, ...]:
        return ()

    def load(self, device: Device, **settings: Any) -> Mapping[str, object]:
        self.calls.append(settings)
        return {}


def test_the_provider_is_loaded_with_pdl_only_when_the_gate_holds() -> None:
    provider = RecordingProvider()
    device = cast(Device, None)
    load_provider(provider, device, False)
    load_provider(provider, device, True)
    assert provider.calls == [{}, {"pdl": True}], "a provider without PDL is never asked for it"
