"""A replay workload: the backend it runs on, scheduler settings, a step cost model and the requests.

Workload JSON (every field but ``requests`` is optional)::

    {"backend": {"profile": "cuda", "kv_block_size": 16, "kv_num_blocks": 64,
                 "max_batch_tokens": 256, "max_running_requests": 8,
                 "model": {"name": "llama-8b", "vocab_size": 32000, "max_model_len": 4096}},
     "scheduler": {"max_bypass_steps": 8, "enable_prefix_caching": true},
     "max_inflight_steps": 1,
     "cost": {"kind": "capability", "memory_bandwidth_gb_s": 3350}
     "requests": [{"id": "a", "prompt_len": 100, "max_tokens": 16, "priority": "interactive",
                   "arrival_tick": 0, "prefix": {"group": "sys", "len": 64}}]}

A request gives ``prompt_ids`` or ``prompt_len`` (ids derived from its id, so distinct requests share
nothing by chance); ``prefix`` puts the same ``len`` ids of a named group in front. Requests that arrive at
the same tick are admitted in list order.
"""

from __future__ import annotations

import zlib
from dataclasses import dataclass, field, replace

from ominix_runtime.contract import (
    BackendCapability,
    BackendKind,
    Granularity,
    ModelInfo,
    Priority,
    stated_profile,
)
from ominix_runtime.engine.config import SchedulerConfig
from ominix_runtime.release.cost_model import StepCostModel, cost_model_from
from ominix_runtime.release.inputs import Fields, ReleaseInputError

_PROFILES = {kind.name.lower(): kind for kind in BackendKind}
_PRIORITIES = {p.name.lower(): p for p in Priority}
_FIRST_ORDINARY_ID = 3  # ids below are kept free for special tokens (EOS = 2 by default)


@dataclass(frozen=True, slots=True)
class ReplayRequest:
    request_id: str
    prompt_token_ids: tuple[int, ...]
    max_tokens: int
    priority: Priority
    arrival_tick: int


@dataclass(frozen=True, slots=True)
class Workload:
    capability: BackendCapability
    scheduler: SchedulerConfig
    cost_model: StepCostModel
    max_inflight_steps: int
    requests: tuple[ReplayRequest, ...] = field(default=())
    name: str = ""


def synthetic_ids(label: str, length: int, vocab_size: int) -> list[int]:
    """``length`` token ids derived from ``label`` alone (crc32 seeds a small LCG; no Python hash())."""
    span = vocab_size - _FIRST_ORDINARY_ID
    state = zlib.crc32(label.encode("utf-8"))
    out = []
    for _ in range(length):
        state = (state * 1103515245 + 12345) & 0x7FFFFFFF
        out.append(_FIRST_ORDINARY_ID + state % span)
    return out


def _capability(f: Fields) -> BackendCapability:
    kind = f.choice("profile", _PROFILES, "cuda")
    base = stated_profile(kind)
    m = f.obj("model")
    model = ModelInfo(
        name=m.text("name", "replay-model"),
        vocab_size=m.integer("vocab_size", 32000, minimum=_FIRST_ORDINARY_ID + 1),
        max_model_len=m.integer("max_model_len", 4096, minimum=2),
        eos_token_ids=tuple(m.integers("eos_token_ids", minimum=0) or [2]),
        num_layers=m.integer("num_layers", 0, minimum=0),
        hidden_size=m.integer("hidden_size", 0, minimum=0),
        num_parameters=m.integer("num_parameters", 0, minimum=0),
    )
    capability = replace(
        base,
        worker_id=f.text("worker_id", "replay-0"),
        device=f.text("device", base.device or "replay"),
        dtype=f.text("dtype", base.dtype),
        model=model,
        granularity=Granularity.STEP,  # replay drives the step scheduler
        kv_block_size=f.integer("kv_block_size", base.kv_block_size or 16, minimum=1),
        kv_num_blocks=f.integer("kv_num_blocks", 1024, minimum=1),
        kv_bytes_per_block=f.integer("kv_bytes_per_block", base.kv_bytes_per_block or 1, minimum=1),
        max_batch_tokens=f.integer("max_batch_tokens", base.max_batch_tokens or 2048, minimum=1),
        max_running_requests=f.integer("max_running_requests", base.max_running_requests, minimum=1),
        supports_prefix_caching=f.flag("supports_prefix_caching", base.supports_prefix_caching),
        supports_chunked_prefill=f.flag("supports_chunked_prefill", base.supports_chunked_prefill),
        supports_whole_prompt_hits=f.flag("supports_whole_prompt_hits", base.supports_whole_prompt_hits),
    )
    problems = capability.problems()
    if problems:
        raise ReleaseInputError(f"{f.where} is not a usable capability: {'; '.join(problems)}")
    return capability


def _scheduler(f: Fields) -> SchedulerConfig:
    d = SchedulerConfig()
    return SchedulerConfig(
        max_batch_tokens=f.optional_integer("max_batch_tokens", minimum=1),
        max_running_requests=f.optional_integer("max_running_requests", minimum=1),
        max_kv_blocks=f.optional_integer("max_kv_blocks", minimum=1),
        enable_prefix_caching=f.flag("enable_prefix_caching", d.enable_prefix_caching),
        enable_chunked_prefill=f.flag("enable_chunked_prefill", d.enable_chunked_prefill),
        max_bypass_steps=f.integer("max_bypass_steps", d.max_bypass_steps, minimum=0),
        preemption_protection_steps=f.integer(
            "preemption_protection_steps", d.preemption_protection_steps, minimum=0
        ),
        prefill_tokens_beside_decodes=f.integer(
            "prefill_tokens_beside_decodes", d.prefill_tokens_beside_decodes, minimum=0
        ),
        prefill_backlog_tokens=f.integer("prefill_backlog_tokens", d.prefill_backlog_tokens, minimum=0),
        max_batch_tokens_with_decodes=f.integer(
            "max_batch_tokens_with_decodes", d.max_batch_tokens_with_decodes, minimum=0
        ),
        burst_backlog_tokens=f.integer("burst_backlog_tokens", d.burst_backlog_tokens, minimum=0),
        max_batch_tokens_in_burst=f.integer(
            "max_batch_tokens_in_burst", d.max_batch_tokens_in_burst, minimum=0
        ),
        backlog_admission_slots=f.integer("backlog_admission_slots", d.backlog_admission_slots, minimum=0),
        backlog_admission_max_wait_steps=f.integer(
            "backlog_admission_max_wait_steps", d.backlog_admission_max_wait_steps, minimum=0
        ),
    )


def _request(f: Fields, vocab_size: int) -> ReplayRequest:
    request_id = f.text("id")
    if not request_id:
        raise ReleaseInputError(f"{f.where}.id is empty")
    ids = f.integers("prompt_ids", minimum=0)
    if ids is None:
        body = synthetic_ids(request_id, f.integer("prompt_len", minimum=1), vocab_size)
        prefix_ids: list[int] = []
        if f.has("prefix"):
            p = f.obj("prefix")
            prefix_ids = synthetic_ids("prefix:" + p.text("group"), p.integer("len", minimum=1), vocab_size)
        ids = prefix_ids + body
    elif f.has("prompt_len") or f.has("prefix"):
        raise ReleaseInputError(f"{f.where}: give prompt_ids or prompt_len (+ prefix), not both")
    return ReplayRequest(
        request_id=request_id,
        prompt_token_ids=tuple(ids),
        max_tokens=f.integer("max_tokens", minimum=1),
        priority=f.choice("priority", _PRIORITIES, "interactive"),
        arrival_tick=f.integer("arrival_tick", 0, minimum=0),
    )


def workload_from_json(document: dict[str, object]) -> Workload:
    """Parse a workload document; any bad field raises ReleaseInputError naming it."""
    root = Fields(document, "workload")
    capability = _capability(root.obj("backend"))
    requests = [_request(r, capability.model.vocab_size) for r in root.objects("requests", required=True)]
    if not requests:
        raise ReleaseInputError("workload.requests is empty")
    seen: set[str] = set()
    for r in requests:
        if r.request_id in seen:
            raise ReleaseInputError(f"workload.requests: id {r.request_id!r} appears twice")
        seen.add(r.request_id)
    return Workload(
        capability=capability,
        scheduler=_scheduler(root.obj("scheduler")),
        cost_model=cost_model_from(root.obj("cost"), capability),
        max_inflight_steps=root.integer("max_inflight_steps", 1, minimum=1),
        requests=tuple(requests),
        name=root.text("name", ""),
    )
