"""Graph capture, replay and update on the stream emulator, and its seeded chaos."""

from __future__ import annotations

import time
from collections.abc import Callable

import pytest
import torch

from corelib.config.schema import EmulatorConfig
from corelib.errors import ConfigError, UnsupportedOperation
from corelib.platform.emulator import EmulatedDevice
from corelib.platform.emulator.ops import LaunchOp
from corelib.platform.emulator.stream_thread import Pacer

OpenDevice = Callable[..., EmulatedDevice]


def test_captured_copy_reads_its_pinned_source_at_each_replay(emulated: OpenDevice) -> None:
    device = emulated("npu")
    stream = device.stream("graph")
    staging = device.host_empty((4,), torch.float32, pinned=True)
    static_in, static_out = device.zeros((4,), torch.float32), device.zeros((4,), torch.float32)
    graph = device.graph("h2d-then-square")

    def body() -> None:
        stream.copy(static_in, staging)
        stream.launch(lambda: torch.mul(static_in, static_in, out=static_out))

    staging.fill_(-1.0)
    graph.capture(body, stream)
    results = []
    for value in (2.0, 3.0):
        staging.fill_(value)
        graph.replay(stream)
        stream.synchronize()
        results.append(static_out[0].item())
    assert results == [4.0, 9.0]


def test_capture_refuses_what_the_profile_cannot_capture(emulated: OpenDevice) -> None:
    device = emulated("cuda")
    stream, other = device.stream("graph"), device.stream("other")
    x = device.zeros((4,), torch.float32)
    pageable = torch.ones(4)
    for body, what in (
        (lambda: stream.copy(x, pageable), "pageable"),
        (lambda: stream.record(device.event()), "record"),
        (lambda: stream.wait(other.record(device.event())), "wait"),
        (stream.synchronize, "record"),
    ):
        with pytest.raises(UnsupportedOperation, match=what):
            device.graph().capture(body, stream)
    stream.launch(lambda: x.add_(1.0))  # the failed captures left the stream usable
    stream.synchronize()
    assert x.tolist() == [1.0] * 4


def test_other_streams_keep_running_during_a_capture(emulated: OpenDevice) -> None:
    device = emulated("npu")
    capturing, other = device.stream("capturing"), device.stream("other")
    ran: list[str] = []
    graph = device.graph()

    def body() -> None:
        capturing.launch(lambda: ran.append("captured"))
        other.launch(lambda: ran.append("other"))  # not the capture stream: it runs for real
        other.synchronize()

    graph.capture(body, capturing)
    assert ran == ["other"]
    graph.replay(capturing)
    capturing.synchronize()
    assert ran == ["other", "captured"]


def test_graph_update_refuses_unknown_parameters(emulated: OpenDevice) -> None:
    device = emulated("npu")
    stream = device.stream("graph")
    graph = device.graph()
    graph.capture(lambda: stream.launch(lambda: None), stream, params={"num_tokens": 1})
    with pytest.raises(KeyError, match="num_toknes"):
        graph.update(stream, num_toknes=2)


def test_chaos_delays_are_reproducible_per_seed_and_stream(monkeypatch: pytest.MonkeyPatch) -> None:
    slept: list[float] = []
    monkeypatch.setattr(time, "sleep", slept.append)

    def delays(seed: int, stream: str) -> list[float]:
        slept.clear()
        pacer = Pacer(EmulatorConfig(chaos=0.5, chaos_max_ms=2.0, seed=seed), stream)
        for _ in range(200):
            pacer.before(LaunchOp(lambda: None))
        return list(slept)

    first = delays(7, "prepare")
    assert first == delays(7, "prepare"), "same seed and stream: same delays"
    assert first != delays(8, "prepare") and first != delays(7, "compute")
    assert 60 < len(first) < 140, "about half of the operations are delayed"
    assert all(0.0 < delay <= 0.002 for delay in first)


@pytest.mark.parametrize(
    ("setting", "key"),
    [({"chaos": 1.5}, "chaos"), ({"chaos_max_ms": 0.0}, "chaos_max_ms"), ({"copy_gb_per_s": -1.0}, "copy")],
)
def test_bad_emulator_settings_name_their_key(
    emulated: OpenDevice, setting: dict[str, float], key: str
) -> None:
    with pytest.raises(ConfigError, match=key):
        emulated("npu", **setting)


def test_chaos_keeps_stream_order(emulated: OpenDevice) -> None:
    device = emulated("npu", chaos=1.0, chaos_max_ms=0.5, seed=3)
    x = device.zeros((1,), torch.int64)
    a, b = device.stream("a"), device.stream("b")
    for k in range(1, 8):
        a.launch(lambda k=k: x.mul_(3).add_(k))  # type: ignore[misc]
    b.wait(a.record(device.event()))
    b.launch(lambda: x.add_(1000))
    b.synchronize()
    expected = 0
    for k in range(1, 8):
        expected = expected * 3 + k
    assert x.item() == expected + 1000
