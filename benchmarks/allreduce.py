"""The all-reduces of one tensor-parallel decode step, timed alone on two GPUs: NCCL and symmetric memory.

A decode step of the Llama shape does two all-reduces per layer (after o_proj and after
down_proj) of [batch, hidden] activations. This issues exactly that many back to back and
times them with events, eagerly and replayed from one CUDA graph (as inside the engine), with
the process group's NCCL and with corelib's symmetric-memory all-reduce
(``corelib.transport.parallel.SymmetricAllReduce``, the path ``engine.fast_allreduce`` enables).
Each figure is one step's all-reduces, so its share of a measured tp=2 step is at most
all-reduce / TPOT. Before timing, each path's sum is checked against the expected one.

    python3 benchmarks/allreduce.py --out allreduce.json                  # small-0.6b and llama-8b, bs 1 and 32
    python3 benchmarks/allreduce.py --layers 28 --hidden 1024 --batch 1 32  # one shape

Multicast (NVLS) stays off in every process: NCCL_NVLS_ENABLE=0, TORCH_SYMM_MEM_DISABLE_MULTICAST=1,
NVSHMEM_DISABLE_NVLS=1.
"""

from __future__ import annotations

import argparse
import json
import os
import socket
import sys
import time
import traceback
from collections.abc import Callable
from typing import Any

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from corelib.transport.parallel import SymmetricAllReduce, collective_all_reduce
from corelib.trust.isolation import NO_MULTICAST

# model: (layers, hidden) of the presets in conf/model
SHAPES = {"small-0.6b": (28, 1024), "llama-8b": (32, 4096)}

AllReduce = Callable[[torch.Tensor], torch.Tensor]


def _free_port() -> int:
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        return int(probe.getsockname()[1])


def _check(all_reduce: AllReduce, rows: int, hidden: int, rank: int, world: int) -> str:
    """'' when ``all_reduce`` sums like NCCL does; else what differs."""
    x = torch.full((rows, hidden), float(rank + 1), dtype=torch.bfloat16, device="cuda")
    all_reduce(x)
    expected = float(world * (world + 1) // 2)
    torch.cuda.synchronize()
    if not bool((x == expected).all()):
        return f"wrong sum: {sorted(set(x.float().flatten().tolist()))[:4]} instead of {expected}"
    return ""


def _time_step(all_reduce: AllReduce, x: torch.Tensor, count: int, repeats: int, graph: bool,
               side: torch.cuda.Stream) -> float:
    """Milliseconds for ``count`` all-reduces of ``x`` back to back (one decode step's), mean of ``repeats``."""
    for _ in range(3):  # warm-up: NCCL channels, symmetric-memory handles, allocator
        all_reduce(x)
    torch.cuda.synchronize()
    replay = None
    if graph:
        captured = torch.cuda.CUDAGraph()
        with torch.cuda.graph(captured, stream=side):
            for _ in range(count):
                all_reduce(x)
        replay = captured.replay
        replay()  # the first replay uploads the graph
    dist.barrier()
    torch.cuda.synchronize()
    start = torch.cuda.Event(enable_timing=True)  # type: ignore[no-untyped-call]
    end = torch.cuda.Event(enable_timing=True)  # type: ignore[no-untyped-call]
    start.record()
    for _ in range(repeats):
        if replay is not None:
            replay()
        else:
            for _ in range(count):
                all_reduce(x)
    end.record()
    end.synchronize()
    return float(start.elapsed_time(end)) / repeats


def _rank(rank: int, world: int, port: int, args: argparse.Namespace, results: Any) -> None:
    os.environ.update(NO_MULTICAST)
    torch.cuda.set_device(rank)
    device = torch.device("cuda", rank)
    dist.init_process_group("nccl", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=world,
                            device_id=device)
    nccl = collective_all_reduce()
    paths: dict[str, AllReduce] = {"nccl": nccl}
    notes: list[str] = []
    try:
        paths["symmetric"] = SymmetricAllReduce.create(device, nccl)
    except Exception as error:  # noqa: BLE001 - reported, and NCCL is still measured
        notes.append(f"symmetric memory could not be set up: {type(error).__name__}: {error}")
    side = torch.cuda.Stream()  # type: ignore[no-untyped-call]
    rows: list[dict[str, Any]] = []
    for model, (layers, hidden) in args.shapes.items():
        for batch in args.batch:
            for name, all_reduce in paths.items():
                wrong = _check(all_reduce, batch, hidden, rank, world)
                if wrong:
                    notes.append(f"{model} bs {batch} {name}: {wrong}")
                    continue
                x = torch.zeros(batch, hidden, dtype=torch.bfloat16, device="cuda")  # sums stay 0: no overflow
                route = all_reduce.route(x).value if isinstance(all_reduce, SymmetricAllReduce) else "nccl"
                for mode in ("eager", "graph"):
                    try:
                        ms = _time_step(all_reduce, x, 2 * layers, args.repeats, mode == "graph", side)
                    except Exception as error:  # noqa: BLE001 - one failing point must not hide the others
                        notes.append(f"{model} bs {batch} {name} {mode}: {type(error).__name__}: {error}")
                        traceback.print_exc()
                        continue
                    rows.append({"model": model, "layers": layers, "hidden": hidden, "batch": batch,
                                 "message_bytes": batch * hidden * 2, "path": name, "route": route, "mode": mode,
                                 "ms_per_step": ms, "us_per_all_reduce": 1000 * ms / (2 * layers)})
                    if rank == 0:
                        print(f"{model} bs {batch} {name} ({route}) {mode}: {ms:.3f} ms per step", flush=True)
    if rank == 0:
        results.put({"rows": rows, "notes": notes, "torch": torch.__version__, "cuda": torch.version.cuda,
                     "device": torch.cuda.get_device_name(0)})
    elif notes:
        print("\n".join(f"rank {rank}: {n}" for n in notes), file=sys.stderr, flush=True)
    dist.barrier()
    dist.destroy_process_group()


def table(report: dict[str, Any]) -> list[str]:
    """One line per (model, batch): NCCL and symmetric memory, eager and graph, and the graph speed-up."""
    by_key: dict[tuple[str, int, int], dict[tuple[str, str], float]] = {}
    for row in report["rows"]:
        key = (row["model"], row["batch"], row["message_bytes"])
        by_key.setdefault(key, {})[(row["path"], row["mode"])] = row["ms_per_step"]
    lines = [f"{'model':<12}{'bs':>4}{'KiB':>6}  {'nccl eager':>11}{'nccl graph':>11}{'symm eager':>11}"
             f"{'symm graph':>11}  graph nccl/symm  (ms per decode step, 2 x layers all-reduces)"]
    for (model, batch, message_bytes), values in by_key.items():
        kib = message_bytes / 1024
        cells = [values.get((p, m)) for p in ("nccl", "symmetric") for m in ("eager", "graph")]
        text = "".join(f"{'-' if c is None else f'{c:.3f}':>11}" for c in cells)
        ratio = "-" if cells[1] is None or not cells[3] else f"{cells[1] / cells[3]:.2f}x"
        lines.append(f"{model:<12}{batch:>4}{kib:>6.0f}  {text}  {ratio:>8}")
    return lines


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--layers", type=int, default=0, help="one custom shape (with --hidden) instead of the presets")
    parser.add_argument("--hidden", type=int, default=0)
    parser.add_argument("--batch", type=int, nargs="+", default=[1, 32])
    parser.add_argument("--repeats", type=int, default=50)
    parser.add_argument("--graph", action="store_true", help="kept for old scripts: eager and graph are both timed")
    parser.add_argument("--out", default="")
    args = parser.parse_args()
    args.shapes = {f"custom-{args.layers}x{args.hidden}": (args.layers, args.hidden)} if args.layers else SHAPES
    if torch.cuda.device_count() < 2:
        sys.exit("allreduce.py needs two GPUs")
    os.environ.update(NO_MULTICAST)
    context = mp.get_context("spawn")
    results = context.SimpleQueue()
    port = _free_port()
    processes = [context.Process(target=_rank, args=(r, 2, port, args, results)) for r in range(2)]
    for p in processes:
        p.start()
    deadline = time.monotonic() + 300
    while results.empty() and any(p.is_alive() for p in processes) and time.monotonic() < deadline:
        time.sleep(0.2)
    if results.empty():
        for p in processes:
            p.terminate()
        sys.exit(f"allreduce.py: no result (exit codes {[p.exitcode for p in processes]})")
    report = results.get()
    for p in processes:
        p.join(30)
        if p.is_alive():  # NCCL teardown can linger after the figures are in
            p.terminate()
    print(f"{report['device']} x2, torch {report['torch']}, CUDA {report['cuda']}")
    for line in table(report):
        print(line)
    for row in report["rows"]:  # one line each, in the form benchmarks/h200.sh collects
        print(f"all-reduce per decode step, tp=2, {row['model']} batch {row['batch']}: {row['ms_per_step']:.3f} ms "
              f"({2 * row['layers']} all-reduces, {row['path']} {row['route']}, {row['mode']})")
    for note in report["notes"]:
        print(f"note: {note}")
    if args.out:
        with open(args.out, "w") as handle:
            json.dump(report, handle, indent=2)


if __name__ == "__main__":
    main()
