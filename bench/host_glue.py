"""The host's share of an eager step on the CUDA code path, measured on a CPU: the model runs with the fused
ops and the Triton paged-attention backend it uses on CUDA, every Triton launch replaced by a no-op and every
projection's GEMM by an empty output of its shape, on a model of the real depth with tiny widths. What remains is this project's Python per
step (input preparation, metadata, per-layer glue) and torch's dispatch, without the launches themselves: on a
GPU add each Triton launch's own cost (printed: the count per step) and each cuBLAS call's.

A pipelined worker posts the previous step's result only once the next step is launched, so this time is how
long an eager step's launch can hold that result back when nothing waits for the device; on a GPU,
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
import statistics
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "workers"))
sys.path.insert(0, str(ROOT))

import torch  # noqa: E402

from ominix_runtime.contract import DecodeStep, NewRequestData, RunningRequestData, SamplingParams  # noqa: E402

BLOCK = 16


class NoLaunch:
    """Stands in for a Triton kernel: ``kernel[grid](...)`` counts the launch and does nothing."""

    launches = 0
    gemms = 0  # the projections' GEMMs, also stood in for (``stub_triton_kernels``)

    def __getitem__(self, grid: object) -> object:
        def launch(*args: object, **kwargs: object) -> None:
            NoLaunch.launches += 1

        return launch


def stub_triton_kernels() -> None:
    """Every Triton kernel the CUDA path launches becomes a NoLaunch, every projection's GEMM an empty output;
    the model takes the fused ops as on CUDA."""
    import triton

    from ominix_worker.attention import triton_paged
    from ominix_worker.models import llama
    from ominix_worker.ops import cpu_gemm, fused
    from ominix_worker.parallel.layers import PackableLinear

    kernel_types = (triton.runtime.jit.JITFunction, triton.runtime.autotuner.Autotuner)
    for module in (fused, triton_paged):
        for name, value in list(vars(module).items()):
            if isinstance(value, kernel_types):
                setattr(module, name, NoLaunch())
    llama.cuda_ops = lambda x: fused  # type: ignore[assignment]
    # GEMMs (cuBLAS on CUDA, one F.linear a projection) become empty outputs of their shape: their compute is
    # the device's, and the CPU's packed-weight path is mechanism the CUDA path does not take.
    cpu_gemm.can_pack = lambda weight: False  # type: ignore[assignment]

    def no_gemm(self: PackableLinear, x: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
        NoLaunch.gemms += 1
        return x.new_empty((*x.shape[:-1], self.weight.shape[0]))

    PackableLinear.gemm = no_gemm  # type: ignore[method-assign]


def _new(rid: str, tokens: int, blocks: list[int]) -> NewRequestData:
    return NewRequestData(
        request_id=rid,
        prompt_token_ids=[3 + i % 900 for i in range(tokens)],
        sampling=SamplingParams(temperature=0.0, max_tokens=1 << 20),
        kv_block_ids=blocks,
        num_computed_tokens=0,
        num_scheduled_tokens=tokens,
        effective_seed=0,
    )


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--layers", type=int, default=32)
    p.add_argument("--prompt", type=int, default=1024, help="the new prompt's tokens in the mixed step")
    p.add_argument("--decodes", type=int, default=8, help="running decodes beside it (context 512)")
    p.add_argument("--trials", type=int, default=20)
    p.add_argument("--profile", type=int, default=0, help="print this many functions of one step by own time")
    p.add_argument("--json", help="write the figures here")
    args = p.parse_args()
    torch.set_num_threads(1)  # the host thread that launches, not the GEMMs, is what is measured
    stub_triton_kernels()
    from ominix_worker.runner import build_runner
    from ominix_worker.testing import tiny_config_kwargs

    folder = Path(tempfile.mkdtemp())
    shape = tiny_config_kwargs("llama", 1000, 128, args.layers, 4, 2, False, 4096)
    config = {"architectures": ["LlamaForCausalLM"], "model_type": "llama", **shape}
    (folder / "config.json").write_text(json.dumps(config))
    decode_blocks = -(-(512 + 2 * args.trials + 10) // BLOCK)
    prompt_blocks = -(-(args.prompt + 1) // BLOCK)
    num_blocks = args.decodes * decode_blocks + 2 * prompt_blocks
    runner = build_runner(
        f"dummy:{folder / 'config.json'}", device="cpu", attention="triton", num_blocks=num_blocks
    )
    runner.overlap_steps = False
    running = [f"d{i}" for i in range(args.decodes)]
    step_id = 1
    first = [
        _new(r, 512, list(range(i * decode_blocks, (i + 1) * decode_blocks))) for i, r in enumerate(running)
    ]
    runner.execute_step(DecodeStep(step_id, first))
    prompt_base = args.decodes * decode_blocks

    def mixed_step(i: int) -> tuple[DecodeStep, DecodeStep]:
        nonlocal step_id
        blocks = list(range(prompt_base + (i % 2) * prompt_blocks, prompt_base + (i % 2 + 1) * prompt_blocks))
        decodes = [RunningRequestData(r, [], 1) for r in running]
        step = DecodeStep(step_id + 1, [_new(f"p{i}", args.prompt, blocks)], decodes)
        step_id += 2
        return step, DecodeStep(step_id, finished_request_ids=[f"p{i}"])

    times: list[float] = []
    launches = gemms = 0
    for i in range(args.trials + 3):
        step, finish = mixed_step(i)
        NoLaunch.launches = NoLaunch.gemms = 0
        started = time.perf_counter()
        runner.execute_step(step)
        if i >= 3:
            times.append((time.perf_counter() - started) * 1e3)
        launches, gemms = NoLaunch.launches, NoLaunch.gemms
        runner.execute_step(finish)
    figures = {
        "layers": args.layers,
        "prompt_tokens": args.prompt,
        "decodes": args.decodes,
        "host_ms_median": round(statistics.median(times), 3),
        "host_ms_min": round(min(times), 3),
        "triton_launches_per_step": launches,
        "gemms_per_step": gemms,
        "steps": len(times),
    }
    print(json.dumps(figures, indent=1))
    if args.json:
        Path(args.json).write_text(json.dumps(figures, indent=1) + "\n")
    if args.profile:
        step, finish = mixed_step(args.trials + 100)
        profiler = cProfile.Profile()
        profiler.enable()
        runner.execute_step(step)
        profiler.disable()
        runner.execute_step(finish)
        pstats.Stats(profiler).sort_stats("tottime").print_stats(args.profile)


if __name__ == "__main__":
    main()
