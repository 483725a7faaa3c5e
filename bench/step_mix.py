"""The steps a server ran during one online run, from its Prometheus endpoint: how many, and how many tokens
each computed on average (prefill and decode together).

Two servers can reach the same output rate with different step mixes (few long steps that carry big prefill
chunks, or many short ones), and the mix decides ITL and TPOT. Both engines count the tokens of every step in
a histogram: ours ``ominix_scheduler_step_tokens`` (one series per worker), vLLM
``vllm:iteration_tokens_total``. The endpoint is read before and after a run; the difference is the run's.
"""

from __future__ import annotations

import math
import urllib.request
from dataclasses import dataclass

from prometheus_client.parser import text_string_to_metric_families

# The first of these an endpoint has is read: ours, then vLLM's name for the same histogram.
STEP_TOKEN_HISTOGRAMS = ("ominix_scheduler_step_tokens", "vllm:iteration_tokens_total")
SCRAPE_TIMEOUT_S = 5.0


@dataclass(frozen=True, slots=True)
class StepTotals:
    """One reading of a step-token histogram, summed over its series."""

    histogram: str
    steps: float
    tokens: float


def parse_step_totals(text: str) -> StepTotals | None:
    """The step totals in a Prometheus text exposition; None when it has no step-token histogram."""
    samples = [sample for family in text_string_to_metric_families(text) for sample in family.samples]
    for name in STEP_TOKEN_HISTOGRAMS:
        counts = [s.value for s in samples if s.name == f"{name}_count"]
        if counts:
            tokens = sum(s.value for s in samples if s.name == f"{name}_sum")
            return StepTotals(name, sum(counts), tokens)
    return None


def scrape_step_totals(url: str) -> StepTotals | None:
    with urllib.request.urlopen(url, timeout=SCRAPE_TIMEOUT_S) as response:
        return parse_step_totals(response.read().decode())


def step_mix(before: StepTotals, after: StepTotals) -> dict[str, float | str]:
    """What ran between two readings: steps, tokens and tokens per step."""
    if before.histogram != after.histogram:
        raise ValueError(f"two readings of different histograms: {before.histogram}, {after.histogram}")
    steps = after.steps - before.steps
    tokens = after.tokens - before.tokens
    return {
        "histogram": after.histogram,
        "steps": steps,
        "tokens": tokens,
        "tokens_per_step": tokens / steps if steps > 0 else math.nan,
    }
