"""Row-parallel GEMM + all-reduce on this host's GPUs: one all-reduce after the GEMM against row chunks whose
all-reduces overlap the next chunk's GEMM (``TensorParallel.overlap_chunks``), as an eager prefill step runs them.

Starts SIZE rank processes (cuda:0..SIZE-1, joined as worker ranks join). For the two row-parallel layers of
one decoder layer of the model shape (o_proj: heads × head_dim → hidden; down: FFN → hidden, inputs split over
the ranks) and each token count it times, with CUDA events, the GEMM alone, the all-reduce alone, and the
layer's forward with 1 (serial), 2, 4 and 8 chunks; then the same on an NCCL group whose stream has high
priority. The leader prints one JSON line; ``per_layer_ms`` sums o_proj and down.

    NCCL_NVLS_ENABLE=0 python bench/tp_overlap.py --size 4 --hidden 8192 --ffn 28672 --tokens 2048 8192
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import subprocess
import sys
import time
from functools import partial
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "workers"))
sys.path.insert(0, str(ROOT))

CHUNKS = (1, 2, 4, 8)


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
    options = dist.ProcessGroupNCCL.Options()
    options.is_high_priority_stream = True
    high = dist.new_group(backend="nccl", pg_options=options)
    torch.manual_seed(args.rank)
    with torch.inference_mode():  # as the worker runs its forward
        rows = _measure(args, group, high, device)
    out: dict[str, object] = {"size": args.size, "device": torch.cuda.get_device_name(device), "rows": rows}
    if group.is_leader:
        print(json.dumps(out), flush=True)
        if args.json:
            Path(args.json).write_text(json.dumps(out, indent=1))
    dist.barrier(group=group.control)
    os._exit(0)


def _measure(args: argparse.Namespace, group, high, device) -> list[dict[str, object]]:  # noqa: ANN001
    import torch
    import torch.distributed as dist

    from ominix_worker.parallel import RowParallelLinear

    layers = {"o_proj": args.hidden, "down": args.ffn}
    rows = []
    for stream_kind, pg in (("default", group.tp.group), ("high_priority", high)):
        for tokens in args.tokens:
            row: dict[str, object] = {"stream": stream_kind, "tokens": tokens}
            per_layer = {str(k): 0.0 for k in CHUNKS}
            for name, in_features in layers.items():
                base = dataclasses.replace(group.tp, group=pg, overlap_min_tokens=1)
                layer = RowParallelLinear(in_features, args.hidden, bias=False, tp=base)
                layer = layer.to(device=device, dtype=torch.bfloat16)
                torch.nn.init.normal_(layer.weight, std=0.02)
                x = torch.randn(tokens, layer.shard.size, device=device, dtype=torch.bfloat16)
                y = torch.empty(tokens, args.hidden, device=device, dtype=torch.bfloat16)
                row[f"{name}_gemm_ms"] = round(_time_ms(partial(layer.matmul_into, x, y), args.iters), 3)
                row[f"{name}_all_reduce_ms"] = round(
                    _time_ms(partial(dist.all_reduce, y, group=pg), args.iters), 3
                )
                for k in CHUNKS:
                    layer.tp = dataclasses.replace(base, overlap_chunks=k)
                    ms = _time_ms(partial(layer, x), args.iters)
                    row[f"{name}_chunks{k}_ms"] = round(ms, 3)
                    per_layer[str(k)] += ms
            row["per_layer_ms"] = {k: round(v, 3) for k, v in per_layer.items()}
            rows.append(row)
    return rows


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--size", type=int, default=2)
    p.add_argument("--hidden", type=int, default=8192)
    p.add_argument("--ffn", type=int, default=28672)
    p.add_argument("--tokens", type=int, nargs="+", default=[2048, 8192])
    p.add_argument("--iters", type=int, default=20)
    p.add_argument("--json", default=None)
    p.add_argument("--rank", type=int, default=None, help=argparse.SUPPRESS)
    p.add_argument("--addr", default=None, help=argparse.SUPPRESS)
    args = p.parse_args()
    if args.rank is not None:
        rank_main(args)
        return
    from ominix_worker.parallel.distributed import free_rendezvous_port

    addr = f"127.0.0.1:{free_rendezvous_port()}"
    env = {**os.environ, "NCCL_NVLS_ENABLE": "0"}
    argv = [sys.executable, __file__, *sys.argv[1:], "--addr", addr]
    procs = [subprocess.Popen([*argv, "--rank", str(r)], env=env) for r in range(args.size)]
    deadline = time.monotonic() + 600
    try:  # stop as soon as one rank fails: the others would wait for it until their collective timeout
        while any(proc.poll() is None for proc in procs) and time.monotonic() < deadline:
            if any(proc.poll() not in (None, 0) for proc in procs):
                break
            time.sleep(0.2)
    finally:
        for proc in procs:
            proc.kill()
    codes = [proc.wait() for proc in procs]
    if any(codes):
        sys.exit(f"rank exit codes {codes}")


if __name__ == "__main__":
    main()
