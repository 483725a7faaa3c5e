"""Protobuf ⇄ contract conversions. Only gRPC edges (front server, worker client, worker server) use these."""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from enum import IntEnum
from typing import TypeVar, cast

from ominix_runtime.contract import (
    NULL_BLOCK_ID,
    AttentionKind,
    BackendCapability,
    BackendKind,
    DecodeStep,
    FinishReason,
    Granularity,
    KVGroup,
    ModelInfo,
    NewRequestData,
    OminixError,
    RankInfo,
    RequestOutput,
    RunningRequestData,
    RuntimeErrorKind,
    SampledLogprobs,
    SamplingParams,
    StepResult,
    TokenLogprob,
)
from ominix_runtime.engine.stats import LoadSnapshot
from ominix_runtime.pb import common_pb2, engine_pb2, worker_pb2

# ---- enums and errors ---------------------------------------------------------------------------------
# The contract enums carry the wire numbers (tests/unit/test_pb_fresh.py checks it); the casts only tell
# the type checker that an int is the protobuf enum type it stands for.


def error_code_to_pb(kind: RuntimeErrorKind) -> common_pb2.ErrorCode:
    return cast("common_pb2.ErrorCode", int(kind))


def finish_reason_to_pb(reason: FinishReason) -> common_pb2.FinishReason:
    return cast("common_pb2.FinishReason", int(reason))


def error_info_to_pb(kind: RuntimeErrorKind, message: str, retryable: bool = False) -> common_pb2.ErrorInfo:
    return common_pb2.ErrorInfo(code=error_code_to_pb(kind), message=message, retryable=retryable)


def error_from_pb(pb: common_pb2.ErrorInfo) -> tuple[RuntimeErrorKind | None, str]:
    """A worker's per-request error as (kind, message); kind None when no code is set. Proto3 enums are open,
    so a newer worker may send a code this engine has no name for: that one request fails as INTERNAL with
    the worker's message (a ValueError here would break the whole Run stream, and every request with it)."""
    code = pb.code
    if not code:
        return None, pb.message
    try:
        return RuntimeErrorKind(code), pb.message
    except ValueError:
        return RuntimeErrorKind.INTERNAL, f"{pb.message} (worker error code {code}, unknown to this engine)"


_E = TypeVar("_E", bound=IntEnum)


def _enum_from_pb(enum: type[_E], value: int, field: str, worker_id: str) -> _E:
    """``enum(value)``, or CAPABILITY_MISMATCH naming the field when this engine does not know the value."""
    try:
        return enum(value)
    except ValueError:
        raise OminixError(
            RuntimeErrorKind.CAPABILITY_MISMATCH,
            f"worker {worker_id!r} states {field} = {value}, which this engine does not know "
            "(a newer worker, or an unset field)",
        ) from None


# ---- sampling -----------------------------------------------------------------------------------------


def sampling_from_pb(pb: common_pb2.SamplingParams) -> SamplingParams:
    """Proto defaults → contract defaults. Not validated here: call ``.validate()``."""
    return SamplingParams(
        max_tokens=pb.max_tokens or SamplingParams().max_tokens,
        temperature=pb.temperature if pb.HasField("temperature") else 1.0,
        top_p=pb.top_p if pb.HasField("top_p") else 1.0,
        top_k=pb.top_k if pb.top_k > 0 else -1 if pb.top_k in (0, -1) else pb.top_k,
        min_p=pb.min_p,
        seed=pb.seed if pb.HasField("seed") else None,
        stop=list(pb.stop),
        stop_token_ids=list(pb.stop_token_ids),
        ignore_eos=pb.ignore_eos,
        logprobs=pb.logprobs if pb.HasField("logprobs") else None,
        repetition_penalty=pb.repetition_penalty if pb.HasField("repetition_penalty") else 1.0,
        frequency_penalty=pb.frequency_penalty,
        presence_penalty=pb.presence_penalty,
        min_tokens=pb.min_tokens,
    )


def sampling_to_pb(sp: SamplingParams) -> common_pb2.SamplingParams:
    pb = common_pb2.SamplingParams(
        max_tokens=sp.max_tokens,
        temperature=sp.temperature,
        top_p=sp.top_p,
        top_k=max(sp.top_k, 0),
        min_p=sp.min_p,
        stop=sp.stop,
        stop_token_ids=sp.stop_token_ids,
        ignore_eos=sp.ignore_eos,
        repetition_penalty=sp.repetition_penalty,
        frequency_penalty=sp.frequency_penalty,
        presence_penalty=sp.presence_penalty,
        min_tokens=sp.min_tokens,
    )
    if sp.seed is not None:
        pb.seed = sp.seed
    if sp.logprobs is not None:
        pb.logprobs = sp.logprobs
    return pb


# ---- KV layouts ---------------------------------------------------------------------------------------

_NULL_BLOCK_WIRE = 0xFFFFFFFF  # NULL_BLOCK_ID on the wire (block ids are uint32)


def block_ids_to_pb(ids: list[int]) -> list[int]:
    return [_NULL_BLOCK_WIRE if b == NULL_BLOCK_ID else b for b in ids]


def block_ids_from_pb(ids: Iterable[int]) -> list[int]:
    return [NULL_BLOCK_ID if b == _NULL_BLOCK_WIRE else b for b in ids]


def block_tables_to_pb(tables: list[list[int]]) -> list[common_pb2.BlockTable]:
    return [common_pb2.BlockTable(block_ids=block_ids_to_pb(t)) for t in tables]


def block_tables_from_pb(tables: Iterable[common_pb2.BlockTable]) -> list[list[int]]:
    return [block_ids_from_pb(t.block_ids) for t in tables]


def kv_group_to_pb(g: KVGroup) -> common_pb2.KVGroup:
    return common_pb2.KVGroup(
        kind=cast("common_pb2.AttentionKind", int(g.kind)),
        layer_indices=list(g.layer_indices),
        block_size=g.block_size,
        num_blocks=g.num_blocks,
        bytes_per_token_per_layer=g.bytes_per_token_per_layer,
        sliding_window=g.sliding_window,
        compress_ratio=g.compress_ratio,
    )


def kv_group_from_pb(pb: common_pb2.KVGroup, worker_id: str = "") -> KVGroup:
    return KVGroup(
        kind=_enum_from_pb(AttentionKind, pb.kind or AttentionKind.FULL, "kv_groups.kind", worker_id),
        layer_indices=tuple(pb.layer_indices),
        block_size=pb.block_size,
        num_blocks=pb.num_blocks,
        bytes_per_token_per_layer=pb.bytes_per_token_per_layer,
        sliding_window=pb.sliding_window,
        compress_ratio=pb.compress_ratio,
    )


# ---- capability ---------------------------------------------------------------------------------------


def capability_to_pb(cap: BackendCapability) -> common_pb2.BackendCapability:
    m = cap.model
    model = common_pb2.ModelInfo(
        name=m.name,
        architecture=m.architecture,
        vocab_size=m.vocab_size,
        max_model_len=m.max_model_len,
        eos_token_ids=list(m.eos_token_ids),
        num_layers=m.num_layers,
        hidden_size=m.hidden_size,
        num_attention_heads=m.num_attention_heads,
        num_kv_heads=m.num_kv_heads,
        head_dim=m.head_dim,
        num_parameters=m.num_parameters,
        num_experts=m.num_experts,
        num_experts_per_tok=m.num_experts_per_tok,
    )
    if m.bos_token_id is not None:
        model.bos_token_id = m.bos_token_id
    return common_pb2.BackendCapability(
        worker_id=cap.worker_id,
        kind=cast("common_pb2.BackendKind", int(cap.kind)),
        device=cap.device,
        dtype=cap.dtype,
        supported_dtypes=list(cap.supported_dtypes),
        kv_block_size=cap.kv_block_size,
        kv_num_blocks=cap.kv_num_blocks,
        kv_bytes_per_block=cap.kv_bytes_per_block,
        max_batch_tokens=cap.max_batch_tokens,
        max_running_requests=cap.max_running_requests,
        granularity=cast("common_pb2.Granularity", int(cap.granularity)),
        supports_paged_kv=cap.supports_paged_kv,
        supports_prefix_caching=cap.supports_prefix_caching,
        supports_chunked_prefill=cap.supports_chunked_prefill,
        supports_graph_capture=cap.supports_graph_capture,
        supports_fp8_kv=cap.supports_fp8_kv,
        tensor_parallel_size=cap.tensor_parallel_size,
        collective_backend=cap.collective_backend,
        custom_all_reduce=cap.custom_all_reduce,
        attention_backend=cap.attention_backend,
        model=model,
        version=cap.version,
        ranks=[
            common_pb2.RankInfo(
                rank=r.rank,
                device=r.device,
                host=r.host,
                memory_total_bytes=r.memory_total_bytes,
                weight_bytes=r.weight_bytes,
                kv_cache_bytes=r.kv_cache_bytes,
                kv_head_start=r.kv_head_start,
                kv_num_heads=r.kv_num_heads,
            )
            for r in cap.ranks
        ],
        kv_groups=[kv_group_to_pb(g) for g in cap.kv_groups],
        weight_dtype=cap.weight_dtype,
        kv_cache_dtype=cap.kv_cache_dtype,
        moe_parallel=cap.moe_parallel,
        supports_prefill_decode_split=cap.supports_prefill_decode_split,
        supports_whole_prompt_hits=cap.supports_whole_prompt_hits,
        contract_kind=cap.kind.contract_name,
    )


def capability_from_pb(pb: common_pb2.BackendCapability) -> BackendCapability:
    m = pb.model
    model = ModelInfo(
        name=m.name,
        vocab_size=m.vocab_size,
        max_model_len=m.max_model_len,
        eos_token_ids=tuple(m.eos_token_ids),
        architecture=m.architecture,
        bos_token_id=m.bos_token_id if m.HasField("bos_token_id") else None,
        num_layers=m.num_layers,
        hidden_size=m.hidden_size,
        num_attention_heads=m.num_attention_heads,
        num_kv_heads=m.num_kv_heads,
        head_dim=m.head_dim,
        num_parameters=m.num_parameters,
        num_experts=m.num_experts,
        num_experts_per_tok=m.num_experts_per_tok,
    )
    return BackendCapability(
        worker_id=pb.worker_id,
        kind=_enum_from_pb(BackendKind, pb.kind, "kind", pb.worker_id),
        device=pb.device,
        dtype=pb.dtype,
        model=model,
        kv_block_size=pb.kv_block_size,
        kv_num_blocks=pb.kv_num_blocks,
        kv_bytes_per_block=pb.kv_bytes_per_block,
        max_batch_tokens=pb.max_batch_tokens,
        max_running_requests=pb.max_running_requests,
        granularity=_enum_from_pb(
            Granularity, pb.granularity or Granularity.STEP, "granularity", pb.worker_id
        ),
        supported_dtypes=tuple(pb.supported_dtypes),
        supports_paged_kv=pb.supports_paged_kv,
        supports_prefix_caching=pb.supports_prefix_caching,
        supports_chunked_prefill=pb.supports_chunked_prefill,
        supports_graph_capture=pb.supports_graph_capture,
        supports_fp8_kv=pb.supports_fp8_kv,
        tensor_parallel_size=pb.tensor_parallel_size or 1,
        collective_backend=pb.collective_backend,
        custom_all_reduce=pb.custom_all_reduce,
        attention_backend=pb.attention_backend,
        version=pb.version,
        ranks=tuple(
            RankInfo(
                rank=r.rank,
                device=r.device,
                host=r.host,
                memory_total_bytes=r.memory_total_bytes,
                weight_bytes=r.weight_bytes,
                kv_cache_bytes=r.kv_cache_bytes,
                kv_head_start=r.kv_head_start,
                kv_num_heads=r.kv_num_heads,
            )
            for r in pb.ranks
        ),
        kv_groups=tuple(kv_group_from_pb(g, pb.worker_id) for g in pb.kv_groups),
        weight_dtype=pb.weight_dtype,
        kv_cache_dtype=pb.kv_cache_dtype,
        moe_parallel=pb.moe_parallel,
        supports_prefill_decode_split=pb.supports_prefill_decode_split,
        supports_whole_prompt_hits=pb.supports_whole_prompt_hits,
    )


# ---- load ---------------------------------------------------------------------------------------------


def backend_load_to_pb(load: LoadSnapshot, served_aliases: tuple[str, ...] = ()) -> engine_pb2.BackendLoad:
    """One backend's GetLoad entry; ``served_aliases`` are the other names of the models it serves.

    Counts are clamped to their unsigned fields' range: some figures come from the backend's own report (a
    transiently negative counter, say), and protobuf raising on one would fail GetLoad for every backend."""
    return engine_pb2.BackendLoad(
        worker_id=load.worker_id,
        queued_requests=_uint(load.queued_requests, _UINT32_MAX),
        running_requests=_uint(load.running_requests, _UINT32_MAX),
        waiting_tokens=_uint(load.waiting_tokens, _UINT64_MAX),
        kv_bytes_used=_uint(load.kv_bytes_used, _UINT64_MAX),
        kv_bytes_capacity=_uint(load.kv_bytes_capacity, _UINT64_MAX),
        estimated_decode_tokens_per_second=load.estimated_decode_tokens_per_second,
        healthy=load.healthy,
        health=cast("engine_pb2.BackendHealth", int(load.health)),
        timestamp_ms=_uint(load.timestamp_ms, _UINT64_MAX),
        model_ids=list(load.model_ids),
        served_aliases=list(served_aliases),
        capabilities=list(load.capabilities),
        backend_kind=load.backend_kind,
    )


def total_load_to_pb(backends: list[engine_pb2.BackendLoad], timestamp_ms: int) -> engine_pb2.BackendLoad:
    """The sum over backends; its health is the best of theirs (AVAILABLE if any backend takes requests)."""
    healths = [b.health for b in backends]
    best = (
        min(healths, key=lambda h: _HEALTH_RANK.get(h, 99)) if healths else engine_pb2.BACKEND_HEALTH_OFFLINE
    )
    return engine_pb2.BackendLoad(
        worker_id="total",
        queued_requests=min(sum(b.queued_requests for b in backends), _UINT32_MAX),
        running_requests=min(sum(b.running_requests for b in backends), _UINT32_MAX),
        waiting_tokens=min(sum(b.waiting_tokens for b in backends), _UINT64_MAX),
        kv_bytes_used=min(sum(b.kv_bytes_used for b in backends), _UINT64_MAX),
        kv_bytes_capacity=min(sum(b.kv_bytes_capacity for b in backends), _UINT64_MAX),
        estimated_decode_tokens_per_second=sum(b.estimated_decode_tokens_per_second for b in backends),
        healthy=bool(backends) and any(b.healthy for b in backends),
        health=best,
        timestamp_ms=timestamp_ms,
        model_ids=sorted({m for b in backends for m in b.model_ids}),
        served_aliases=sorted({a for b in backends for a in b.served_aliases}),
        capabilities=sorted({c for b in backends for c in b.capabilities}),
    )


_UINT32_MAX = (1 << 32) - 1
_UINT64_MAX = (1 << 64) - 1


def _uint(value: float, limit: int) -> int:
    """``value`` as an integer in [0, limit]; NaN counts as 0."""
    if value != value:
        return 0
    return int(min(max(value, 0), limit))


# Preference order when summarising several backends' states.
_HEALTH_RANK = {
    engine_pb2.BACKEND_HEALTH_AVAILABLE: 0,
    engine_pb2.BACKEND_HEALTH_DRAINING: 1,
    engine_pb2.BACKEND_HEALTH_STARTING: 2,
    engine_pb2.BACKEND_HEALTH_UNHEALTHY: 3,
    engine_pb2.BACKEND_HEALTH_OFFLINE: 4,
}


# ---- steps --------------------------------------------------------------------------------------------


def step_to_pb(step: DecodeStep) -> worker_pb2.DecodeStep:
    # Built with add() rather than message constructors, and empty fields left unset: at batch 256 this is
    # a quarter of the time (the engine builds one per step on its critical path).
    pb = worker_pb2.DecodeStep(step_id=step.step_id, finished_request_ids=step.finished_request_ids)
    add_new = pb.new_requests.add
    for r in step.new_requests:
        add_new(
            request_id=r.request_id,
            prompt_token_ids=r.prompt_token_ids,
            output_token_ids=r.output_token_ids,
            sampling=sampling_to_pb(r.sampling),
            kv_block_ids=block_ids_to_pb(r.kv_block_ids),
            num_computed_tokens=r.num_computed_tokens,
            num_scheduled_tokens=r.num_scheduled_tokens,
            effective_seed=r.effective_seed,
            traceparent=r.traceparent,
            group_kv_block_ids=block_tables_to_pb(r.group_kv_block_ids),
            num_cached_kv_tokens=r.num_cached_kv_tokens,
        )
    add_running = pb.running_requests.add
    for run in step.running_requests:
        if run.new_kv_block_ids or run.new_group_kv_block_ids:
            add_running(
                request_id=run.request_id,
                new_kv_block_ids=run.new_kv_block_ids,
                num_scheduled_tokens=run.num_scheduled_tokens,
                new_group_kv_block_ids=block_tables_to_pb(run.new_group_kv_block_ids),
            )
        else:  # the common decode row: one token, no new block
            add_running(request_id=run.request_id, num_scheduled_tokens=run.num_scheduled_tokens)
    return pb


def int_list(values: Sequence[int]) -> list[int]:
    """A repeated integer field as a list. A slice of the container is built in C, faster than ``list()``
    iterating it (28 – 32 µs against 36 – 63 µs for 2,112 ids, measured twice), on a prompt's way to its first
    token."""
    out = values[:]
    return out if isinstance(out, list) else list(out)


def step_from_pb(pb: worker_pb2.DecodeStep) -> DecodeStep:
    return DecodeStep(
        step_id=pb.step_id,
        new_requests=[
            NewRequestData(
                request_id=r.request_id,
                prompt_token_ids=int_list(r.prompt_token_ids),
                sampling=sampling_from_pb(r.sampling),
                kv_block_ids=block_ids_from_pb(r.kv_block_ids),
                num_computed_tokens=r.num_computed_tokens,
                num_scheduled_tokens=r.num_scheduled_tokens,
                effective_seed=r.effective_seed,
                output_token_ids=int_list(r.output_token_ids),
                traceparent=r.traceparent,
                group_kv_block_ids=block_tables_from_pb(r.group_kv_block_ids),
                num_cached_kv_tokens=r.num_cached_kv_tokens,
            )
            for r in pb.new_requests
        ],
        running_requests=[
            RunningRequestData(
                r.request_id,
                list(r.new_kv_block_ids),
                r.num_scheduled_tokens,
                block_tables_from_pb(r.new_group_kv_block_ids) if r.new_group_kv_block_ids else [],
            )
            for r in pb.running_requests
        ],
        finished_request_ids=list(pb.finished_request_ids),
    )


def logprobs_to_pb(lp: SampledLogprobs) -> common_pb2.SampledLogprobs:
    return common_pb2.SampledLogprobs(
        sampled=common_pb2.TokenLogprob(token_id=lp.sampled.token_id, logprob=lp.sampled.logprob),
        top=[common_pb2.TokenLogprob(token_id=t.token_id, logprob=t.logprob) for t in lp.top],
    )


def logprobs_from_pb(pb: common_pb2.SampledLogprobs) -> SampledLogprobs:
    return SampledLogprobs(
        sampled=TokenLogprob(pb.sampled.token_id, pb.sampled.logprob),
        top=[TokenLogprob(t.token_id, t.logprob) for t in pb.top],
    )


def step_result_to_pb(res: StepResult) -> worker_pb2.StepResult:
    pb = worker_pb2.StepResult(
        step_id=res.step_id, compute_seconds=res.compute_seconds, num_tokens=res.num_tokens
    )
    add = pb.outputs.add
    for o in res.outputs:
        if o.logprobs is None and o.error_kind is None:  # the common row: a token or nothing yet
            add(request_id=o.request_id, sampled_token_id=o.sampled_token_id)
            continue
        out = add(request_id=o.request_id, sampled_token_id=o.sampled_token_id)
        if o.logprobs is not None:
            out.logprobs.CopyFrom(logprobs_to_pb(o.logprobs))
        if o.error_kind is not None:
            out.error.CopyFrom(error_info_to_pb(o.error_kind, o.error_message))
    return pb


def step_result_from_pb(pb: worker_pb2.StepResult) -> StepResult:
    outputs: list[RequestOutput] = []
    append = outputs.append
    for o in pb.outputs:
        has_token = o.HasField("sampled_token_id")
        if not (o.HasField("logprobs") or o.HasField("error")):  # the common row, checked cheaply
            append(RequestOutput(o.request_id, o.sampled_token_id if has_token else None))
            continue
        error_kind, error_message = error_from_pb(o.error) if o.HasField("error") else (None, "")
        append(
            RequestOutput(
                request_id=o.request_id,
                sampled_token_id=o.sampled_token_id if has_token else None,
                logprobs=logprobs_from_pb(o.logprobs) if o.HasField("logprobs") else None,
                error_kind=error_kind,
                error_message=error_message,
            )
        )
    return StepResult(
        step_id=pb.step_id, outputs=outputs, compute_seconds=pb.compute_seconds, num_tokens=pb.num_tokens
    )
