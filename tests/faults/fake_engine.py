"""`serve` with in-process fake step backends, as its own process (soak, shutdown and bad-input tests).

    python fake_engine.py --port P --metrics-port M [--workers 2] [--step-latency S] [--max-queue-len N]
        [--api-key KEY ...] [--front-procs N]

The front server, engine core and drivers are the real ones; only the workers are the deterministic fake.
The model is the embedded SmolLM2 (its tokenizer resolves text prompts), so the fakes state its vocabulary.
SIGUSR1 crashes the first fake worker (its stream breaks, it refuses connections) and revives it shortly after.
"""

from __future__ import annotations

import argparse
import asyncio
import signal
import sys

from ominix_runtime.config import EngineCoreConfig, FrontConfig, LogConfig, RuntimeConfig, ServerConfig
from ominix_runtime.models import DEFAULT_MODEL_NAME
from ominix_runtime.server.app import EngineDaemon
from ominix_runtime.server.logging import configure_logging
from ominix_runtime.testing.fake_backend import FakeConfig, FakeStepBackend

SMOLLM2_VOCAB = 49152


async def main(args: argparse.Namespace) -> int:
    configure_logging("warning", json_output=True)
    backends = [
        FakeStepBackend(
            FakeConfig(
                worker_id=f"fake-{i}",
                model_name=DEFAULT_MODEL_NAME,
                vocab_size=SMOLLM2_VOCAB,
                max_model_len=args.max_model_len,
                kv_num_blocks=args.kv_blocks,
                max_running_requests=64,
                step_latency=args.step_latency,
            )
        )
        for i in range(args.workers)
    ]
    config = RuntimeConfig(
        server=ServerConfig(
            host="127.0.0.1", port=args.port, metrics_port=args.metrics_port, drain_timeout=args.drain_timeout
        ),
        engine=EngineCoreConfig(max_waiting_requests=args.max_queue_len),
        log=LogConfig(format="json"),
        front=FrontConfig(
            api_keys=tuple(args.api_key),
            tokenizer_threads=args.tokenizer_threads,
            max_pending_tokenizations=args.max_pending_tokenizations,
            procs=args.front_procs,
        ),
    )
    daemon = EngineDaemon(config, backends=backends)
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGINT, signal.SIGTERM):
        loop.add_signal_handler(sig, daemon.on_signal)

    def crash_first_worker() -> None:  # SIGUSR1: fault injection (kill, then restart after a moment)
        if backends[0].down:
            return
        backends[0].crash()
        print("fault injected: fake-0 crashed", file=sys.stderr, flush=True)
        loop.call_later(args.revive_after, backends[0].revive)

    loop.add_signal_handler(signal.SIGUSR1, crash_first_worker)
    try:
        await daemon.start()
        await daemon.stop_requested.wait()
    finally:
        await daemon.shutdown()
    return 0


if __name__ == "__main__":
    p = argparse.ArgumentParser()
    p.add_argument("--port", type=int, required=True)
    p.add_argument("--metrics-port", type=int, required=True)
    p.add_argument("--workers", type=int, default=2)
    p.add_argument("--step-latency", type=float, default=0.001)
    p.add_argument("--kv-blocks", type=int, default=512)
    p.add_argument("--max-model-len", type=int, default=2048)
    p.add_argument("--max-queue-len", type=int, default=1024)
    p.add_argument("--drain-timeout", type=float, default=10.0)
    p.add_argument("--api-key", action="append", default=[], help="require this API key (repeatable)")
    p.add_argument("--tokenizer-threads", type=int, default=2)
    p.add_argument("--max-pending-tokenizations", type=int, default=64)
    p.add_argument("--front-procs", type=int, default=0, help="front processes (serve --front-procs)")
    p.add_argument("--revive-after", type=float, default=0.3, help="SIGUSR1 crashes fake-0; back after this")
    sys.exit(asyncio.run(main(p.parse_args())))
