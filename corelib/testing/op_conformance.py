"""Op conformance: every op a backend's provider offers, checked against the plain-torch reference.

The tests ask for ``op_target`` (see :class:`OpTarget`). Run with the backend conformance suite,
the plugin loads each backend's op provider on its native runtime, and the tests skip, naming
why, where a backend has no provider, runs emulated, or its provider cannot load here. A test
module may override ``op_target`` to run the same checks elsewhere (Triton's CPU interpreter).

What is checked, over GQA ratios 1/2/4/8, head dims 64/128, block sizes 16/32, batches 1/3/32/128
and ragged context lengths (1, bs-1, bs, bs+1, a long one, padded rows on block 0):

- float outputs: max |provided - reference| <= tol * max |reference|, tol per dtype in
  ``TOLERANCES`` (float32 1e-4, bfloat16 2e-2, float16 5e-3);
- sampled token ids: exactly the reference's (greedy ties go to the lowest id; sampled rows
  use the same counter-based noise);
- paged decode attention reads only live keys: every cache slot past a sequence's length (and
  every block no sequence owns) holds NaN, as stale cache memory may;
- under graph capture: each op captured once in a device graph on static buffers, the inputs
  changed (other context lengths included), replayed, and compared with the reference on the
  new inputs.

The default run takes a few cases per op; the full sweep is marked ``slow``.
"""

from __future__ import annotations

import dataclasses
import itertools
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass

import pytest
import torch

from corelib.device import Device
from corelib.ops import Ops, PagedAttention, SamplingInputs, VarlenAttention

#: the normwise tolerance of each dtype, relative to the reference output's largest magnitude
TOLERANCES = {torch.float32: 1e-4, torch.bfloat16: 2e-2, torch.float16: 5e-3}
LONG_CONTEXT = 1900
VOCAB = 151936

F32, BF16 = torch.float32, torch.bfloat16
Args = tuple[object, ...]
Call = Callable[[Ops, Args], tuple[torch.Tensor, ...]]


@dataclass(frozen=True)
class OpTarget:
    """One op provider loaded for one device: what the tests run against."""

    provider: str
    declared: tuple[str, ...]  # provider.op_names()
    loaded: Mapping[str, object]  # provider.load(device)
    torch_device: torch.device
    device: Device | None = None  # graphs are captured through it; None skips the graph tests
    no_graph_reason: str = "no device to capture graphs on"

    @property
    def ops(self) -> Ops:
        """The reference ops with this provider's swapped in."""
        return Ops.reference().with_provider(self.provider, self.loaded)

    def require(self, op: str) -> Ops:
        if op not in self.loaded:
            pytest.skip(f"op provider {self.provider!r} does not offer {op}")
        return self.ops


# -- inputs ------------------------------------------------------------------------------------


def _randn(gen: torch.Generator, *shape: int, dtype: torch.dtype = F32) -> torch.Tensor:
    return torch.randn(shape, generator=gen).to(dtype)


def _ragged(batch: int, block_size: int, long: int) -> tuple[int, ...]:
    """Context lengths over the block edges; from 3 rows on, the last row is padding (length 1)."""
    pattern = [long, 1, block_size - 1, block_size, block_size + 1, 2 * block_size + 3, 5 * block_size - 1]
    lengths = list(itertools.islice(itertools.cycle(pattern), batch))
    if batch >= 3:
        lengths[-1] = 1
    return tuple(lengths)


@dataclass(frozen=True)
class DecodeCase:
    dtype: torch.dtype
    batch: int
    group: int  # query heads per KV head
    head_dim: int
    block_size: int
    long: int = LONG_CONTEXT
    kv_heads: int = 2
    lengths: tuple[int, ...] = ()  # default: _ragged

    def seq_lengths(self) -> tuple[int, ...]:
        return self.lengths or _ragged(self.batch, self.block_size, self.long)

    @property
    def width(self) -> int:
        """Block-table width: two padding columns (block 0) past the longest context."""
        return -(-max(self.long, *self.seq_lengths()) // self.block_size) + 2

    def build(self, seed: int, device: torch.device) -> Args:
        gen = torch.Generator().manual_seed(seed)
        bs, lengths, width = self.block_size, list(self.seq_lengths()), self.width
        if seed:  # other lengths on the same static shapes: a replayed graph must follow them
            lengths = [lengths[i] for i in torch.randperm(len(lengths), generator=gen).tolist()]
        padded = self.batch >= 3 and not self.lengths
        num_blocks = self.batch * width + 1
        kc = _randn(gen, num_blocks, bs, self.kv_heads, self.head_dim, dtype=self.dtype)
        vc = _randn(gen, num_blocks, bs, self.kv_heads, self.head_dim, dtype=self.dtype)
        owners = torch.randperm(num_blocks - 1, generator=gen) + 1  # block 0 is the padding block
        tables = torch.zeros(self.batch, width, dtype=torch.int32)
        live = torch.zeros(num_blocks, bs, dtype=torch.bool)
        if padded:  # a padded row: one key, on block 0
            lengths[-1] = 1
        for row, length in enumerate(lengths):
            blocks = owners[row * width : row * width + -(-length // bs)]
            if padded and row == self.batch - 1:
                blocks = torch.zeros(1, dtype=torch.int64)
            tables[row, : len(blocks)] = blocks.to(torch.int32)
            live.view(-1)[(blocks[:, None] * bs + torch.arange(bs)).view(-1)[:length]] = True
        q = _randn(gen, self.batch, self.kv_heads * self.group, self.head_dim, dtype=self.dtype)
        attn = PagedAttention(tables.to(device), torch.tensor(lengths, device=device), bs)
        return q.to(device), kc.to(device), vc.to(device), attn, self.head_dim**-0.5, live.to(device)


def _decode_call(ops: Ops, args: Args, poison: bool) -> tuple[torch.Tensor, ...]:
    q, kc, vc, attn, scale, live = args
    assert isinstance(q, torch.Tensor) and isinstance(kc, torch.Tensor) and isinstance(vc, torch.Tensor)
    assert isinstance(attn, PagedAttention) and isinstance(scale, float) and isinstance(live, torch.Tensor)
    if poison:  # keys past each length may hold anything: NaN must not leak into the output
        dead = ~live[:, :, None, None]
        kc, vc = kc.masked_fill(dead, float("nan")), vc.masked_fill(dead, float("nan"))
    return (ops.paged_decode_attention(q, kc, vc, attn, scale),)


@dataclass(frozen=True)
class PrefillCase:
    dtype: torch.dtype
    group: int
    head_dim: int
    lengths: tuple[int, ...]
    kv_heads: int = 2

    def build(self, seed: int, device: torch.device) -> Args:
        gen = torch.Generator().manual_seed(seed)
        nh, nkv, hd, tokens = self.kv_heads * self.group, self.kv_heads, self.head_dim, sum(self.lengths)
        # q and k as the model passes them: views of the rotated [T, nh+nkv, hd]; v of the fused qkv
        qk = _randn(gen, tokens, nh + nkv, hd, dtype=self.dtype)
        v = _randn(gen, tokens, (nh + 2 * nkv) * hd, dtype=self.dtype)[:, (nh + nkv) * hd :].view(tokens, nkv, hd)
        cu = torch.tensor([0, *itertools.accumulate(self.lengths)], dtype=torch.int64, device=device)
        qk, v = qk.to(device), v.to(device)
        return qk[:, :nh], qk[:, nh:], v, VarlenAttention(cu, max(self.lengths)), hd**-0.5


@dataclass(frozen=True)
class RopeCase:
    dtype: torch.dtype
    tokens: int
    group: int
    head_dim: int
    block_size: int
    kv_heads: int = 2

    def build(self, seed: int, device: torch.device) -> Args:
        gen = torch.Generator().manual_seed(seed)
        nkv, hd = self.kv_heads, self.head_dim
        nh = nkv * self.group
        qkv = _randn(gen, self.tokens, (nh + 2 * nkv) * hd, dtype=self.dtype).to(device)
        angles = torch.rand(4096, 1, hd, generator=gen) * 6.3
        cos_sin = torch.cat((angles.cos(), angles.sin()), dim=1).to(self.dtype)
        positions = torch.randint(0, 4096, (self.tokens,), generator=gen)
        num_blocks = -(-self.tokens // self.block_size) + 3
        slots = torch.randperm(num_blocks * self.block_size, generator=gen)[: self.tokens]
        kc = _randn(gen, num_blocks, self.block_size, nkv, hd, dtype=self.dtype)
        vc = _randn(gen, num_blocks, self.block_size, nkv, hd, dtype=self.dtype)
        qk = qkv[:, : (nh + nkv) * hd].view(self.tokens, nh + nkv, hd)
        v = qkv[:, (nh + nkv) * hd :].view(self.tokens, nkv, hd)
        return qk, v, positions.to(device), cos_sin.to(device), kc.to(device), vc.to(device), slots.to(device)


@dataclass(frozen=True)
class NormCase:
    dtype: torch.dtype
    shape: tuple[int, ...]
    residual: bool = False
    per_head: bool = False  # x is [T, n, hd] read out of a wider fused output, as q/k norm does

    def build(self, seed: int, device: torch.device) -> Args:
        gen = torch.Generator().manual_seed(seed)
        if self.per_head:
            tokens, heads, hd = self.shape
            x = _randn(gen, tokens, 3 * heads * hd, dtype=self.dtype).to(device)[:, : heads * hd].view(self.shape)
        else:
            x = _randn(gen, *self.shape, dtype=self.dtype).to(device)
        residual = _randn(gen, *self.shape, dtype=self.dtype).to(device) if self.residual else None
        weight = (1.0 + 0.1 * _randn(gen, self.shape[-1])).to(self.dtype).to(device)
        return x, weight, 1e-6, residual


@dataclass(frozen=True)
class SiluCase:
    dtype: torch.dtype
    tokens: int
    inter: int

    def build(self, seed: int, device: torch.device) -> Args:
        gen = torch.Generator().manual_seed(seed)
        return (_randn(gen, self.tokens, 2 * self.inter, dtype=self.dtype).to(device),)


@dataclass(frozen=True)
class SampleCase:
    batch: int
    vocab: int = VOCAB
    ties: bool = False  # logits from bfloat16 values: many equal maxima
    sampled: bool = False  # rows with temperature, top-k and top-p among greedy rows

    def build(self, seed: int, device: torch.device) -> Args:
        gen = torch.Generator().manual_seed(seed)
        logits = _randn(gen, self.batch, self.vocab) * 3
        if self.ties:
            logits = logits.round()  # small integers: the maximum repeats in every row
        sampling = None
        if self.sampled:
            rows = torch.arange(self.batch) % 4
            sampling = SamplingInputs(
                temperature=torch.tensor([0.0, 0.7, 1.0, 1.5])[rows].to(device),
                top_k=torch.tensor([0, 50, 0, 10])[rows].to(device),
                top_p=torch.tensor([1.0, 0.9, 0.5, 1.0])[rows].to(device),
                seeds=torch.randint(0, 2**40, (self.batch,), generator=gen).to(device),
                positions=torch.randint(0, 4096, (self.batch,), generator=gen).to(device),
            )
        return logits.to(device), sampling


def _case_id(case: object) -> str:
    """The fields a case sets, e.g. ``bfloat16-batch3-group8-head_dim128-block_size32-long300``."""
    parts = []
    for f in dataclasses.fields(case):  # type: ignore[arg-type]
        value = getattr(case, f.name)
        if isinstance(value, torch.dtype):
            parts.append(str(value).removeprefix("torch."))
        elif value is True:
            parts.append(f.name)
        elif f.default is dataclasses.MISSING or (value != f.default and value is not False):
            text = "x".join(map(str, value)) if isinstance(value, tuple) else str(value)
            parts.append(f"{f.name}{text}")
    return "-".join(parts)


def _params(default: Sequence[object], sweep: Sequence[object]) -> Sequence[object]:
    slow = [pytest.param(c, id=_case_id(c), marks=pytest.mark.slow) for c in sweep]
    return [pytest.param(c, id=_case_id(c)) for c in default] + slow


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
PREFILL_CASES = [
    PrefillCase(F32, 1, 64, (1,)),
    PrefillCase(F32, 4, 64, (5, 70, 1)),
    PrefillCase(BF16, 2, 128, (33, 100)),
]
PREFILL_SWEEP = [PrefillCase(d, g, hd, (1, bs - 1, bs, bs + 1, 130)) for d, g, hd, bs in _GEOMETRY[::2]]
ROPE_CASES = [RopeCase(F32, 5, 2, 64, 16), RopeCase(BF16, 3, 2, 128, 32, kv_heads=8), RopeCase(F32, 1, 8, 128, 16)]
ROPE_SWEEP = [RopeCase(d, (1, 3, 32, 128)[i % 4], g, hd, bs) for i, (d, g, hd, bs) in enumerate(_GEOMETRY)]
NORM_CASES = [
    NormCase(F32, (3, 1024)),
    NormCase(F32, (3, 1024), residual=True),
    NormCase(BF16, (2, 8192), residual=True),
    NormCase(F32, (5, 4, 128), per_head=True),
    NormCase(BF16, (3, 2, 64), per_head=True),
]
NORM_SWEEP = [
    NormCase(d, (rows, hidden), residual=r)
    for d, rows, hidden, r in itertools.product((F32, BF16), (1, 32, 128), (64, 1024, 3000, 8192), (False, True))
] + [NormCase(d, (t, 16, hd), per_head=True) for d, t, hd in itertools.product((F32, BF16), (1, 128), (64, 128))]
SILU_CASES = [SiluCase(F32, 3, 1000), SiluCase(BF16, 1, 3072)]
SILU_SWEEP = [SiluCase(d, t, i) for d, t, i in itertools.product((F32, BF16), (1, 32, 128), (3072, 1000))]
SAMPLE_CASES = [SampleCase(1), SampleCase(3, 1000, ties=True), SampleCase(4, 1000, sampled=True)]
SAMPLE_SWEEP = [SampleCase(32, ties=True), SampleCase(128), SampleCase(32, sampled=True)]


# -- tests -------------------------------------------------------------------------------------


def assert_matches(actual: torch.Tensor, expected: torch.Tensor, what: str) -> None:
    """Same shape and dtype; max error within the dtype's tolerance of the reference's scale."""
    assert actual.shape == expected.shape, f"{what}: shape {tuple(actual.shape)}, reference {tuple(expected.shape)}"
    assert actual.dtype == expected.dtype, f"{what}: dtype {actual.dtype}, reference {expected.dtype}"
    if expected.dtype in (torch.int64, torch.int32):
        assert torch.equal(actual, expected), f"{what}: {actual.tolist()} != reference {expected.tolist()}"
        return
    tol = TOLERANCES[expected.dtype]
    a, e = actual.float(), expected.float()
    assert bool(torch.isfinite(a).all()), f"{what}: {int((~torch.isfinite(a)).sum())} values are NaN or inf"
    error = float((a - e).abs().max()) / max(float(e.abs().max()), 1e-6) if e.numel() else 0.0
    assert error <= tol, f"{what}: max error {error:.2e} of the reference's scale, above {tol:g} ({expected.dtype})"


def _check(target: OpTarget, op: str, case: object, call: Call) -> None:
    ops = target.require(op)
    build = getattr(case, "build")  # noqa: B009 - every case class has one
    actual = call(ops, build(0, target.torch_device))
    expected = call(Ops.reference(), build(0, target.torch_device))
    for index, (a, e) in enumerate(zip(actual, expected, strict=True)):
        assert_matches(a, e, f"{target.provider}.{op} output {index} ({_case_id(case)})")


def _norm(ops: Ops, args: Args) -> tuple[torch.Tensor, ...]:
    x, weight, eps, residual = args
    return ops.rms_norm(x, weight, eps, residual)  # type: ignore[arg-type]


def _rope(ops: Ops, args: Args) -> tuple[torch.Tensor, ...]:
    qk, v, positions, cos_sin, kc, vc, slots = args
    out = ops.rope_kv_write(qk, v, positions, cos_sin, kc, vc, slots)  # type: ignore[arg-type]
    return out, kc, vc  # type: ignore[return-value]


def _prefill(ops: Ops, args: Args) -> tuple[torch.Tensor, ...]:
    return (ops.prefill_attention(*args),)  # type: ignore[arg-type]


def _silu(ops: Ops, args: Args) -> tuple[torch.Tensor, ...]:
    return (ops.silu_mul(*args),)  # type: ignore[arg-type]


def _sample(ops: Ops, args: Args) -> tuple[torch.Tensor, ...]:
    return (ops.sample(*args),)  # type: ignore[arg-type]


def _decode(ops: Ops, args: Args) -> tuple[torch.Tensor, ...]:
    return _decode_call(ops, args, poison=ops.providers["paged_decode_attention"] != "reference")


CALLS: dict[str, Call] = {
    "rms_norm": _norm,
    "rope_kv_write": _rope,
    "paged_decode_attention": _decode,
    "prefill_attention": _prefill,
    "silu_mul": _silu,
    "sample": _sample,
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


@pytest.mark.parametrize("case", _params(DECODE_CASES, DECODE_SWEEP))
def test_paged_decode_attention_matches_reference(op_target: OpTarget, case: DecodeCase) -> None:
    _check(op_target, "paged_decode_attention", case, _decode)


@pytest.mark.parametrize("case", _params(PREFILL_CASES, PREFILL_SWEEP))
def test_prefill_attention_matches_reference(op_target: OpTarget, case: PrefillCase) -> None:
    _check(op_target, "prefill_attention", case, _prefill)


@pytest.mark.parametrize("case", _params(SILU_CASES, SILU_SWEEP))
def test_silu_mul_matches_reference(op_target: OpTarget, case: SiluCase) -> None:
    _check(op_target, "silu_mul", case, _silu)


@pytest.mark.parametrize("case", _params(SAMPLE_CASES, SAMPLE_SWEEP))
def test_sample_matches_reference(op_target: OpTarget, case: SampleCase) -> None:
    _check(op_target, "sample", case, _sample)


GRAPH_CASES: dict[str, object] = {
    "rms_norm": NormCase(BF16, (3, 1024), residual=True),
    "rope_kv_write": RopeCase(BF16, 3, 2, 128, 16),
    "paged_decode_attention": DecodeCase(BF16, 3, 4, 128, 16, long=300),
    "prefill_attention": PrefillCase(BF16, 2, 64, (5, 40)),
    "silu_mul": SiluCase(BF16, 3, 3072),
    "sample": SampleCase(3, ties=True),
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
    ops = op_target.require(op)
    device = op_target.device
    if device is None or not device.capabilities.graphs:
        pytest.skip(f"op provider {op_target.provider!r}: {op_target.no_graph_reason}")
    case, call = GRAPH_CASES[op], CALLS[op]
    build = getattr(case, "build")  # noqa: B009 - every case class has one
    static = build(0, op_target.torch_device)
    stream = device.stream(f"graph-{op}")
    captured: list[tuple[torch.Tensor, ...]] = []
    stream.launch(lambda: call(ops, static))  # compiles and loads the kernels outside capture
    stream.synchronize()
    graph = device.graph(f"op-{op}")
    graph.capture(lambda: stream.launch(lambda: captured.append(call(ops, static))), stream)
    stream.synchronize()
    fresh = build(1, op_target.torch_device)
    stream.launch(lambda: _copy_into(static, fresh))
    graph.replay(stream)
    stream.synchronize()
    expected = call(Ops.reference(), build(1, op_target.torch_device))
    for index, (a, e) in enumerate(zip(captured[0], expected, strict=True)):
        assert_matches(a, e, f"{op_target.provider}.{op} output {index} after graph replay ({_case_id(case)})")
