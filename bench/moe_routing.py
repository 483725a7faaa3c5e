"""How many distinct experts a dummy-weight MoE model routes a batch of tokens to, per layer: vLLM's or ours.

A decode step of an MoE model reads the weights of every expert its batch hits, so two engines compare only when
their dummy models spread tokens over the experts alike. vLLM's dummy loader draws every floating parameter
uniform in ±1e-3 (norm weights included); ours draws N(0, 0.02) matrices and unit norms. ``--engine vllm`` runs
vLLM eagerly in this process (no CUDA graphs, no compile: forward hooks fire) and records the routers of its
decode batches; ``--engine ours`` prefills ``--num-requests`` prompts in one step of our runner, then
runs one decode step. Both count the decode batch only. Prints the distinct experts hit by each layer's
top-k, next to what uniform random routing would hit. ``--quantization fp8`` as in bench/peer_vllm.py.

Two views in vLLM: ``router`` takes the top-k of each ``mlp.gate``'s logits (as ours routes); ``kernel`` counts the
top-k ids vLLM's Triton experts are handed (from its own top-k gating kernel). On vLLM's stock dummy weights (±1e-3
norms) the router view spread over all experts while the kernel view was the same 8 ids for every token
(Qwen3-30B-A3B, FP8); ``--unit-norms`` (bench/peer_vllm.py's) spreads both. The kernel view is what a decode step
reads. gpt-oss stayed on 4 of 32 experts with unit norms; ``--ours-init`` (every weight drawn as ours) spreads it.

    python bench/moe_routing.py --engine vllm --config bench/configs/qwen3-30b-a3b-config.json --vocab 150000
    python bench/moe_routing.py --engine ours --config bench/configs/qwen3-30b-a3b-config.json --vocab 150000
    python bench/moe_routing.py --engine vllm --config bench/configs/gpt-oss-20b-config.json --vocab 199000 \
        --ours-init --num-requests 64     # gpt-oss: the long-context decode batch
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import tempfile
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[1]

Record = tuple[str, int, int]  # (layer, tokens, distinct experts)
KERNEL = "vllm-triton-experts"  # the layer name of records taken at vLLM's expert kernels


def expected_distinct(experts: int, top_k: int, tokens: int) -> float:
    """Distinct experts hit by ``tokens`` independent uniform top-k draws."""
    return experts * (1 - (1 - top_k / experts) ** tokens)


# Router modules by name: ``mlp.gate`` (ours, and vLLM's Qwen3-MoE / Mixtral), ``mlp.router`` (vLLM's gpt-oss).
ROUTER_SUFFIXES = ("mlp.gate", "mlp.router")


def hook_routers(model: torch.nn.Module, top_k: int, log: str) -> int:
    """Appends every router call's (layer, rows, distinct top-k experts) to the file ``log`` as a JSON line (a
    file, because vLLM may run the hook on a pickled copy of this function); returns the routers hooked."""
    hooked = 0
    for name, module in model.named_modules():
        if name.endswith(ROUTER_SUFFIXES):

            def record(_m: torch.nn.Module, _in: object, out: object, name: str = name) -> None:
                logits = out[0] if isinstance(out, tuple) else out
                assert isinstance(logits, torch.Tensor)
                ids = torch.topk(logits.float(), top_k, dim=-1).indices
                with open(log, "a") as f:
                    f.write(json.dumps([name, int(logits.shape[0]), int(torch.unique(ids).numel())]) + "\n")

            module.register_forward_hook(record)
            hooked += 1
    return hooked


def read_log(log: str) -> list[Record]:
    return [tuple(json.loads(line)) for line in Path(log).read_text().splitlines()]  # type: ignore[misc]


def record_ours(args: argparse.Namespace, top_k: int, log: str) -> None:
    """Prefills ``--num-requests`` prompts in one step, then runs one decode step of that many rows."""
    sys.path.insert(0, str(ROOT / "workers"))
    sys.path.insert(0, str(ROOT))
    from ominix_runtime.contract import DecodeStep, NewRequestData, RunningRequestData, SamplingParams
    from ominix_worker.runner import build_runner

    per_request = args.input_len // 16 + 1  # the prompt and the decoded token
    on_cpu = args.device == "cpu"
    runner = build_runner(
        f"dummy:{args.config}", device=args.device, dtype=torch.float32 if on_cpu else torch.bfloat16,
        num_blocks=args.num_requests * per_request + 1, quantization=args.quantization,
    )  # fmt: skip
    print(f"routers hooked: {hook_routers(runner.model, top_k, log)}", flush=True)
    gen = torch.Generator().manual_seed(1)
    greedy = SamplingParams(temperature=0.0)
    extra_groups = len(runner.kv_windows) - 1  # a hybrid layout (gpt-oss): each group's pool has every id

    def blocks(i: int) -> list[int]:
        return list(range(1 + i * per_request, 1 + (i + 1) * per_request))

    new = [
        NewRequestData(
            f"r{i}",
            torch.randint(0, args.vocab, (args.input_len,), generator=gen).tolist(),
            greedy,
            blocks(i),
            0,
            args.input_len,
            i,
            group_kv_block_ids=[blocks(i) for _ in range(extra_groups)],
        )  # fmt: skip
        for i in range(args.num_requests)
    ]
    runner.execute_step(DecodeStep(1, new_requests=new))
    # Only the decode step counts: the prefill's last layer routes the sampled rows alone, as many as a decode.
    Path(log).write_text("")
    running = [RunningRequestData(r.request_id, [], 1) for r in new]
    runner.execute_step(DecodeStep(2, running_requests=running))


def count_kernel_routing(log: str) -> None:
    """Wraps the expert assignment of vLLM's Triton experts (it is given the top-k ids the MoE kernels run on)
    so each call appends (KERNEL, rows, distinct experts) to ``log``."""
    from vllm.model_executor.layers.fused_moe.experts import triton_moe

    assign = triton_moe._prepare_expert_assignment

    def counted(topk_ids: torch.Tensor, *rest: object, **named: object) -> object:
        with open(log, "a") as f:
            f.write(json.dumps([KERNEL, int(topk_ids.shape[0]), int(torch.unique(topk_ids).numel())]) + "\n")
        return assign(topk_ids, *rest, **named)

    triton_moe._prepare_expert_assignment = counted


def record_vllm(args: argparse.Namespace, top_k: int, log: str) -> None:
    from peer_vllm import dummy_llm, use_offline_env  # this folder, as a script's sys.path[0]

    # The model lives in this process: hooks can record it.
    use_offline_env(VLLM_ENABLE_V1_MULTIPROCESSING="0")
    from vllm import SamplingParams
    from vllm.inputs import TokensPrompt

    count_kernel_routing(log)
    gen = torch.Generator().manual_seed(1)
    prompts = [
        torch.randint(0, args.vocab, (args.input_len,), generator=gen).tolist()
        for _ in range(args.num_requests)
    ]
    forced = SamplingParams(temperature=0.0, max_tokens=args.output_len, ignore_eos=True, detokenize=False)
    with dummy_llm(args.config, args.quantization, args.dummy_init, enforce_eager=True) as llm:
        print(f"routers hooked: {llm.apply_model(lambda model: hook_routers(model, top_k, log))}", flush=True)
        llm.generate([TokensPrompt(prompt_token_ids=q) for q in prompts], forced, use_tqdm=False)


def main() -> None:
    from peer_vllm import add_dummy_init_args  # this folder, as a script's sys.path[0]

    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--engine", choices=("vllm", "ours"), required=True)
    p.add_argument("--config", required=True)
    p.add_argument("--quantization", default=None)
    p.add_argument("--num-requests", type=int, default=256, help="the decode batch")
    p.add_argument("--input-len", type=int, default=512)
    p.add_argument(
        "--output-len",
        type=int,
        default=16,
        help="vllm only: decode steps (at 4, vLLM's 256-row batches still carried prefill chunks)",
    )
    p.add_argument("--vocab", type=int, default=128000)
    add_dummy_init_args(p)  # vllm only
    p.add_argument("--device", default="cuda", help="ours only: cuda, or cpu (float32) for a small config")
    args = p.parse_args()
    config = json.loads(Path(args.config).read_text())
    experts = int(config.get("num_experts") or config["num_local_experts"])  # gpt-oss: num_local_experts
    top_k = int(config["num_experts_per_tok"])
    with tempfile.TemporaryDirectory(prefix="moe-routing-") as work:
        log = str(Path(work) / "routers.jsonl")
        (record_vllm if args.engine == "vllm" else record_ours)(args, top_k, log)
        recorded = read_log(log)
    views = {
        "router": [r for r in recorded if r[0] != KERNEL],
        "kernel": [r for r in recorded if r[0] == KERNEL],
    }
    report: dict[str, object] = {
        "engine": args.engine,
        "quantization": args.quantization or "bf16",
        "batch": args.num_requests,
        "uniform_routing_expects": round(expected_distinct(experts, top_k, args.num_requests), 1),
    }
    for view, records in views.items():
        batch = [r for r in records if r[1] == args.num_requests]
        if not records:
            continue
        if not batch:
            sizes = sorted({r[1] for r in records})
            raise SystemExit(
                f"{view}: no batch of {args.num_requests} tokens was recorded (sizes: {sizes[:20]})"
            )
        distinct = [r[2] for r in batch]
        report[view] = {
            "layer_calls": len(batch),
            "distinct_experts_median": statistics.median(distinct),
            "distinct_experts_min": min(distinct),
            "distinct_experts_max": max(distinct),
            "distinct_experts_first_calls": distinct[:48],
        }
    print(json.dumps(report), flush=True)


if __name__ == "__main__":
    main()
