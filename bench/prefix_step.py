"""The worker's side of a shared-prefix TTFT, in process (no gRPC, no engine): a prompt of ``--prefix-len``
tokens is prefilled once, then each trial is a new request whose first ``--prefix-len`` tokens hit that KV and
whose ``--suffix-len`` new tokens run as one step through ``ModelRunner.execute_step`` (the captured prefill
graph when one holds them), sampling one token. Reports the step's wall time on the host (median and minimum),
which on CUDA runs until the sampled ids are back. A batch-1 decode step is timed the same way for comparison.
``--mixed-decodes D`` also times a step of D running decodes beside the prefill of ``--mixed-prompts`` new
prompts of ``--mixed-prompt`` tokens each (one by default: an online step when a request arrives; 8 x 512 is
a W1 prefill step), eager, and the same D decodes alone; also the host time to
launch each of them while the device is kept busy by a spin kernel (``*_host_launch``): a pipelined worker
posts the previous step's result only once the next step is launched, so an eager step's launch delays it.
``--profile`` adds the device time by kernel of one suffix step and of one mixed step (torch profiler);
``--trace`` writes one mixed step's host and device timeline; ``--piecewise-graph-tokens N`` replays the mixed
steps from piecewise CUDA graphs (the worker's ``OMINIX_PIECEWISE_GRAPH_TOKENS``; ``--piecewise-fastest-bucket``
times the buckets and replays the fastest that holds a step). ``--device cpu`` runs it all
on a tiny model in float32: a check of the script, not a measurement.

    python bench/prefix_step.py --model dummy:bench/configs/llama8b-config.json --profile --json out.json
    python bench/prefix_step.py --mixed-decodes 8 --mixed-prompt 1024 --profile
"""

from __future__ import annotations

import argparse
import cProfile
import json
import pstats
import statistics
import sys
import time
from collections.abc import Callable
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "workers"))
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "bench"))  # moe_profile, for --profile

import torch  # noqa: E402

from ominix_runtime import memory  # noqa: E402
from ominix_runtime.contract import (  # noqa: E402
    CUDA_PROFILE,
    DecodeStep,
    NewRequestData,
    RunningRequestData,
    SamplingParams,
    StepResult,
)
from ominix_worker.ops.launch import KERNELS, set_fast_launch  # noqa: E402
from ominix_worker.piecewise_graph import TOKEN_STEP  # noqa: E402
from ominix_worker.runner import ModelRunner, build_runner  # noqa: E402

BLOCK = 16
SUFFIX_BLOCKS = 512  # KV blocks the suffix steps cycle through (after the shared prefix's)
MIXED_FIRST = 1024  # the mixed step's blocks start here (the batch-1 decode's lie between)
# A spin kernel queued before a launch is timed, longer than any launch (~0.1 - 0.2 s on an H100 / H200 clock):
# no launch then waits for the device, so the time is the host's alone.
SPIN_CYCLES = 300_000_000
Summary = dict[str, float | int | list[float]]  # median_ms, min_ms, steps, all_ms


class StepClock:
    """Host wall time of each ``execute_step`` call. The runner returns once the step's sampled ids are on the
    host, so on CUDA this is the step from its first host work to its last kernel and the copy back."""

    def __init__(self, runner: ModelRunner) -> None:
        self.runner = runner
        self.wall_ms: list[float] = []

    def run(self, step: DecodeStep, keep: bool = True) -> StepResult:
        if self.runner.device.type == "cuda":
            torch.cuda.synchronize()
        started = time.perf_counter()
        result = self.runner.execute_step(step)
        wall = (time.perf_counter() - started) * 1e3
        if result is None:
            raise RuntimeError("the runner overlapped a step: overlap_steps must be off")
        check_outputs(result)
        if keep:
            self.wall_ms.append(wall)
        return result

    def summary(self) -> Summary:
        return summary(self.wall_ms)


def summary(times_ms: list[float]) -> Summary:
    return {
        "median_ms": round(statistics.median(times_ms), 3),
        "min_ms": round(min(times_ms), 3),
        "steps": len(times_ms),
        "all_ms": [round(t, 3) for t in times_ms],
    }


def check_outputs(result: StepResult) -> None:
    for out in result.outputs:
        if out.error_kind is not None:
            raise RuntimeError(f"{out.request_id}: {out.error_message}")


def host_launch(
    runner: ModelRunner,
    steps: list[tuple[DecodeStep, DecodeStep | None]],
    pstats_path: str | None = None,
) -> Summary:
    """Host ms to launch each step (with its finishing step after it, if any) through the runner's pipelined
    path, each behind a spin kernel: what the step's launch holds back the previous step's result by. Nothing
    is pending when a step is launched here, so the placeholder gather of a step launched behind another is
    not in the time. On the CPU (no spin, the step computes as it is launched) this checks the path only.
    ``pstats_path``: the launches also run under cProfile (their times then include its overhead), whose
    stats are written there and summed by function on stdout."""
    cuda = runner.device.type == "cuda"
    times: list[float] = []
    # The launching thread's CPU time beside each wall time: equal, the host ran the launch's code that long;
    # less, the launch waited (a lock, another thread holding the GIL, the device).
    cpu_times: list[float] = []
    profiler = cProfile.Profile() if pstats_path else None
    for step, finish in steps:
        spun: torch.cuda.Event | None = None
        if cuda:
            torch.cuda.synchronize()
            torch.cuda._sleep(SPIN_CYCLES)  # type: ignore[no-untyped-call]
            spun = torch.cuda.Event()
            spun.record()
        runner.overlap_steps = True
        started = time.perf_counter()
        cpu_started = time.thread_time()
        try:
            if profiler is not None:
                profiler.enable()
            runner.execute_step(step)
            if profiler is not None:
                profiler.disable()
            launched = (time.perf_counter() - started) * 1e3
            cpu_times.append(round((time.thread_time() - cpu_started) * 1e3, 3))
            if not runner.has_pending():
                raise RuntimeError(f"step {step.step_id} did not take the pipelined path")
            if spun is not None and spun.query():
                raise RuntimeError(
                    f"the spin kernel ended before step {step.step_id}'s launch returned ({launched:.1f} ms): "
                    "the launch waited for the device (a sync on the host path), or SPIN_CYCLES is too short"
                )
            times.append(launched)
            runner.finish_pending()
        finally:
            runner.overlap_steps = False
        for result in runner.take_results():
            check_outputs(result)
        if finish is not None:
            StepClock(runner).run(finish, keep=False)
    if profiler is not None:
        profiler.dump_stats(str(pstats_path))
        print(f"--- cProfile of {len(steps)} launches (also in {pstats_path})")
        pstats.Stats(profiler).sort_stats("tottime").print_stats(25)
    return summary(times) | {"thread_cpu_ms": cpu_times}


def _new(rid: str, prompt: list[int], blocks: list[int], computed: int, scheduled: int) -> NewRequestData:
    return NewRequestData(
        request_id=rid,
        prompt_token_ids=prompt,
        sampling=SamplingParams(temperature=0.0, max_tokens=1),
        kv_block_ids=blocks,
        num_computed_tokens=computed,
        num_scheduled_tokens=scheduled,
        effective_seed=0,
    )


def step_kernels(
    make: Callable[[int], tuple[DecodeStep, DecodeStep]], first: int, clock: StepClock, top: int
) -> list[dict[str, object]]:
    """Device µs per step by kernel (``moe_profile.kernel_table``: warmed up, then averaged over many steps) of
    the steps ``make(first)``, ``make(first + 1)``, ..., each followed by its finishing step."""
    from moe_profile import kernel_table  # CUDA only: it imports the Triton MoE kernels

    indices = iter(range(first, first + 1_000))

    def one_step() -> None:
        step, finish = make(next(indices))
        clock.run(step, keep=False)
        clock.run(finish, keep=False)

    return [{"kernel": name, "us": round(us, 1), "calls": n} for name, us, n in kernel_table(one_step)[:top]]


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", default="dummy:bench/configs/llama8b-config.json")
    p.add_argument("--prefix-len", type=int, default=2048)
    p.add_argument("--suffix-len", type=int, default=64)
    p.add_argument("--trials", type=int, default=30)
    p.add_argument("--num-blocks", type=int, default=4096)
    p.add_argument(
        "--profile", action="store_true", help="device time by kernel of one suffix step (and one mixed step)"
    )
    p.add_argument(
        "--mixed-decodes",
        type=int,
        default=0,
        help="also time a step of this many running decodes beside a new prompt's prefill (0: off)",
    )
    p.add_argument("--mixed-prompt", type=int, default=1024, help="the new prompt's tokens in that step")
    p.add_argument(
        "--mixed-prompts",
        type=int,
        default=1,
        help="new prompts of --mixed-prompt tokens each in that step (8 x 512 beside up to 248 decodes: a W1 "
        "prefill step under the 4,096-token budget)",
    )
    p.add_argument("--top", type=int, default=20)
    p.add_argument("--json", help="write the figures here")
    p.add_argument("--trace", help="write a Chrome trace (host and device) of one mixed step here")
    p.add_argument(
        "--launch-pstats",
        help="also launch the mixed steps under cProfile; write its stats here (--mixed-decodes)",
    )
    p.add_argument(
        "--triton-launch",
        choices=("fast", "triton"),
        default="fast",
        help="launch the wrapped Triton kernels through ominix_worker.ops.launch (fast, the worker's default) "
        "or through Triton's own launch (triton: the worker's OMINIX_TRITON_FAST_LAUNCH=0)",
    )
    p.add_argument(
        "--warm-gemm-rows",
        type=int,
        default=0,
        help="with --mixed-decodes: then run the runner's GEMM warm-up in buckets of this many rows (the "
        "worker's OMINIX_WARM_GEMM_ROWS) and time the mixed steps and their launch again",
    )
    p.add_argument("--warm-gemm-max-tokens", type=int, default=8192, help="the warm-up's top row count")
    p.add_argument(
        "--piecewise-graph-tokens",
        type=int,
        default=0,
        help="capture prefill and mixed steps of up to this many tokens in pieces (the worker's "
        "OMINIX_PIECEWISE_GRAPH_TOKENS); 0: they run eagerly",
    )
    p.add_argument(
        "--piecewise-token-step",
        type=int,
        default=None,
        help="with --piecewise-graph-tokens: a bucket every this many tokens (the worker's "
        "OMINIX_PIECEWISE_TOKEN_STEP; 8 unless set)",
    )
    p.add_argument(
        "--piecewise-fastest-bucket",
        action="store_true",
        help="with --piecewise-graph-tokens: time each bucket at capture and replay the fastest that holds a "
        "step (the worker's OMINIX_PIECEWISE_FASTEST_BUCKET=1); the JSON gets every bucket's ms",
    )
    p.add_argument("--device", default="cuda", help="cuda (bf16), or cpu (float32: checks the script only)")
    args = p.parse_args()
    if args.piecewise_fastest_bucket and not args.piecewise_graph_tokens:
        p.error("--piecewise-fastest-bucket times the buckets of --piecewise-graph-tokens N: set N too")
    if args.piecewise_token_step is not None and not args.piecewise_graph_tokens:
        p.error("--piecewise-token-step spaces the buckets of --piecewise-graph-tokens N: set N too")
    if args.piecewise_token_step is not None and args.piecewise_token_step < 1:
        p.error("--piecewise-token-step must be at least 1")
    if args.mixed_prompts < 1:
        p.error("--mixed-prompts must be at least 1")
    set_fast_launch(args.triton_launch == "fast")
    if args.device == "cuda" and not torch.cuda.is_available():
        sys.exit("prefix_step.py needs a CUDA device (or --device cpu)")
    if args.prefix_len % BLOCK:
        sys.exit(f"--prefix-len must be a multiple of {BLOCK}")
    cuda = args.device == "cuda"
    dtype = torch.bfloat16 if cuda else torch.float32
    runner = build_runner(
        args.model, device=args.device, dtype=dtype, num_blocks=args.num_blocks, block_size=BLOCK
    )
    profile = args.profile and cuda  # the table is of device kernels
    runner.overlap_steps = False
    # As the worker starts: eager warm-up (Triton's compiles and variants), graphs, then the heap frozen, so
    # that collections during the trials skip the model's and the kernels' objects.
    mixed_tokens = args.mixed_prompts * args.mixed_prompt + args.mixed_decodes
    runner.warm_up(max(args.prefix_len, args.suffix_len, mixed_tokens))
    runner.capture_decode_graphs()
    started = time.perf_counter()
    token_step = args.piecewise_token_step or TOKEN_STEP
    piecewise_graph_buckets = (
        runner.capture_piecewise_graphs(
            args.piecewise_graph_tokens,
            timed=args.piecewise_fastest_bucket,
            step=token_step,
            # As the worker captures them, for its default running-request limit or this step's rows.
            sampled_rows=max(CUDA_PROFILE.max_running_requests, args.mixed_decodes + args.mixed_prompts),
        )
        if args.piecewise_graph_tokens
        else 0
    )
    piecewise_graph_capture_s = round(time.perf_counter() - started, 2)
    memory.freeze_startup_heap()
    vocab = runner.model.config.vocab_size
    gen = torch.Generator().manual_seed(0)
    prefix = torch.randint(3, vocab, (args.prefix_len,), generator=gen).tolist()
    prefix_blocks = list(range(args.prefix_len // BLOCK))
    free = list(range(len(prefix_blocks), args.num_blocks))
    # The KV blocks each part uses, after the shared prefix's: the suffixes cycle through SUFFIX_BLOCKS, the
    # batch-1 decode has its own, the mixed step's decodes and prompts come after.
    # a token per step: each mixed step and each step alone, timed (trials + 5 each) and launched (trials each,
    # trials more with --launch-pstats), and the profiled mixed steps
    decode_steps = 5 * args.trials + 40 + (2 * args.trials + 5 if args.warm_gemm_rows else 0)
    per_decode = -(-(512 + decode_steps) // BLOCK)
    prompt_blocks = -(-(args.mixed_prompt + 1) // BLOCK)
    needed = MIXED_FIRST + (
        args.mixed_decodes * per_decode + 2 * args.mixed_prompts * prompt_blocks if args.mixed_decodes else 0
    )
    if len(free) < needed:
        sys.exit(
            f"--num-blocks {args.num_blocks} holds too few KV blocks: at least {len(prefix_blocks) + needed}"
        )
    clock = StepClock(runner)
    clock.run(DecodeStep(1, [_new("a", prefix, prefix_blocks, 0, args.prefix_len)]), keep=False)
    clock.run(DecodeStep(2, finished_request_ids=["a"]), keep=False)

    suffix_blocks = -(-(args.suffix_len + 1) // BLOCK)
    step_id = 3

    def suffix_step(i: int) -> tuple[DecodeStep, DecodeStep]:
        nonlocal step_id
        suffix = torch.randint(3, vocab, (args.suffix_len,), generator=gen).tolist()
        first = (i * suffix_blocks) % (SUFFIX_BLOCKS - suffix_blocks)
        blocks = prefix_blocks + free[first : first + suffix_blocks]
        rid = f"b{i}"
        step = DecodeStep(step_id, [_new(rid, prefix + suffix, blocks, args.prefix_len, args.suffix_len)])
        finish = DecodeStep(step_id + 1, finished_request_ids=[rid])
        step_id += 2
        return step, finish

    for i in range(args.trials + 5):
        step, finish = suffix_step(i)
        clock.run(step, keep=i >= 5)
        clock.run(finish, keep=False)
    graphs = runner._graphs
    figures: dict[str, object] = {
        "suffix_step": clock.summary(),
        "prefill_graph_sizes": sorted(graphs.prefill_graphs) if graphs is not None else [],
        "piecewise_graph_buckets": piecewise_graph_buckets,
        "piecewise_token_step": token_step if piecewise_graph_buckets else 0,
        "piecewise_graph_capture_s": piecewise_graph_capture_s,
        "piecewise_bucket_ms": {str(b): round(ms, 3) for b, ms in runner.piecewise_bucket_ms.items()},
        "trials": args.trials,
    }
    if runner._piecewise_graphs is not None and args.mixed_decodes:
        figures["mixed_step_bucket"] = runner._piecewise_graphs.bucket_for(mixed_tokens)

    # Batch-1 decode from a 512-token prompt, one token a step.
    decode = StepClock(runner)
    prompt = torch.randint(3, vocab, (512,), generator=gen).tolist()
    blocks = free[SUFFIX_BLOCKS : SUFFIX_BLOCKS + (512 + args.trials + 6) // BLOCK + 1]
    decode.run(DecodeStep(step_id, [_new("d", prompt, blocks, 0, 512)]), keep=False)
    step_id += 1
    for i in range(args.trials + 5):
        running = [RunningRequestData("d", [], 1)]
        decode.run(DecodeStep(step_id, running_requests=running), keep=i >= 5)
        step_id += 1
    decode.run(DecodeStep(step_id, finished_request_ids=["d"]), keep=False)
    step_id += 1
    figures["batch1_decode_step"] = decode.summary()

    if profile:
        figures["suffix_step_kernels"] = step_kernels(suffix_step, args.trials + 10, clock, args.top)

    if args.mixed_decodes:
        # A new prompt's prefill beside running decodes (an online step when a request arrives): the step that
        # sets the inter-token latency's tail at low request rates. Then the same decodes alone, from the graph.
        pool = free[MIXED_FIRST:]
        running_ids = [f"m{i}" for i in range(args.mixed_decodes)]
        new = []
        for i, rid in enumerate(running_ids):
            prompt = torch.randint(3, vocab, (512,), generator=gen).tolist()
            new.append(_new(rid, prompt, pool[i * per_decode : (i + 1) * per_decode], 0, 512))
        step_id += 1
        clock.run(DecodeStep(step_id, new), keep=False)
        prompt_pool = pool[args.mixed_decodes * per_decode :]
        mixed, alone = StepClock(runner), StepClock(runner)

        def mixed_step(i: int) -> tuple[DecodeStep, DecodeStep]:
            nonlocal step_id
            # Consecutive steps' prompts take alternate halves of the pool (the one before is finished after).
            half = (i % 2) * args.mixed_prompts * prompt_blocks
            prompts = []
            for j in range(args.mixed_prompts):
                prompt = torch.randint(3, vocab, (args.mixed_prompt,), generator=gen).tolist()
                first = half + j * prompt_blocks
                blocks = prompt_pool[first : first + prompt_blocks]
                prompts.append(_new(f"p{i}.{j}", prompt, blocks, 0, args.mixed_prompt))
            running = [RunningRequestData(r, [], 1) for r in running_ids]
            step_id += 1
            step = DecodeStep(step_id, prompts, running)
            step_id += 1
            return step, DecodeStep(step_id, finished_request_ids=[n.request_id for n in prompts])

        def alone_step() -> tuple[DecodeStep, None]:
            nonlocal step_id
            step_id += 1
            running = [RunningRequestData(r, [], 1) for r in running_ids]
            return DecodeStep(step_id, running_requests=running), None

        for i in range(args.trials + 5):
            step, finish = mixed_step(i)
            mixed.run(step, keep=i >= 5)
            clock.run(finish, keep=False)
            alone.run(alone_step()[0], keep=i >= 5)
        figures["mixed_step"] = mixed.summary() | {
            "decodes": args.mixed_decodes,
            "prompt_tokens": args.mixed_prompt,
            "prompts": args.mixed_prompts,
        }
        figures["decodes_alone_step"] = alone.summary()
        launched = [mixed_step(args.trials + 2_000 + i) for i in range(args.trials)]
        figures["mixed_step_host_launch"] = host_launch(runner, launched)
        if args.launch_pstats:
            more = [mixed_step(args.trials + 3_000 + i) for i in range(args.trials)]
            figures["mixed_step_host_launch_profiled"] = host_launch(runner, more, args.launch_pstats)
        figures["decodes_alone_host_launch"] = host_launch(runner, [alone_step() for _ in range(args.trials)])
        if args.warm_gemm_rows:
            # The worker's OMINIX_WARM_GEMM_ROWS, then the same launches again: does the warm-up change them?
            started = time.perf_counter()
            calls = runner.warm_up_gemm_rows(args.warm_gemm_max_tokens, args.warm_gemm_rows)
            figures["gemm_warm_up"] = {"calls": calls, "s": round(time.perf_counter() - started, 2)}
            again = [mixed_step(args.trials + 4_000 + i) for i in range(args.trials)]
            figures["mixed_step_host_launch_after_gemm_warm_up"] = host_launch(runner, again)
            walls = StepClock(runner)
            for i in range(args.trials + 5):
                step, finish = mixed_step(args.trials + 5_000 + i)
                walls.run(step, keep=i >= 5)
                clock.run(finish, keep=False)
            figures["mixed_step_after_gemm_warm_up"] = walls.summary()
        if profile:
            figures["mixed_step_kernels"] = step_kernels(mixed_step, args.trials + 5, clock, args.top)
        if args.trace:
            step, finish = mixed_step(args.trials + 1_100)
            activities = [torch.profiler.ProfilerActivity.CPU]
            if cuda:
                activities.append(torch.profiler.ProfilerActivity.CUDA)
            with torch.profiler.profile(activities=activities, with_stack=True) as prof:
                clock.run(step, keep=False)
            clock.run(finish, keep=False)
            prof.export_chrome_trace(args.trace)
    figures["device"] = torch.cuda.get_device_name() if cuda else "cpu"
    figures["triton_launch"] = args.triton_launch
    # per wrapped kernel, over the whole run (warm-up and untimed steps too; none with --triton-launch triton):
    # [launches through the fast path, compiled variants remembered]
    figures["fast_launches"] = {
        f"{k.fn.__module__}.{k.fn.__name__}": [k.num_fast_launches, k.num_variants]
        for k in KERNELS
        if k.enabled
    }
    print(json.dumps(figures, indent=1))
    if args.json:
        Path(args.json).write_text(json.dumps(figures, indent=1) + "\n")


if __name__ == "__main__":
    main()
