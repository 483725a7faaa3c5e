"""One rank of a tensor-parallel check, run as its own process (gloo on CPU, NCCL on CUDA).

``python tp_logits.py --model DIR --rank R --size N --addr HOST:PORT --device cpu --out FILE`` joins the group,
loads rank R's shards, runs a fixed ragged batch (two prompts of different lengths in one step, then one
decode step for both) and, on rank 0, saves every row's logits to FILE. ``batch_logits`` is the same batch
for an in-process runner (TP=1 reference). ``--moe-parallel tensor|expert`` picks how MoE layers split.

``--check graphs`` (CUDA) instead captures decode graphs on every rank (their all-reduces and the logits
all-gather inside) and saves, on rank 0, the greedy tokens of a pipelined graph run and of an eager run of
the same steps, and the largest logit difference between a graph replay and the eager forward.
"""

from __future__ import annotations

import argparse
import os
import sys
from dataclasses import replace
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "workers"))  # a bare checkout on GPU machines

from ominix_runtime.contract import SamplingParams  # noqa: E402
from ominix_worker.parallel import SINGLE, MoeParallel, TensorParallel  # noqa: E402
from ominix_worker.runner import CachedRequest, ModelRunner, ScheduledRow, build_runner  # noqa: E402

PROMPTS = ([3 + (7 * i) % 250 for i in range(37)], [5 + (11 * i) % 240 for i in range(9)])
NUM_BLOCKS = 16
BLOCK_SIZE = 16


@torch.inference_mode()
def batch_logits(runner: ModelRunner) -> torch.Tensor:
    """Logits of every prompt row of a ragged prefill step, then of a decode row per request (CPU, float32)."""
    requests = [
        CachedRequest(
            f"r{i}",
            list(p),
            [],
            SamplingParams(temperature=0.0),
            [[3 * i, 3 * i + 1, 3 * i + 2] for _ in runner.attention_groups],
            0,
            0,
        )
        for i, p in enumerate(PROMPTS)
    ]
    prefill = [ScheduledRow(r, 0, r.num_tokens, samples=True) for r in requests]
    inputs = runner._prepare_inputs(prefill)
    # Every position's logits, not only the sampled rows ``_forward`` keeps: the ranks must agree on all.
    hidden = runner.model(inputs.input_ids, inputs.positions, runner.kv_caches, inputs.metas)
    prefill_logits = runner.model.compute_logits(hidden)
    for r in requests:
        r.num_computed_tokens = r.num_tokens
        r.output_token_ids.append(11 + len(r.prompt_token_ids))
    decode = [ScheduledRow(r, r.num_tokens - 1, r.num_tokens, samples=True) for r in requests]
    inputs = runner._prepare_inputs(decode)
    decode_logits = runner.model.compute_logits(runner._forward(inputs))[: len(requests)]
    return torch.cat([prefill_logits, decode_logits]).float().cpu()


def greedy_tokens(runner: ModelRunner, num_steps: int, pipelined: bool) -> dict[str, list[int]]:
    """Greedy tokens of both prompts over ``num_steps`` steps, driven like the worker's step loop."""
    from ominix_runtime.contract import DecodeStep, NewRequestData, RunningRequestData

    runner.reset()
    runner.overlap_steps = pipelined
    greedy = SamplingParams(temperature=0.0)
    news = [
        NewRequestData(f"r{i}", list(p), greedy, list(range(8 * i, 8 * i + 8)), 0, len(p), 0)
        for i, p in enumerate(PROMPTS)
    ]
    results = []
    for step_id in range(1, num_steps + 1):
        if step_id == 1:
            step = DecodeStep(1, new_requests=news)
        else:
            step = DecodeStep(
                step_id, running_requests=[RunningRequestData(n.request_id, [], 1) for n in news]
            )
        result = runner.execute_step(step)
        results += ([result] if result is not None else []) + runner.take_results()
    runner.finish_pending()
    results += runner.take_results()
    tokens: dict[str, list[int]] = {n.request_id: [] for n in news}
    for result in results:
        for out in result.outputs:
            assert out.error_kind is None, out.error_message
            tokens[out.request_id].append(int(out.sampled_token_id))  # type: ignore[arg-type]
    return tokens


@torch.inference_mode()
def graph_check(runner: ModelRunner) -> dict[str, object]:
    """Pipelined graph decode (and the prompts' step from piecewise graphs) vs eager steps on one runner (graphs
    captured on every rank)."""
    assert runner.capture_decode_graphs([1, 2, 4]), "no graphs captured"
    graphs = runner._graphs
    assert graphs is not None
    # Every bucket keeps only the sampled rows past the last attention (one per prompt), as a serving
    # worker's buckets above its running-request limit do.
    buckets = runner.capture_piecewise_graphs(64, step=32, sampled_rows=len(PROMPTS))
    pieces = runner._piecewise_graphs
    assert pieces is not None and pieces.tail_rows == len(PROMPTS)
    pipelined = greedy_tokens(runner, 12, pipelined=True)
    runner._graphs = runner._piecewise_graphs = None
    eager = greedy_tokens(runner, 12, pipelined=False)
    runner._graphs = graphs
    requests = [
        CachedRequest(
            f"g{i}", list(p), [7], SamplingParams(temperature=0.0), [[3 * i, 3 * i + 1, 3 * i + 2]], 0, 0
        )
        for i, p in enumerate(PROMPTS)
    ]
    prompt_rows = [ScheduledRow(r, 0, r.num_tokens - 1, True) for r in requests]

    def prompt_logits() -> tuple[torch.Tensor, int]:
        inputs = runner._prepare_inputs(prompt_rows)
        hidden = runner._forward(inputs)
        return runner.model.compute_logits(hidden)[: len(requests)].float(), inputs.piecewise_bucket

    eager_prompt_logits, _ = prompt_logits()
    runner._piecewise_graphs = pieces
    piece_logits, piece_bucket = prompt_logits()
    runner._piecewise_graphs = None
    for r in requests:
        r.num_computed_tokens = r.num_tokens - 1
    rows = [ScheduledRow(r, r.num_tokens - 1, r.num_tokens, samples=True) for r in requests]
    graph_logits = graphs.run(rows).float()
    # Padded to a captured size past the sampled rows, as the graphs' LM head is.
    eager_logits = runner.model.compute_logits(runner._forward(runner._prepare_inputs(rows)))[
        : len(rows)
    ].float()
    return {
        "pipelined": pipelined,
        "eager": eager,
        "max_logit_diff": float((graph_logits - eager_logits).abs().max()),
        "num_graphs": len(graphs.graphs),
        "piecewise_graph_buckets": buckets,
        "piece_bucket": piece_bucket,
        "piece_logit_diff": float((piece_logits - eager_prompt_logits).abs().max()),
    }


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
    parser.add_argument("--check", choices=("logits", "graphs"), default="logits")
    parser.add_argument("--moe-parallel", choices=[m.value for m in MoeParallel], default="tensor")
    args = parser.parse_args()
    from ominix_worker.parallel.distributed import init_rank_group

    torch.set_num_threads(1)
    device = torch.device(args.device)
    group = init_rank_group(args.rank, args.size, args.addr, device, timeout_s=60)
    tp = replace(group.tp, moe=MoeParallel(args.moe_parallel))
    runner = load_runner(args.model, args.device, getattr(torch, args.dtype), tp)
    result = batch_logits(runner) if args.check == "logits" else graph_check(runner)
    if args.rank == 0:
        torch.save(result, args.out)
    if args.check == "graphs":
        # Captured graphs hold the NCCL communicator: tearing the group down under them blocks forever
        # (seen on H100s), so a rank that captured leaves without it, as a worker process does.
        sys.stdout.flush()
        os._exit(0)
    torch.distributed.destroy_process_group()


if __name__ == "__main__":
    main()
