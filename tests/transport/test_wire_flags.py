"""The flags a frame carries survive the trip through its packed header, in every combination."""

from __future__ import annotations

import itertools

import pytest

from corelib.transport.wire import (
    HEADER_BYTES,
    FrameHeader,
    FrameKind,
    InputFlags,
    ResultFlags,
    WireResult,
    decode_result,
    encode_result,
    result_header,
)


def through_the_wire(header: FrameHeader) -> FrameHeader:
    buffer = memoryview(bytearray(HEADER_BYTES))
    header.pack_into(buffer)
    return FrameHeader.unpack_from(buffer, "test frame")


@pytest.mark.parametrize(("graph", "decode"), list(itertools.product([False, True], repeat=2)))
def test_a_result_says_whether_it_replayed_a_graph_and_whether_it_decoded(graph: bool, decode: bool) -> None:
    sent = WireResult(7, decode, graph, [3, 1, 4], 1.5, None, 20.0)
    got = decode_result(through_the_wire(result_header(sent, sent_at=1.0)), encode_result(sent))
    assert (got.graph, got.decode) == (graph, decode)
    assert got == sent


@pytest.mark.parametrize("wake_us", [None, 0.0, 12.5])
def test_a_result_carries_the_hops_wake_up_part_or_says_it_has_none(wake_us: float | None) -> None:
    sent = WireResult(7, True, True, [3], 1.5, 0.25, 20.0, wake_us=wake_us)
    got = decode_result(through_the_wire(result_header(sent, sent_at=1.0)), encode_result(sent))
    assert got.wake_us == wake_us and got.transport_us == 20.0 and got == sent


def test_each_flag_is_a_bit_of_its_own() -> None:
    for flags in (ResultFlags, InputFlags):
        bits = [int(flag) for flag in flags if flag]
        assert all(bit & (bit - 1) == 0 for bit in bits), flags
        assert len(set(bits)) == len(bits), flags


@pytest.mark.parametrize("sample", [False, True])
def test_an_input_frame_says_whether_some_row_samples(sample: bool) -> None:
    flags = InputFlags.SAMPLE if sample else InputFlags.NONE
    got = through_the_wire(FrameHeader(FrameKind.step, 0, 3, 2, 4, 2, int(flags)))
    assert bool(got.flags & InputFlags.SAMPLE) is sample


def test_each_frame_decodes_to_its_own_step_layout() -> None:
    # Both ends cache a layout's words (packed by the tuple's identity, decoded by their bytes) and the decoded
    # layout: frames of several layouts in turn, sent as the engine sends them (the layout's own words tuple) and
    # as a list, each decode to the layout they were packed with.
    from omegaconf import OmegaConf

    from corelib.config.schema import CorelibConfig
    from corelib.startup.compose import compose_config
    from corelib.step.layout import EngineLayout

    config = OmegaConf.to_object(compose_config(["engine.max_num_seqs=8"]))
    assert isinstance(config, CorelibConfig)
    engine = EngineLayout.of(config)
    layouts = [engine.decode_layout, engine.step_layout(24), engine.step_layout(40), engine.decode_layout]
    for step, layout in enumerate(layouts * 2):
        words = layout.words if step < len(layouts) else layout.encode()
        got = through_the_wire(FrameHeader(FrameKind.step, 0, step, payload_len=layout.nbytes, layout=words))
        assert got.input_layout("test frame") == layout
