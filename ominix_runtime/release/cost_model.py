"""How long a simulated step takes. Only the simulated clock (TTFT, latency in ms) depends on it; which
request runs when is decided by the scheduler alone, so the trace fingerprint never depends on the cost model.

- ``capability``: a roofline estimate from the backend's stated capability: a step streams the weights and
  the KV blocks in use once and does 2 FLOPs per parameter per token; it takes the longer of the two plus a
  fixed overhead.
- ``profile``: measured steps (``bench/step_probe.py`` writes them: ``tokens``, ``decode`` and either
  ``ms`` or ``enter``/``exit`` seconds), interpolated linearly in the step's token count, decode-only steps
  and steps with prefill apart.
"""

from __future__ import annotations

import bisect
from abc import ABC, abstractmethod
from collections import defaultdict
from dataclasses import dataclass

from ominix_runtime.contract import BackendCapability
from ominix_runtime.release.inputs import Fields, ReleaseInputError

_DTYPE_BYTES = {"float32": 4, "bfloat16": 2, "float16": 2, "float8": 1, "int8": 1}


@dataclass(frozen=True, slots=True)
class StepShape:
    """What a step does, as far as its cost goes."""

    prefill_tokens: int
    decode_tokens: int
    kv_blocks_in_use: int

    @property
    def num_tokens(self) -> int:
        return self.prefill_tokens + self.decode_tokens


class StepCostModel(ABC):
    """Milliseconds per simulated step."""

    name: str = ""

    @abstractmethod
    def step_ms(self, shape: StepShape) -> float: ...

    @property
    @abstractmethod
    def idle_ms(self) -> float:
        """Length of a tick in which nothing runs (waiting for the next arrival)."""


class CapabilityCostModel(StepCostModel):
    name = "capability"

    def __init__(
        self,
        capability: BackendCapability,
        memory_bandwidth_gb_s: float,
        peak_tflops: float,
        step_overhead_ms: float,
        weight_bytes: float | None = None,
    ) -> None:
        params = capability.model.num_parameters
        bytes_per_param = _DTYPE_BYTES.get(capability.dtype, 2)
        self.weight_bytes = weight_bytes if weight_bytes is not None else float(params * bytes_per_param)
        self.flops_per_token = 2.0 * (self.weight_bytes / bytes_per_param)
        self.kv_bytes_per_block = capability.kv_bytes_per_block
        self.bytes_per_ms = memory_bandwidth_gb_s * 1e9 / 1e3
        self.flops_per_ms = peak_tflops * 1e12 / 1e3
        self.overhead_ms = step_overhead_ms

    def step_ms(self, shape: StepShape) -> float:
        if shape.num_tokens == 0:
            return self.overhead_ms
        memory = (self.weight_bytes + shape.kv_blocks_in_use * self.kv_bytes_per_block) / self.bytes_per_ms
        compute = shape.num_tokens * self.flops_per_token / self.flops_per_ms
        return self.overhead_ms + max(memory, compute)

    @property
    def idle_ms(self) -> float:
        return self.overhead_ms


class _Curve:
    """Piecewise-linear ms over token count through the median of each measured token count."""

    def __init__(self, points: dict[int, list[float]]) -> None:
        self.xs = sorted(points)
        self.ys = [sorted(points[x])[len(points[x]) // 2] for x in self.xs]

    def __call__(self, tokens: int) -> float:
        xs, ys = self.xs, self.ys
        if len(xs) == 1:
            return ys[0] * max(tokens, 1) / max(xs[0], 1) if tokens > xs[0] else ys[0]
        i = min(max(bisect.bisect_left(xs, tokens), 1), len(xs) - 1)
        x0, x1, y0, y1 = xs[i - 1], xs[i], ys[i - 1], ys[i]
        return max(0.0, y0 + (y1 - y0) * (tokens - x0) / (x1 - x0))


class ProfileCostModel(StepCostModel):
    name = "profile"

    def __init__(self, decode: dict[int, list[float]], prefill: dict[int, list[float]]) -> None:
        if not decode and not prefill:
            raise ReleaseInputError("cost.steps holds no usable step")
        self._decode = _Curve(decode or prefill)
        self._prefill = _Curve(prefill or decode)
        self._idle = min(self._decode.ys)

    def step_ms(self, shape: StepShape) -> float:
        if shape.num_tokens == 0:
            return self._idle
        curve = self._prefill if shape.prefill_tokens else self._decode
        return curve(shape.num_tokens)

    @property
    def idle_ms(self) -> float:
        return self._idle


def _profile(f: Fields) -> ProfileCostModel:
    decode: dict[int, list[float]] = defaultdict(list)
    prefill: dict[int, list[float]] = defaultdict(list)
    for step in f.objects("steps", required=True):
        tokens = step.integer("tokens", minimum=0)
        if step.has("ms"):
            ms = step.number("ms", minimum=0.0)
        else:
            ms = (step.number("exit") - step.number("enter")) * 1e3
            if ms < 0:
                raise ReleaseInputError(f"{step.where}: exit is before enter")
        if tokens > 0:
            (decode if step.flag("decode", False) else prefill)[tokens].append(ms)
    return ProfileCostModel(dict(decode), dict(prefill))


def cost_model_from(f: Fields, capability: BackendCapability) -> StepCostModel:
    kind = f.text("kind", "capability")
    if kind == "profile":
        return _profile(f)
    if kind != "capability":
        raise ReleaseInputError(f"{f.where}.kind must be 'capability' or 'profile', got {kind!r}")
    weight_bytes = f.optional_number("weight_bytes", minimum=1.0)
    if weight_bytes is None and capability.model.num_parameters <= 0:
        # Without a size the roofline has nothing to stream: a nominal 1 B-parameter model keeps ms sensible.
        weight_bytes = 1e9 * _DTYPE_BYTES.get(capability.dtype, 2)
    return CapabilityCostModel(
        capability,
        memory_bandwidth_gb_s=f.number("memory_bandwidth_gb_s", 2000.0, minimum=1e-3),
        peak_tflops=f.number("peak_tflops", 400.0, minimum=1e-3),
        step_overhead_ms=f.number("step_overhead_ms", 0.5, minimum=0.0),
        weight_bytes=weight_bytes,
    )
