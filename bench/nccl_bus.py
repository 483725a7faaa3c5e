"""NCCL all-reduce on this host's GPUs: bus bandwidth by message size, and the all-reduce time of one decode step.

Starts SIZE processes (cuda:0..SIZE-1) joined the way worker ranks join (``init_rank_group``). For each
message size it times ITERS all-reduces with CUDA events and prints algorithm and bus bandwidth
(bus = alg × 2(n-1)/n, the figure nccl-tests reports). Then it captures, in one CUDA graph, the all-reduces
of one decode step of the model shape (two per layer of batch × hidden bf16 values, as the row-parallel
o_proj and down projections issue them) and times a replay: the communication floor of a TP decode step.

    NCCL_NVLS_ENABLE=0 python bench/nccl_bus.py --size 4 --hidden 8192 --layers 80 --json out.json
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "workers"))
sys.path.insert(0, str(ROOT))

MESSAGE_BYTES = (16 * 1024, 256 * 1024, 4 * 2**20, 32 * 2**20, 256 * 2**20)


def _time_ms(fn, iters: int) -> float:  # noqa: ANN001
    import torch

    for _ in range(3):
        fn()
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    torch.cuda.synchronize()
    start.record()
    for _ in range(iters):
        fn()
    end.record()
    torch.cuda.synchronize()
    return start.elapsed_time(end) / iters


def rank_main(args: argparse.Namespace) -> None:
    import torch
    import torch.distributed as dist

    from ominix_worker.parallel.distributed import init_rank_group

    device = torch.device(f"cuda:{args.rank}")
    group = init_rank_group(args.rank, args.size, args.addr, device, timeout_s=120)
    n = args.size
    rows = []
    for nbytes in MESSAGE_BYTES:
        x = torch.ones(nbytes // 2, dtype=torch.bfloat16, device=device)
        ms = _time_ms(lambda x=x: dist.all_reduce(x, group=group.tp.group), args.iters)
        alg = nbytes / (ms / 1000) / 1e9
        rows.append(
            {
                "bytes": nbytes,
                "ms": round(ms, 4),
                "alg_GBps": round(alg, 1),
                "bus_GBps": round(alg * 2 * (n - 1) / n, 1),
            }
        )
    steps = {}
    for batch in args.batches:
        bufs = [
            torch.ones(batch, args.hidden, dtype=torch.bfloat16, device=device)
            for _ in range(2 * args.layers)
        ]
        stream = torch.cuda.Stream()
        stream.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(stream):
            for b in bufs:  # warm-up outside the graph
                dist.all_reduce(b, group=group.tp.group)
        torch.cuda.current_stream().wait_stream(stream)
        torch.cuda.synchronize()
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph):
            for b in bufs:
                dist.all_reduce(b, group=group.tp.group)
        steps[batch] = round(_time_ms(graph.replay, max(3, args.iters // 4)), 3)
    if group.is_leader:
        out = {
            "size": n,
            "device": torch.cuda.get_device_name(device),
            "all_reduce": rows,
            "decode_step_all_reduce_ms": steps,
            "shape": {"hidden": args.hidden, "layers": args.layers, "all_reduces_per_step": 2 * args.layers},
        }
        print(json.dumps(out), flush=True)
        if args.json:
            Path(args.json).write_text(json.dumps(out, indent=1))
    dist.barrier(group=group.control)
    os._exit(0)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--size", type=int, default=2)
    p.add_argument("--hidden", type=int, default=8192)
    p.add_argument("--layers", type=int, default=80)
    p.add_argument("--batches", type=int, nargs="+", default=[1, 256])
    p.add_argument("--iters", type=int, default=40)
    p.add_argument("--json", default=None)
    p.add_argument("--rank", type=int, default=None, help=argparse.SUPPRESS)
    p.add_argument("--addr", default=None, help=argparse.SUPPRESS)
    args = p.parse_args()
    if args.rank is not None:
        rank_main(args)
        return
    from ominix_runtime.bind_probe import free_port

    addr = f"127.0.0.1:{free_port()}"
    env = {**os.environ, "NCCL_NVLS_ENABLE": "0"}
    argv = [sys.executable, __file__, *sys.argv[1:], "--addr", addr]
    procs = [subprocess.Popen([*argv, "--rank", str(r)], env=env) for r in range(args.size)]
    codes = [proc.wait(timeout=600) for proc in procs]
    if any(codes):
        sys.exit(f"rank exit codes {codes}")


if __name__ == "__main__":
    main()
