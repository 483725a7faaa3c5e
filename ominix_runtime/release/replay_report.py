"""The replay report: fingerprint, KV and queue pressure, utilisation, totals, completions, the KV check."""

from __future__ import annotations

from ominix_runtime.release.replay import ReplayRun
from ominix_runtime.release.stats import percentile

REPORT_VERSION = 1


def _ratio(num: float, den: float) -> float:
    return round(num / den, 6) if den else 0.0


def replay_report(run: ReplayRun, include_trace: bool = True) -> dict[str, object]:
    scheduler = run.scheduler
    registry = scheduler.registry
    ticks = run.ticks
    busy = [t for t in ticks if t.scheduled]
    peak_kv = max((t.kv_blocks_used for t in ticks), default=0)
    counters = scheduler.counters
    tracks = list(run.tracks.values())
    completions = []
    # The scheduler keeps every ended request (its group drains them for run reports; replay has no group).
    ended = {r.request_id: r for r in scheduler.finished}
    ttft_ms: list[float] = []
    e2e_ms: list[float] = []
    for track in tracks:
        spec = track.spec
        req = ended.get(spec.request_id)
        ttft = e2e = None
        if req is not None and req.finished_time is not None:
            e2e = (req.finished_time - req.queued_time) * 1e3
            e2e_ms.append(e2e)
            if req.first_token_time is not None:
                ttft = (req.first_token_time - req.queued_time) * 1e3
                ttft_ms.append(ttft)
        completions.append(
            {
                "id": spec.request_id,
                "priority": spec.priority.name.lower(),
                "arrival_tick": spec.arrival_tick,
                "first_admitted_tick": track.first_admitted_tick,
                "first_token_tick": track.first_token_tick,
                "finish_tick": track.finish_tick,
                "finish": track.finish or "UNFINISHED",
                "error": track.error,
                "prompt_tokens": len(spec.prompt_token_ids),
                "output_tokens": track.output_tokens,
                "cached_tokens": req.num_cached_tokens if req else 0,
                "preemptions": req.num_preemptions if req else 0,
                "ttft_ms": round(ttft, 6) if ttft is not None else None,
                "e2e_ms": round(e2e, 6) if e2e is not None else None,
            }
        )
    finished = sum(1 for t in tracks if t.finish in ("STOP", "LENGTH"))
    kv_ok = not run.kv_problem and run.worker_requests_left == 0
    report: dict[str, object] = {
        "version": REPORT_VERSION,
        "name": run.workload.name,
        "trace_fingerprint": run.trace_fingerprint,
        "backend": {
            "kind": run.workload.capability.kind.name.lower(),
            "kv_num_blocks": registry.num_blocks,
            "kv_block_size": registry.block_size,
            "max_batch_tokens": scheduler.max_batch_tokens,
            "max_running_requests": scheduler.max_running_requests,
            # The scheduler's budgets with decodes, outside and inside a burst (the settings bounded by the
            # running slots and the budget); the prefill limit as set (0: off). All need chunked prefill.
            "max_batch_tokens_with_decodes": scheduler.max_batch_tokens_with_decodes,
            "max_batch_tokens_in_burst": scheduler.max_batch_tokens_in_burst,
            "burst_backlog_tokens": run.workload.scheduler.burst_backlog_tokens,
            "prefill_tokens_beside_decodes": run.workload.scheduler.prefill_tokens_beside_decodes,
            "prefill_backlog_tokens": run.workload.scheduler.prefill_backlog_tokens,
            "backlog_admission_slots": run.workload.scheduler.backlog_admission_slots,
            "backlog_admission_max_wait_steps": run.workload.scheduler.backlog_admission_max_wait_steps,
            "chunked_prefill": scheduler.chunked_prefill,
            "max_inflight_steps": run.workload.max_inflight_steps,
            "cost_model": run.workload.cost_model.name,
        },
        "kv": {
            "peak_blocks": peak_kv,
            "peak_pressure_pct": round(100.0 * peak_kv / registry.num_blocks, 3),
            "all_blocks_returned": kv_ok,
            "leases_left": registry.num_leases,
            "leased_blocks_left": registry.num_leased_blocks,
            "reusable_blocks": registry.num_available_blocks,
            "worker_requests_left": run.worker_requests_left,
            "problem": run.kv_problem,
        },
        "queue": {
            "max_queued": max((t.queued for t in ticks), default=0),
            "max_active": max((t.active for t in ticks), default=0),
            "queue_pressure_ticks": sum(1 for t in ticks if t.queued > 0),
            "active_capacity_ticks": sum(1 for t in ticks if t.active >= scheduler.max_running_requests),
        },
        "utilisation": {
            "busy_ticks_ratio": _ratio(len(busy), len(ticks)),
            "token_budget": _ratio(
                sum(t.prefill_tokens + t.decode_tokens for t in busy), sum(t.token_budget for t in busy)
            ),
            "kv_blocks": _ratio(sum(t.kv_blocks_used for t in busy), len(busy) * registry.num_blocks),
            "running_slots": _ratio(sum(t.active for t in busy), len(busy) * scheduler.max_running_requests),
        },
        "totals": {
            "requests": len(tracks),
            "accepted": counters.accepted,
            "rejected": len(run.rejected),
            "finished": finished,
            "failed": counters.failed,
            "ticks": len(ticks),
            "last_tick": ticks[-1].tick if ticks else 0,
            "busy_ticks": len(busy),
            "steps": counters.steps,
            "prompt_tokens": counters.prompt_tokens,
            "prefill_tokens_computed": sum(t.prefill_tokens for t in ticks),
            "decode_tokens_computed": sum(t.decode_tokens for t in ticks),
            "generated_tokens": counters.generated_tokens,
            "cached_tokens": counters.cached_tokens,
            "preemptions": counters.preemptions,
            "simulated_ms": round(run.simulated_ms, 6),
        },
        "latency_simulated_ms": {
            "ttft_p50": round(percentile(ttft_ms, 50), 6),
            "ttft_p95": round(percentile(ttft_ms, 95), 6),
            "e2e_p50": round(percentile(e2e_ms, 50), 6),
            "e2e_p95": round(percentile(e2e_ms, 95), 6),
        },
        "rejected": run.rejected,
        "completions": completions,
    }
    if include_trace:
        report["trace"] = [t.to_json() for t in ticks]
    return report
