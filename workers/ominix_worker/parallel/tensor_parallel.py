"""This process's place in a tensor-parallel group and the collectives sharded layers need.

A ``TensorParallel`` of size 1 (``SINGLE``) makes every sharded layer behave as the plain one: full
weights, no collective. Of size N, it holds the torch.distributed process group the layers reduce and
gather over (NCCL on CUDA, gloo on CPU); all collectives run on the current stream, so they are captured in
CUDA graphs with the kernels around them.
"""

from __future__ import annotations

from dataclasses import dataclass
from enum import Enum

import torch
import torch.distributed as dist


@dataclass(frozen=True, slots=True)
class ShardRange:
    """Rows [start, start + size) of a full dimension held by this rank."""

    start: int
    size: int

    @property
    def end(self) -> int:
        return self.start + self.size


class MoeParallel(str, Enum):
    """How a group splits mixture-of-experts layers (``--moe-parallel``).

    TENSOR: every rank holds a slice of every expert's intermediate dimension (w13 rows, w2 columns).
    EXPERT: every rank holds E / size whole experts and computes only the assignments routed to them.
    Either way each rank's output is a partial sum that one all-reduce per layer completes."""

    TENSOR = "tensor"
    EXPERT = "expert"


@dataclass(frozen=True, slots=True)
class TensorParallel:
    rank: int = 0
    size: int = 1
    group: dist.ProcessGroup | None = None
    moe: MoeParallel = MoeParallel.TENSOR

    def __post_init__(self) -> None:
        if self.size < 1 or not 0 <= self.rank < self.size:
            raise ValueError(f"tensor-parallel rank {self.rank} outside a group of {self.size}")
        if self.size > 1 and self.group is None:
            raise ValueError("a tensor-parallel group of more than one rank needs a process group")

    # ---- how dimensions split ----------------------------------------------------------------------

    def split(self, total: int, what: str = "dimension") -> ShardRange:
        """An even split of ``total``; raises ValueError when it does not divide."""
        if total % self.size:
            raise ValueError(f"{what} {total} does not divide into {self.size} tensor-parallel ranks")
        size = total // self.size
        return ShardRange(self.rank * size, size)

    def padded_split(self, total: int) -> ShardRange:
        """An even split of ``total`` rounded up to a multiple of the group size (vocabularies).

        ``size`` is the padded per-rank share; the last ranks may hold fewer than ``size`` real rows."""
        size = -(-total // self.size)
        return ShardRange(self.rank * size, size)

    def experts(self, num_experts: int) -> ShardRange:
        """The routed experts this rank holds: all of them under TENSOR, an even share under EXPERT."""
        if self.moe is MoeParallel.TENSOR:
            return ShardRange(0, num_experts)
        if num_experts % self.size:
            raise ValueError(
                f"{num_experts} experts do not divide into {self.size} ranks for expert parallelism "
                f"(--moe-parallel expert); use --moe-parallel tensor or a tensor-parallel size dividing "
                f"{num_experts}"
            )
        return self.split(num_experts, "the number of experts")

    def expert_intermediate(self, intermediate_size: int) -> ShardRange:
        """The rows of each held expert's intermediate dimension: a slice under TENSOR, all under EXPERT."""
        if self.moe is MoeParallel.EXPERT:
            return ShardRange(0, intermediate_size)
        return self.split(intermediate_size, "moe_intermediate_size")

    def kv_heads(self, num_kv_heads: int, num_heads: int) -> ShardRange:
        """The KV heads this rank keeps: an even share, or one replicated head when there are fewer KV heads
        than ranks (each query head still meets its own KV head)."""
        self.split(num_heads, "the number of attention heads")
        if num_kv_heads >= self.size:
            return self.split(num_kv_heads, "the number of KV heads")
        if self.size % num_kv_heads:
            raise ValueError(
                f"{num_kv_heads} KV heads cannot be replicated evenly over {self.size} tensor-parallel ranks"
            )
        return ShardRange(self.rank * num_kv_heads // self.size, 1)

    # ---- collectives -------------------------------------------------------------------------------

    def all_reduce(self, x: torch.Tensor) -> torch.Tensor:
        """Sum over the group, in place; the identity for one rank."""
        if self.size > 1:
            dist.all_reduce(x, group=self.group)
        return x

    def all_gather_last_dim(self, x: torch.Tensor) -> torch.Tensor:
        """Each rank's (..., n) → (..., size * n) in rank order; the identity for one rank."""
        if self.size == 1:
            return x
        x = x.contiguous()
        gathered = torch.empty((self.size, *x.shape), dtype=x.dtype, device=x.device)
        dist.all_gather_into_tensor(gathered.view(self.size * x.shape[0], *x.shape[1:]), x, group=self.group)
        return gathered.movedim(0, -2).reshape(*x.shape[:-1], self.size * x.shape[-1])


SINGLE = TensorParallel()
