"""Op conformance: every op a backend's provider offers, checked against the plain-torch reference.

The tests ask for ``op_target`` (see :class:`OpTarget`). They run with the backend conformance
suite, whose plugin loads each backend's op provider on its native runtime; they skip, naming
why, where a backend has no provider, runs emulated, or its provider cannot load here. A test
module may override ``op_target`` to run the same checks elsewhere (Triton's CPU interpreter).

What is checked, over GQA ratios 1/2/4/8, head dims 64/128, block sizes 16/32, batches 1/3/32/128
and ragged context lengths (1, bs-1, bs, bs+1, a long one, padded rows on block 0), and for the
projections (linear and the fused decode-layer ops) over M = 1-128 and a prefill-sized M, K not
a multiple of any block, odd N, with and without bias:

- float outputs: max |provided - reference| <= tol * max |reference|, tol per dtype in
  ``TOLERANCES`` (float32 1e-4, bfloat16 2e-2, float16 5e-3);
- sampled token ids: exactly the reference's (greedy ties go to the lowest id; sampled rows
  use the same counter-based noise);
- paged attention (query lengths of 1 or more over the paged cache: decode steps, and steps of
  decode rows with first and later prefill chunks, on and off block edges) reads only live keys:
  every cache slot past a sequence's length (and every block no sequence owns) holds NaN, as stale
  cache memory may;
- under graph capture: each op captured once in a device graph on static buffers, the inputs
  changed (a decode step: other context lengths per row), replayed, and compared with the reference
  on the new inputs (steps with chunks run eagerly: the longest query count is a host int).

The default run takes a few cases per op; the full sweep is marked ``slow``.

Long: every op's cases and checks in one module, beside the contract each one checks (``corelib.ops.spec``).
"""

from __future__ import annotations

import dataclasses
import itertools
from collections.abc import Callable, Mapping, Sequence

import pytest
import torch

from corelib.ops import Ops, PagedAttention
from corelib.ops.reference import reference_ops
from corelib.platform.device import Device
from corelib.testing.op_cases import (
    BF16,
    F32,
    Args,
    CapturedChunkCase,
    Case,
    ChunkCase,
    DecodeCase,
    NormCase,
    RelayCase,
    RopeCase,
    SampleCase,
    SamplePublishCase,
    SiluCase,
    case_id,
)
from corelib.testing.projection_cases import (
    GATE_UP_CASES,
    GATE_UP_SWEEP,
    LINEAR_CASES,
    LINEAR_RESIDUAL_CASES,
    LINEAR_RESIDUAL_SWEEP,
    LINEAR_SWEEP,
    LOGITS_CASES,
    LOGITS_SWEEP,
    QKV_ATTENTION_CASES,
    QKV_ATTENTION_SWEEP,
    QKV_CASES,
    QKV_SWEEP,
    LinearCase,
    LinearResidualCase,
    NormGateUpCase,
    NormLogitsCase,
    NormQkvAttentionCase,
    NormQkvCase,
)

#: the normwise tolerance of each dtype, relative to the reference output's largest magnitude
TOLERANCES = {torch.float32: 1e-4, torch.bfloat16: 2e-2, torch.float16: 5e-3}
Call = Callable[[Ops, Args], tuple[torch.Tensor, ...]]


@dataclasses.dataclass(frozen=True)
class OpTarget:
    """One op provider loaded for one device: what the tests run against."""

    provider: str
    declared: tuple[str, ...]  # provider.op_names()
    loaded: Mapping[str, object]  # provider.load(device)
    torch_device: torch.device
    device: Device | None = None  # graphs are captured through it; None skips the graph tests
    no_graph_reason: str = "no device to capture graphs on"
    folded_norms: bool = False  # provider.folded_norms: its fused norm ops take norm_weight None (folded)

    @property
    def ops(self) -> Ops:
        """The reference ops with this provider's swapped in."""
        return reference_ops().with_provider(self.provider, self.loaded)

    def require(self, op: str) -> Ops:
        if op not in self.loaded:
            pytest.skip(f"op provider {self.provider!r} does not offer {op}")
        return self.ops


def _paged_call(ops: Ops, args: Args, poison: bool, op: str) -> tuple[torch.Tensor, ...]:
    q, kc, vc, attn, scale, live = args
    assert isinstance(q, torch.Tensor) and isinstance(kc, torch.Tensor) and isinstance(vc, torch.Tensor)
    assert isinstance(attn, PagedAttention) and isinstance(scale, float) and isinstance(live, torch.Tensor)
    if poison:  # keys past each length may hold anything: NaN must not leak into the output
        dead = ~live[:, :, None, None]
        kc, vc = kc.masked_fill(dead, float("nan")), vc.masked_fill(dead, float("nan"))
    return (getattr(ops, op)(q, kc, vc, attn, scale),)


def _params(default: Sequence[Case], sweep: Sequence[Case]) -> Sequence[object]:
    slow = [pytest.param(c, id=case_id(c), marks=[pytest.mark.slow, pytest.mark.sweep]) for c in sweep]
    return [pytest.param(c, id=case_id(c)) for c in default] + slow


# -- cases -------------------------------------------------------------------------------------

_GEOMETRY = list(itertools.product((F32, BF16), (1, 2, 4, 8), (64, 128), (16, 32)))
DECODE_CASES = [
    DecodeCase(F32, 1, 1, 64, 16, lengths=(1,)),
    DecodeCase(F32, 1, 2, 128, 32, kv_heads=1),  # one long sequence: the split-K path
    DecodeCase(F32, 3, 4, 64, 16, long=70),
    DecodeCase(F32, 5, 1, 128, 16, lengths=(15, 16, 17, 33, 1)),
    DecodeCase(BF16, 3, 8, 128, 32, long=300),
    DecodeCase(BF16, 32, 2, 64, 16, long=100, kv_heads=1),
]
DECODE_SWEEP = [DecodeCase(d, (1, 3, 32, 128)[i % 4], g, hd, bs) for i, (d, g, hd, bs) in enumerate(_GEOMETRY)]
# Steps of query lengths >= 1: rows as (cached context, queries). A first chunk (nothing cached),
# later chunks starting on and off a block edge, chunks across several blocks and longer than a
# query tile, decode rows (one query) among them, and a long cached context.
CHUNK_CASES = [
    ChunkCase(F32, 1, 64, 16, ((0, 5),)),
    ChunkCase(F32, 2, 64, 16, ((0, 17), (16, 16), (7, 40), (30, 1))),
    ChunkCase(F32, 4, 128, 32, ((100, 1), (0, 70), (33, 130), (64, 1), (5, 3))),
    ChunkCase(BF16, 8, 128, 16, ((0, 33), (300, 64), (17, 1))),
    ChunkCase(BF16, 2, 64, 32, ((1, 1), (31, 2), (32, 97), (1500, 16)), kv_heads=1),
    # decode rows listed first and named so: a provider may run them as a decode step
    ChunkCase(F32, 4, 64, 16, ((40, 1), (300, 1), (1, 1), (0, 33), (17, 1), (5, 70)), split=True),
    ChunkCase(BF16, 2, 128, 32, ((700, 1), (33, 130)), split=True),
]
# Captured steps (a graph per token bucket): two steps in one padded shape each, decode rows beside
# chunks, rows past the step's left empty and tokens past the step's (which must come out 0).
CAPTURED_CASES = [
    CapturedChunkCase(F32, 2, 64, 16, 64, 6, (((0, 17), (16, 16), (30, 1)), ((40, 1), (3, 1), (0, 50)))),
    CapturedChunkCase(BF16, 4, 128, 32, 128, 4, (((100, 1), (33, 100), (5, 3)), ((0, 128),))),
    CapturedChunkCase(F32, 1, 64, 16, 48, 8, (((7, 1), (8, 1), (9, 1), (0, 40)), ((1500, 16), (0, 30)))),
    CapturedChunkCase(BF16, 8, 128, 16, 96, 3, (((700, 1), (17, 64), (64, 31)), ((0, 1),))),
]
# Large buckets: the wide query tiles split over their keys (captured_config), decode rows beside chunks.
CAPTURED_SWEEP = [
    CapturedChunkCase(BF16, 2, 128, 16, 1024, 6, (((300, 1), (0, 700), (20, 1), (1100, 300)), ((5, 1), (0, 1000)))),
    CapturedChunkCase(F32, 2, 64, 16, 1024, 5, (((0, 1000), (40, 1), (900, 23)), ((2000, 1), (3, 900), (0, 100)))),
]
CHUNK_SWEEP = [ChunkCase(d, g, hd, bs, ((0, 1), (bs - 1, 2), (bs, bs), (bs + 1, 130), (3 * bs, 1), (0, 300)))
               for d, g, hd, bs in _GEOMETRY[1::2]]
ROPE_CASES = [RopeCase(F32, 5, 2, 64, 16), RopeCase(BF16, 3, 2, 128, 32, kv_heads=8), RopeCase(F32, 1, 8, 128, 16)]
ROPE_SWEEP = [RopeCase(d, (1, 3, 32, 128)[i % 4], g, hd, bs) for i, (d, g, hd, bs) in enumerate(_GEOMETRY)]
NORM_CASES = [
    NormCase(F32, (3, 1024)),
    NormCase(F32, (3, 1536), residual=True),  # not a power of two (Qwen2-1.5B)
    NormCase(BF16, (2, 8192), residual=True),
    NormCase(F32, (5, 4, 128), per_head=True),
    NormCase(BF16, (3, 2, 64), per_head=True),
]
NORM_SWEEP = [NormCase(d, (rows, hidden), residual=r) for d, rows, hidden, r in itertools.product(
    (F32, BF16), (1, 32, 128), (64, 1024, 3000, 8192), (False, True))] + [
    NormCase(d, (t, 16, hd), per_head=True) for d, t, hd in itertools.product((F32, BF16), (1, 128), (64, 128))]
SILU_CASES = [SiluCase(F32, 3, 1000), SiluCase(BF16, 1, 3072)]
SILU_SWEEP = [SiluCase(d, t, i) for d, t, i in itertools.product((F32, BF16), (1, 32, 128), (3072, 1000))]
SAMPLE_CASES = [SampleCase(1), SampleCase(3, 1000, ties=True), SampleCase(4, 1000, ties=True, sampled=True),
                SampleCase(4, 1000, uncut=True)]
SAMPLE_PUBLISH_CASES = [SamplePublishCase(1), SamplePublishCase(5, nonfinite=True),
                        SamplePublishCase(3, 1000, nonfinite=True, sampled=True)]
SAMPLE_PUBLISH_SWEEP = [SamplePublishCase(32, nonfinite=True), SamplePublishCase(128, 5000, nonfinite=True)]
RELAY_CASES = [RelayCase(1), RelayCase(5), RelayCase(1500)]
RELAY_SWEEP = [RelayCase(4096, states=300)]
SAMPLE_SWEEP = [SampleCase(32, ties=True), SampleCase(128), SampleCase(32, sampled=True), SampleCase(32, argmax=True),
                SampleCase(32, uncut=True), SampleCase(128, ties=True, sampled=True)]


# -- tests -------------------------------------------------------------------------------------


def assert_matches(actual: torch.Tensor, expected: torch.Tensor, what: str, tolerance_dtype: torch.dtype | None = None
                   ) -> None:
    """Same shape and dtype; max error within the dtype's tolerance of the reference's scale.

    ``tolerance_dtype``: whose tolerance applies, where it is not the output's (float32 logits of
    a bfloat16 model carry bfloat16's error).
    """
    assert actual.shape == expected.shape, f"{what}: shape {tuple(actual.shape)}, reference {tuple(expected.shape)}"
    assert actual.dtype == expected.dtype, f"{what}: dtype {actual.dtype}, reference {expected.dtype}"
    if expected.dtype in (torch.int64, torch.int32):
        assert torch.equal(actual, expected), f"{what}: {actual.tolist()} != reference {expected.tolist()}"
        return
    tol = TOLERANCES[tolerance_dtype or expected.dtype]
    a, e = actual.float(), expected.float()
    assert bool(torch.isfinite(a).all()), f"{what}: {int((~torch.isfinite(a)).sum())} values are NaN or inf"
    error = float((a - e).abs().max()) / max(float(e.abs().max()), 1e-6) if e.numel() else 0.0
    assert error <= tol, f"{what}: max error {error:.2e} of the reference's scale, above {tol:g} ({expected.dtype})"


def _check(target: OpTarget, op: str, case: Case, call: Call) -> None:
    ops = target.require(op)
    if getattr(case, "folded", False) and not target.folded_norms:
        pytest.skip(f"op provider {target.provider!r} takes the norm's weight itself (folded_norms is False)")
    assert_like_reference(ops, case, target.torch_device, f"{target.provider}.{op} ({case_id(case)})", call=call)


def assert_like_reference(ops: Ops, case: Case, device: torch.device, what: str, *, op: str = "",
                          call: Call | None = None, seed: int = 0) -> None:
    """``op`` (or ``call``) on ``case`` built from ``seed``, through ``ops`` and through the reference ops: each
    output within the tolerance of its dtype (or the case's ``tolerance_dtype``)."""
    call = call or CALLS[op]
    actual = call(ops, case.build(seed, device))
    expected = call(reference_ops(), case.build(seed, device))
    for index, (a, e) in enumerate(zip(actual, expected, strict=True)):
        assert_matches(a, e, f"{what}, output {index}", getattr(case, "tolerance_dtype", None))


def _norm(ops: Ops, args: Args) -> tuple[torch.Tensor, ...]:
    x, weight, eps, residual = args
    return ops.rms_norm(x, weight, eps, residual)  # type: ignore[arg-type]


def _rope(ops: Ops, args: Args) -> tuple[torch.Tensor, ...]:
    qk, v, positions, cos_sin, kc, vc, slots = args
    out = ops.rope_kv_write(qk, v, positions, cos_sin, kc, vc, slots)  # type: ignore[arg-type]
    return out, kc, vc  # type: ignore[return-value]


def _silu(ops: Ops, args: Args) -> tuple[torch.Tensor, ...]:
    return (ops.silu_mul(*args),)  # type: ignore[arg-type]


def _sample(ops: Ops, args: Args) -> tuple[torch.Tensor, ...]:
    return (ops.sample(*args),)  # type: ignore[arg-type]


def _sample_publish(ops: Ops, args: Args) -> tuple[torch.Tensor, ...]:
    """(checked, tokens, relay), where a row's logits were not finite its token and relay entry read -2 for a
    valid id, -3 for another: any valid id may stand there (torch's argmax takes a NaN as the largest, a kernel
    need not). Graph-safe: no host sync."""
    logits, _, checked, relay, slots = args
    assert isinstance(logits, torch.Tensor) and isinstance(checked, torch.Tensor)
    assert isinstance(relay, torch.Tensor) and isinstance(slots, torch.Tensor)
    tokens = ops.sample_publish(*args)  # type: ignore[arg-type]
    bad = checked < 0
    valid = (tokens >= 0) & (tokens < logits.shape[-1])
    masked = torch.where(bad, torch.where(valid, -2, -3), tokens)
    relay = relay.clone()
    relay.index_copy_(0, slots, torch.where(bad, masked, relay.index_select(0, slots)))
    return checked, masked, relay


def _relay(ops: Ops, args: Args) -> tuple[torch.Tensor, ...]:  # the fed ids and the tokens at every slot
    return ops.relay_inputs(*args), args[3]  # type: ignore[arg-type, return-value]


def _paged(ops: Ops, args: Args) -> tuple[torch.Tensor, ...]:
    return _paged_call(ops, args, ops.providers["paged_attention"] != "reference", "paged_attention")


def _linear(ops: Ops, args: Args) -> tuple[torch.Tensor, ...]:
    return (ops.linear(*args),)  # type: ignore[arg-type]


def _linear_residual(ops: Ops, args: Args) -> tuple[torch.Tensor, ...]:
    return (ops.linear_residual(*args),)  # type: ignore[arg-type]


def _gate_up(ops: Ops, args: Args) -> tuple[torch.Tensor, ...]:
    return (ops.norm_gate_up_silu_mul(*args),)  # type: ignore[arg-type]


def _logits(ops: Ops, args: Args) -> tuple[torch.Tensor, ...]:
    return (ops.norm_logits(*args),)  # type: ignore[arg-type]


def _qkv(ops: Ops, args: Args) -> tuple[torch.Tensor, ...]:
    q = ops.norm_qkv_rope_kv_write(*args)  # type: ignore[arg-type]
    return q, args[7], args[8]  # type: ignore[return-value]  # the rotated queries and both caches


def _qkv_attention(ops: Ops, args: Args) -> tuple[torch.Tensor, ...]:  # the attention's output and both caches
    return ops.norm_qkv_attention(*args), args[7], args[8]  # type: ignore[arg-type, return-value]


CALLS: dict[str, Call] = {
    "rms_norm": _norm,
    "rope_kv_write": _rope,
    "paged_attention": _paged,
    "silu_mul": _silu,
    "sample": _sample,
    "linear": _linear,
    "linear_residual": _linear_residual,
    "norm_qkv_rope_kv_write": _qkv,
    "norm_gate_up_silu_mul": _gate_up,
    "norm_logits": _logits,
    "norm_qkv_attention": _qkv_attention,
    "sample_publish": _sample_publish,
    "relay_inputs": _relay,
}


def test_provider_loads_the_ops_it_names(op_target: OpTarget) -> None:
    assert set(op_target.loaded) == set(op_target.declared), "load() must return exactly op_names()"
    assert all(callable(fn) for fn in op_target.loaded.values())
    assert set(op_target.ops.fused) == set(op_target.declared)


@pytest.mark.parametrize("case", _params(NORM_CASES, NORM_SWEEP))
def test_rms_norm_matches_reference(op_target: OpTarget, case: NormCase) -> None:
    _check(op_target, "rms_norm", case, _norm)


@pytest.mark.parametrize("case", _params(ROPE_CASES, ROPE_SWEEP))
def test_rope_kv_write_matches_reference(op_target: OpTarget, case: RopeCase) -> None:
    _check(op_target, "rope_kv_write", case, _rope)


@pytest.mark.parametrize("case", _params([*DECODE_CASES, *CHUNK_CASES, *CAPTURED_CASES],
                                         [*DECODE_SWEEP, *CHUNK_SWEEP, *CAPTURED_SWEEP]))
def test_paged_attention_matches_reference(op_target: OpTarget,
                                           case: DecodeCase | ChunkCase | CapturedChunkCase) -> None:
    _check(op_target, "paged_attention", case, _paged)


@pytest.mark.parametrize("case", _params(SILU_CASES, SILU_SWEEP))
def test_silu_mul_matches_reference(op_target: OpTarget, case: SiluCase) -> None:
    _check(op_target, "silu_mul", case, _silu)


@pytest.mark.parametrize("case", _params(SAMPLE_CASES, SAMPLE_SWEEP))
def test_sample_matches_reference(op_target: OpTarget, case: SampleCase) -> None:
    _check(op_target, "sample", case, _sample)


@pytest.mark.parametrize("case", _params(SAMPLE_PUBLISH_CASES, SAMPLE_PUBLISH_SWEEP))
def test_sample_publish_matches_reference(op_target: OpTarget, case: SamplePublishCase) -> None:
    _check(op_target, "sample_publish", case, _sample_publish)


@pytest.mark.parametrize("case", _params(RELAY_CASES, RELAY_SWEEP))
def test_relay_inputs_matches_reference(op_target: OpTarget, case: RelayCase) -> None:
    _check(op_target, "relay_inputs", case, _relay)


@pytest.mark.parametrize("case", _params(LINEAR_CASES, LINEAR_SWEEP))
def test_linear_matches_reference(op_target: OpTarget, case: LinearCase) -> None:
    _check(op_target, "linear", case, _linear)


@pytest.mark.parametrize("case", _params(LINEAR_RESIDUAL_CASES, LINEAR_RESIDUAL_SWEEP))
def test_linear_residual_matches_reference(op_target: OpTarget, case: LinearResidualCase) -> None:
    _check(op_target, "linear_residual", case, _linear_residual)


@pytest.mark.parametrize("case", _params(GATE_UP_CASES, GATE_UP_SWEEP))
def test_norm_gate_up_silu_mul_matches_reference(op_target: OpTarget, case: NormGateUpCase) -> None:
    _check(op_target, "norm_gate_up_silu_mul", case, _gate_up)


@pytest.mark.parametrize("case", _params(LOGITS_CASES, LOGITS_SWEEP))
def test_norm_logits_matches_reference(op_target: OpTarget, case: NormLogitsCase) -> None:
    _check(op_target, "norm_logits", case, _logits)


@pytest.mark.parametrize("case", _params(QKV_CASES, QKV_SWEEP))
def test_norm_qkv_rope_kv_write_matches_reference(op_target: OpTarget, case: NormQkvCase) -> None:
    _check(op_target, "norm_qkv_rope_kv_write", case, _qkv)


@pytest.mark.parametrize("case", _params(QKV_ATTENTION_CASES, QKV_ATTENTION_SWEEP))
def test_norm_qkv_attention_matches_reference(op_target: OpTarget, case: NormQkvAttentionCase) -> None:
    _check(op_target, "norm_qkv_attention", case, _qkv_attention)


GRAPH_CASES: dict[str, Case] = {
    "rms_norm": NormCase(BF16, (3, 1024), residual=True),
    "rope_kv_write": RopeCase(BF16, 3, 2, 128, 16),
    "paged_attention": DecodeCase(BF16, 3, 4, 128, 16, long=300),  # a decode step: the captured shape
    "silu_mul": SiluCase(BF16, 3, 3072),
    "sample": SampleCase(3, ties=True),
    "linear": LinearCase(BF16, 3, 1001, 300, bias=True),
    "linear_residual": LinearResidualCase(BF16, 32, 256, 1500),
    "norm_qkv_rope_kv_write": NormQkvCase(BF16, 3, 4, 64, 16, hidden=1024),
    "norm_gate_up_silu_mul": NormGateUpCase(BF16, 1, 1024, 768),
    "norm_logits": NormLogitsCase(BF16, 17, 1024, 5003),
    "norm_qkv_attention": NormQkvAttentionCase(BF16, 20, 2, 64, 16, hidden=1024, folded=True, long=300),
    "sample_publish": SamplePublishCase(5, 5000, nonfinite=True),
    "relay_inputs": RelayCase(7),
}


def _copy_into(static: object, fresh: object) -> None:
    """Copy new input values into the captured static buffers, field by field."""
    if isinstance(static, torch.Tensor):
        assert isinstance(fresh, torch.Tensor)
        static.copy_(fresh)
    elif isinstance(static, tuple):
        for s, f in zip(static, fresh, strict=True):  # type: ignore[call-overload]
            _copy_into(s, f)
    elif dataclasses.is_dataclass(static):
        for f in dataclasses.fields(static):
            _copy_into(getattr(static, f.name), getattr(fresh, f.name))
    else:
        assert static == fresh, f"a captured graph cannot change the non-tensor input {static!r}"


@pytest.mark.parametrize("op", list(GRAPH_CASES))
def test_op_replays_in_a_graph_on_new_inputs(op_target: OpTarget, op: str) -> None:
    _replay_on_new_inputs(op_target, op, GRAPH_CASES[op])


@pytest.mark.parametrize("case", _params(CAPTURED_CASES, CAPTURED_SWEEP))
def test_a_captured_step_replays_on_a_step_of_other_query_lengths(op_target: OpTarget,
                                                                   case: CapturedChunkCase) -> None:
    _replay_on_new_inputs(op_target, "paged_attention", case)


def _replay_on_new_inputs(op_target: OpTarget, op: str, case: Case) -> None:
    """Capture ``op`` on ``case.build(0)``, copy ``case.build(1)`` into its static inputs, replay, compare."""
    ops = op_target.require(op)
    device = op_target.device
    if device is None or not device.capabilities.graphs:
        pytest.skip(f"op provider {op_target.provider!r}: {op_target.no_graph_reason}")
    call = CALLS[op]
    static = case.build(0, op_target.torch_device)
    stream = device.stream(f"graph-{op}")
    captured: list[tuple[torch.Tensor, ...]] = []
    stream.launch(lambda: call(ops, static))  # compiles and loads the kernels outside capture
    stream.synchronize()
    graph = device.graph(f"op-{op}")
    graph.capture(lambda: stream.launch(lambda: captured.append(call(ops, static))), stream)
    stream.synchronize()
    fresh = case.build(1, op_target.torch_device)
    stream.launch(lambda: _copy_into(static, fresh))
    graph.replay(stream)
    stream.synchronize()
    expected = call(reference_ops(), case.build(1, op_target.torch_device))
    for index, (a, e) in enumerate(zip(captured[0], expected, strict=True)):
        assert_matches(a, e, f"{op_target.provider}.{op} output {index} after graph replay ({case_id(case)})",
                       getattr(case, "tolerance_dtype", None))
