"""The cuda, npu and mlu plugins without their hardware: probes, runtime choice, and the native
code paths driven through a recording stand-in for a torch device module."""

from __future__ import annotations

import itertools
import os
import sys
import threading
import time
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

import pytest
import torch

from corelib.config.schema import BackendConfig, RuntimeMode
from corelib.errors import BackendUnavailable, DeviceError
from corelib.platform.backend import Backend, resolve_runtime
from corelib.platform.device import Capabilities, Runtime
from corelib.plugins import PluginRegistry

NPU_CAPABILITIES = Capabilities(
    streams=True,
    events=True,
    event_query=True,
    event_timing=True,
    blocking_sync=True,
    graphs=True,
    graph_param_update=True,
    pinned_host=True,
    host_register=True,
    async_d2h=True,
    pageable_h2d_is_staged=False,
    comm_backend="hccl",
)


def _backend(name: str) -> Backend:
    return PluginRegistry().get(name)


def _config(name: str, runtime: RuntimeMode, capabilities: Capabilities = NPU_CAPABILITIES) -> BackendConfig:
    return BackendConfig(name=name, runtime=runtime, capabilities=capabilities.as_dict())


# -- a stand-in for torch_npu, recording what the plugin asks of it ---------------------------


class Recorder:
    def __init__(self) -> None:
        self.calls: list[tuple[object, ...]] = []
        self.current: list[FakeStream] = []
        self.ids = itertools.count()

    def log(self, *call: object) -> None:
        self.calls.append(call)

    def names(self) -> list[object]:
        return [call[0] for call in self.calls]


class FakeStream:
    def __init__(self, recorder: Recorder, device: object = None, priority: int = 0) -> None:
        self.recorder, self.id = recorder, f"stream{next(recorder.ids)}"

    def query(self) -> bool:
        return True

    def wait_stream(self, other: FakeStream) -> None:
        self.recorder.log("wait_stream", self.id, other.id)


class FakeEvent:
    def __init__(self, recorder: Recorder) -> None:
        self.recorder, self.id = recorder, f"event{next(recorder.ids)}"

    def record(self, stream: FakeStream) -> None:
        self.recorder.log("event.record", self.id, stream.id)

    def wait(self, stream: FakeStream) -> None:
        self.recorder.log("event.wait", self.id, stream.id)

    def reset(self, stream: FakeStream) -> None:
        self.recorder.log("external.reset", self.id, stream.id)

    def query(self) -> bool:
        return True

    def elapsed_time(self, end: FakeEvent) -> float:
        return 1.5


class FakeGraph:
    def __init__(self, recorder: Recorder) -> None:
        self.recorder = recorder

    def replay(self) -> None:
        self.recorder.log("replay", self.recorder.current[-1].id)

    def reset(self) -> None:
        self.recorder.log("graph.reset")


class FakeNpurt:
    def __init__(self, recorder: Recorder) -> None:
        self.recorder = recorder

    def npuHostRegister(self, ptr: int, size: int, flags: int) -> int:  # noqa: N802 - vendor name
        self.recorder.log("npuHostRegister", size, flags)
        return 107000 if size == 12345 * 4 else 0  # ACL_ERROR_RT_PARAM_INVALID for one odd size

    def npuHostUnregister(self, ptr: int) -> int:  # noqa: N802 - vendor name
        self.recorder.log("npuHostUnregister")
        return 0


class FakeNpuCore:
    """What every torch_npu has: the torch.cuda-like module ``torch_npu.npu``."""

    def __init__(self, recorder: Recorder) -> None:
        self.recorder = recorder
        self.default = FakeStream(recorder)
        recorder.current.append(self.default)
        self.visible = 1

    def Stream(self, device: object = None, priority: int = 0) -> FakeStream:  # noqa: N802 - vendor name
        return FakeStream(self.recorder, device, priority)

    def Event(self, enable_timing: bool = False, blocking: bool = False) -> FakeEvent:  # noqa: N802
        return FakeEvent(self.recorder)

    def NPUGraph(self) -> FakeGraph:  # noqa: N802 - vendor name
        return FakeGraph(self.recorder)

    @contextmanager
    def stream(self, target: FakeStream) -> Iterator[None]:
        self.recorder.current.append(target)
        try:
            yield
        finally:
            self.recorder.current.pop()

    @contextmanager
    def device(self, index: int) -> Iterator[None]:
        yield

    @contextmanager
    def graph(
        self, g: FakeGraph, pool: object, stream: FakeStream, capture_error_mode: str
    ) -> Iterator[None]:
        self.recorder.log("capture_begin", stream.id, capture_error_mode)
        with self.stream(stream):
            yield
        self.recorder.log("capture_end", stream.id)

    def graph_pool_handle(self) -> tuple[str]:
        return ("pool",)

    def device_count(self) -> int:
        return self.visible

    def memory_allocated(self, index: int) -> int:
        return 0

    def current_stream(self, index: int) -> FakeStream:
        return self.recorder.current[-1]

    def default_stream(self, index: int) -> FakeStream:
        return self.default


class FakeNpu(FakeNpuCore):
    """A torch_npu recent enough for graph task update and host registration."""

    def ExternalEvent(self) -> FakeEvent:  # noqa: N802 - vendor name
        return FakeEvent(self.recorder)

    def graph_task_group_begin(self, stream: FakeStream) -> None:
        self.recorder.log("group_begin", stream.id)

    def graph_task_group_end(self, stream: FakeStream) -> str:
        self.recorder.log("group_end", stream.id)
        return "handle"

    def graph_task_update_begin(self, stream: FakeStream, handle: str) -> None:
        self.recorder.log("update_begin", stream.id, handle)

    def graph_task_update_end(self, stream: FakeStream) -> None:
        self.recorder.log("update_end", stream.id)

    def npurt(self) -> FakeNpurt:
        return FakeNpurt(self.recorder)


class FakeTorchNpu:
    __version__ = "2.13.0.fake"

    def __init__(self, npu: FakeNpuCore) -> None:
        self.npu = npu


def install(monkeypatch: pytest.MonkeyPatch, npu: FakeNpuCore) -> None:
    monkeypatch.setitem(sys.modules, "torch_npu", FakeTorchNpu(npu))
    monkeypatch.setitem(sys.modules, "torch_npu.npu", npu)


@pytest.fixture
def recorder(monkeypatch: pytest.MonkeyPatch) -> Recorder:
    if torch._C._get_privateuse1_backend_name() not in ("privateuseone", "npu"):
        pytest.skip("another device extension owns torch's PrivateUse1 device type")
    # What importing torch_npu does first: name PrivateUse1 "npu", so torch.device("npu") exists.
    torch.utils.rename_privateuse1_backend("npu")  # type: ignore[attr-defined]
    recorder = Recorder()
    install(monkeypatch, FakeNpu(recorder))
    return recorder


# -- runtime choice ---------------------------------------------------------------------------


def test_cuda_without_a_gpu_falls_back_refuses_or_is_forced() -> None:
    if torch.cuda.is_available():
        pytest.skip("a GPU is present: the native runtime is chosen")
    backend = _backend("cuda")
    auto = resolve_runtime(backend, _config("cuda", RuntimeMode.auto), 5.0)
    assert auto.spec.runtime is Runtime.emulated
    assert "stream emulator" in auto.message and "no CUDA device" in auto.message
    with pytest.raises(BackendUnavailable, match="native refused"):
        resolve_runtime(backend, _config("cuda", RuntimeMode.native), 5.0)
    forced = resolve_runtime(backend, _config("cuda", RuntimeMode.emulated), 5.0)
    assert forced.spec.runtime is Runtime.emulated


def test_a_torch_npu_that_cannot_load_becomes_the_reason(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    package = tmp_path / "torch_npu"
    package.mkdir()
    (package / "__init__.py").write_text(
        "raise OSError('libhccl.so: cannot open shared object file: No such file or directory')\n"
    )
    monkeypatch.syspath_prepend(str(tmp_path))
    monkeypatch.delitem(sys.modules, "torch_npu", raising=False)
    availability = _backend("npu").probe()
    assert not availability.native
    assert "libhccl.so" in availability.reason and "torch_npu" in availability.reason
    resolution = resolve_runtime(_backend("npu"), _config("npu", RuntimeMode.auto), 5.0)
    assert resolution.spec.runtime is Runtime.emulated and "libhccl.so" in resolution.message


def test_npu_probe_narrows_what_the_installed_torch_npu_lacks(monkeypatch: pytest.MonkeyPatch) -> None:
    npu = FakeNpuCore(Recorder())
    install(monkeypatch, npu)
    monkeypatch.setenv("ASCEND_RT_VISIBLE_DEVICES", "3")
    availability = _backend("npu").probe()
    assert availability.native and "ASCEND_RT_VISIBLE_DEVICES='3'" in availability.reason
    assert dict(availability.narrow) == {"graph_param_update": False, "host_register": False}
    assert os.environ["ASCEND_RT_VISIBLE_DEVICES"] == "3", "the probe never rewrites the visible devices"
    npu.visible = 0
    assert "sees no NPU" in _backend("npu").probe().reason


def test_npu_device_index_counts_within_the_visible_devices(recorder: Recorder) -> None:
    config = _config("npu", RuntimeMode.native)
    config.device_index = 1
    spec = resolve_runtime(_backend("npu"), config, 5.0).spec
    with pytest.raises(BackendUnavailable, match="ASCEND_RT_VISIBLE_DEVICES"):
        _backend("npu").open(spec)


# -- native code paths, through the stand-in --------------------------------------------------


def test_native_npu_graph_update_follows_the_task_update_protocol(recorder: Recorder) -> None:
    spec = resolve_runtime(_backend("npu"), _config("npu", RuntimeMode.native), 5.0).spec
    with _backend("npu").open(spec) as device:
        compute = device.stream("compute")
        launched_on: list[object] = []
        graph = device.graph("decode")

        def step() -> None:
            launched_on.append((recorder.current[-1].id, graph.params["num_tokens"]))

        graph.capture(lambda: compute.launch(step), compute, params={"num_tokens": 4})
        capture_stream = recorder.calls[[c[0] for c in recorder.calls].index("capture_begin")][1]
        assert recorder.names()[:5] == [
            "capture_begin",
            "event.wait",
            "external.reset",
            "group_begin",
            "group_end",
        ]
        graph.replay(compute)  # no update pending: the captured ExternalEvent wait is released first
        assert recorder.names()[-2:] == ["event.record", "replay"]
        del recorder.calls[:]
        graph.update(compute, num_tokens=9)
        names = recorder.names()
        assert names == ["wait_stream", "update_begin", "update_end", "event.record"]
        update_stream = recorder.calls[1][1]
        assert update_stream != capture_stream, "torch_npu requires a separate update stream"
        assert launched_on[-1] == (update_stream, 9), "the re-issued work goes to the update stream"
        del recorder.calls[:]
        graph.replay(compute)
        assert recorder.names() == ["replay"], "the update already released the captured wait"


def test_native_host_registration_checks_the_vendor_status(recorder: Recorder) -> None:
    spec = resolve_runtime(_backend("npu"), _config("npu", RuntimeMode.native), 5.0).spec
    with _backend("npu").open(spec) as device:
        with pytest.raises(DeviceError, match="ACL_ERROR_RT_PARAM_INVALID"):
            device.register_host(torch.zeros(12345))
        assert device.memory_stats().registered_bytes == 0, "a failed registration is not counted"
        buffer = torch.zeros(1024)
        registration = device.register_host(buffer)
        assert device.memory_stats().registered_bytes == 4096
        registration.close()
        assert recorder.names()[-1] == "npuHostUnregister"
        event_a, event_b = device.event(timing=True), device.event(timing=True)
        stream = device.stream("s")
        stream.record(event_a)
        stream.record(event_b)
        event_b.synchronize(timeout=0.1)
        assert event_a.elapsed_ms(event_b) == 1.5


class LateEvent(FakeEvent):
    """A vendor event still pending until the vendor's blocking synchronize() is called (and returns)."""

    def __init__(self, recorder: Recorder) -> None:
        super().__init__(recorder)
        self.synchronized_on: list[str] = []

    def query(self) -> bool:
        return bool(self.synchronized_on)

    def synchronize(self) -> None:
        self.synchronized_on.append(threading.current_thread().name)


def test_a_long_native_event_wait_is_the_vendors_blocking_wait_never_a_sleep(
    recorder: Recorder, monkeypatch: pytest.MonkeyPatch
) -> None:
    slept: list[float] = []
    monkeypatch.setattr(time, "sleep", slept.append)
    spec = resolve_runtime(_backend("npu"), _config("npu", RuntimeMode.native), 5.0).spec
    with _backend("npu").open(spec) as device:
        event = device.event(blocking=True, name="tokens")
        late = LateEvent(recorder)
        event._native = late  # type: ignore[attr-defined]
        device.stream("d2h").record(event)
        event.synchronize(timeout=5.0)  # past the spin, the wait is handed to the vendor's synchronize()
        assert late.synchronized_on and late.synchronized_on[0] != threading.current_thread().name, (
            "the vendor's wait cannot time out, so it runs on a helper thread while this one waits, bounded")
        assert slept == [], f"the event wait slept fixed times: {slept[:5]}"


def test_closing_a_native_device_joins_its_blocking_wait_helper(recorder: Recorder) -> None:
    before = set(threading.enumerate())
    spec = resolve_runtime(_backend("npu"), _config("npu", RuntimeMode.native), 5.0).spec
    with _backend("npu").open(spec) as device:
        event = device.event(blocking=True, name="tokens")
        event._native = LateEvent(recorder)  # type: ignore[attr-defined]
        device.stream("d2h").record(event)
        event.synchronize(timeout=5.0)  # starts the helper thread
        assert any(t.name.endswith("-blocking") for t in set(threading.enumerate()) - before)
    assert [t.name for t in set(threading.enumerate()) - before] == [], "close() returned before its helper ended"
