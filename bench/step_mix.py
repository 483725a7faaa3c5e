"""The steps a server ran during one online run, from its Prometheus endpoint: how many, and how many tokens
they carried (prefill and decode together).

Two servers can reach the same output rate with different step mixes (few long steps that carry big prefill
chunks, or many short ones), and the mix decides ITL and TPOT. Both engines keep a step-token histogram, read
before and after a run; the difference is the run's. They do not count alike:
- ours, ``ominix_scheduler_step_tokens`` (one series per worker): every worker step, with the tokens it
  computed (a prefill chunk's own tokens; prefix-cache hits not included);
- vLLM, ``vllm:iteration_tokens_total``: each engine step that returned output, with the generated tokens and
  the whole prompt of each request that got its first token in that step (earlier chunks of a chunked prefill
  count there, not in steps of their own).
So step counts compare; tokens per step compare only roughly. The readings also take each engine's count of
requests preempted to free KV (recomputed later: each is a long gap in its stream); ours refreshes it from the
workers every half second, so a preemption in a run's last moments may count in the next run. And each
server's KV capacity in tokens, which decides when it must preempt: ours ``ominix_kv_capacity_tokens`` (summed
over workers), vLLM's ``vllm:cache_config_info`` labels (``num_gpu_blocks`` x ``block_size``).
"""

from __future__ import annotations

import urllib.request
from dataclasses import dataclass

from prometheus_client.parser import text_string_to_metric_families
from prometheus_client.samples import Sample

# The first of these an endpoint has is read: ours, then vLLM's name for the same kind of histogram.
STEP_TOKEN_HISTOGRAMS = ("ominix_scheduler_step_tokens", "vllm:iteration_tokens_total")
PREEMPTION_COUNTERS = {  # the counter sample read beside each histogram
    "ominix_scheduler_step_tokens": "ominix_preemptions_total",
    "vllm:iteration_tokens_total": "vllm:num_preemptions_total",
}
SCRAPE_TIMEOUT_S = 5.0


@dataclass(frozen=True, slots=True)
class StepTotals:
    """One reading of a step-token histogram, summed over its series."""

    histogram: str
    steps: float
    tokens: float
    preemptions: float | None = None  # None: the endpoint has no preemption counter
    kv_tokens: float | None = None  # the KV capacity in tokens; None: the endpoint does not state it


def kv_capacity_tokens(samples: list[Sample]) -> float | None:
    """Ours: ``ominix_kv_capacity_tokens`` over every worker; vLLM: its cache config's blocks x block size."""
    ours = [s.value for s in samples if s.name == "ominix_kv_capacity_tokens"]
    if ours:
        return sum(ours)
    for s in samples:
        if s.name == "vllm:cache_config_info":
            blocks, size = s.labels.get("num_gpu_blocks", ""), s.labels.get("block_size", "")
            if blocks.isdigit() and size.isdigit():
                return float(int(blocks) * int(size))
    return None


def parse_step_totals(text: str) -> StepTotals | None:
    """The step totals in a Prometheus text exposition; None when it has no step-token histogram. A histogram
    declared with no series yet (a server that has run no step) reads as zero steps."""
    families = list(text_string_to_metric_families(text))
    samples = [sample for family in families for sample in family.samples]
    for name in STEP_TOKEN_HISTOGRAMS:
        counts = [s.value for s in samples if s.name == f"{name}_count"]
        if counts or any(family.name == name for family in families):
            tokens = sum(s.value for s in samples if s.name == f"{name}_sum")
            preempted = [s.value for s in samples if s.name == PREEMPTION_COUNTERS[name]]
            preemptions = sum(preempted) if preempted else None
            return StepTotals(name, sum(counts), tokens, preemptions, kv_capacity_tokens(samples))
    return None


def scrape_step_totals(url: str) -> StepTotals | None:
    with urllib.request.urlopen(url, timeout=SCRAPE_TIMEOUT_S) as response:
        return parse_step_totals(response.read().decode())


def step_mix(before: StepTotals, after: StepTotals) -> dict[str, float | str | None]:
    """What ran between two readings: steps, tokens, tokens per step (None without a step) and preemptions
    (None without a counter in both readings). Raises
    ValueError for readings that cannot be of one server's run: another histogram, or counts that went back
    (the server started again)."""
    if before.histogram != after.histogram:
        raise ValueError(f"two readings of different histograms: {before.histogram}, {after.histogram}")
    steps = after.steps - before.steps
    tokens = after.tokens - before.tokens
    preemptions = None
    if before.preemptions is not None and after.preemptions is not None:
        preemptions = after.preemptions - before.preemptions
    if steps < 0 or tokens < 0 or (preemptions is not None and preemptions < 0):
        raise ValueError(f"the step counts went back ({before} -> {after}): did the server start again?")
    return {
        "histogram": after.histogram,
        "steps": steps,
        "tokens": tokens,
        "tokens_per_step": tokens / steps if steps > 0 else None,
        "preemptions": preemptions,
        "kv_tokens": after.kv_tokens,
    }
