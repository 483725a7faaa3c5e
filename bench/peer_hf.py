"""Peer baseline: workload W1 through Hugging Face transformers' static ``generate``.

GPU (default): a Llama-3.1-8B-shaped model with random bf16 weights from ``bench/configs/llama8b-config.json``,
256 random prompts of 512 tokens, exactly 256 new tokens each (greedy, no EOS), in static batches of 128:

    python bench/peer_hf.py [--batch 128] [--json out.json]

CPU comparison, batch 8, with a real model (a ``.gguf`` file or a Hugging Face folder):

    python bench/peer_hf.py --device cpu --batch 8 --model path/to/SmolLM2-135M-Instruct.Q4_1.gguf \
        --requests 8 --prompt-len 128 --output-len 64

Prints output tokens/s (generated tokens over the wall time of the timed batches, after one warm-up call).
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path
from typing import TYPE_CHECKING

import torch

if TYPE_CHECKING:
    from transformers import PreTrainedModel

DEFAULT_CONFIG = Path(__file__).resolve().parent / "configs" / "llama8b-config.json"


def load_model(model: str | None, device: str, dtype: torch.dtype) -> tuple[PreTrainedModel, int]:
    from transformers import AutoConfig, AutoModelForCausalLM

    if model is None or model.startswith("dummy:") or model.endswith(".json"):
        path = Path(
            model[len("dummy:") :] if model and model.startswith("dummy:") else (model or DEFAULT_CONFIG)
        )
        config_file = path / "config.json" if path.is_dir() else path
        config = AutoConfig.from_pretrained(str(config_file))
        torch.manual_seed(0)
        with torch.device(device):
            return AutoModelForCausalLM.from_config(config, dtype=dtype).eval(), config.vocab_size
    path = Path(model)
    if path.suffix == ".gguf":
        m = AutoModelForCausalLM.from_pretrained(str(path.parent), gguf_file=path.name, dtype=dtype)
    else:
        m = AutoModelForCausalLM.from_pretrained(str(path), dtype=dtype)
    return m.to(device).eval(), m.config.vocab_size


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description="HF transformers static generate on W1")
    parser.add_argument("--model", help="dummy:CONFIG, a config.json, a .gguf file or an HF folder")
    parser.add_argument("--device", default="cuda")
    parser.add_argument("--batch", type=int, default=128)
    parser.add_argument("--requests", type=int, default=256)
    parser.add_argument("--prompt-len", type=int, default=512)
    parser.add_argument("--output-len", type=int, default=256)
    parser.add_argument("--dtype", default=None, help="bfloat16 (GPU default) or float32 (CPU default)")
    parser.add_argument("--threads", type=int, default=None, help="torch CPU threads")
    parser.add_argument("--json", help="write the result to this file")
    args = parser.parse_args(argv)

    from transformers import GenerationConfig

    if args.threads:
        torch.set_num_threads(args.threads)
    dtype = getattr(torch, args.dtype or ("bfloat16" if args.device.startswith("cuda") else "float32"))
    started = time.perf_counter()
    model, vocab = load_model(args.model, args.device, dtype)
    print(f"model ready in {time.perf_counter() - started:.1f} s on {args.device} ({dtype})", flush=True)

    gen = torch.Generator().manual_seed(1)
    prompts = torch.randint(0, vocab, (args.requests, args.prompt_len), generator=gen)
    config = GenerationConfig(
        max_new_tokens=args.output_len,
        min_new_tokens=args.output_len,
        do_sample=False,
        eos_token_id=None,
        pad_token_id=0,
    )
    warm = GenerationConfig(
        max_new_tokens=4, min_new_tokens=4, do_sample=False, eos_token_id=None, pad_token_id=0
    )
    sync = torch.cuda.synchronize if args.device.startswith("cuda") else (lambda: None)
    with torch.inference_mode():
        model.generate(prompts[: args.batch].to(args.device), generation_config=warm)
        sync()
        started = time.perf_counter()
        generated = 0
        for first in range(0, args.requests, args.batch):
            ids = prompts[first : first + args.batch].to(args.device)
            out = model.generate(ids, attention_mask=torch.ones_like(ids), generation_config=config)
            generated += (out.shape[1] - ids.shape[1]) * out.shape[0]
        sync()
        elapsed = time.perf_counter() - started
    device_name = torch.cuda.get_device_name() if args.device.startswith("cuda") else "cpu"
    result = {
        "peer": "hf-transformers-static-generate",
        "device": device_name,
        "batch": args.batch,
        "requests": args.requests,
        "prompt_len": args.prompt_len,
        "output_len": args.output_len,
        "seconds": elapsed,
        "output_tokens": generated,
        "out_tok_s": generated / elapsed,
    }
    print(
        f"HF static generate batch={args.batch} N={args.requests} P={args.prompt_len} O={args.output_len} "
        f"on {device_name}: {elapsed:.1f} s, {generated} tokens, {generated / elapsed:,.0f} out tok/s"
    )
    if args.json:
        Path(args.json).write_text(json.dumps(result, indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(main())
