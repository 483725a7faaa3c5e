"""Release tooling: deterministic replay through the real scheduler, and a promote/hold/rollback gate.

- :mod:`~ominix_runtime.release.replay` drives the real :class:`~ominix_runtime.engine.scheduler.Scheduler`
  and KV registry with a simulated backend and reports a per-tick trace with a stable fingerprint.
- :mod:`~ominix_runtime.release.gate` joins baseline and candidate observations by request id and decides.
- :mod:`~ominix_runtime.release.mirror` turns vLLM- and SGLang-style observations into gate input.

Everything here is policy-side: no torch, no network.
"""
