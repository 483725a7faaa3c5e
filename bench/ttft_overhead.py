"""What the service adds to a device's prefill step: time to first token through a real ``serve`` engine and
real gRPC, in front of a worker that answers every step at once (``bench/engine_overhead.py --role worker``).

On a GPU, TTFT = the worker's prefill step + this. One request at a time, sequentially, over one client channel
(as a shared-prefix TTFT figure is taken): a short prompt, and a shared prefix (``--prefix-len`` tokens every
request repeats, so after the first the engine's prefix cache holds it) with ``--suffix-len`` new tokens. Each
``--front-procs`` value starts its own engine. Nothing here imports torch.

    python bench/ttft_overhead.py                               # --front-procs 0 1, 200 requests a shape
    python bench/ttft_overhead.py --front-procs 1 --trials 500 --json out.json
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

if __package__ in (None, ""):
    sys.path[0] = str(Path(__file__).resolve().parent.parent)

from bench.common import (  # noqa: E402
    ServiceDied,
    WatchedProcess,
    free_ports,
    health_status,
    percentile,
    wait_until_ready,
)

HERE = Path(__file__).resolve().parent
MODEL = "dummy:bench/configs/llama8b-config.json"
MODEL_NAME = "llama8b-config"
WARMUP = 20


@contextmanager
def fake_service(
    front_procs: int, step_ms: float, work_dir: Path
) -> Iterator[tuple[str, list[WatchedProcess]]]:
    """A fake worker and a ``serve`` engine on free ports; both stopped on exit."""
    wport, eport = free_ports(2)
    env = dict(os.environ, PYTHONPATH=os.pathsep.join([str(HERE.parent), os.environ.get("PYTHONPATH", "")]))
    worker_argv = [sys.executable, str(HERE / "engine_overhead.py"), "--role", "worker", "--port", str(wport)]
    worker_argv += ["--concurrency", "1", "--step-ms", str(step_ms), "--model-name", MODEL_NAME]
    engine_argv = [sys.executable, "-m", "ominix_runtime", "serve", "--model", MODEL, "--worker"]
    engine_argv += [
        f"127.0.0.1:{wport}",
        "--port",
        str(eport),
        "--metrics-port",
        "0",
        "--log-level",
        "warning",
    ]
    engine_argv += ["--front-procs", str(front_procs)]
    watched: list[WatchedProcess] = []
    procs: list[subprocess.Popen[bytes]] = []
    try:
        for name, argv in (("fake worker", worker_argv), ("engine", engine_argv)):
            log = work_dir / f"{name.replace(' ', '_')}.log"
            with log.open("wb") as out:
                proc = subprocess.Popen(argv, stdout=out, stderr=subprocess.STDOUT, env=env, cwd=HERE.parent)
            procs.append(proc)
            watched.append(WatchedProcess(name, log, process=proc))
        address = f"127.0.0.1:{eport}"
        wait_until_ready(lambda: health_status(address), watched, 120.0, f"engine at {address}")
        yield address, watched
    finally:
        for proc in reversed(procs):
            proc.terminate()
        for proc in reversed(procs):
            try:
                proc.wait(timeout=20)
            except subprocess.TimeoutExpired:
                proc.kill()
                proc.wait()


async def time_to_first_token(client: Any, request: Any) -> float:
    start = time.perf_counter()
    first = None
    async for event in client.generate(request, timeout=30):
        if first is None and event.WhichOneof("event") == "token" and event.token.token_ids:
            first = time.perf_counter() - start
        if event.WhichOneof("event") == "error":
            raise RuntimeError(f"request {request.request_id} failed: {event}")
    if first is None:
        raise RuntimeError(f"request {request.request_id} gave no token")
    return first


def make_request(request_id: str, ids: list[int], max_tokens: int) -> Any:
    from ominix_runtime.pb import common_pb2, engine_pb2

    request = engine_pb2.GenerateRequest(
        request_id=request_id,
        model=MODEL_NAME,
        sampling=common_pb2.SamplingParams(max_tokens=max_tokens, temperature=0.0, ignore_eos=True),
        stream=True,
    )
    request.input_ids.ids.extend(ids)
    return request


async def measure(address: str, args: argparse.Namespace, watched: list[WatchedProcess]) -> dict[str, Any]:
    from ominix_runtime.client import AsyncEngineClient

    prefix = [1000 + (i * 7919) % 100000 for i in range(args.prefix_len)]
    shapes = {
        f"short ({args.short_len} tokens)": lambda i: [
            5000 + (i * 131 + j) % 90000 for j in range(args.short_len)
        ],
        f"shared prefix ({args.prefix_len} cached + {args.suffix_len} new)": lambda i: (
            prefix + [7000 + (i * 257 + j) % 90000 for j in range(args.suffix_len)]
        ),
    }
    out: dict[str, Any] = {}
    async with AsyncEngineClient(address) as client:
        for shape, prompt in shapes.items():
            ttfts = []
            for i in range(WARMUP + args.trials):
                dead = [w.failure(s) for w in watched if (s := w.exit_status()) is not None]
                if dead:
                    raise ServiceDied("\n".join(dead))
                ttft = await time_to_first_token(
                    client, make_request(f"{shape[:5]}-{i}", prompt(i), args.max_tokens)
                )
                if i >= WARMUP:
                    ttfts.append(ttft * 1e3)
            out[shape] = {
                "p50_ms": statistics.median(ttfts),
                "p90_ms": percentile(ttfts, 90),
                "mean_ms": statistics.fmean(ttfts),
                "trials": len(ttfts),
            }
    return out


def main() -> int:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--front-procs", type=int, nargs="+", default=[0, 1])
    parser.add_argument("--trials", type=int, default=200)
    parser.add_argument("--short-len", type=int, default=16)
    parser.add_argument("--prefix-len", type=int, default=2048)
    parser.add_argument("--suffix-len", type=int, default=64)
    parser.add_argument(
        "--step-ms", type=float, default=0.0, help="the fake worker's step time (a stand-in for the device's)"
    )
    parser.add_argument("--max-tokens", type=int, default=1, help="outputs per request (TTFT is the first)")
    parser.add_argument("--json", default="")
    args = parser.parse_args()
    report: dict[str, Any] = {}
    for fronts in args.front_procs:
        with tempfile.TemporaryDirectory(prefix="ttft-overhead-") as tmp:
            try:
                with fake_service(fronts, args.step_ms, Path(tmp)) as (address, watched):
                    report[f"front_procs={fronts}"] = asyncio.run(measure(address, args, watched))
            except ServiceDied as exc:
                print(f"ttft_overhead.py: {exc}", file=sys.stderr)
                return 1
    worker = f"a worker step of {args.step_ms:g} ms" if args.step_ms else "a worker that answers at once"
    print(f"TTFT through the service, {worker}, {args.max_tokens} outputs; load {os.getloadavg()[0]:.2f}")
    for fronts, shapes in report.items():
        for shape, row in shapes.items():
            print(
                f"  {fronts:14s} {shape:42s} p50 {row['p50_ms']:6.2f} ms  p90 {row['p90_ms']:6.2f} ms  "
                f"mean {row['mean_ms']:6.2f} ms  ({row['trials']} requests)"
            )
    if args.json:
        Path(args.json).write_text(json.dumps(report, indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(main())
