"""The Triton ops against the plain-torch reference on one GPU, at small-0.6b decode shapes.

For each op: median time of the Triton op and of the reference (``triton.testing.do_bench``,
eager launches, L2 flushed between runs, and ``do_bench_cudagraph``: the same inside a CUDA
graph, as the engine replays it), and the Triton result's error against the reference
(max |triton - reference| over max |reference|; greedy tokens must match exactly). Then one
decode layer built from each ops set (rms_norm, qkv linear, rope_kv_write, attention, o linear,
rms_norm + residual, gate_up linear, silu_mul, down linear): its kernels counted with
torch.profiler, and a CUDA graph of all the model's layers timed per step.

    python3 benchmarks/ops_h200.py                       # bs 1 32 128, context 96 and 1900, head_dim 64
    (paged_attention(chunks): `bs` rows each feeding its last min(context, 512) tokens as one chunk)
    python3 benchmarks/ops_h200.py --head-dim 128 --out ops.json
"""

from __future__ import annotations

import argparse
import json
import math
import sys
from collections.abc import Callable
from dataclasses import asdict, dataclass

import torch
import torch.nn.functional as F
from corelib_cuda.backend import CUDABackend
from corelib_cuda.triton_ops import TritonOps

from corelib.ops import Ops, PagedAttention
from corelib.ops.reference import reference_ops
from corelib.platform.backend import DeviceSpec
from corelib.platform.device import Capabilities, Runtime

BLOCK_SIZE = 16


@dataclass(frozen=True)
class Shape:
    """small-0.6b (conf/model/small-0.6b.yaml); head_dim 128 gives the Qwen3-0.6B attention."""

    hidden: int = 1024
    heads: int = 16
    kv_heads: int = 8
    head_dim: int = 64
    inter: int = 3072
    vocab: int = 151936
    layers: int = 28
    eps: float = 1e-6


def _rel_error(actual: torch.Tensor, expected: torch.Tensor) -> float:
    if actual.dtype == torch.int64:
        return 0.0 if torch.equal(actual, expected) else float("inf")
    scale = float(expected.float().abs().max())
    return float((actual.float() - expected.float()).abs().max()) / max(scale, 1e-6)


def _bench(fn: Callable[[], object], graph: bool) -> tuple[float, float]:
    """(eager, graph) median microseconds; graph NaN where the op is never captured (prefill)."""
    import triton.testing

    eager = triton.testing.do_bench(fn, warmup=25, rep=200, return_mode="median")
    if not graph:
        return 1e3 * float(eager), float("nan")
    with torch.cuda.stream(torch.cuda.Stream()):  # type: ignore[no-untyped-call]
        replayed = triton.testing.do_bench_cudagraph(fn, rep=200, return_mode="median")
    return 1e3 * float(eager), 1e3 * float(replayed)


@dataclass
class Layer:
    """One decoder layer's weights and paged cache, with the step's inputs."""

    shape: Shape
    batch: int
    context: int
    dtype: torch.dtype = torch.bfloat16

    def __post_init__(self) -> None:
        s, dev, dt = self.shape, "cuda", self.dtype
        q_size, kv_size = s.heads * s.head_dim, s.kv_heads * s.head_dim

        def weight(*size: int) -> torch.Tensor:
            return (torch.randn(size, device=dev) / math.sqrt(size[-1])).to(dt)

        self.input_norm = 1 + 0.1 * weight(s.hidden)
        self.post_norm = 1 + 0.1 * weight(s.hidden)
        self.qkv = weight(q_size + 2 * kv_size, s.hidden)
        self.o = weight(s.hidden, q_size)
        self.gate_up = weight(2 * s.inter, s.hidden)
        self.down = weight(s.hidden, s.inter)
        width = -(-self.context // BLOCK_SIZE)
        blocks = self.batch * width + 1
        self.k_cache = torch.randn(blocks, BLOCK_SIZE, s.kv_heads, s.head_dim, device=dev).to(dt)
        self.v_cache = torch.randn_like(self.k_cache)
        tables = 1 + torch.randperm(blocks - 1, device=dev)[: self.batch * width].view(self.batch, width)
        seq_lens = torch.full((self.batch,), self.context, device=dev)
        self.attn = PagedAttention(tables.to(torch.int32), seq_lens, BLOCK_SIZE)
        self.positions = seq_lens - 1
        last_block = tables[:, -1].to(torch.int64)
        self.slot_mapping = last_block * BLOCK_SIZE + (self.positions % BLOCK_SIZE)
        angles = torch.rand(4096, 1, s.head_dim, device=dev) * 6.3
        self.cos_sin = torch.cat((angles.cos(), angles.sin()), dim=1).to(dt)
        self.h = torch.randn(self.batch, s.hidden, device=dev).to(dt)
        self.residual = torch.randn(self.batch, s.hidden, device=dev).to(dt)

    def forward(self, ops: Ops, h: torch.Tensor, residual: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        s, batch = self.shape, self.batch
        nh, nkv, hd = s.heads, s.kv_heads, s.head_dim
        x, residual = ops.rms_norm(h, self.input_norm, s.eps, residual)  # [B, H]
        qkv = F.linear(x, self.qkv)  # [B, (nh + 2 nkv) hd]
        qk = qkv[:, : (nh + nkv) * hd].view(batch, nh + nkv, hd)
        v = qkv[:, (nh + nkv) * hd :].view(batch, nkv, hd)
        rotated = ops.rope_kv_write(qk, v, self.positions, self.cos_sin, self.k_cache, self.v_cache, self.slot_mapping)
        attn = ops.paged_attention(rotated[:, :nh], self.k_cache, self.v_cache, self.attn, hd**-0.5)
        h = F.linear(attn.reshape(batch, nh * hd), self.o)
        x, residual = ops.rms_norm(h, self.post_norm, s.eps, residual)
        return F.linear(ops.silu_mul(F.linear(x, self.gate_up)), self.down), residual


@dataclass(frozen=True)
class OpRow:
    op: str
    batch: int
    context: int
    triton_us: float
    reference_us: float
    triton_graph_us: float
    reference_graph_us: float
    rel_error: float


@dataclass(frozen=True)
class LayerRow:
    ops: str
    batch: int
    context: int
    kernels_per_layer: int
    layers_ms_per_step: float
    kernels: list[str]


def op_rows(layer: Layer, ops: Ops, include_context_free: bool) -> list[OpRow]:
    s, batch, reference = layer.shape, layer.batch, reference_ops()
    nh, nkv, hd = s.heads, s.kv_heads, s.head_dim
    qkv = torch.randn(batch, (nh + 2 * nkv) * hd, device="cuda").to(layer.dtype)
    qk, v = qkv[:, : (nh + nkv) * hd].view(batch, nh + nkv, hd), qkv[:, (nh + nkv) * hd :].view(batch, nkv, hd)
    q = torch.randn(batch, nh, hd, device="cuda").to(layer.dtype)
    gate_up = torch.randn(batch, 2 * s.inter, device="cuda").to(layer.dtype)
    logits = torch.randn(batch, s.vocab, device="cuda")
    cases: dict[str, Callable[[Ops], object]] = {
        "paged_attention(decode)": lambda o: o.paged_attention(q, layer.k_cache, layer.v_cache, layer.attn,
                                                               hd**-0.5),
    }
    chunk = min(layer.context, 512)
    if batch * chunk <= 65536:  # each row's last `chunk` tokens as one prefill chunk over its cached context
        pq = torch.randn(batch * chunk, nh, hd, device="cuda").to(layer.dtype)
        starts = torch.arange(0, batch * chunk + 1, chunk, device="cuda")
        chunked = PagedAttention(layer.attn.block_tables, layer.attn.seq_lens, layer.attn.block_size, starts, chunk)
        cases["paged_attention(chunks)"] = lambda o: o.paged_attention(pq, layer.k_cache, layer.v_cache, chunked,
                                                                       hd**-0.5)
    if include_context_free:
        cases |= {
            "rms_norm+residual": lambda o: o.rms_norm(layer.h, layer.input_norm, s.eps, layer.residual)[0],
            "rms_norm(q heads)": lambda o: o.rms_norm(qk[:, :nh], layer.input_norm[:hd], s.eps)[0],
            "rope_kv_write": lambda o: o.rope_kv_write(qk, v, layer.positions, layer.cos_sin, layer.k_cache,
                                                       layer.v_cache, layer.slot_mapping),
            "silu_mul": lambda o: o.silu_mul(gate_up),
            "sample(greedy)": lambda o: o.sample(logits, None),
            "torch.argmax": lambda o: logits.argmax(dim=-1),
        }
    rows = []
    for name, run in cases.items():
        actual, expected = run(ops), run(reference)
        assert isinstance(actual, torch.Tensor) and isinstance(expected, torch.Tensor)
        graph = name != "paged_attention(chunks)"  # eager in the engine; the reference is not capturable
        triton_us, triton_graph_us = _bench(lambda run=run: run(ops), graph)  # type: ignore[misc]
        ref_us, ref_graph_us = _bench(lambda run=run: run(reference), graph)  # type: ignore[misc]
        error = _rel_error(actual, expected)
        rows.append(OpRow(name, batch, layer.context, triton_us, ref_us, triton_graph_us, ref_graph_us, error))
    return rows


def layer_rows(layer: Layer, sets: dict[str, Ops]) -> list[LayerRow]:
    from torch.profiler import ProfilerActivity, profile

    rows = []
    for name, ops in sets.items():
        layer.forward(ops, layer.h, layer.residual)  # compile and warm up
        torch.cuda.synchronize()
        with profile(activities=[ProfilerActivity.CUDA]) as prof:
            layer.forward(ops, layer.h, layer.residual)
            torch.cuda.synchronize()
        kernels = [e.name for e in prof.events() if e.device_type.name == "CUDA"]  # kernels, copies, memsets
        stream = torch.cuda.Stream()  # type: ignore[no-untyped-call]
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph, stream=stream):
            h, residual = layer.h, layer.residual
            for _ in range(layer.shape.layers):  # one layer's weights and cache stand for each
                h, residual = layer.forward(ops, h, residual)
        start, end = (torch.cuda.Event(enable_timing=True) for _ in range(2))  # type: ignore[no-untyped-call]
        for _ in range(3):
            graph.replay()
        start.record()
        for _ in range(20):
            graph.replay()
        end.record()
        end.synchronize()
        step_ms = start.elapsed_time(end) / 20
        rows.append(LayerRow(name, layer.batch, layer.context, len(kernels), step_ms, kernels))
    return rows


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--batch", type=int, nargs="+", default=[1, 32, 128])
    parser.add_argument("--context", type=int, nargs="+", default=[96, 1900], help="keys per sequence (32 + 64 ...)")
    parser.add_argument("--head-dim", type=int, default=64)
    parser.add_argument("--out", help="write every row as JSON here")
    parser.add_argument("--kernels", action="store_true", help="list each decode layer's kernels by name")
    args = parser.parse_args(argv)
    provider = TritonOps()
    reason = provider.available()
    if reason is not None:
        print(f"ops_h200: {reason}", file=sys.stderr)
        return 2
    device = CUDABackend().open(DeviceSpec("cuda", Runtime.native, Capabilities(graphs=True, streams=True)))
    triton_ops = reference_ops().with_provider(provider.name, provider.load(device))
    shape = Shape(head_dim=args.head_dim)
    torch.manual_seed(0)
    print(f"{torch.cuda.get_device_name()}, torch {torch.__version__}, head_dim {shape.head_dim}, bfloat16")
    ops: list[OpRow] = []
    layers: list[LayerRow] = []
    for batch in args.batch:
        for index, context in enumerate(args.context):
            layer = Layer(shape, batch, context)
            ops += op_rows(layer, triton_ops, include_context_free=index == 0)
            layers += layer_rows(layer, {"reference": reference_ops(), "triton": triton_ops})
            del layer
    print(f"\n{'op':24} {'bs':>4} {'ctx':>5} {'triton us':>10} {'ref us':>9} {'x':>6} "
          f"{'graph: triton':>14} {'ref':>8} {'x':>6} {'rel err':>9}")
    for r in ops:
        print(f"{r.op:24} {r.batch:>4} {r.context:>5} {r.triton_us:10.1f} {r.reference_us:9.1f} "
              f"{r.reference_us / r.triton_us:6.2f} {r.triton_graph_us:14.1f} {r.reference_graph_us:8.1f} "
              f"{r.reference_graph_us / r.triton_graph_us:6.2f} {r.rel_error:9.1e}")
    print(f"\n{'decode layer':14} {'bs':>4} {'ctx':>5} {'kernels/layer':>14} {f'{shape.layers} layers ms/step':>20}")
    for row in layers:
        print(f"{row.ops:14} {row.batch:>4} {row.context:>5} {row.kernels_per_layer:>14} "
              f"{row.layers_ms_per_step:20.3f}")
        if args.kernels:
            print("    " + "\n    ".join(row.kernels))
    failed = [r for r in ops if r.rel_error > 2e-2]
    for r in failed:
        print(f"ops_h200: {r.op} bs {r.batch} ctx {r.context}: error {r.rel_error:.2e} above 2e-2", file=sys.stderr)
    if args.out:
        with open(args.out, "w") as f:
            rows = {"ops": [asdict(r) for r in ops], "layers": [asdict(r) for r in layers]}
            json.dump({"head_dim": shape.head_dim, **rows}, f, indent=1)
    device.close()
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
