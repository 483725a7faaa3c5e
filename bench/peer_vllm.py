"""Peer: vLLM offline on dummy weights, the same workload as ``bench/offline.py``'s W1 and batch-1 TPOT.

    python bench/peer_vllm.py --config bench/configs/llama8b-config.json --quantization fp8
    python bench/peer_vllm.py --config bench/configs/qwen3-30b-a3b-config.json --vocab 150000 [--quantization fp8]
    python bench/peer_vllm.py --config bench/configs/llama70b-config.json --tp 4   # all-reduce fusion off at TP>1

W1: N requests of P random prompt tokens, exactly O forced output tokens each (greedy, no EOS), submitted at once,
after a 32-request warm-up; timed twice (the second run hits vLLM's prefix cache: same prompts). Then batch-1 TPOT:
one P-token prompt, (time of 128 tokens - time of 2 tokens) / 126. Then shared-prefix TTFT, the shape of
``bench/offline.py --shared-prefix``: A (a fresh 2,048-token prefix + 64 tokens), then B (the same prefix + 64
others: a prefix-cache hit), each alone, timed as a one-token ``generate``; medians over ``--prefix-trials`` prefixes. ``--quantization fp8`` quantizes the dummy bf16
weights to FP8 at load (vLLM's online FP8, W8A8 on Hopper), as ``--quantization fp8`` does ours. Needs vllm
importable (the peers README under shared/peers/vllm says how to carry it to a GPU machine). One line per figure,
``vLLM ...``; ``--json`` writes them too.

``--unit-norms`` sets every RMSNorm weight of vLLM's dummy model to 1 after loading (ours draws unit norms). vLLM's
dummy loader draws them uniform in ±1e-3 like every other parameter; with those, vLLM's top-k gating kernel handed
the same 8 expert ids to every token of a Qwen3-30B-A3B decode batch (bench/moe_routing.py, kernel view; why was not
pinned down), so a decode step read 8 experts per layer where a real checkpoint, and ours, read nearly all of them.
The MoE benches pass it; a dense model's work does not depend on it.

``--ours-init`` goes further and redraws every bf16 parameter as our dummy loader draws it (``draw_like_ours``):
N(0, 0.02), RMSNorm weights 1, ``*.bias`` 0 (the experts' ``w13_bias``/``w2_bias`` are drawn). Unit norms alone did
not spread gpt-oss: with vLLM's ±1e-3 matrices, a decode batch of 64 went to the same 4 of 32 experts in every
layer (bench/moe_routing.py, 2026-11-27), so vLLM's decode step read an eighth of the expert weights ours read.
Both engines then run one model family drawn the same way. Not with ``--quantization`` (it would overwrite the FP8
weights and their scales).
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import tempfile
import time
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any


def use_offline_env(**extra: str) -> None:
    """vLLM offline and quiet, set before vllm is imported (values already in the environment win); FlashInfer's
    sampler needs a JIT the machines cannot build. ``extra``: more variables for one script."""
    defaults = {
        "HF_HUB_OFFLINE": "1",
        "TRANSFORMERS_OFFLINE": "1",
        "VLLM_NO_USAGE_STATS": "1",
        "DO_NOT_TRACK": "1",
        "VLLM_USE_FLASHINFER_SAMPLER": "0",
        "VLLM_ALLOW_INSECURE_SERIALIZATION": "1",  # LLM.apply_model sends a function to the engine process
    }
    for key, value in {**defaults, **extra}.items():
        os.environ.setdefault(key, value)


use_offline_env()


def set_unit_norms(model: Any) -> int:
    """Fills every RMSNorm weight (a parameter named ``*norm.weight``) of a loaded vLLM model with 1; returns how
    many. In place, so CUDA graphs captured over these parameters stay valid."""
    filled = 0
    for name, param in model.named_parameters():
        if name.endswith("norm.weight"):
            param.data.fill_(1.0)
            filled += 1
    return filled


def draw_like_ours(model: Any) -> int:
    """Redraws every parameter of a loaded vLLM model as our dummy loader does (``init_dummy_weights``): names
    ending in ``norm.weight`` 1, in ``.bias`` 0, the rest N(0, 0.02), one seeded generator per parameter; returns
    how many. In place, so captured CUDA graphs stay valid. Refuses a parameter that is not bf16, fp16 or fp32."""
    import torch

    drawn = 0
    with torch.no_grad():
        for index, (name, param) in enumerate(model.named_parameters()):
            if param.dtype not in (torch.bfloat16, torch.float16, torch.float32):
                raise ValueError(f"{name} is {param.dtype}: --ours-init redraws float weights only")
            if name.endswith("norm.weight"):
                param.fill_(1.0)
            elif name.endswith(".bias"):
                param.zero_()
            else:
                generator = torch.Generator(device=param.device).manual_seed(1_000_003 + index)
                param.normal_(0.0, 0.02, generator=generator)
            drawn += 1
    return drawn


DUMMY_INITS = {"stock": None, "unit-norms": set_unit_norms, "ours": draw_like_ours}


def add_dummy_init_args(parser: argparse.ArgumentParser) -> None:
    """``--unit-norms`` / ``--ours-init`` (dest ``dummy_init``), for every script that builds ``dummy_llm``."""
    group = parser.add_mutually_exclusive_group()
    group.add_argument(
        "--unit-norms", dest="dummy_init", action="store_const", const="unit-norms", default="stock",
        help="RMSNorm weights of the dummy model set to 1 (Qwen3-MoE: routing spread as with real weights)",
    )  # fmt: skip
    group.add_argument(
        "--ours-init", dest="dummy_init", action="store_const", const="ours",
        help="every bf16 weight redrawn as our dummy loader draws it (gpt-oss: routing spread); not with FP8",
    )  # fmt: skip


@contextmanager
def dummy_llm(config: str, quantization: str | None, dummy_init: str, **options: Any) -> Iterator[Any]:
    """vLLM's ``LLM`` on dummy bf16 weights of ``config``'s shape, from a temporary model folder that lives as long
    as the block; ``dummy_init``: a key of ``DUMMY_INITS``, the function applied to the loaded model (``stock``:
    none). ``options``: more ``LLM`` keywords (max_model_len 2048 and gpu_memory_utilization 0.90 unless given)."""
    if dummy_init == "ours" and quantization:
        raise ValueError(
            "--ours-init redraws bf16 weights; with --quantization it would overwrite FP8 weights"
        )
    from vllm import LLM

    with tempfile.TemporaryDirectory(prefix="peer-vllm-") as folder:
        shutil.copy(config, Path(folder) / "config.json")  # vLLM reads a model folder; the weights are dummy
        llm = LLM(
            model=folder, load_format="dummy", skip_tokenizer_init=True, dtype="bfloat16",
            quantization=quantization, seed=0,
            **{"max_model_len": 2048, "gpu_memory_utilization": 0.90, **options},
        )  # fmt: skip
        redraw = DUMMY_INITS[dummy_init]
        if redraw is not None:
            print(f"vLLM dummy init {dummy_init}: {sum(llm.apply_model(redraw))} parameters set", flush=True)
        yield llm


def compile_options(args: argparse.Namespace) -> dict[str, object]:
    """LLM(...) keyword arguments for the all-reduce fusion pass; none when vLLM keeps its default."""
    fusion = args.allreduce_fusion if args.allreduce_fusion is not None else (False if args.tp > 1 else None)
    if fusion is None:
        return {}
    return {"compilation_config": {"pass_config": {"fuse_allreduce_rms": fusion}}}


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument(
        "--config", required=True, help="a Hugging Face config.json (dummy weights of its shape)"
    )
    parser.add_argument("--quantization", default=None, help="vLLM's quantization (e.g. fp8); default bf16")
    parser.add_argument("--tp", type=int, default=1, help="tensor_parallel_size")
    parser.add_argument("--num-requests", type=int, default=256)
    parser.add_argument("--input-len", type=int, default=512)
    parser.add_argument("--output-len", type=int, default=256)
    parser.add_argument("--vocab", type=int, default=128000, help="prompt token ids are drawn below this")
    parser.add_argument("--gpu-memory-utilization", type=float, default=0.90)
    parser.add_argument(
        "--max-model-len",
        type=int,
        default=4096,
        help="above input-len + output-len and the shared-prefix prompt",
    )
    parser.add_argument(
        "--again",
        action=argparse.BooleanOptionalAction,
        default=True,
        help="time W1 a second time (prefix hits)",
    )
    parser.add_argument("--batch1", action=argparse.BooleanOptionalAction, default=True, help="batch-1 TPOT")
    parser.add_argument(
        "--shared-prefix", action=argparse.BooleanOptionalAction, default=True, help="shared-prefix TTFT"
    )
    parser.add_argument("--prefix-len", type=int, default=2048)
    parser.add_argument("--prefix-suffix-len", type=int, default=64)
    parser.add_argument("--prefix-trials", type=int, default=3)
    parser.add_argument(
        "--allreduce-fusion",
        action=argparse.BooleanOptionalAction,
        default=None,
        help="vLLM's FlashInfer all-reduce + RMSNorm compile pass (default: vLLM's choice at TP=1, off at TP>1: "
        "with it, CUDA-graph capture failed on lent H100 x4 machines even with the custom all-reduce off)",
    )
    add_dummy_init_args(parser)
    parser.add_argument("--json", default=None)
    args = parser.parse_args()
    if args.input_len + args.output_len > args.max_model_len:
        parser.error(f"--max-model-len {args.max_model_len} < input-len + output-len")
    if args.shared_prefix and args.prefix_len + args.prefix_suffix_len + 1 > args.max_model_len:
        parser.error(
            f"--max-model-len {args.max_model_len} does not hold the shared-prefix prompt and its token"
        )

    import torch
    from vllm import SamplingParams
    from vllm.inputs import TokensPrompt

    label = f"{Path(args.config).stem} {args.quantization or 'bf16'} TP{args.tp}"
    figures: dict[str, float | str | bool] = {"model": label, "dummy_init": args.dummy_init}
    gen = torch.Generator().manual_seed(1)
    prompts = [
        torch.randint(0, args.vocab, (args.input_len,), generator=gen).tolist()
        for _ in range(args.num_requests)
    ]
    started = time.perf_counter()
    with dummy_llm(
        args.config,
        args.quantization,
        args.dummy_init,
        tensor_parallel_size=args.tp,
        max_model_len=args.max_model_len,
        gpu_memory_utilization=args.gpu_memory_utilization,
        disable_custom_all_reduce=args.tp > 1,  # crashed on lent multi-GPU machines (see the peers README)
        **compile_options(args),
    ) as llm:
        figures["init_s"] = round(time.perf_counter() - started, 1)
        # vLLM's own KV size: with the same memory share, how many requests fit decides W1 on a full card.
        cache = llm.llm_engine.vllm_config.cache_config
        figures["kv_blocks"] = getattr(cache, "num_gpu_blocks", None) or 0
        figures["kv_block_size"] = getattr(cache, "block_size", None) or 0
        print(
            f"vLLM {label} init {figures['init_s']}s; KV cache: {figures['kv_blocks']} blocks of "
            f"{figures['kv_block_size']} tokens",
            flush=True,
        )
        forced = SamplingParams(
            temperature=0.0, max_tokens=args.output_len, ignore_eos=True, detokenize=False
        )
        warm_gen = torch.Generator().manual_seed(3)
        warm = [
            torch.randint(0, args.vocab, (args.input_len,), generator=warm_gen).tolist() for _ in range(32)
        ]
        llm.generate([TokensPrompt(prompt_token_ids=p) for p in warm], forced, use_tqdm=False)
        for run in ("cold", "again") if args.again else ("cold",):
            t = time.perf_counter()
            outs = llm.generate([TokensPrompt(prompt_token_ids=p) for p in prompts], forced, use_tqdm=False)
            seconds = time.perf_counter() - t
            tokens = sum(len(o.outputs[0].token_ids) for o in outs)
            figures[f"w1_{run}_out_tok_s"] = round(tokens / seconds, 1)
            print(
                f"vLLM {label} W1 {args.num_requests}x{args.input_len}x{args.output_len} {run}: {seconds:.2f}s "
                f"{tokens / seconds:.0f} out tok/s",
                flush=True,
            )
        if args.batch1:
            figures["batch1_tpot_ms"] = batch1_tpot_ms(llm, prompts[0])
            print(f"vLLM {label} batch-1 TPOT {figures['batch1_tpot_ms']:.2f} ms", flush=True)
        if args.shared_prefix:
            cold, warm = shared_prefix_ttft_ms(llm, args)
            figures["prefix_ttft_cold_ms"], figures["prefix_ttft_warm_ms"] = cold, warm
            print(
                f"vLLM {label} shared-prefix {args.prefix_len}+{args.prefix_suffix_len}: TTFT cold {cold:.2f} ms, "
                f"warm {warm:.2f} ms",
                flush=True,
            )
    if args.json:
        Path(args.json).write_text(json.dumps(figures, indent=1))


def batch1_tpot_ms(llm: Any, prompt: list[int]) -> float:
    """(time of 128 tokens - time of 2 tokens) / 126 for one prompt, after one untimed 128-token run."""
    from vllm import SamplingParams
    from vllm.inputs import TokensPrompt

    long = SamplingParams(temperature=0.0, max_tokens=128, ignore_eos=True, detokenize=False)
    short = SamplingParams(temperature=0.0, max_tokens=2, ignore_eos=True, detokenize=False)
    one = [TokensPrompt(prompt_token_ids=prompt)]
    llm.generate(one, long, use_tqdm=False)
    t = time.perf_counter()
    llm.generate(one, short, use_tqdm=False)
    two_s = time.perf_counter() - t
    t = time.perf_counter()
    llm.generate(one, long, use_tqdm=False)
    long_s = time.perf_counter() - t
    return round((long_s - two_s) / 126 * 1000, 3)


def shared_prefix_ttft_ms(llm: Any, args: argparse.Namespace) -> tuple[float, float]:
    """Median one-token ``generate`` times of A (cold) and B (A's prefix cached) over ``args.prefix_trials``
    fresh prefixes. The offline API returns nothing before the request ends: with one output token its time is
    the TTFT plus the end of one request."""
    import statistics

    import torch
    from vllm import SamplingParams
    from vllm.inputs import TokensPrompt

    one = SamplingParams(temperature=0.0, max_tokens=1, ignore_eos=True, detokenize=False)
    gen = torch.Generator().manual_seed(7)
    cold: list[float] = []
    warm: list[float] = []
    for _ in range(args.prefix_trials):
        prefix = torch.randint(0, args.vocab, (args.prefix_len,), generator=gen).tolist()
        for times in (cold, warm):
            suffix = torch.randint(0, args.vocab, (args.prefix_suffix_len,), generator=gen).tolist()
            t = time.perf_counter()
            llm.generate([TokensPrompt(prompt_token_ids=prefix + suffix)], one, use_tqdm=False)
            times.append((time.perf_counter() - t) * 1000)
    return round(statistics.median(cold), 3), round(statistics.median(warm), 3)


if __name__ == "__main__":
    main()
