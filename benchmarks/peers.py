#!/usr/bin/env python3
"""Peer comparison: transformers ``generate()`` with a static cache, corelib, and the graph floor.

Every figure comes from one process, on the same weights (seeded random weights in Hugging
Face names, generated once on the CPU) and the same prompts, per batch size:

- transformers: ``generate(cache_implementation="static")``, greedy, EOS off. TPOT is
  (time for N new tokens - time for 1 new token) / (N - 1) after a warm-up generate, which
  also compiles the decode forward where transformers does that by itself (CUDA);
- corelib: the engine with graphs, async token handoff off and on; TPOT is the median over
  requests of ``RequestOutput.tpot_ms``, median over repeats, after a warm-up generate;
- the graph floor: the engine's captured decode graphs replayed back to back with no host
  read, timed with device events, each KV-width bucket weighted by how many decode steps use it;
- the weight-read floor: bytes of weights read per decode step / the copy bandwidth of a
  large device-to-device copy;
- greedy agreement: per request, how many new tokens agree before the first difference
  (bf16 kernels differ, so this is reported, never asserted).

    python3 benchmarks/peers.py --out peers.json                      # small-0.6b, bs 1 and 32, CUDA
    python3 benchmarks/peers.py --model tiny --device cpu --new-tokens 8 --batch-sizes 1 2
"""

from __future__ import annotations

import argparse
import gc
import json
import platform
import statistics
import sys
import time
from collections import Counter
from collections.abc import Callable, Sequence
from typing import Any

import torch

from corelib.config.schema import CorelibConfig
from corelib.engine.api import Engine
from corelib.engine.sequence import SamplingParams
from corelib.errors import ConfigError
from corelib.models.base import Model
from corelib.models.llama import LlamaModel, ModelWeights, build_weights
from corelib.models.random_init import random_state_dict
from corelib.models.registry import llama_variant, model_shape
from corelib.models.rope import inv_freq
from corelib.models.shape import ModelShape
from corelib.models.sharding import TensorShard
from corelib.models.weight_map import LM_HEAD, weight_map
from corelib.platform.device import Device
from corelib.plugins import PluginRegistry
from corelib.startup.compose import compose_config, prepare_config_store
from corelib.startup.start import Startup, start
from corelib.step.buckets import blocks_for
from corelib.step.runner import Sampler

FLOOR_WARMUP = 10  # replays before the timed ones
Json = dict[str, Any]


def parse_args(argv: Sequence[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--model", default="small-0.6b", help="corelib model preset (conf/model), e.g. tiny")
    parser.add_argument("--dtype", default=None, help="weights dtype (default: the preset's)")
    parser.add_argument("--seed", type=int, default=0, help="seed of the random weights")
    parser.add_argument("--device", choices=["cuda", "cpu"], default="cuda" if torch.cuda.is_available() else "cpu")
    parser.add_argument("--batch-sizes", type=int, nargs="+", default=[1, 32])
    parser.add_argument("--prompt-len", type=int, default=32)
    parser.add_argument("--new-tokens", type=int, default=128)
    parser.add_argument("--repeats", type=int, default=3, help="timed repeats per point; medians are reported")
    parser.add_argument("--floor-replays", type=int, default=200, help="back-to-back graph replays per bucket")
    parser.add_argument("--copy-mib", type=int, default=None, help="copy size for the bandwidth (default 1024 "
                        "on cuda, 64 on cpu)")
    parser.add_argument("--no-compile", action="store_true", help="transformers: generate(disable_compile=True)")
    parser.add_argument("--skip-transformers", action="store_true", help="corelib and the floors only")
    parser.add_argument("--set", nargs="*", default=[], metavar="KEY=VALUE",
                        help="more corelib overrides, e.g. backend=cuda backend.runtime=emulated")
    parser.add_argument("--out", default=None, help="write the results as JSON to this file")
    args = parser.parse_args(argv)
    if args.new_tokens < 2:
        parser.error("--new-tokens must be at least 2 (TPOT needs a decode step)")
    if args.copy_mib is None:
        args.copy_mib = 1024 if args.device == "cuda" else 64
    return args


def timed(fn: Callable[[], Any], device: torch.device) -> tuple[Any, float]:
    """``fn()`` and its wall time, the device synchronized before and after."""
    synchronize = torch.cuda.synchronize if device.type == "cuda" else lambda _: None
    synchronize(device)
    start = time.perf_counter()
    result = fn()
    synchronize(device)
    return result, time.perf_counter() - start


# ---------------------------------------------------------------------- corelib
def overrides(args: argparse.Namespace, batch_size: int, handoff: str) -> list[str]:
    # Context for prompt + output only, so the engine captures the KV-width buckets this run uses
    # (transformers' static cache is sized the same way: prompt + new tokens).
    max_len = 1 << (args.prompt_len + args.new_tokens).bit_length()
    return [
        f"model={args.model}", f"model.seed={args.seed}", f"model.max_model_len={max_len}",
        *([f"model.dtype={args.dtype}"] if args.dtype else []),
        *(["backend=cuda", "backend.runtime=native", "engine.graph=on"] if args.device == "cuda" else ["backend=cpu"]),
        f"engine.max_num_seqs={batch_size}", f"engine.graph_batch_sizes=[{batch_size}]",
        f"engine.max_num_batched_tokens={max(batch_size * args.prompt_len, 256)}",
        f"engine.async_token_handoff={handoff}", *args.set,
    ]


def corelib_run(engine: Engine, prompts: list[list[int]], new_tokens: int,
                repeats: int) -> tuple[Json, list[list[int]]]:
    sampling = SamplingParams(max_tokens=new_tokens, ignore_eos=True)
    start = time.perf_counter()
    engine.generate(prompts, sampling)
    warmup_s = time.perf_counter() - start
    first_step = engine.stats().num_steps
    tpots, tokens = [], []
    for _ in range(repeats):
        outputs = engine.generate(prompts, sampling)
        tpots.append(statistics.median(o.tpot_ms for o in outputs if o.tpot_ms is not None))
        tokens = [o.output_token_ids for o in outputs]
    device = engine.stats(since_step=first_step).device
    return {
        "tpot_ms": statistics.median(tpots), "repeats_tpot_ms": tpots, "warmup_s": warmup_s,
        "async_token_handoff": engine.async_handoff, "graphs": engine.options.graphs,
        "graph_steps": engine.local_runner.num_graph_steps, "eager_steps": engine.local_runner.num_eager_steps,
        "occupancy": device["occupancy"], "idle_gap_median_us": device["idle_gap_median_us"],
    }, tokens


def graph_floor(engine: Engine, batch_size: int, prompt_len: int, new_tokens: int, replays: int) -> Json:
    """Back-to-back replays of the decode graphs a run uses, weighted by its decode steps per bucket.

    The decode arena still holds the last real decode step, so every replay reads a valid batch.
    """
    runner, buckets, device = engine.local_runner, engine.core.buckets, engine.local_device
    if not runner.graphs:
        return {"skipped": "graphs are off on this device"}
    block_size = engine.layout.block_size
    steps: Counter[tuple[int, int]] = Counter()
    for position in range(prompt_len, prompt_len + new_tokens - 1):  # the position each decode step feeds
        rows, kv, _ = buckets.decode_shape(batch_size, blocks_for(position + 1, block_size))
        steps[(rows, buckets.graph_kv(kv))] += 1
    stream = runner.compute
    per_bucket: dict[str, float] = {}
    total = 0.0
    device.synchronize()
    for (rows, kv), count in sorted(steps.items()):
        graph = runner.graphs.get((rows, kv, Sampler.argmax, False))  # greedy, no logprobs
        if graph is None:
            return {"skipped": f"no captured graph for {rows} rows x {kv} KV blocks"}
        for _ in range(FLOOR_WARMUP):
            graph.replay(stream)
        start = stream.record(device.event(timing=True, name="floor.start"))
        for _ in range(replays):
            graph.replay(stream)
        end = stream.record(device.event(timing=True, name="floor.end"))
        end.synchronize()
        per_bucket[f"{rows}x{kv * block_size}"] = ms = start.elapsed_ms(end) / replays
        total += ms * count
    return {"ms": total / sum(steps.values()), "per_bucket_ms": per_bucket,
            "decode_steps_per_bucket": {f"{r}x{kv * block_size}": c for (r, kv), c in sorted(steps.items())}}


def copy_bandwidth(device: Device, mib: int, repeats: int = 5) -> float:
    """Bytes moved per second (read + written) by a large device-to-device copy."""
    nbytes = mib << 20
    src, dst = device.empty((nbytes,), torch.uint8), device.empty((nbytes,), torch.uint8)
    stream = device.stream("peers-copy")
    stream.launch(lambda: src.fill_(1))
    stream.copy(dst, src)  # warm-up
    start = stream.record(device.event(timing=True, name="copy.start"))
    for _ in range(repeats):
        stream.copy(dst, src)
    end = stream.record(device.event(timing=True, name="copy.end"))
    end.synchronize()
    return 2 * nbytes * repeats / (start.elapsed_ms(end) / 1e3)


def weight_bytes(shape: ModelShape) -> tuple[int, int]:
    """(bytes a decode step reads, bytes of all parameters): a step gathers only its rows of the embedding."""
    size = shape.dtype.itemsize
    weights = weight_map(shape)
    return weights.step_parameter_count() * size, weights.parameter_count() * size


# ---------------------------------------------------------------------- transformers
def hf_model(shape: ModelShape, state: dict[str, torch.Tensor], device: torch.device) -> Any:
    """A transformers model of the same shape holding the same tensors (same names, keys checked)."""
    import transformers

    family = "Qwen3" if shape.qk_norm else "Qwen2" if shape.attention_bias else "Llama"
    config = getattr(transformers, f"{family}Config")(
        vocab_size=shape.vocab_size, hidden_size=shape.hidden_size, intermediate_size=shape.intermediate_size,
        num_hidden_layers=shape.num_layers, num_attention_heads=shape.num_heads,
        num_key_value_heads=shape.num_kv_heads, head_dim=shape.head_dim, max_position_embeddings=shape.max_model_len,
        rms_norm_eps=shape.rms_norm_eps, rope_theta=shape.rope_theta, tie_word_embeddings=shape.tie_word_embeddings,
        bos_token_id=None, eos_token_id=None, pad_token_id=0,
    )
    previous = torch.get_default_dtype()
    torch.set_default_dtype(shape.dtype)  # as from_pretrained(dtype=...) does: RoPE buffers stay float32
    try:
        with torch.device(device):
            model = getattr(transformers, f"{family}ForCausalLM")(config)
    finally:
        torch.set_default_dtype(previous)
    expected = set(model.state_dict())
    tied = {LM_HEAD} if shape.tie_word_embeddings else set()
    missing, unexpected = sorted(expected - set(state) - tied), sorted(set(state) - expected)
    if missing or unexpected:
        raise ConfigError(f"state dict and transformers model differ: missing {missing[:3]}, unexpected "
                          f"{unexpected[:3]}")
    model.load_state_dict(state, strict=False)
    ours, _ = inv_freq(shape.head_dim, shape.rope_theta, None)
    theirs = model.model.rotary_emb.inv_freq.detach().cpu().double()
    if not torch.allclose(theirs, ours.double(), rtol=1e-5):
        raise ConfigError("transformers' RoPE frequencies differ from corelib's; the config did not carry rope_theta")
    model.generation_config.eos_token_id = None  # run every request to its full length, as ignore_eos does
    return model.eval()


def hf_run(model: Any, prompts: list[list[int]], args: argparse.Namespace,
           compile_: bool) -> tuple[Json, list[list[int]]]:
    device, new_tokens = model.device, args.new_tokens
    ids = torch.tensor(prompts, device=device)
    mask = torch.ones_like(ids)

    # Passed only when asked for: transformers releases before the option reject the keyword.
    no_compile = {} if compile_ else {"disable_compile": True}

    def generate(count: int) -> torch.Tensor:
        out: torch.Tensor = model.generate(ids, attention_mask=mask, max_new_tokens=count, do_sample=False,
                                           cache_implementation="static", pad_token_id=0, **no_compile)
        return out

    if hasattr(model, "_compiled_call"):
        # A fresh compile per batch size: no dynamic shapes carried over from the last one.
        del model._compiled_call
        torch._dynamo.reset()
    out, warmup_s = timed(lambda: generate(new_tokens), device)
    ones, fulls = [], []
    for _ in range(args.repeats):
        ones.append(timed(lambda: generate(1), device)[1])
        out, seconds = timed(lambda: generate(new_tokens), device)
        fulls.append(seconds)
    tokens = out[:, len(prompts[0]):].tolist()
    if any(len(t) != new_tokens for t in tokens):
        raise RuntimeError(f"transformers generated {len(tokens[0])} tokens, not {new_tokens}")
    full, one = statistics.median(fulls), statistics.median(ones)
    return {
        "tpot_ms": (full - one) / (new_tokens - 1) * 1e3, "time_1_token_s": one, f"time_{new_tokens}_tokens_s": full,
        "warmup_s": warmup_s, "compile_and_warmup_s": warmup_s - full,
        "compiled": hasattr(model, "_compiled_call"), "attn_implementation": model.config._attn_implementation,
    }, tokens


# ---------------------------------------------------------------------- the run
def agreement(ours: list[list[int]], theirs: list[list[int]]) -> Json:
    """How many leading new tokens agree, per request."""
    prefix = []
    for a, b in zip(ours, theirs, strict=True):
        same = next((i for i, (x, y) in enumerate(zip(a, b, strict=False)) if x != y), min(len(a), len(b)))
        prefix.append(same)
    return {"min": min(prefix), "median": statistics.median(prefix), "all_equal": sum(p == len(a) for p, a in
            zip(prefix, ours, strict=True)), "requests": len(prefix), "per_request": prefix}


def prompts_for(batch_size: int, prompt_len: int, vocab: int, seed: int) -> list[list[int]]:
    generator = torch.Generator().manual_seed(seed)
    # Ids from 2 on: 0 pads and 1 is the presets' EOS.
    prompts: list[list[int]] = torch.randint(2, vocab, (batch_size, prompt_len), generator=generator).tolist()
    return prompts


def run(args: argparse.Namespace) -> Json:
    began = time.perf_counter()
    registry = PluginRegistry()
    prepare_config_store(registry)

    def startup(batch_size: int, handoff: str) -> Startup:
        return start(compose_config(overrides(args, batch_size, handoff)), registry)

    first = startup(args.batch_sizes[0], "off")
    shape = model_shape(first.config.model)
    result: Json = {"machine": machine(), "settings": {k: v for k, v in vars(args).items() if k != "out"}}
    result["weight_read_floor"] = weight_read_floor(first, shape, args.copy_mib)
    torch_device = torch.device(args.device)
    # One set of weights for every engine and for transformers: generated on the CPU, converted once.
    cpu_state = random_state_dict(shape, args.seed)
    state = {name: cpu_state.pop(name).to(device=torch_device, dtype=shape.dtype) for name in list(cpu_state)}
    built: list[ModelWeights] = []

    def shared_weights(config: CorelibConfig, device: Device, shard: TensorShard | None) -> Model:
        if shard is not None:
            raise ValueError("peers.py compares one device; it does not shard")
        if not built:
            built.append(build_weights(shape, state, device.torch_device))
        architecture = llama_variant(config.model.architecture)
        return LlamaModel(built[0], architecture.facts(config.model), compile_decode=config.engine.compile)

    model, result["transformers"] = load_transformers(args, shape, state, torch_device)
    result["model"] = {"preset": args.model, "dtype": str(shape.dtype).removeprefix("torch."), "seed": args.seed,
                       "parameters": weight_map(shape).parameter_count()}
    result["points"] = []
    for batch_size in args.batch_sizes:
        prompts = prompts_for(batch_size, args.prompt_len, shape.vocab_size, seed=1000 + batch_size)
        point: Json = {"batch_size": batch_size}
        hf_tokens = None
        if model is not None:
            try:
                point["transformers"], hf_tokens = hf_run(model, prompts, args, not args.no_compile)
            except Exception as error:  # a failed compile must not cost the whole run: retry eagerly
                if args.no_compile:
                    raise
                point["transformers"], hf_tokens = hf_run(model, prompts, args, compile_=False)
                point["transformers"]["compile_error"] = f"{type(error).__name__}: {error}"[:400]
        tokens: dict[str, list[list[int]]] = {}
        for handoff, name in (("off", "corelib_sync"), ("on", "corelib_async")):
            try:
                engine = Engine(first if (batch_size, handoff) == (args.batch_sizes[0], "off")
                                else startup(batch_size, handoff), shared_weights)
            except ConfigError as error:
                point[name] = {"skipped": " / ".join(str(error).splitlines())}
                continue
            with engine:
                point[name], tokens[handoff] = corelib_run(engine, prompts, args.new_tokens, args.repeats)
                if "ms" not in point.get("graph_floor", {}):
                    point["graph_floor"] = graph_floor(engine, batch_size, args.prompt_len, args.new_tokens,
                                                       args.floor_replays)
        if len(tokens) == 2:
            point["sync_async_tokens_equal"] = tokens["off"] == tokens["on"]
        reference = tokens.get("off") or tokens.get("on")
        if hf_tokens is not None and reference is not None:
            point["token_agreement"] = agreement(reference, hf_tokens)
        result["points"].append(point)
        gc.collect()
    result["total_s"] = time.perf_counter() - began
    return result


def weight_read_floor(startup: Startup, shape: ModelShape, copy_mib: int) -> Json:
    read_bytes, all_bytes = weight_bytes(shape)
    device = startup.backend.open(startup.spec)
    try:
        rate = copy_bandwidth(device, copy_mib)
    finally:
        device.close()
    return {"copy_bytes_per_s": rate, "bytes_read_per_step": read_bytes, "bytes_all_parameters": all_bytes,
            "ms": read_bytes / rate * 1e3, "all_parameters_ms": all_bytes / rate * 1e3,
            "note": "the copy rate counts bytes read + written; a decode step reads every weight but the embedding"}


def load_transformers(args: argparse.Namespace, shape: ModelShape, state: dict[str, torch.Tensor],
                      device: torch.device) -> tuple[Any, Json]:
    if args.skip_transformers:
        return None, {"skipped": "--skip-transformers"}
    if shape.conv_kernel or shape.rope_scaling is not None:
        return None, {"skipped": f"model={args.model} has hybrid layers or RoPE scaling, which this script does not "
                                 "map to a transformers config"}
    try:
        import transformers
    except ImportError:
        return None, {"skipped": "transformers is not installed (pip install 'corelib[bench]')"}
    model = hf_model(shape, state, device)
    return model, {"version": transformers.__version__, "disable_compile": args.no_compile,
                   "compile_config": str(getattr(model.generation_config, "compile_config", None)
                                         or "transformers' default")}


def machine() -> Json:
    info: Json = {"date": time.strftime("%Y-%m-%d"), "python": platform.python_version(), "torch": torch.__version__}
    if torch.cuda.is_available():
        info.update(gpu=torch.cuda.get_device_name(0), cuda=torch.version.cuda)
    return info


def table(result: Json) -> str:
    """A short summary: TPOT in ms/token per batch size, then the floors and token agreement."""

    def cell(point: Json, key: str, field: str = "tpot_ms", digits: int = 3) -> str:
        value = point.get(key, {}).get(field)
        return "-" if value is None else f"{value:.{digits}f}"

    settings, hf, floor = result["settings"], result["transformers"], result["weight_read_floor"]
    compiled = {p.get("transformers", {}).get("compiled") for p in result["points"]} - {None}
    lines = [
        f"peers: {result['model']['preset']} ({result['model']['parameters'] / 1e9:.2f} B params, "
        f"{result['model']['dtype']}), prompt {settings['prompt_len']}, {settings['new_tokens']} new tokens, greedy, "
        f"{settings['device']}; transformers {hf.get('version', hf.get('skipped'))}, decode compiled: "
        f"{'/'.join(sorted(map(str, compiled))) or '-'}",
        f"weight-read floor {floor['ms']:.3f} ms/step ({floor['bytes_read_per_step'] / 1e9:.2f} GB at "
        f"{floor['copy_bytes_per_s'] / 1e12:.2f} TB/s; all parameters {floor['all_parameters_ms']:.3f} ms)",
        f"{'bs':>4} {'HF static':>10} {'HF compile s':>12} {'corelib sync':>13} {'corelib async':>14} "
        f"{'graph floor':>12} {'async/HF':>9} {'tokens agree min/median':>24}",
    ]
    for p in result["points"]:
        hf_ms, async_ms = p.get("transformers", {}).get("tpot_ms"), p.get("corelib_async", {}).get("tpot_ms")
        ratio = f"{async_ms / hf_ms:.2f}" if hf_ms and async_ms else "-"
        agree = p.get("token_agreement")
        agreed = f"{agree['min']}/{agree['median']:g} of {settings['new_tokens']}" if agree else "-"
        lines.append(
            f"{p['batch_size']:>4} {cell(p, 'transformers'):>10} "
            f"{cell(p, 'transformers', 'compile_and_warmup_s', 1):>12} {cell(p, 'corelib_sync'):>13} "
            f"{cell(p, 'corelib_async'):>14} {cell(p, 'graph_floor', 'ms'):>12} {ratio:>9} {agreed:>24}"
        )
    return "\n".join(lines)


def main(argv: Sequence[str] | None = None) -> int:
    args = parse_args(argv)
    try:
        result = run(args)
    except ConfigError as error:
        print(f"peers: error: {error}", file=sys.stderr)
        return 2
    if args.out:
        with open(args.out, "w") as handle:
            json.dump(result, handle, indent=2, default=str)
            handle.write("\n")
        print(f"peers: wrote {args.out}")
    print(table(result))
    return 0


if __name__ == "__main__":
    sys.exit(main())
