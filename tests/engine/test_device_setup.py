"""The device side's set-up is finished before the compute stream reads it.

Building an engine's device side zeroes the KV cache, the relays and the penalty counts, fills the token mask and
folds the norms into the weights, all on the building thread's current stream; on a native device nothing orders
that stream before the compute stream (torch's streams do not wait for its default one). So the build waits for
the device once, after the set-up and before the first warm-up, capture or step.
"""

from __future__ import annotations

from typing import Any

import pytest
import torch

from corelib.engine import Engine, SamplingParams
from corelib.platform.device import Device
from corelib.step.device_steps import DeviceSteps
from corelib.step.runner import ModelRunner


@pytest.mark.parametrize("capture", ["upfront", "lazy"])
def test_the_device_is_synchronized_after_its_set_up_and_before_its_first_device_work(
    monkeypatch: pytest.MonkeyPatch, capture: str
) -> None:
    log: list[str] = []
    zeros, synchronize = Device.zeros, Device.synchronize
    record, submit = ModelRunner._record, DeviceSteps.submit

    def spy_zeros(self: Device, shape: Any, dtype: torch.dtype) -> torch.Tensor:
        log.append("set-up")
        return zeros(self, shape, dtype)

    def spy_synchronize(self: Device, timeout: float | None = None) -> None:
        log.append("synchronize")
        synchronize(self, timeout)

    def spy_record(self: ModelRunner, *args: Any, **kwargs: Any) -> None:
        log.append("compute")
        record(self, *args, **kwargs)

    def spy_submit(self: DeviceSteps, *args: Any) -> Any:
        log.append("compute")
        return submit(self, *args)

    monkeypatch.setattr(Device, "zeros", spy_zeros)
    monkeypatch.setattr(Device, "synchronize", spy_synchronize)
    monkeypatch.setattr(ModelRunner, "_record", spy_record)
    monkeypatch.setattr(DeviceSteps, "submit", spy_submit)
    with Engine.from_overrides(["backend=npu", f"engine.graph_capture={capture}", "engine.max_num_seqs=2"]) as engine:
        [out] = engine.generate([[3, 4, 5]], SamplingParams(max_tokens=3, ignore_eos=True))
    assert len(out.output_token_ids) == 3
    first = log.index("compute")
    last_set_up = max(i for i, what in enumerate(log[:first]) if what == "set-up")
    assert "synchronize" in log[last_set_up:first], \
        f"the compute stream's first work came before the set-up was waited for: {log[: first + 1]}"
