"""The all-reduce time of one tensor-parallel decode step, measured alone on two GPUs.

A decode step of the Llama shape does two all-reduces per layer (after o_proj and after
down_proj) of [batch, hidden] activations. This issues exactly that many back to back and
times them with events (eagerly: an upper bound of what they cost inside the engine's graph),
so the share of a measured tp=2 step is at most all-reduce / TPOT.

    python3 benchmarks/allreduce.py --layers 28 --hidden 1024 --batch 1 32 --out allreduce.json
"""

from __future__ import annotations

import argparse
import json
import os
import socket
import sys
from typing import Any

import torch
import torch.distributed as dist
import torch.multiprocessing as mp


def _free_port() -> int:
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        return int(probe.getsockname()[1])


def _rank(rank: int, world: int, port: int, args: argparse.Namespace, results: Any) -> None:
    torch.cuda.set_device(rank)
    dist.init_process_group("nccl", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=world,
                            device_id=torch.device("cuda", rank))
    if rank == 0:
        print("process group ready", flush=True)
    out: dict[str, float] = {}
    side = torch.cuda.Stream()  # type: ignore[no-untyped-call]
    for batch in args.batch:
        x = torch.randn(batch, args.hidden, dtype=torch.bfloat16, device="cuda")
        for _ in range(5):  # NCCL warm-up
            dist.all_reduce(x)
        torch.cuda.synchronize()
        replay = None
        if args.graph:  # as inside the engine: the all-reduces of one step captured in a CUDA graph
            graph = torch.cuda.CUDAGraph()
            with torch.cuda.graph(graph, stream=side):
                for _ in range(2 * args.layers):
                    dist.all_reduce(x)
            replay = graph.replay
        start = torch.cuda.Event(enable_timing=True)  # type: ignore[no-untyped-call]
        end = torch.cuda.Event(enable_timing=True)  # type: ignore[no-untyped-call]
        torch.cuda.synchronize()
        start.record()
        for _ in range(args.repeats):
            if replay is not None:
                replay()
            else:
                for _ in range(2 * args.layers):
                    dist.all_reduce(x)
        end.record()
        end.synchronize()
        out[str(batch)] = start.elapsed_time(end) / args.repeats
        if rank == 0:
            print(f"batch {batch}: {out[str(batch)]:.3f} ms ({'graph' if args.graph else 'eager'})", flush=True)
    if rank == 0:
        results.put(out)
    dist.destroy_process_group()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--layers", type=int, default=28)
    parser.add_argument("--hidden", type=int, default=1024)
    parser.add_argument("--batch", type=int, nargs="+", default=[1, 32])
    parser.add_argument("--repeats", type=int, default=50)
    parser.add_argument("--graph", action="store_true", help="replay the step's all-reduces from a CUDA graph")
    parser.add_argument("--out", default="")
    args = parser.parse_args()
    if torch.cuda.device_count() < 2:
        sys.exit("allreduce.py needs two GPUs")
    context = mp.get_context("spawn")
    results = context.SimpleQueue()
    port = _free_port()
    os.environ.setdefault("NCCL_NVLS_ENABLE", "0")
    processes = [context.Process(target=_rank, args=(r, 2, port, args, results)) for r in range(2)]
    for p in processes:
        p.start()
    per_step = results.get()
    for p in processes:
        p.join(30)
        if p.is_alive():  # NCCL teardown can linger after the figures are in
            p.terminate()
    for batch, ms in per_step.items():
        how = "graph replay" if args.graph else "eager"
        print(f"all-reduce per decode step, tp=2, batch {batch}: {ms:.3f} ms ({2 * args.layers} all-reduces, {how})")
    if args.out:
        with open(args.out, "w") as handle:
            json.dump({"layers": args.layers, "hidden": args.hidden, "ms_per_step": per_step}, handle, indent=2)


if __name__ == "__main__":
    main()
