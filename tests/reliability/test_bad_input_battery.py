"""The bad-input battery: configuration, requests, sampling values and SHM frames, one table.

Every case gives one clear line naming what was wrong:

- configuration: ``python -m corelib run`` exits 2 with one ``corelib: error:`` line, no traceback;
- a request: that request finishes with ``finish_reason='error'`` and a one-line reason, while
  the requests around it complete with the tokens they get alone;
- a sampling value: ``SamplingParams`` refuses it when built, in one line naming the field (a
  stop token outside the vocabulary, which only the model knows, fails its request alone);
- an SHM frame damaged after the producer sealed it: the worker refuses it before computing
  on it, and the engine stops with a one-line error naming the rank, the ring, the frame and
  the damage, and leaves no worker or segment behind.

The test ids count the cases: ``NN-kind-name``.
"""

from __future__ import annotations

import math
import re
import struct
from collections.abc import Callable, Iterator
from dataclasses import dataclass

import pytest
import torch
from leakkit import Holdings, settled
from support import Cli, assert_user_error

from corelib.engine import Engine, SamplingParams
from corelib.errors import WorkerDied
from corelib.sampling_params import SamplingError
from corelib.transport.shm_executor import ShmExecutor
from corelib.transport.wire import _FIXED, HEADER_BYTES, VERSION, FrameHeader, FrameKind

ENGINE = ["backend=npu", "engine.async_token_handoff=on", "engine.max_num_seqs=4", "model.max_model_len=64"]
GOOD_PROMPTS = [[5, 6, 7], [8, 9, 10, 11]]
GOOD = SamplingParams(max_tokens=6, ignore_eos=True)


@dataclass(frozen=True)
class ConfigCase:
    overrides: tuple[str, ...]
    says: str  # a fragment of the (first) error line
    lines: int = 1  # one line per unmet condition where a feature is forced on


@dataclass(frozen=True)
class SamplingCase:
    kwargs: dict[str, object]
    says: str


@dataclass(frozen=True)
class RequestCase:
    prompt: object
    sampling: SamplingParams
    says: str


# Header fields by position in the packed header, for damage done after packing.
_FIELDS = ("magic", "version", "kind", "seq", "step_id", "num_seqs", "bucket", "kv_blocks", "num_tokens",
           "max_query_len", "num_copies", "decode_rows", "num_recounts", "flags", "sent_at", "payload_len", "words")


def _offset(name: str) -> tuple[int, str]:
    index = _FIELDS.index(name)
    code = _FIXED.format[1:]  # the byte-order mark first
    return struct.calcsize("<" + code[:index]), "<" + code[index]


def _poke(name: str, value: int) -> Callable[[memoryview], None]:
    def poke(buffer: memoryview) -> None:
        offset, code = _offset(name)
        struct.pack_into(code, buffer, offset, value)

    return poke


def _flip_payload(header: FrameHeader, payload: torch.Tensor) -> None:
    payload[3] ^= 0x04


def _flip(name: str, bit: int) -> Callable[[FrameHeader, torch.Tensor], None]:
    def flip(header: FrameHeader, payload: torch.Tensor) -> None:
        setattr(header, name, getattr(header, name) ^ bit)

    return flip


def _flip_layout(header: FrameHeader, payload: torch.Tensor) -> None:
    header.layout = (header.layout[0], header.layout[1] ^ 1, *header.layout[2:])


def _cut_stale(header: FrameHeader, payload: torch.Tensor) -> None:
    header.payload_len -= 64  # the checksum still covers the whole payload


def _cut_resealed(header: FrameHeader, payload: torch.Tensor) -> None:
    # A producer that wrote a short frame and sealed it: the checksum agrees, the layout does not.
    header.payload_len -= 64
    header.checksum = header.crc(memoryview(payload.numpy().tobytes())[: header.payload_len])


def _cut_resealed_header(header: FrameHeader, payload: torch.Tensor) -> None:
    # The same without the payload CRC: the checksum covers the header, whose payload length agrees.
    header.payload_len -= 64
    header.checksum = header.crc()


PAYLOAD_CRC = ("engine.shm.payload_crc=true",)  # a payload's bytes are checked only with this


@dataclass(frozen=True)
class FrameCase:
    says: str  # regex after "input ring (rank 0) frame N (slot S): "
    tamper: Callable[[FrameHeader, torch.Tensor], None] | None = None  # before the header is packed
    poke: Callable[[memoryview], None] | None = None  # after: bytes the packing would have set
    overrides: tuple[str, ...] = ()  # the engine's, beyond the frame cases' own


TARGET_FRAME = 4  # a decode frame, after the prefill and a few decode steps
Case = ConfigCase | RequestCase | SamplingCase | FrameCase
TABLE: list[tuple[str, str, Case]] = [
    # -- configuration, through the CLI
    ("config", "override-typo", ConfigCase(("engine.asyn_token_handoff=on",),
                                           "Key 'asyn_token_handoff' not in 'EngineConfig' (did you mean "
                                           "'async_token_handoff'?)")),
    ("config", "unknown-backend", ConfigCase(("backend=tpu",), "backend=tpu: no such option; available: auto, cpu")),
    ("config", "mode-unknown", ConfigCase(("engine.graph=maybe",), "Invalid value 'maybe', expected one of [auto, on")),
    ("config", "int-from-text", ConfigCase(("model.num_layers=abc",), "model.num_layers: Value 'abc'")),
    ("config", "feature-on-two-unmet", ConfigCase(
        ("engine.async_token_handoff=on", "engine.speculative_draft_model=draft", "engine.kv_transfer_connector=x"),
        "engine.async_token_handoff=on refused: a speculative draft model is configured", lines=2)),
    ("config", "max_num_seqs-0", ConfigCase(("engine.max_num_seqs=0",), "engine.max_num_seqs=0: must be at least 1")),
    ("config", "block_size-0", ConfigCase(("engine.block_size=0",), "engine.block_size=0: must be at least 1")),
    ("config", "timeout-negative", ConfigCase(("engine.timeout_s=-1",), "engine.timeout_s=-1.0: must be a positive")),
    ("config", "shm-slots-0", ConfigCase(("engine.transport=shm", "engine.shm.num_slots=0"),
                                         "engine.shm.num_slots=0: must be at least 1")),
    ("config", "graph-batch-size-0", ConfigCase(("engine.graph_batch_sizes=[4,0]",),
                                                "engine.graph_batch_sizes: 0 is not a batch size")),
    ("config", "max_model_len-1", ConfigCase(("model.max_model_len=1",), "model.max_model_len=1: must be at least 2")),
    ("config", "eos-outside-vocab", ConfigCase(("model.eos_token_id=512",),
                                               "model.eos_token_id: 512 is outside the vocabulary [0, 512)")),
    ("config", "kv-pool-too-small", ConfigCase(("engine.num_kv_blocks=4",),
                                               "engine.num_kv_blocks=4 holds 48 tokens")),
    ("config", "tp-not-dividing-heads", ConfigCase(("engine.transport=shm", "engine.tp=3"),
                                                   "engine.tp=3 must divide model.num_heads=4")),
    ("config", "workload-temperature", ConfigCase(("workload.temperature=-0.5",),
                                                  "workload.temperature=-0.5: must be a finite number >= 0")),
    ("config", "workload-stop-token", ConfigCase(("workload.stop_token_ids=[600]",),
                                                 "workload.stop_token_ids: 600 is outside the vocabulary")),
    ("config", "transport-unknown", ConfigCase(("engine.transport=udp",), "engine.transport")),
    ("config", "chaos-out-of-range", ConfigCase(("backend.emulator.chaos=1.5",),
                                                "backend.emulator.chaos: 1.5 is not in [0, 1]")),
    # values that once ran to exit 0 with every token 0
    ("config", "rms_norm_eps-nan", ConfigCase(("model.rms_norm_eps=nan",),
                                              "model.rms_norm_eps=nan: must be a finite number > 0")),
    ("config", "rope_theta-negative", ConfigCase(("model.rope_theta=-10000",),
                                                 "model.rope_theta=-10000.0: must be a finite number > 0")),
    ("config", "rope-factor-nan", ConfigCase(("+model.rope_scaling.rope_type=linear",
                                              "+model.rope_scaling.factor=nan"),
                                             "model.rope_scaling.factor=nan: must be a finite number")),
    ("config", "hybrid-conv_kernel-0", ConfigCase(("model=hybrid-tiny", "model.conv_kernel=0"),
                                                  "model.conv_kernel=0: must be at least 1")),
    # sizes that once surfaced as a raw exception (exit 1)
    ("config", "num_heads-0", ConfigCase(("model.num_heads=0",), "model.num_heads=0: must be at least 1")),
    ("config", "num_kv_heads-0", ConfigCase(("model.num_kv_heads=0",), "model.num_kv_heads=0: must be at least 1")),
    ("config", "hidden_size-negative", ConfigCase(("model.hidden_size=-8",),
                                                  "model.hidden_size=-8: must be at least 1")),
    ("config", "num_layers-negative", ConfigCase(("model.num_layers=-1",), "model.num_layers=-1: must be at least 1")),
    ("config", "intermediate_size-0", ConfigCase(("model.intermediate_size=0",),
                                                 "model.intermediate_size=0: must be at least 1")),
    ("config", "head_dim-negative", ConfigCase(("model.head_dim=-2",), "model.head_dim=-2: must be at least 0")),
    ("config", "head_dim-odd", ConfigCase(("model.hidden_size=7",), "model.hidden_size=7 // model.num_heads=4 = 1: "
                                                                    "RoPE rotates pairs")),
    ("config", "kv-pool-beyond-memory", ConfigCase(("engine.num_kv_blocks=100000000",),
                                                   "engine.num_kv_blocks=100000000: the KV cache needs")),
    ("config", "max_model_len-beyond-memory", ConfigCase(("model.max_model_len=100000000",),
                                                         "model.max_model_len=100000000: one request's KV cache "
                                                         "needs")),
    ("config", "weights-beyond-memory", ConfigCase(("model.vocab_size=1000000000",),
                                                   "model=tiny: the weights need")),
    # where the run writes, and what it reads: once raw errors (FileExistsError, "Unable to configure handler")
    ("config", "run-dir-a-file", ConfigCase(("hydra.run.dir=/etc/passwd",),
                                            "hydra.run.dir=/etc/passwd is a file, not a directory")),
    ("config", "run-dir-dev-null", ConfigCase(("hydra.run.dir=/dev/null",), "/dev/null is in /dev, the kernel's view")),
    ("config", "run-dir-proc", ConfigCase(("hydra.run.dir=/proc/run",), "/proc/run is in /proc, the kernel's view")),
    ("config", "run-dir-sys", ConfigCase(("hydra.run.dir=/sys/run",), "/sys/run is in /sys, the kernel's view")),
    ("config", "sweep-dir-dev-null", ConfigCase(("-m", "hydra.sweep.dir=/dev/null", "workload.seed=1,2"),
                                                "hydra.sweep.dir=/dev/null: /dev/null is in /dev")),
    ("config", "dataset-dev-zero", ConfigCase(("workload.dataset=/dev/zero",),
                                              "workload.dataset: /dev/zero is a character device, not a regular file")),
    # -- requests, through the API: the request fails alone
    ("request", "empty-prompt", RequestCase([], GOOD, "the prompt is empty")),
    ("request", "prompt-too-long", RequestCase(list(range(2, 66)), GOOD,
                                               "the prompt has 64 tokens; model.max_model_len=64 leaves no room")),
    ("request", "token-negative", RequestCase([3, -1], GOOD, "prompt token id -1 is outside the vocabulary")),
    ("request", "token-outside-vocab", RequestCase([3, 512], GOOD, "prompt token id 512 is outside the vocabulary")),
    ("request", "token-float", RequestCase([3, 4.5], GOOD, "prompt token 4.5 at position 1 is not an integer")),
    ("request", "token-str", RequestCase(["3", "4"], GOOD, "prompt token '3' at position 0 is not an integer")),
    ("request", "prompt-none", RequestCase(None, GOOD, "the prompt is NoneType")),
    ("request", "prompt-nested", RequestCase([[3, 4]], GOOD, "prompt token [3, 4] at position 0 is not an integer")),
    ("request", "prompt-bytes", RequestCase(b"\x03\x04", GOOD, "the prompt is bytes; pass token ids")),
    ("request", "prompt-dict", RequestCase({"a": 3}, GOOD, "the prompt is dict; pass token ids")),
    ("request", "prompt-set", RequestCase({3, 4}, GOOD, "the prompt is set; pass token ids")),
    # -- sampling values, through the API: the request fails alone
    ("sampling", "max_tokens-0", SamplingCase({"max_tokens": 0}, "max_tokens=0: must be at least 1")),
    ("sampling", "max_tokens-negative", SamplingCase({"max_tokens": -3}, "max_tokens=-3")),
    ("sampling", "max_tokens-float", SamplingCase({"max_tokens": 2.5}, "max_tokens=2.5: must be an integer")),
    ("sampling", "temperature-negative", SamplingCase({"temperature": -1.0}, "temperature=-1.0")),
    ("sampling", "temperature-nan", SamplingCase({"temperature": math.nan}, "temperature=nan")),
    ("sampling", "temperature-str", SamplingCase({"temperature": "0.7"}, "temperature='0.7': must be a number")),
    ("sampling", "temperature-beyond-float32", SamplingCase({"temperature": 3.5e38}, "held as float32"
                                                            if False else "the device holds it as float32")),
    ("sampling", "top_p-0", SamplingCase({"top_p": 0.0}, "top_p=0.0: must be in (0, 1]")),
    ("sampling", "top_p-above-1", SamplingCase({"top_p": 1.5}, "top_p=1.5")),
    ("sampling", "top_k-negative", SamplingCase({"top_k": -2}, "top_k=-2")),
    ("sampling", "top_k-beyond-int64", SamplingCase({"top_k": 2**63}, "the device holds it as int64")),
    ("sampling", "seed-negative", SamplingCase({"seed": -1}, "seed=-1")),
    ("sampling", "stop-token-outside-vocab", RequestCase([3, 4], SamplingParams(stop_token_ids=(512,)),
                                                         "stop_token_ids: 512 is outside the vocabulary")),
    ("sampling", "stop-string-empty", SamplingCase({"stop": ("",)}, "stop: an empty string")),
    ("sampling", "stop-strings-not-str", SamplingCase({"stop": [1]}, "stop=[1]: pass a string or a list of strings")),
    # -- SHM frames, end to end through a worker: damaged after the producer sealed them
    ("frame", "payload-bit-flipped", FrameCase("bad checksum", tamper=_flip_payload, overrides=PAYLOAD_CRC)),
    ("frame", "header-num_seqs-bit-flipped", FrameCase("bad checksum", tamper=_flip("num_seqs", 0x10))),
    ("frame", "header-kv_blocks-bit-flipped", FrameCase("bad checksum", tamper=_flip("kv_blocks", 0x04))),
    ("frame", "layout-bit-flipped", FrameCase("bad checksum", tamper=_flip_layout)),
    ("frame", "truncated", FrameCase("bad checksum .*corrupted or truncated", tamper=_cut_stale)),
    ("frame", "truncated-resealed", FrameCase(r"payload of \d+ bytes is shorter than its layout",
                                              tamper=_cut_resealed, overrides=PAYLOAD_CRC)),
    ("frame", "truncated-resealed-header-crc", FrameCase(r"payload of \d+ bytes is shorter than its layout",
                                                         tamper=_cut_resealed_header)),
    ("frame", "wrong-version", FrameCase(f"frame version 9, this corelib speaks version {VERSION}",
                                         poke=_poke("version", 9))),
    ("frame", "bad-magic", FrameCase("bad magic 0x0badf00d", poke=_poke("magic", 0x0BADF00D))),
    ("frame", "oversize", FrameCase(r"payload length 9999999 exceeds the slot's \d+",
                                    poke=_poke("payload_len", 9999999))),
    ("frame", "unknown-kind", FrameCase("unknown frame kind 77", poke=_poke("kind", 77))),
    ("frame", "sequence-number-replayed", FrameCase(r"the header says frame 3 \(overwritten before it was read\)",
                                                    poke=_poke("seq", TARGET_FRAME - 1))),
]
# A config case runs the CLI and a frame case starts an SHM worker: a second or more each.
FRAMES_IN_THE_DEFAULT_RUN = 3  # each frame case starts and kills a worker: the rest run with the long checks
CONFIGS_EVERY = 4  # every fourth config case in the default run, the rest with the long checks


def _marks(kind: str, name: str) -> list[pytest.MarkDecorator]:
    marks = [pytest.mark.slow] if kind in ("config", "frame") else []
    names = [n for k, n, _ in TABLE if k == kind]
    if ((kind == "frame" and names.index(name) >= FRAMES_IN_THE_DEFAULT_RUN)
            or (kind == "config" and names.index(name) % CONFIGS_EVERY)):
        marks.append(pytest.mark.long)
    return marks


PARAMS = [pytest.param(kind, case, id=f"{n:02d}-{kind}-{name}", marks=_marks(kind, name))
          for n, (kind, name, case) in enumerate(TABLE, 1)]


def test_the_battery_has_at_least_30_cases_of_every_kind() -> None:
    kinds = {kind for kind, _, _ in TABLE}
    assert kinds == {"config", "request", "sampling", "frame"}
    assert len(TABLE) >= 30
    assert len({name for _, name, _ in TABLE}) == len(TABLE), "case names must be unique"


# ---------------------------------------------------------------------------------- runners


@pytest.fixture(scope="module")
def engine() -> Iterator[Engine]:
    with Engine.from_overrides(ENGINE) as shared:
        yield shared


@pytest.fixture(scope="module")
def alone(engine: Engine) -> list[list[int]]:
    """What the good requests produce without a bad one among them."""
    return [o.output_token_ids for o in engine.generate(GOOD_PROMPTS, GOOD)]


def check_config(case: ConfigCase, cli: Cli) -> None:
    assert_user_error(cli("run", "backend=npu", "workload.num_requests=2", *case.overrides), case.says,
                      lines=case.lines)


def check_request(case: RequestCase, engine: Engine, alone: list[list[int]]) -> None:
    prompts: list[object] = [GOOD_PROMPTS[0], case.prompt, GOOD_PROMPTS[1]]
    outputs = engine.generate(prompts, [GOOD, case.sampling, GOOD])  # type: ignore[arg-type]
    bad = outputs[1]
    assert bad.finish_reason == "error" and bad.error is not None, f"accepted: {bad}"
    assert case.says in bad.error, f"{case.says!r} not in {bad.error!r}"
    assert "\n" not in bad.error
    assert [outputs[0].output_token_ids, outputs[2].output_token_ids] == alone, "the other requests were disturbed"


def check_sampling(case: SamplingCase, engine: Engine, alone: list[list[int]]) -> None:
    with pytest.raises(SamplingError) as refused:
        SamplingParams(**case.kwargs)  # type: ignore[arg-type]
    message = str(refused.value)
    assert case.says in message and "\n" not in message, message
    assert [o.output_token_ids for o in engine.generate(GOOD_PROMPTS, GOOD)] == alone


def check_frame(case: FrameCase, monkeypatch: pytest.MonkeyPatch) -> None:
    before = Holdings.now()
    engine = Engine.from_overrides([*ENGINE, "engine.transport=shm", "engine.timeout_s=10", *case.overrides])
    try:
        executor = engine.core.executor
        assert isinstance(executor, ShmExecutor)
        if case.tamper is not None:
            damage = case.tamper

            def tamper(header: FrameHeader, payload: torch.Tensor) -> None:
                if header.seq == TARGET_FRAME:
                    damage(header, payload)

            executor.producer.tamper = tamper
        if case.poke is not None:
            # Damage the packed fields before the checksum is taken over them (sealing packs them with _pack_body),
            # so that the frame's own checks, not its CRC, must refuse it.
            poke, pack = case.poke, FrameHeader._pack_body

            def pack_then_poke(header: FrameHeader, buffer: memoryview | bytearray) -> int:
                at = pack(header, buffer)
                if header.seq == TARGET_FRAME and header.kind is FrameKind.step:
                    poke(memoryview(buffer)[:HEADER_BYTES])
                return at

            monkeypatch.setattr(FrameHeader, "_pack_body", pack_then_poke)
        with pytest.raises(WorkerDied) as caught:
            engine.generate(GOOD_PROMPTS, SamplingParams(max_tokens=20, ignore_eos=True))
    finally:
        engine.close()
    message = str(caught.value)
    where = (r"worker rank 0 \(pid \d+\) stopped: TransportError: "
             rf"input ring \(rank 0\) frame {TARGET_FRAME} \(slot 0\): ")
    assert re.search(where + case.says, message), message
    assert "\n" not in message
    left = settled(before)
    assert not left, f"left behind {left}"


@pytest.mark.parametrize(("kind", "case"), PARAMS)
def test_bad_input(kind: str, case: Case, request: pytest.FixtureRequest, monkeypatch: pytest.MonkeyPatch) -> None:
    if isinstance(case, ConfigCase):
        check_config(case, request.getfixturevalue("cli"))
    elif isinstance(case, RequestCase):
        check_request(case, request.getfixturevalue("engine"), request.getfixturevalue("alone"))
    elif isinstance(case, SamplingCase):
        check_sampling(case, request.getfixturevalue("engine"), request.getfixturevalue("alone"))
    else:
        check_frame(case, monkeypatch)

