"""Cost of the leader's step hand-off in a tensor-parallel group (ominix_worker.rank_group), per step.

Starts SIZE rank processes on this host joined by the gloo control group. The leader forwards STEPS decode
steps of a given shape through ``StepSender`` (encode, header all-reduce, payload broadcast), one every
INTERVAL ms so each is timed alone; each follower notes when ``receive`` returned it. Prints the encoded size,
the encode and decode CPU time, and the send-to-receipt latency (median, p90, max) on the host clock shared
by the processes. The hand-off overlaps the previous step's compute; this is its cost when it cannot.

    python bench/tp_handoff.py --size 2 --running 256       # a decode step of 256 requests
    python bench/tp_handoff.py --size 4 --new 8 --prompt-len 512   # a step admitting 8 prompts of 512 tokens
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "workers"))
sys.path.insert(0, str(ROOT))


def make_step(step_id: int, running: int, new: int, prompt_len: int):  # noqa: ANN201
    from ominix_runtime.contract import DecodeStep, NewRequestData, RunningRequestData, SamplingParams

    sampling = SamplingParams(temperature=0.7, top_p=0.9, seed=1)
    news = [
        NewRequestData(
            f"new-{step_id}-{i}",
            list(range(prompt_len)),
            sampling,
            list(range(prompt_len // 16 + 1)),
            0,
            prompt_len,
            7,
        )
        for i in range(new)
    ]
    runs = [
        RunningRequestData(f"req-{i:05d}", [i] if i % 16 == step_id % 16 else [], 1) for i in range(running)
    ]
    return DecodeStep(step_id, new_requests=news, running_requests=runs)


def rank_main(args: argparse.Namespace) -> None:
    import torch

    from ominix_worker.parallel.distributed import init_rank_group
    from ominix_worker.rank_group import Message, StepSender, decode_step, encode_step, receive

    group = init_rank_group(args.rank, args.size, args.addr, torch.device("cpu"), timeout_s=60)
    steps = [make_step(i + 1, args.running, args.new, args.prompt_len) for i in range(args.steps)]
    if group.is_leader:
        sender = StepSender(group, tick_s=3600)
        sent = []
        for step in steps:
            sent.append(time.perf_counter())
            sender.send(Message.STEP, step)
            time.sleep(args.interval_ms / 1000)
        started = time.perf_counter()
        payloads = [encode_step(step) for step in steps]
        encoded = time.perf_counter()
        for payload in payloads:
            decode_step(payload)
        decoded = time.perf_counter()
        received = group.gather_to_all(None)[1:]
        latencies = sorted(
            (r[i] - sent[i]) * 1e6 for r in received for i in range(len(sent)) if isinstance(r, list)
        )
        print(
            json.dumps(
                {
                    "size": args.size,
                    "running": args.running,
                    "new": args.new,
                    "prompt_len": args.prompt_len,
                    "encoded_bytes": len(payloads[0]),
                    "encode_us": round((encoded - started) / len(steps) * 1e6),
                    "decode_us": round((decoded - encoded) / len(steps) * 1e6),
                    "latency_us_median": round(statistics.median(latencies)),
                    "latency_us_p90": round(latencies[int(0.9 * (len(latencies) - 1))]),
                    "latency_us_max": round(latencies[-1]),
                }
            ),
            flush=True,
        )
    else:
        arrivals = []
        for _ in steps:
            kind, _item = receive(group)
            while kind != Message.STEP:
                kind, _item = receive(group)
            arrivals.append(time.perf_counter())
        group.gather_to_all(arrivals)
    os._exit(0)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--size", type=int, default=2)
    p.add_argument("--running", type=int, default=256, help="running requests in each step")
    p.add_argument("--new", type=int, default=0, help="new requests in each step")
    p.add_argument("--prompt-len", type=int, default=512)
    p.add_argument("--steps", type=int, default=200)
    p.add_argument("--interval-ms", type=float, default=5.0)
    p.add_argument("--rank", type=int, default=None, help=argparse.SUPPRESS)
    p.add_argument("--addr", default=None, help=argparse.SUPPRESS)
    args = p.parse_args()
    if args.rank is not None:
        rank_main(args)
        return
    from ominix_runtime.bind_probe import free_port

    addr = f"127.0.0.1:{free_port()}"
    argv = [sys.executable, __file__, *sys.argv[1:], "--addr", addr]
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    procs = [subprocess.Popen([*argv, "--rank", str(r)], env=env) for r in range(args.size)]
    codes = [proc.wait(timeout=600) for proc in procs]
    if any(codes):
        sys.exit(f"rank exit codes {codes}")


if __name__ == "__main__":
    main()
