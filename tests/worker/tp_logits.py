"""One rank of a tensor-parallel logits check, run as its own process (gloo on CPU, NCCL on CUDA).

``python tp_logits.py --model DIR --rank R --size N --addr HOST:PORT --device cpu --out FILE`` joins the group,
loads rank R's shards, runs a fixed ragged batch (two prompts of different lengths in one step, then one
decode step for both) and, on rank 0, saves every row's logits to FILE. ``batch_logits`` is the same batch
for an in-process runner (TP=1 reference).
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "workers"))  # a bare checkout on GPU machines

from ominix_runtime.contract import SamplingParams  # noqa: E402
from ominix_worker.parallel import SINGLE, TensorParallel  # noqa: E402
from ominix_worker.runner import CachedRequest, ModelRunner, ScheduledRow, build_runner  # noqa: E402

PROMPTS = ([3 + (7 * i) % 250 for i in range(37)], [5 + (11 * i) % 240 for i in range(9)])
NUM_BLOCKS = 16
BLOCK_SIZE = 16


@torch.inference_mode()
def batch_logits(runner: ModelRunner) -> torch.Tensor:
    """Logits of every prompt row of a ragged prefill step, then of a decode row per request (CPU, float32)."""
    requests = [
        CachedRequest(
            f"r{i}", list(p), [], SamplingParams(temperature=0.0), [3 * i, 3 * i + 1, 3 * i + 2], 0, 0
        )
        for i, p in enumerate(PROMPTS)
    ]
    prefill = [ScheduledRow(r, 0, r.num_tokens, samples=True) for r in requests]
    inputs = runner._prepare_inputs(prefill)
    prefill_logits = runner.model.compute_logits(runner._forward(inputs))
    for r in requests:
        r.num_computed_tokens = r.num_tokens
        r.output_token_ids.append(11 + len(r.prompt_token_ids))
    decode = [ScheduledRow(r, r.num_tokens - 1, r.num_tokens, samples=True) for r in requests]
    inputs = runner._prepare_inputs(decode)
    decode_logits = runner.model.compute_logits(runner._forward(inputs))
    return torch.cat([prefill_logits, decode_logits]).float().cpu()


def load_runner(model: str, device: str, dtype: torch.dtype, tp: TensorParallel = SINGLE) -> ModelRunner:
    return build_runner(
        model, device=device, dtype=dtype, num_blocks=NUM_BLOCKS, block_size=BLOCK_SIZE, tp=tp
    )


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--model", required=True)
    parser.add_argument("--rank", type=int, required=True)
    parser.add_argument("--size", type=int, required=True)
    parser.add_argument("--addr", required=True)
    parser.add_argument("--device", default="cpu")
    parser.add_argument("--dtype", default="float32")
    parser.add_argument("--out", required=True)
    args = parser.parse_args()
    from ominix_worker.parallel.distributed import init_rank_group

    torch.set_num_threads(1)
    device = torch.device(args.device)
    group = init_rank_group(args.rank, args.size, args.addr, device, timeout_s=60)
    logits = batch_logits(load_runner(args.model, args.device, getattr(torch, args.dtype), group.tp))
    if args.rank == 0:
        torch.save(logits, args.out)
    torch.distributed.destroy_process_group()


if __name__ == "__main__":
    main()
