"""Early materialization where the device stages a pageable source when the copy is issued (cuda): the stager
does that staging itself, into pinned buffers that belong to their steps until the steps are done.

The emulated cuda device plays the part: a copy from pinned memory reads its source when the stream runs it,
and a function launched on the polling stream holds the copies queued behind it for as long as a test wants.
"""

from __future__ import annotations

import functools
import threading
from collections.abc import Iterator

import pytest
import torch
from ringkit import Wired, decode_header, wire

from corelib.config.options import Staging
from corelib.errors import DeviceTimeout
from corelib.platform.device import Device
from corelib.plugins import PluginRegistry
from corelib.startup.compose import compose_config
from corelib.startup.start import start
from corelib.step.arena import ArenaLayout
from corelib.step.forward_input import ForwardInput
from corelib.step.layout import EngineLayout
from corelib.step.staging import EarlyStager, Staged, build_stager
from corelib.transport.wire import input_of


@pytest.fixture
def emulated_cuda() -> Iterator[tuple[Device, ArenaLayout]]:
    """The emulated cuda device, and the decode layout of a small engine."""
    startup = start(compose_config(["backend=cuda", "backend.runtime=emulated", "model.num_layers=1",
                                    "engine.max_num_seqs=4", "model.max_model_len=64"]), PluginRegistry())
    opened = startup.backend.open(startup.spec)
    yield opened, EngineLayout.of(startup.config).decode_layout
    opened.close()


def _pattern(step: int, layout: ArenaLayout) -> torch.Tensor:
    return torch.arange(layout.nbytes // 8, dtype=torch.int64) + 1000 * step


def _frame(wired: Wired, layout: ArenaLayout, step: int) -> tuple[ForwardInput, functools.partial[None]]:
    """Frame ``step`` written into the ring as the packer writes it, and read as a worker reads it."""
    arena = wired.producer.reserve()
    arena[: layout.nbytes].view(torch.int64).copy_(_pattern(step, layout))
    wired.producer.commit(decode_header(layout, step), layout.nbytes)
    consumer = wired.consumers[0]
    frame = consumer.read()
    return input_of(frame.header, frame.payload, "frame"), functools.partial(consumer.release, frame)


def test_each_step_owns_its_pinned_copy_of_the_slot_until_it_is_done(
    emulated_cuda: tuple[Device, ArenaLayout],
) -> None:
    device, layout = emulated_cuda
    wired = wire(num_slots=2, slot_bytes=layout.nbytes + 1024 + 64, timeout=5.0)
    stager = build_stager(Staging.early, device, device.stream("compute"), layout.nbytes, 2, timeout_s=0.2)
    assert isinstance(stager, EarlyStager) and stager.stages_itself
    gate = threading.Event()
    stager.stream.launch(lambda: gate.wait(30.0))  # the H2Ds queued behind it read their sources late
    staged: list[Staged] = []
    try:
        for step in range(2):
            staged.append(stager.receive(*_frame(wired, layout, step)))
        # Both ring slots are back (each frame was copied before its slot went): a third frame can come ...
        third = _frame(wired, layout, 2)
        # ... but both pinned copies belong to steps not done, whose H2Ds have not read them yet.
        with pytest.raises(DeviceTimeout, match="pinned early staging"):
            stager.receive(*third)
        gate.set()
        device.synchronize()
        for step, done in enumerate(staged):
            assert torch.equal(done.source.view(torch.int64).cpu(), _pattern(step, layout)), f"step {step}'s inputs"
        staged[0].release()  # its step is done: its pinned copy serves the next frame
        staged.append(stager.receive(*third))
        device.synchronize()
        assert torch.equal(staged[2].source.view(torch.int64).cpu(), _pattern(2, layout))
    finally:
        gate.set()
        device.synchronize()
        for done in staged:
            done.release()
        stager.close()
        wired.close()


@pytest.mark.parametrize(("overrides", "registered", "stages"), [
    (["backend=cuda", "backend.runtime=emulated"], False, True),
    (["backend=cuda", "backend.runtime=emulated"], True, False),  # engine.shm.register_host: the slot as it is
    (["backend=mlu"], False, True),
    (["backend=npu"], False, False),  # the npu's copies read their source when they run: the hazard early shows
])
def test_the_early_stager_stages_a_slot_itself_only_where_the_device_would(overrides: list[str], registered: bool,
                                                                           stages: bool) -> None:
    startup = start(compose_config([*overrides, "model.num_layers=1"]), PluginRegistry())
    opened = startup.backend.open(startup.spec)
    try:
        stager = build_stager(Staging.early, opened, opened.stream("compute"), 4096, 2, 1.0, registered=registered)
        assert isinstance(stager, EarlyStager) and stager.stages_itself is stages
        stager.close()
    finally:
        opened.close()


@pytest.mark.slow  # two engines, one of them over SHM
def test_early_over_shm_on_cuda_gives_the_tokens_of_sync_in_process() -> None:
    from corelib.engine import Engine, SamplingParams

    base = ["backend=cuda", "backend.runtime=emulated", "backend.emulator.chaos=0.3", "engine.max_num_seqs=4"]
    prompts = [[5, 6, 7], list(range(10, 40)), [100] * 5, [3, 4], list(range(200, 217))]
    params = SamplingParams(max_tokens=16, ignore_eos=True)
    with Engine.from_overrides([*base, "engine.transport=shm", "engine.async_token_handoff=on"]) as engine:
        assert engine.options.staging is Staging.early, "materialization=auto keeps cuda on the early path"
        early = [out.output_token_ids for out in engine.generate(prompts, params)]
    with Engine.from_overrides([*base, "engine.async_token_handoff=off"]) as engine:
        sync = [out.output_token_ids for out in engine.generate(prompts, params)]
    assert early == sync
