"""Per-device scratch for kernels whose programs split one output across several programs: float32 partial
sums, and int32 arrival counters that are zero between launches (the last program of an output to arrive
combines the partials and sets its counter back to zero, so the reduction needs no second kernel).

The worker runs its forward passes on one stream, whose kernels run one after another, so every launch on a
device shares the buffers. A CUDA graph holds the addresses it captured: a replaced buffer is kept, never
freed, and none may be replaced during capture (run the largest shape once before capturing).
"""

from __future__ import annotations

import torch

# Never allocate less than this many elements: small launches all share one buffer.
_MIN_ELEMENTS = 1 << 16


class SplitScratch:
    """Float32 partials and int32 arrival counters per device, grown on demand."""

    def __init__(self) -> None:
        self._buffers: dict[tuple[torch.device, torch.dtype], list[torch.Tensor]] = {}

    def get(self, device: torch.device, partial: int, counters: int) -> tuple[torch.Tensor, torch.Tensor]:
        """At least ``partial`` float32 elements and ``counters`` zeroed int32 counters on ``device``."""
        return self._at_least(device, torch.float32, partial), self.counters(device, counters)

    def counters(self, device: torch.device, count: int) -> torch.Tensor:
        """At least ``count`` int32 arrival counters on ``device``, each zero when no launch is running."""
        return self._at_least(device, torch.int32, count)

    def _at_least(self, device: torch.device, dtype: torch.dtype, numel: int) -> torch.Tensor:
        held = self._buffers.setdefault((device, dtype), [])
        if not held or held[-1].numel() < numel:
            if device.type == "cuda" and torch.cuda.is_current_stream_capturing():
                raise RuntimeError("split scratch grew during CUDA graph capture; run the shape once before")
            held.append(torch.zeros(max(numel, _MIN_ELEMENTS), dtype=dtype, device=device))
        return held[-1]


SCRATCH = SplitScratch()
