"""A follower node checks every frame from node 0 before its ranks may read it: a damaged one is refused."""

from __future__ import annotations

from collections import deque

import pytest
import torch

from corelib.errors import TransportError
from corelib.transport.follower import Follower
from corelib.transport.nodes import MessageCode, Topology, _frame_bytes
from corelib.transport.wire import FrameHeader, FrameKind


class Ring:
    """This node's ring, as the follower sees it: frames written, in order."""

    timeout = 1.0

    def __init__(self) -> None:
        self.frames: list[tuple[FrameHeader, bytes]] = []

    def write_frame(self, header: FrameHeader, payload: memoryview | None) -> None:
        self.frames.append((header, b"" if payload is None else bytes(payload)))

    def why_gone(self) -> str | None:
        return None

    def close(self, timeout: float) -> None:
        pass

    def stop_now(self) -> None:
        pass


class NodeZero:
    """Node 0's end of the line: a script of messages; what the follower sends back is kept."""

    def __init__(self, *messages: tuple[MessageCode, torch.Tensor | None]) -> None:
        self.messages = deque(messages)
        self.sent: list[MessageCode] = []

    def receive(self, peer: int, status: bool = False, first: bool = False) -> tuple[MessageCode, torch.Tensor | None]:
        return self.messages.popleft()

    def send(self, code: MessageCode, data: torch.Tensor | None, peer: int, status: bool = False,
             first: bool = False) -> None:
        self.sent.append(code)

    def close(self) -> None:
        pass


def frame(seq: int, payload: bytes) -> torch.Tensor:
    """Node 0's frame as it travels: the header it wrote into its own ring (seq, length, CRC-32C), then the payload."""
    header = FrameHeader(FrameKind.step, seq, step_id=seq, num_seqs=1, bucket=1, kv_blocks=1)
    header.payload_len = len(payload)
    header.checksum = header.crc(payload)
    return _frame_bytes(header, payload)


def follow(*messages: tuple[MessageCode, torch.Tensor | None]) -> Ring:
    ring = Ring()
    follower = Follower(ring, NodeZero(*messages), Topology(1, 2, 2), announce=lambda line: None)
    follower.run()
    return ring


def test_frames_that_arrive_whole_reach_the_ring_in_order() -> None:
    payloads = [bytes(range(i, i + 64)) for i in range(3)]
    ring = follow(*[(MessageCode.FRAME, frame(i, p)) for i, p in enumerate(payloads)], (MessageCode.DONE, None))
    assert [payload for _, payload in ring.frames] == payloads
    assert [header.step_id for header, _ in ring.frames] == [0, 1, 2]


@pytest.mark.parametrize("where", ["payload", "header"])
def test_a_frame_with_a_flipped_bit_is_refused_and_never_reaches_the_ring(where: str) -> None:
    good, damaged = frame(0, bytes(64)), frame(1, bytes(range(64)))
    step_id_at, payload_at = 16, damaged.numel() - 64  # the header's step id: only its CRC shows a change there
    damaged[payload_at + 5 if where == "payload" else step_id_at] ^= 0x10  # one bit, after the CRC was taken
    with pytest.raises(TransportError, match=r"frame 1 from node 0: the frame is damaged"):
        follow((MessageCode.FRAME, good), (MessageCode.FRAME, damaged), (MessageCode.DONE, None))
