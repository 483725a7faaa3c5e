"""The host's share of an eager step on the CUDA code path, measured on a CPU: the model runs with the fused
ops and the Triton paged-attention backend it uses on CUDA, every Triton launch replaced by a no-op and every
projection's GEMM by an unfilled output of its shape, on a model of the real depth and head counts with tiny
widths, in bfloat16. What remains is this project's Python per step (input preparation, metadata, per-layer
glue, sampling) and torch's dispatch, through the worker's pipelined path (``bench/prefix_step.py``'s
``host_launch``).

Not in the time, to add on a GPU: each Triton launch's own cost and each cuBLAS call's (both counted per
step), the host-to-device copies of the step's inputs (pinned, about a dozen), a handful of native torch
kernels (embedding, index_select, the sampler's stack and casts), the greedy kernel (the CPU takes
``logits.max`` instead), and the sampled ids' pinned copy back with its event. A pipelined worker posts the
previous step's result only once the next step is launched, so the launch holds that result back; on a GPU,
``bench/prefix_step.py``'s ``*_host_launch`` figures measure the whole launch.

    python bench/host_glue.py                                  # 32 layers, 8 decodes beside a 1,024-token prompt
    python bench/host_glue.py --layers 32 --prompt 1024 --decodes 8 --profile 20

Needs triton importable (its kernels are replaced, never compiled); no GPU.
"""

from __future__ import annotations

import argparse
import cProfile
import json
import pstats
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "workers"))
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "bench"))  # prefix_step's host_launch

import torch  # noqa: E402
from prefix_step import BLOCK, _new, host_launch  # noqa: E402

from ominix_runtime.contract import DecodeStep, RunningRequestData  # noqa: E402
from ominix_worker.ops import cdiv  # noqa: E402

# What the stand-ins were asked to do, per step.
COUNTS = {"triton_launches": 0, "gemms": 0}


class NoLaunch:
    """Stands in for a Triton kernel: ``kernel[grid](...)`` counts the launch and does nothing."""

    def __getitem__(self, grid: object) -> object:
        def launch(*args: object, **kwargs: object) -> None:
            COUNTS["triton_launches"] += 1

        return launch


def stand_in_for_the_device() -> None:
    """Every Triton kernel the CUDA path launches becomes a NoLaunch, every projection's GEMM an output of its
    shape; the model takes the fused ops as on CUDA."""
    from triton.runtime import KernelInterface  # JIT, autotuned, heuristic and interpreted kernels alike

    from ominix_worker.attention import triton_paged
    from ominix_worker.models import llama
    from ominix_worker.ops import cpu_gemm, fused
    from ominix_worker.ops.launch import FastKernel
    from ominix_worker.parallel.layers import PackableLinear, ParallelLMHead

    for module in (fused, triton_paged):
        for name, value in list(vars(module).items()):
            # FastKernel: a launched kernel behind ominix_worker.ops.launch's fast path
            if isinstance(value, KernelInterface | FastKernel):
                setattr(module, name, NoLaunch())
    llama.cuda_ops = lambda x: fused  # type: ignore[assignment]
    # The GEMM below never reads a packed weight: packing them at load would only cost time.
    cpu_gemm.can_pack = lambda weight: False  # type: ignore[assignment]

    def no_gemm(self: PackableLinear, x: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
        COUNTS["gemms"] += 1
        shape = (*x.shape[:-1], self.weight.shape[0])
        # The logits are zeros (a few rows), so no NaN in them ends a request; elsewhere no fill (its time would
        # be the CPU's compute, not the host's share).
        return x.new_zeros(shape) if isinstance(self, ParallelLMHead) else x.new_empty(shape)

    PackableLinear.gemm = no_gemm  # type: ignore[method-assign]


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--layers", type=int, default=32)
    p.add_argument("--heads", type=int, default=32, help="query heads (Llama-3.1-8B: 32)")
    p.add_argument("--kv-heads", type=int, default=8, help="KV heads (Llama-3.1-8B: 8)")
    p.add_argument("--prompt", type=int, default=1024, help="the new prompt's tokens in the mixed step")
    p.add_argument("--decodes", type=int, default=8, help="running decodes beside it (context 512)")
    p.add_argument("--trials", type=int, default=20)
    p.add_argument(
        "--profile", type=int, default=0, help="print this many functions by own time over the trials"
    )
    p.add_argument("--json", help="write the figures here")
    args = p.parse_args()
    torch.set_num_threads(1)  # the host thread that launches, not the GEMMs, is what is measured
    stand_in_for_the_device()
    from ominix_worker.runner import build_runner
    from ominix_worker.testing import tiny_config_kwargs

    folder = Path(tempfile.mkdtemp())
    shape = tiny_config_kwargs(
        "llama", 1000, 8 * args.heads, args.layers, args.heads, args.kv_heads, False, 4096
    )
    config = {"architectures": ["LlamaForCausalLM"], "model_type": "llama", **shape}
    (folder / "config.json").write_text(json.dumps(config))
    decode_blocks = cdiv(512 + args.trials + 10, BLOCK)
    prompt_blocks = cdiv(args.prompt + 1, BLOCK)
    runner = build_runner(
        f"dummy:{folder / 'config.json'}",
        device="cpu",
        dtype=torch.bfloat16,
        attention="triton",
        num_blocks=args.decodes * decode_blocks + 2 * prompt_blocks,
        block_size=BLOCK,
    )
    runner.overlap_steps = False
    running = [f"d{i}" for i in range(args.decodes)]
    prompt_ids = [3 + i % 900 for i in range(max(512, args.prompt))]
    first = [
        _new(r, prompt_ids[:512], list(range(i * decode_blocks, (i + 1) * decode_blocks)), 0, 512)
        for i, r in enumerate(running)
    ]
    runner.execute_step(DecodeStep(1, first))
    prompt_base = args.decodes * decode_blocks
    step_id = 1

    def mixed_step(i: int) -> tuple[DecodeStep, DecodeStep]:
        nonlocal step_id
        blocks = list(range(prompt_base + (i % 2) * prompt_blocks, prompt_base + (i % 2 + 1) * prompt_blocks))
        decodes = [RunningRequestData(r, [], 1) for r in running]
        prompt = _new(f"p{i}", prompt_ids[: args.prompt], blocks, 0, args.prompt)
        step = DecodeStep(step_id + 1, [prompt], decodes)
        step_id += 2
        return step, DecodeStep(step_id, finished_request_ids=[f"p{i}"])

    host_launch(runner, [mixed_step(i) for i in range(3)])  # warm-up
    COUNTS.update(triton_launches=0, gemms=0)
    steps = [mixed_step(3 + i) for i in range(args.trials)]
    profiler = cProfile.Profile() if args.profile else None
    if profiler is not None:
        profiler.enable()
    timed = host_launch(runner, steps)
    if profiler is not None:
        profiler.disable()
    figures = {
        "layers": args.layers,
        "prompt_tokens": args.prompt,
        "decodes": args.decodes,
        "host_ms_median": timed["median_ms"],
        "host_ms_min": timed["min_ms"],
        "triton_launches_per_step": COUNTS["triton_launches"] // args.trials,
        "gemms_per_step": COUNTS["gemms"] // args.trials,  # a finishing step computes nothing
        "steps": timed["steps"],
    }
    print(json.dumps(figures, indent=1))
    if args.json:
        Path(args.json).write_text(json.dumps(figures, indent=1) + "\n")
    if profiler is not None:
        print(f"cProfile over {args.trials} steps (and their finishing steps), seconds in all:")
        pstats.Stats(profiler).sort_stats("tottime").print_stats(args.profile)


if __name__ == "__main__":
    main()
