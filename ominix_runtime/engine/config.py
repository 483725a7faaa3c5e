"""Engine and scheduler settings: the ``engine`` branch of the runtime's config tree (``ominix_runtime.config``)."""

from __future__ import annotations

from dataclasses import dataclass

# The engine core's own guard on a step: --step-timeout when given; else only a backstop for a backend with
# no timeout of its own (the worker client derives one per stream from its measured steps). One definition.
DEFAULT_STEP_TIMEOUT_S = 600.0


@dataclass(frozen=True, slots=True)
class SchedulerConfig:
    """Per worker group. Limits default to the worker's capability when None (the one scheduler config)."""

    max_batch_tokens: int | None = None  # token budget per step
    max_running_requests: int | None = None
    max_kv_blocks: int | None = None  # use at most this many of the worker's KV blocks (tests, reserves)
    enable_prefix_caching: bool = True
    enable_chunked_prefill: bool = True
    # Anti-starvation: a waiting request that cannot get KV may be bypassed by later (smaller) requests in
    # at most this many steps; after that nothing behind it is admitted until it fits.
    max_bypass_steps: int = 8
    # Anti-thrash: a request resumed after preemption is not chosen as a victim for this many steps
    # unless every other candidate is protected too.
    preemption_protection_steps: int = 4
    # A step that carries decodes admits waiting requests only up to this many prefill tokens in the step
    # (running prompts' chunks count, but are not cut) while no backlog waits (the waiting prompts would go
    # in this step and the next under the limit, and each has a free running slot); a prompt it held back
    # takes the budget beside it from the next step on; with chunked prefill only; 0: no limit. A prefill beside
    # decodes stalls every decoding stream for its whole duration: steps carrying two 1,024-token prompts
    # ended most ITL p99 gaps at 16 req/s on an H200. With 1,024 (and the worker's early results) ITL p99
    # beside vLLM went from 1.08x to 0.97x at 4 req/s and 0.91x at 8 (bench/RESULTS.md, 2026-11-29). A
    # backlog lifts the limit: holding a queue back only releases it later in one long step.
    prefill_tokens_beside_decodes: int = 1024
    # Waiting prompt tokens past what is left of the limit in this step that the limit still holds back; more
    # is a backlog, which lifts it. 0: the limit itself (what one more step under it takes). With a limit of
    # 512 and 2,048 here, on an H200 beside vLLM, ITL p99 fell to 0.66x / 0.61x vLLM's at 4 / 8 req/s but TTFT
    # p50 rose 3.4 / 4.3 ms over the defaults (two halves replay slower buckets than the whole), and at 16 req/s
    # both were behind (bench/RESULTS.md, 2026-11-30 15:52): a deployment's choice, not a default.
    prefill_backlog_tokens: int = 0
    # Token budget of a step that carries decodes (decodes and prefill, running prompts' chunks included),
    # backlog or not, but for a burst (below); a step without decodes keeps max_batch_tokens; only with chunked
    # prefill (without it a longer prompt could not be admitted while anything decodes). 0: max_batch_tokens;
    # never below max_running_requests (a step of decodes alone fits). Under a backlog every step admits
    # prompts up to its budget and each decoding stream waits for the whole step; a smaller budget beside
    # decodes trades a little TTFT of the prompts behind for shorter longest gaps. Beside vLLM on one H200
    # (bench/RESULTS.md, 2026-11-30, 13:37 - 13:51, before the burst budget), 4,096 of the CUDA profile's 8,192
    # read ITL p99 0.69x of vLLM's at 32 req/s and 0.54x all at once, where 6,144 read 0.96x and 0.79x (and
    # 1.12x at 32 req/s on an earlier machine), for TTFT p50 +4% at 32 req/s, output throughput level, and no
    # change at 4 - 16 req/s. It applies wherever the budget is larger (the CUDA and Ascend profiles; measured
    # on CUDA only); the CPU profile's budget (2,048) is below it.
    max_batch_tokens_with_decodes: int = 4096
    # A burst being taken in: every waiting request has a free running slot, together they hold at least
    # burst_backlog_tokens tokens (prefix hits not subtracted), the free or reusable (prefix-cached) KV holds them
    # all beside what the running requests still need, and no running request is of a higher class than the first
    # of them. The batch is filling after many requests came at once, and each step with decodes puts the decodes'
    # share of it between the last prompt and its first token, so such a step takes up to
    # max_batch_tokens_in_burst (never fewer than max_batch_tokens_with_decodes, never more than
    # max_batch_tokens). Not a burst: a queue for slots (more waiting than free slots: their first tokens wait for
    # requests to end, which longer steps do not hasten), a queue for KV, or the few prompts of an arrival
    # cluster; one waiting prompt of that many tokens is, for its first chunk. With 256 requests at once on one
    # H200 (bench/RESULTS.md, 2026-12-01 08:11 to 08:13, the rule before its KV and class conditions, which make
    # the same steps there in the scheduler model) it took TTFT p99 3% lower than without it on the same machine,
    # for ITL p99 1.46x (157.6 against 108.1 ms; vLLM's there: 204 to 226 ms); the scheduler model moved nothing
    # at 4 to 32 req/s. 0 in either: off.
    burst_backlog_tokens: int = 16384
    max_batch_tokens_in_burst: int = 6144
    # Under a backlog (more admissible waiting requests than free running slots), a step that carries decodes
    # admits waiting requests only once this many running slots are free (at most max_running_requests - 1), or
    # once admission has waited backlog_admission_max_wait_steps steps with a slot free; a waiting request of a
    # higher class than a running one is never held. At saturation about one request ends a step, and filling
    # each slot as it frees puts a prompt beside the decodes in about every other step, so the median gap of
    # every stream can be a prefill step's; two at a time keeps most steps decode-only for the same work (on
    # one H200 at 32 req/s: ITL p50 0.69x for TTFT p50 +4%; docs/SCHEDULER.md). 0 or 1: off.
    backlog_admission_slots: int = 2
    backlog_admission_max_wait_steps: int = 4


# Steps in flight under light load (EngineCoreConfig.light_load_below_running).
LIGHT_LOAD_INFLIGHT_STEPS = 2


@dataclass(frozen=True, slots=True)
class EngineCoreConfig:
    scheduler: SchedulerConfig = SchedulerConfig()
    # Steps sent ahead of their results. A pipelined worker launches step N+1 while step N runs on the device
    # and then posts N's result; step N+2 must reach it before N+1 ends. With 2 in flight the engine builds
    # N+2 from N's result, so it has one device step less the two messages and its own turnaround; with 3 it
    # builds it from N-1's, a whole device step earlier. 1: none.
    max_inflight_steps: int = 3
    # The third step costs a request that arrives one device step of TTFT: it joins the first step not yet
    # sent. Two cost the running requests instead when the engine's turnaround or an eager step's host launch
    # outlasts a device step (ITL and TPOT of every running request). So at most LIGHT_LOAD_INFLIGHT_STEPS
    # while fewer requests than this run on a worker and none waits for admission: with nothing waiting a
    # third step would be built before the arrivals it should carry; with a backlog (prompts held back, KV
    # exhausted) it carries waiting work and keeps the device fed. H200, Llama-8B shape (bench/RESULTS.md,
    # 2026-11-30 18:48 - 19:08): 2 in flight below 128 running, waiting or not, took 18 - 19% off TTFT p50 at
    # 16 req/s, TPOT level, where 16 (the default before) kept 3. At 32 req/s, where the KV ran out and prompts
    # waited, those servers read 4% less output, but they also held 8% less KV than the one they were compared
    # with: not a measure of the depth. A backlog keeps the 3 those runs had before.
    # 0: always max_inflight_steps.
    light_load_below_running: int = 128
    step_timeout: float = DEFAULT_STEP_TIMEOUT_S
    deadline_check_interval: float = 0.05  # seconds between deadline sweeps while idle
    idle_integrity_check_interval: float = 1.0  # registry check_integrity() while idle, at most this often
    recent_window: int = 256  # recent step durations / batch sizes kept for stats
    decode_rate_ewma_alpha: float = 0.2
    max_waiting_requests: int = 1024  # per engine (--max-queue-len); 0: unbounded
    # A failed worker is polled (Describe) with exponential backoff and re-joins with a fresh scheduler.
    reconnect: bool = True
    reconnect_backoff_initial: float = 0.5
    reconnect_backoff_max: float = 10.0
    reconnect_rpc_timeout: float = 10.0

    def inflight_limit(self, num_running: int, num_waiting: int) -> int:
        """Steps a worker group may have in flight while ``num_running`` requests run on it and ``num_waiting``
        wait for admission: the configured depth, less under light load (few running, none waiting)."""
        depth = max(1, self.max_inflight_steps)
        light = num_running < self.light_load_below_running and num_waiting == 0
        if self.light_load_below_running and light:
            return min(depth, LIGHT_LOAD_INFLIGHT_STEPS)
        return depth
