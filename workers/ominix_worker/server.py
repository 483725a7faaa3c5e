"""The worker process: one device, one model, a gRPC Worker service (plus health and reflection).

Startup order: check the device and the model source, bind the port (so a taken port fails at once),
then load weights, size the KV cache and warm up while Health answers not-ready. Any failure ends the
process with a one-line message and a non-zero exit code.

Tensor parallel (``--tp-size N``): N such processes, one per device, form a group at ``--dist-init-addr``.
Rank 0 (the leader) serves the engine as above, stating the whole group; ranks 1..N-1 bind no port and run
the leader's steps on their shards (``rank_group``). Every rank must be started with the same model and
flags; the group checks that before loading.
"""

from __future__ import annotations

import asyncio
import contextlib
import functools
import logging
import os
import signal
import socket
import sys
import threading
import time
import traceback
from collections.abc import AsyncIterator
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import TYPE_CHECKING, Any, NoReturn, cast

import grpc
from grpc_health.v1 import health, health_pb2, health_pb2_grpc
from grpc_reflection.v1alpha import reflection

from ominix_runtime import memory, wire
from ominix_runtime.bind_probe import probe_bind
from ominix_runtime.config import CPU_KV_CACHE_MEMORY, RuntimeConfig, TLSConfig
from ominix_runtime.contract import (
    AttentionKind,
    BackendCapability,
    DecodeStep,
    KVGroup,
    ModelInfo,
    OminixError,
    RankInfo,
    stated_profile,
)
from ominix_runtime.models import resolve_model
from ominix_runtime.pb import common_pb2, worker_pb2, worker_pb2_grpc
from ominix_runtime.server.logging import configure_logging, set_log_fields
from ominix_worker import __version__
from ominix_worker.access import AccessConfigError, EngineAccess, engine_access
from ominix_worker.step_loop import StepFailure, StepLoop, StepOutcome, StepRunner

if TYPE_CHECKING:  # these import torch, loaded only once the port is bound
    from ominix_worker.parallel.distributed import RankGroup
    from ominix_worker.runner import ModelRunner

log = logging.getLogger("ominix_worker")

WORKER_SERVICE = worker_pb2.DESCRIPTOR.services_by_name["Worker"].full_name
HEALTH_SERVICE = health_pb2.DESCRIPTOR.services_by_name["Health"].full_name
# Well inside the engine's --worker-heartbeat-timeout (default 3 s).
HEARTBEAT_INTERVAL_S = 0.5
RUN_HANDOVER_S = 2.0
# A worker asked to stop (SIGTERM/SIGINT) is gone within this many seconds whatever its threads wait on: a
# collective or group rendezvous (up to --dist-timeout), a step on the device. Well inside launch's
# STOP_TIMEOUT_S, after which it would be killed.
SHUTDOWN_DEADLINE_S = 5.0
ASCEND_BLOCK_SIZE = 128


class StartupError(RuntimeError):
    """A reason the worker cannot start; printed as one line."""


def stated_kv_groups(runner: ModelRunner, bytes_per_block: int) -> tuple[KVGroup, ...]:
    """The KV layout stated to the engine: every group when some layers attend within a window, else none
    (the engine then assumes one full-attention group). ``bytes_per_block``: K and V of every KV tensor."""
    layout = runner.kv_layout(bytes_per_block // (runner.block_size * runner.config.num_kv_cache_layers))
    if all(g.kind == AttentionKind.FULL for g in layout):
        return ()
    return layout


def _say(message: str) -> None:
    """Startup progress (loading, sizing, warming up) as info lines of the log stream."""
    log.info(message)


# ---- settings ----------------------------------------------------------------------------------------


def server_credentials(tls: TLSConfig) -> grpc.ServerCredentials | None:
    """TLS credentials from --tls-cert/--tls-key, requiring a client certificate when --tls-ca is given."""
    if not (tls.cert or tls.key or tls.ca):
        return None
    if not (tls.cert and tls.key):
        raise StartupError("--tls-cert and --tls-key go together (and --tls-ca needs both)")
    try:
        key, cert = Path(tls.key).read_bytes(), Path(tls.cert).read_bytes()
        ca = Path(tls.ca).read_bytes() if tls.ca else None
    except OSError as exc:
        raise StartupError(f"cannot read a TLS file: {exc}") from None
    return grpc.ssl_server_credentials(
        [(key, cert)], root_certificates=ca, require_client_auth=ca is not None
    )


# ---- model state -------------------------------------------------------------------------------------


@dataclass(slots=True)
class WorkerState:
    capability: BackendCapability | None = None
    runner: ModelRunner | None = None
    # What a Run stream drives: the runner itself, or the group leader that forwards steps to its peers.
    step_runner: StepRunner | None = None
    ready: bool = False
    run_active: bool = False
    run_idle: asyncio.Event = field(default_factory=asyncio.Event)
    launch_nonce: str = ""  # stated in Health: `launch` knows its own workers by it


def join_group(settings: RuntimeConfig) -> RankGroup | None:
    """The tensor-parallel group this process belongs to (None without --tp-size > 1); raises StartupError."""
    args = settings.worker
    if args.tp_size == 1:
        return None
    from ominix_worker.devices import parse_device
    from ominix_worker.parallel.distributed import GroupInitError, init_rank_group

    assert args.dist_init_addr is not None  # check_args refuses --tp-size > 1 without it
    _say(f"joining tensor-parallel group {args.dist_init_addr} as rank {args.tp_rank} of {args.tp_size}")
    try:
        group = init_rank_group(
            args.tp_rank, args.tp_size, args.dist_init_addr, parse_device(args.device), args.dist_timeout
        )
    except GroupInitError as exc:
        raise StartupError(str(exc)) from None
    stated = cast(list[dict[str, object]], group.gather_to_all(group_settings(settings)))
    disagreement = settings_disagreement(stated)
    if disagreement is not None:
        raise StartupError(disagreement)
    return group


def group_settings(settings: RuntimeConfig) -> dict[str, object]:
    """The flags every rank of a group must share, by flag name. The model and the shape-deciding flags make
    every rank run the same collectives in the same order; the weight and KV formats make the ranks' shards
    one model (a rank that quantizes alone, or stores its KV in another dtype, computes garbage or hangs
    in a collective)."""
    args = settings.worker
    return {
        "--model": settings.model.path,
        "--dtype": args.dtype,
        "--quantization": args.quantization,
        "--kv-cache-dtype": args.kv_cache_dtype,
        "--block-size": args.block_size,
        "--max-batch-tokens": args.max_batch_tokens,
        "--max-running-requests": args.max_running_requests,
        "--max-model-len": args.max_model_len,
        "--kv-cache-memory": args.kv_cache_memory,
        "--gpu-memory-utilization": args.gpu_memory_utilization,
        "--attention": args.attention,
        "--moe-parallel": args.moe_parallel,
    }


def settings_disagreement(stated: list[dict[str, object]]) -> str | None:
    """Every flag a rank states apart from rank 0, with both values, as one line (``stated``: each rank's
    ``group_settings``, in rank order); None when the ranks agree."""
    leader = stated[0]
    differences = [
        f"{name} is {flags.get(name)!r} on rank {rank} but {leader.get(name)!r} on rank 0"
        for rank, flags in enumerate(stated[1:], start=1)
        for name in dict.fromkeys([*leader, *flags])  # both sides' names: a rank may state one more
        if flags.get(name) != leader.get(name)
    ]
    if not differences:
        return None
    return f"the ranks disagree: {'; '.join(differences)} (start every rank with the same model and flags)"


def load_worker(
    settings: RuntimeConfig, worker_id: str, group: RankGroup | None = None
) -> tuple[ModelRunner, BackendCapability]:
    """Load weights (this rank's shards in a group), size and allocate KV, warm up. Runs in a thread; raises
    StartupError. In a group every rank runs it in lockstep: its forwards meet in collectives."""
    import socket as socket_module

    import torch

    from ominix_runtime.byte_sizes import parse_bytes
    from ominix_worker.attention import get_attention_backend
    from ominix_worker.devices import (
        backend_kind,
        device_name,
        dtype_name,
        make_current,
        parse_device,
        resolve_dtype,
    )
    from ominix_worker.kv_cache import (
        allocate_kv_cache,
        group_block_counts,
        kv_bytes_per_block,
        measure_device_room,
        num_blocks_for_budget,
        resolve_kv_cache_dtype,
    )
    from ominix_worker.loader import ModelLoadError, load_model
    from ominix_worker.parallel import SINGLE, MoeParallel, PackableLinear
    from ominix_worker.progress import stage
    from ominix_worker.runner import ModelRunner

    args, debug = settings.worker, settings.debug
    tp = replace(group.tp if group is not None else SINGLE, moe=MoeParallel(args.moe_parallel))

    device = parse_device(args.device)
    make_current(device)
    if args.num_threads > 0:
        torch.set_num_threads(args.num_threads)
    dtype = resolve_dtype(args.dtype, device)
    PackableLinear.stream_single_token = debug.weight_stream
    if device.type == "cuda":
        from ominix_worker.ops.launch import set_fast_launch

        set_fast_launch(debug.triton_fast_launch)
    kind = backend_kind(device)
    profile = stated_profile(kind)
    block_size = ASCEND_BLOCK_SIZE if device.type == "npu" else args.block_size
    backend = get_attention_backend(args.attention or device.type, block_size)
    source = resolve_model(settings.model.path)

    _say(f"loading {source.name} ({source.format.value}) onto {device_name(device)} as {dtype_name(dtype)}")
    started = time.perf_counter()
    try:
        loaded = load_model(
            source,
            device,
            dtype,
            backend,
            max_positions=args.max_model_len,
            tp=tp,
            quantization=args.quantization,
        )
    except ModelLoadError as exc:
        raise StartupError(str(exc)) from None
    config = loaded.config
    _say(f"weights loaded in {time.perf_counter() - started:.1f}s")

    max_batch_tokens = args.max_batch_tokens or profile.max_batch_tokens
    max_running = args.max_running_requests or profile.max_running_requests
    model_len = config.max_len_for(backend.supports_sliding_window)
    max_model_len = min(args.max_model_len or model_len, model_len)
    kv_dtype = resolve_kv_cache_dtype(args.kv_cache_dtype, dtype, device)
    if config.compress_ratios and kv_dtype != dtype:
        raise StartupError(
            "the compressed-attention reference keeps its KV in the run dtype (no --kv-cache-dtype)"
        )
    kv_heads = tp.kv_heads(config.num_kv_heads, config.num_heads)
    bytes_per_block = kv_bytes_per_block(config, block_size, kv_dtype, kv_heads.size)
    # A small KV for the profile forward; replaced below by the sized one.
    profile_blocks = -(-max(max_batch_tokens, 1) // block_size) + 1
    runner = ModelRunner(
        loaded.model,
        config,
        backend,
        allocate_kv_cache(backend, config, profile_blocks, kv_dtype, device, kv_heads.size),
        device,
        max_model_len,
    )
    _say("sizing the KV cache")
    profiling = stage("profiling the KV cache")
    # Prefill and mixed steps captured in pieces up to this many tokens (after the decode graphs, below); their
    # pool holds a forward's activations at the largest bucket for good, which the KV budget leaves room for.
    piecewise_tokens = 0
    if debug.cuda_graphs and runner.piecewise_capturable():
        piecewise_tokens = min(debug.piecewise_graph_tokens, max_batch_tokens)  # the largest bucket
    if device.type == "cpu":
        budget = parse_bytes(args.kv_cache_memory or CPU_KV_CACHE_MEMORY)
        runner.profile_forward(min(64, max_batch_tokens))  # warm-up only: the CPU budget is explicit
    else:
        room = measure_device_room(
            device,
            lambda: runner.profile_forward(max_batch_tokens),
            graph_forward=(lambda: runner.profile_forward(piecewise_tokens)) if piecewise_tokens else None,
            release=lambda: runner.set_kv_caches([]),
        )
        if args.kv_cache_memory:  # a given budget (e.g. every server of an A/B alike) replaces the share
            budget = parse_bytes(args.kv_cache_memory)
            try:
                room.check_given(budget)
            except ValueError as exc:
                raise StartupError(str(exc)) from None
        else:
            budget = room.budget_at(args.gpu_memory_utilization)
    profiling.close()
    uniform_blocks = num_blocks_for_budget(budget, bytes_per_block)
    if group is not None:  # one block table for the group: the rank with the least room decides
        uniform_blocks = group.min_over_ranks(uniform_blocks)
    if uniform_blocks < 1:
        raise StartupError(f"the KV budget ({budget} bytes) holds no block of {bytes_per_block} bytes")
    # A pure function of the agreed count, so every rank of a group sizes its groups alike.
    counts = group_block_counts(
        runner.attention_groups, uniform_blocks, block_size, max_running, max_batch_tokens
    )
    runner.set_kv_caches([])
    runner.set_kv_caches(allocate_kv_cache(backend, config, counts, kv_dtype, device, kv_heads.size))
    num_blocks = counts[0]  # group 0: the full-attention group when there is one (the largest pool)
    if not runner.attention_groups[0].window:  # full attention needs every block of a request
        max_model_len = min(max_model_len, num_blocks * block_size)
    for kv_group in runner.kv_layout():  # a compressed pool holds a bounded number of rows per request
        if kv_group.is_compressed:
            max_model_len = min(max_model_len, kv_group.tokens_for_blocks(kv_group.num_blocks))
    runner.max_model_len = max_model_len
    per_layer_block = bytes_per_block // config.num_kv_cache_layers
    sized = list(zip(runner.attention_groups, counts, strict=True))
    kv_bytes = sum(n * len(g.layers) * per_layer_block for g, n in sized)
    pools = ", ".join(
        f"{n} blocks"
        + (f" (window {g.window})" if g.window else "")
        + (f" (a row per {g.compress_ratio} tokens)" if g.compress_ratio else "")
        for g, n in sized
    )
    _say(f"KV cache: {pools} of {block_size} tokens ({kv_bytes / 2**20:.0f} MiB)")
    _say("warming up")
    warming = stage("warming up")
    runner.warm_up(max_batch_tokens)
    if debug.warm_gemm_rows and device.type == "cuda":
        started = time.perf_counter()
        # Unpadded, the LM head runs at every count of sampled rows: warm it too.
        calls = runner.warm_up_gemm_rows(max_batch_tokens, debug.warm_gemm_rows, lm_head=not debug.pad_logits)
        took = time.perf_counter() - started
        _say(f"warmed {calls} GEMMs (buckets of {debug.warm_gemm_rows} rows) in {took:.1f} s")
    graphs = runner.capture_decode_graphs() if debug.cuda_graphs else False
    if graphs and piecewise_tokens:
        started = time.perf_counter()
        buckets = runner.capture_piecewise_graphs(
            piecewise_tokens,
            timed=debug.piecewise_fastest_bucket,
            step=debug.piecewise_token_step,
            sampled_rows=max_running,
        )
        if buckets:
            took = time.perf_counter() - started
            timed = f" (timed: {len(runner.piecewise_bucket_ms)})" if runner.piecewise_bucket_ms else ""
            _say(f"captured prefill and mixed steps at {buckets} token counts{timed} in {took:.1f} s")
    runner.pad_logits = debug.pad_logits
    runner.pipeline_decode = debug.pipeline
    runner.pipeline_eager = debug.pipeline_eager
    runner.early_results = args.early_results
    warming.close()
    if device.type == "cuda":
        torch.cuda.synchronize(device)
        # What the KV sizing did not see (graph objects, the decode graphs' pool, the sampler's buffers) shows
        # as this process's memory past its share.
        free, total = torch.cuda.mem_get_info(device)
        _say(
            f"device memory after start: this process {torch.cuda.memory_reserved(device) / 2**30:.2f} GiB "
            f"reserved by torch, {(total - free) / 2**30:.2f} of {total / 2**30:.2f} GiB in use on the device"
        )
    # Everything loaded so far lives as long as the process: keep it out of the collector's scans, so the
    # per-step garbage (outputs, messages) is collected without walking the model's objects; and the engine's
    # thresholds (memory.SERVING_GC_THRESHOLD) make full collections rarer: with Python's, the worker's paused
    # it 25 - 40 ms twice per W1-shaped run on an H200 (bench/RESULTS.md, 2026-11-29).
    memory.freeze_startup_heap()
    # The forward thread and the event loop (protobuf, gRPC) share the GIL; a shorter switch interval keeps
    # the forward thread from waiting up to 5 ms between its kernels (CPU: between its torch ops).
    sys.setswitchinterval(0.0005)

    dtype_text = dtype_name(dtype)
    supported = (
        profile.supported_dtypes
        if dtype_text in profile.supported_dtypes
        else (*profile.supported_dtypes, dtype_text)
    )
    model_info = ModelInfo(
        name=loaded.name,
        vocab_size=config.vocab_size,
        max_model_len=max_model_len,
        eos_token_ids=config.eos_token_ids,
        architecture=config.architecture,
        bos_token_id=config.bos_token_id,
        num_layers=config.num_layers,
        hidden_size=config.hidden_size,
        num_attention_heads=config.num_heads,
        num_kv_heads=config.num_kv_heads,
        head_dim=config.head_dim,
        num_parameters=runner.model.num_parameters(),
        num_experts=config.num_experts,
        num_experts_per_tok=config.num_experts_per_tok,
    )
    rank = RankInfo(
        rank=tp.rank,
        device=device_name(device),
        host=socket_module.gethostname(),
        memory_total_bytes=torch.cuda.mem_get_info(device)[1] if device.type == "cuda" else 0,
        weight_bytes=sum(p.numel() * p.element_size() for p in loaded.model.parameters()),
        kv_cache_bytes=kv_bytes,
        kv_head_start=kv_heads.start,
        kv_num_heads=kv_heads.size,
    )
    ranks = cast(tuple[RankInfo, ...], tuple(group.gather_to_all(rank))) if group is not None else (rank,)
    capability = stated_profile(
        kind,
        worker_id=worker_id,
        device=device_name(device),
        dtype=dtype_text,
        supported_dtypes=supported,
        model=model_info,
        kv_block_size=block_size,
        kv_num_blocks=num_blocks,
        kv_bytes_per_block=bytes_per_block * tp.size,  # the group's bytes: every rank holds its heads
        tensor_parallel_size=tp.size,
        collective_backend=group.backend if group is not None else profile.collective_backend,
        ranks=ranks,
        max_batch_tokens=max_batch_tokens,
        max_running_requests=max_running,
        supports_graph_capture=graphs,
        attention_backend=backend.name,
        version=__version__,
        weight_dtype="float8_e4m3fn" if config.quantization else dtype_text,
        kv_cache_dtype="fp8_e4m3" if kv_dtype == torch.float8_e4m3fn else dtype_text,
        supports_fp8_kv=device.type in ("cpu", "cuda"),
        supports_whole_prompt_hits=runner.supports_whole_prompt_hits,
        moe_parallel=tp.moe.value if config.is_moe else "",
        kv_groups=stated_kv_groups(runner, bytes_per_block * tp.size),
    )
    return runner, capability


# ---- gRPC service ------------------------------------------------------------------------------------


def _error_info(message: str) -> common_pb2.ErrorInfo:
    return common_pb2.ErrorInfo(code=common_pb2.ERROR_CODE_INTERNAL, message=message)


def _outcome_to_pb(outcome: StepOutcome) -> worker_pb2.WorkerMessage:
    if isinstance(outcome, StepFailure):
        return worker_pb2.WorkerMessage(fatal_error=_error_info(outcome.message))
    return worker_pb2.WorkerMessage(step_result=wire.step_result_to_pb(outcome))


class WorkerService(worker_pb2_grpc.WorkerServicer):
    """Adapts the Worker RPCs to the worker state; a Run stream drives one ``StepLoop``."""

    def __init__(
        self, state: WorkerState, executor: ThreadPoolExecutor, access: EngineAccess | None = None
    ) -> None:
        self.state = state
        self.executor = executor
        self.access = access or EngineAccess()

    async def Describe(
        self,
        request: worker_pb2.DescribeRequest,
        context: grpc.aio.ServicerContext[worker_pb2.DescribeRequest, common_pb2.BackendCapability],
    ) -> common_pb2.BackendCapability:
        if not self.state.ready or self.state.capability is None:
            await context.abort(grpc.StatusCode.UNAVAILABLE, "the worker is still loading its model")
        assert self.state.capability is not None
        return wire.capability_to_pb(self.state.capability)

    async def Health(
        self,
        request: worker_pb2.HealthRequest,
        context: grpc.aio.ServicerContext[worker_pb2.HealthRequest, worker_pb2.HealthResponse],
    ) -> worker_pb2.HealthResponse:
        runner = self.state.runner
        return worker_pb2.HealthResponse(
            ready=self.state.ready,
            num_requests=len(runner.requests) if runner is not None else 0,
            last_step_id=runner.last_step_id if runner is not None else 0,
            launch_nonce=self.state.launch_nonce,
            pid=os.getpid(),
        )

    async def Run(
        self,
        request_iterator: AsyncIterator[worker_pb2.DecodeStep],
        context: grpc.aio.ServicerContext[worker_pb2.DecodeStep, worker_pb2.WorkerMessage],
    ) -> AsyncIterator[worker_pb2.WorkerMessage]:
        refusal = self.access.refusal(context)
        if refusal is not None:
            log.warning("Run refused: %s", refusal)
            await context.abort(grpc.StatusCode.PERMISSION_DENIED, refusal)
        if not self.state.ready or self.state.step_runner is None:
            await context.abort(grpc.StatusCode.UNAVAILABLE, "the worker is still loading its model")
        if self.state.run_active:
            # An engine that just closed its stream and reconnects may arrive before the old stream's
            # cleanup ran: give that cleanup a moment before refusing.
            with contextlib.suppress(asyncio.TimeoutError):
                await asyncio.wait_for(self.state.run_idle.wait(), timeout=RUN_HANDOVER_S)
        if self.state.run_active:
            await context.abort(
                grpc.StatusCode.FAILED_PRECONDITION,
                "another Run stream is active on this worker; only one engine may drive it",
            )
        assert self.state.step_runner is not None
        self.state.run_active = True
        self.state.run_idle.clear()
        loop = asyncio.get_running_loop()
        outbox: asyncio.Queue[StepOutcome | None] = asyncio.Queue()

        def emit(outcome: StepOutcome | None) -> None:
            """From the device thread: hand an outcome to the event loop, in order."""
            with contextlib.suppress(RuntimeError):  # the loop closed: nobody is listening any more
                loop.call_soon_threadsafe(outbox.put_nowait, outcome)

        # Steps are read and converted on the event loop as they arrive (while the previous one computes) and
        # run back to back on the device thread; outcomes come back to the loop to be converted and sent.
        steps = StepLoop(self.state.step_runner, emit)

        async def read_steps() -> None:
            try:
                async for step_pb in request_iterator:
                    steps.submit(step_pb.step_id, functools.partial(_step_from_pb, step_pb))
            finally:
                steps.close()

        running = loop.run_in_executor(self.executor, _run_steps, steps)  # ends after close(), state dropped
        reading = asyncio.create_task(read_steps())
        try:
            # The first message accepts the stream (the engine counts the worker healthy only then). Later
            # heartbeats come from this event loop whenever nothing else was sent for an interval: the loop
            # never waits on the device (steps run on the device thread), so a long step does not silence
            # them, while a stopped or wedged process does.
            yield worker_pb2.WorkerMessage(heartbeat=worker_pb2.Heartbeat(worker_time=time.monotonic()))
            while True:
                try:
                    outcome = await asyncio.wait_for(outbox.get(), timeout=HEARTBEAT_INTERVAL_S)
                except asyncio.TimeoutError:
                    yield worker_pb2.WorkerMessage(
                        heartbeat=worker_pb2.Heartbeat(worker_time=time.monotonic())
                    )
                    continue
                if outcome is None:
                    break
                yield _outcome_to_pb(outcome)
            if not reading.done():
                # The loop ended on its own (close() ends the reading first): steps the engine still sends
                # would never be answered, and with no heartbeats it would learn that only from a timeout.
                failure = await running or "it stopped"
                await context.abort(grpc.StatusCode.INTERNAL, f"the worker's step loop ended: {failure}")
            await reading  # surfaces a broken request stream as an error of this call
            failure = await running
            if failure:
                await context.abort(grpc.StatusCode.INTERNAL, f"the worker's step loop failed: {failure}")
        finally:
            reading.cancel()
            steps.close()  # the device thread stops after the step it may be running
            await running
            self.state.run_active = False
            self.state.run_idle.set()


def _run_steps(steps: StepLoop) -> str:
    """Run the step loop on the device thread; returns why it failed ("" when it ended after close())."""
    try:
        steps.run()
    except Exception as exc:  # noqa: BLE001 - the Run call ends with it as its error
        log.error("the step loop failed:\n%s", traceback.format_exc())
        return f"{type(exc).__name__}: {exc}"
    return ""


def _step_from_pb(step_pb: worker_pb2.DecodeStep) -> DecodeStep:
    step = wire.step_from_pb(step_pb)
    for new in step.new_requests:  # the engine's trace context, for correlating logs with traces
        if new.traceparent:
            log.debug("request %s traceparent %s", new.request_id, new.traceparent)
    return step


# ---- process -----------------------------------------------------------------------------------------


def check_port_free(host: str, port: int) -> None:
    """Bind and release the address first: gRPC's own bind failure comes with a multi-line log."""
    try:
        probe_bind(host, port)
    except socket.gaierror as exc:
        raise StartupError(f"cannot resolve host {host!r}: {exc}") from None
    except OSError as exc:
        raise StartupError(
            f"cannot bind {host}:{port}: {exc.strerror or exc} (is the port taken? stop what holds it or pass "
            "another --port)"
        ) from None


def check_args(settings: RuntimeConfig) -> str:
    """Cheap checks across flags before anything is bound or loaded (each flag's own range is checked when
    it is read); returns the device's name."""
    from ominix_runtime.byte_sizes import parse_bytes
    from ominix_worker.devices import DeviceError, device_name, parse_device, resolve_dtype
    from ominix_worker.kv_cache import resolve_kv_cache_dtype
    from ominix_worker.parallel.distributed import parse_init_addr

    args = settings.worker
    try:
        device = parse_device(args.device)
        resolve_model(settings.model.path)
        resolve_kv_cache_dtype(args.kv_cache_dtype, resolve_dtype(args.dtype, device), device)
        if args.kv_cache_memory:
            parse_bytes(args.kv_cache_memory)
        if args.tp_size < 1 or not 0 <= args.tp_rank < args.tp_size:
            raise ValueError(f"--tp-rank {args.tp_rank} is not a rank of --tp-size {args.tp_size}")
        if args.tp_size > 1:
            if not args.dist_init_addr:
                raise ValueError(
                    "--tp-size > 1 needs --dist-init-addr HOST:PORT (where rank 0 gathers the group)"
                )
            parse_init_addr(args.dist_init_addr)
            if device.type not in ("cuda", "cpu"):
                raise ValueError(f"tensor parallelism runs on cuda or cpu devices, not {device.type}")
    except (DeviceError, OminixError, ValueError) as exc:
        raise StartupError(str(exc)) from None
    return device_name(device)


def _load_leader(
    settings: RuntimeConfig, worker_id: str
) -> tuple[ModelRunner, StepRunner, BackendCapability]:
    """Join the group (if any), load, and wrap the runner so a group leader forwards its steps."""
    group = join_group(settings)
    runner, capability = load_worker(settings, worker_id, group)
    if group is None:
        return runner, runner, capability
    from ominix_worker.rank_group import GroupLeader

    return runner, GroupLeader(runner, group), capability


def follow(settings: RuntimeConfig) -> int:
    """A rank > 0: no port, no engine; join the group, load this rank's shards and run the leader's steps."""
    import socket as socket_module

    from ominix_worker.rank_group import run_follower

    args = settings.worker
    device = check_args(settings)
    worker_id = args.worker_id or f"{device}@{socket_module.gethostname()}#rank{args.tp_rank}"
    set_log_fields(worker_id=worker_id)
    group = join_group(settings)
    assert group is not None
    runner, _ = load_worker(settings, worker_id, group)
    _say(f"rank {args.tp_rank} of {args.tp_size} ready")
    run_follower(runner, group)


async def serve(config: RuntimeConfig) -> int:
    args = config.worker
    device = check_args(config)
    address = config.server.address
    worker_id = args.worker_id or f"{device}@{address}"
    set_log_fields(worker_id=worker_id)

    state = WorkerState(launch_nonce=args.launch_nonce)
    executor = ThreadPoolExecutor(max_workers=1, thread_name_prefix="ominix-forward")
    server = grpc.aio.server(
        options=[
            ("grpc.so_reuseport", 0),  # a second worker on the same port must fail, not share it
            ("grpc.max_receive_message_length", 64 * 1024 * 1024),
            ("grpc.max_send_message_length", 64 * 1024 * 1024),
        ]
    )
    health_servicer = health.aio.HealthServicer()
    mutual_tls = bool(config.tls.ca)
    try:
        access = engine_access(list(config.tls.engine_identities), config.tls.engine_secret_file, mutual_tls)
    except AccessConfigError as exc:
        raise StartupError(str(exc)) from None
    worker_pb2_grpc.add_WorkerServicer_to_server(WorkerService(state, executor, access), server)
    health_pb2_grpc.add_HealthServicer_to_server(health_servicer, server)
    reflection.enable_server_reflection((WORKER_SERVICE, HEALTH_SERVICE, reflection.SERVICE_NAME), server)
    credentials = server_credentials(config.tls)
    check_port_free(config.server.host, config.server.port)
    try:
        if credentials is not None:
            bound = server.add_secure_port(address, credentials)
        else:
            bound = server.add_insecure_port(address)
    except RuntimeError as exc:
        raise StartupError(f"cannot bind {address}: {exc} (is the port taken? pass another --port)") from None
    if not bound:
        raise StartupError(f"cannot bind {address} (is the port taken? pass another --port)")
    for service in ("", WORKER_SERVICE):
        await health_servicer.set(service, health_pb2.HealthCheckResponse.NOT_SERVING)
    await server.start()

    stop = asyncio.Event()
    loop = asyncio.get_running_loop()

    def on_stop_signal() -> None:
        if not stop.is_set():
            exit_by_deadline(SHUTDOWN_DEADLINE_S)
        stop.set()

    for sig in (signal.SIGINT, signal.SIGTERM):
        with contextlib.suppress(NotImplementedError, RuntimeError):  # non-main thread or Windows
            loop.add_signal_handler(sig, on_stop_signal)

    try:
        load = loop.run_in_executor(executor, _load_leader, config, worker_id)
        stop_wait = asyncio.ensure_future(stop.wait())
        waits: set[asyncio.Future[Any]] = {load, stop_wait}  # futures of different results
        done, _ = await asyncio.wait(waits, return_when=asyncio.FIRST_COMPLETED)
        if load not in done:
            return 0
        state.runner, state.step_runner, state.capability = load.result()
        state.ready = True
        for service in ("", WORKER_SERVICE):
            await health_servicer.set(service, health_pb2.HealthCheckResponse.SERVING)
        _say(f"serving {state.capability.model.name} as {worker_id}")
        if access.open_to_anyone:
            log.warning(
                "no --tls-ca and no engine secret: any process reaching %s may drive this worker", address
            )
        await stop_wait
        return 0
    finally:
        await health_servicer.enter_graceful_shutdown()
        await server.stop(grace=1.0)
        executor.shutdown(wait=False, cancel_futures=True)


def exit_by_deadline(seconds: float, code: int = 0) -> None:
    """End the process ``seconds`` from now if it is still running (a daemon timer, so a clean exit before
    then is not delayed): interpreter exit joins the forward thread, which may be waiting on a peer."""

    def expire() -> None:
        print(f"ominix-worker: still stopping after {seconds:.0f}s; exiting now", file=sys.stderr, flush=True)
        os._exit(code)

    timer = threading.Timer(seconds, expire)
    timer.daemon = True
    timer.start()


def leave_group_process(code: int) -> NoReturn:
    """End a tensor-parallel rank without tearing its process group down: ``destroy_process_group`` (or the
    communicators' destructors at interpreter exit) blocks forever on NCCL while captured CUDA graphs hold
    the communicator, and a loading or forward thread may wait in a collective for the whole --dist-timeout.
    The peers notice the closed connections at their next control message and leave too."""
    logging.shutdown()
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(code)


def run(config: RuntimeConfig) -> int:
    """Run the worker until SIGINT/SIGTERM; a startup failure is one line on stderr and exit code 1."""
    configure_logging(config.log.level, config.log.json, component="worker")
    try:
        if config.worker.tp_rank > 0:
            return follow(config)
        try:
            import uvloop
        except ImportError:
            code = asyncio.run(serve(config))
        else:
            code = uvloop.run(serve(config))
        if config.worker.tp_size > 1:
            leave_group_process(code)
        return code
    except StartupError as exc:
        print(f"ominix-worker: error: {exc}", file=sys.stderr, flush=True)
        return 1
    except KeyboardInterrupt:
        return 130
    except Exception as exc:  # noqa: BLE001 - one clear line instead of a traceback at startup
        log.debug("startup failed", exc_info=True)
        print(f"ominix-worker: error: {type(exc).__name__}: {exc}", file=sys.stderr, flush=True)
        return 1


def main(argv: list[str] | None = None) -> int:
    """``python -m ominix_worker``: the same flags as ``ominix-runtime worker``."""
    from ominix_runtime.cli import main as cli_main

    return cli_main(["worker", *(sys.argv[1:] if argv is None else argv)])


if __name__ == "__main__":
    sys.exit(main())
