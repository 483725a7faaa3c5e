"""Peer diagnostic: vLLM's kernels on a W1-shaped batch (dummy weights), by total device time, with the KV cache
dtype vLLM chose. Runs vLLM in this process (as it serves: CUDA graphs and compile on) under torch.profiler for one
``generate`` of N prompts × P tokens × O outputs after a warm-up, and prints the top kernels as JSON.

``--again`` runs the batch once unprofiled first, so the profiled run finds its prompts in the prefix cache and is
nearly all decode at batch N (W1 again); ``kernels_per_step_ms`` then reads as one decode step. ``--eager`` turns
vLLM's CUDA graphs off, for a profile that cannot miss a kernel replayed inside a graph.

    python bench/peer_vllm_profile.py --config bench/configs/qwen3-30b-a3b-config.json --vocab 150000 --quantization fp8
    python bench/peer_vllm_profile.py --config ... --quantization fp8 --again --eager --output-len 32
    python bench/peer_vllm_profile.py --config bench/configs/gpt-oss-20b-config.json --vocab 199000 --ours-init \
        --num-requests 16 --input-len 8192 --output-len 8 --max-model-len 8448    # long-prompt prefill
"""

from __future__ import annotations

import argparse
import json
import time

from peer_vllm import (  # this folder, as the script's sys.path[0]
    add_dummy_init_args,
    dummy_llm,
    use_offline_env,
)

# The engine core in this process: the profiler sees its kernels.
use_offline_env(VLLM_ENABLE_V1_MULTIPROCESSING="0")


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--config", required=True)
    p.add_argument("--quantization", default=None)
    p.add_argument("--num-requests", type=int, default=256)
    p.add_argument("--input-len", type=int, default=512)
    p.add_argument("--output-len", type=int, default=64)
    p.add_argument("--vocab", type=int, default=128000)
    p.add_argument(
        "--max-model-len", type=int, default=2048, help="vLLM's max_model_len (input + output fit)"
    )
    p.add_argument("--top", type=int, default=15)
    p.add_argument("--again", action="store_true", help="profile the batch's second run (prompts cached)")
    p.add_argument("--eager", action="store_true", help="enforce_eager: no CUDA graphs, no compile")
    add_dummy_init_args(p)
    args = p.parse_args()
    if args.input_len + args.output_len > args.max_model_len:
        p.error(f"--max-model-len {args.max_model_len} < input-len + output-len")

    import torch
    from torch.profiler import ProfilerActivity, profile
    from vllm import SamplingParams
    from vllm.inputs import TokensPrompt

    gen = torch.Generator().manual_seed(1)

    def prompts(n: int) -> list[TokensPrompt]:
        return [
            TokensPrompt(
                prompt_token_ids=torch.randint(0, args.vocab, (args.input_len,), generator=gen).tolist()
            )
            for _ in range(n)
        ]

    forced = SamplingParams(temperature=0.0, max_tokens=args.output_len, ignore_eos=True, detokenize=False)
    with dummy_llm(
        args.config,
        args.quantization,
        args.dummy_init,
        enforce_eager=args.eager,
        max_model_len=args.max_model_len,
    ) as llm:
        llm.generate(prompts(32), forced, use_tqdm=False)
        batch = prompts(args.num_requests)
        if args.again:
            llm.generate(batch, forced, use_tqdm=False)
        with profile(activities=[ProfilerActivity.CUDA]) as prof:
            started = time.perf_counter()
            llm.generate(batch, forced, use_tqdm=False)
            seconds = time.perf_counter() - started
        cache = llm.llm_engine.vllm_config.cache_config
    rows = sorted(
        (e for e in prof.key_averages() if e.device_time_total > 0), key=lambda e: -e.device_time_total
    )
    total_ms = sum(e.device_time_total for e in rows) / 1e3
    print(
        json.dumps(
            {
                "peer": "vLLM",
                "quantization": args.quantization or "bf16",
                "kv_cache_dtype": str(cache.cache_dtype),
                "gpu_blocks": getattr(cache, "num_gpu_blocks", None),
                "again": args.again,
                "eager": args.eager,
                "dummy_init": args.dummy_init,
                "generate_s": round(seconds, 3),
                "kernels_total_ms": round(total_ms, 1),
                "kernels_per_step_ms": round(total_ms / args.output_len, 2),
                "kernels_ms": [
                    [e.key[:90], round(e.device_time_total / 1e3, 2), e.count] for e in rows[: args.top]
                ],
            }
        ),
        flush=True,
    )


if __name__ == "__main__":
    main()
