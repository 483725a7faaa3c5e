"""Megatron-style sharded layers: column- and row-parallel linears, a vocab-parallel embedding and LM head.

Each layer owns how its checkpoint tensors are cut: ``load_weight(param_name, source, part)`` reads this
rank's slice of a full checkpoint tensor (``part`` picks one of several tensors fused into one parameter,
e.g. q, k, v) and writes it into the local parameter. With ``SINGLE`` they are the plain layers with full
weights and no collective, so one model definition serves every group size.

- ``ColumnParallelLinear``: output features split; each rank returns its slice of the output (no collective).
- ``RowParallelLinear``: input features split; partial products are summed with one all-reduce.
- ``VocabParallelEmbedding``: vocabulary rows split (padded to a multiple of the group); lookups outside the
  rank's rows give zeros and one all-reduce completes each embedding.
- ``ParallelLMHead``: vocabulary rows split; the logits are all-gathered, so every rank holds all of them and
  samples the same token.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import ClassVar

import torch
import torch.nn.functional as F
from torch import nn

from ominix_worker.ops import cpu_gemm
from ominix_worker.parallel.tensor_parallel import SINGLE, ShardRange, TensorParallel
from ominix_worker.parallel.weights import TensorWeight, WeightSource


def _copy_checked(target: torch.Tensor, tensor: torch.Tensor, what: str) -> None:
    if tuple(target.shape) != tuple(tensor.shape):
        raise ValueError(f"{what}: shape {tuple(tensor.shape)} != expected {tuple(target.shape)}")
    with torch.no_grad():
        target.copy_(tensor)


class ParallelModule(nn.Module):
    """A layer that reads its own slices of checkpoint tensors."""

    def load_weight(self, param_name: str, source: WeightSource, part: int | None = None) -> None:
        raise NotImplementedError

    def num_parts(self, param_name: str) -> int:
        """How many checkpoint tensors are fused into ``param_name`` (each must be loaded once)."""
        return 1

    def full_shape(self, param_name: str) -> tuple[int, ...] | None:
        """The unsharded shape of ``param_name`` (its fused parts stacked); None when it is held whole."""
        return None

    def load_full(self, param_name: str, full: torch.Tensor) -> None:
        """Keep this rank's share of the unsharded ``full`` (dummy weights drawn whole, then cut)."""
        self.load_weight(param_name, TensorWeight(full))

    def pack_for_cpu(self, keep_dense: bool) -> None:
        """Once loaded: reorder a GEMM weight for the CPU (``ops.cpu_gemm``); other layers keep theirs."""


def _one_streamable_token(x: torch.Tensor, weight: torch.Tensor) -> bool:
    """``F.linear(x, weight)`` is one token on CUDA, with a row-major 2-D weight in x's 16-bit dtype: the case
    ``ops.weight_stream`` takes instead of cuBLAS."""
    return (
        x.is_cuda
        and x.numel() == x.shape[-1]
        and x.stride(-1) == 1
        and x.dtype in (torch.bfloat16, torch.float16)
        and weight.dtype == x.dtype
        and weight.dim() == 2
        and weight.stride(1) == 1
    )


class PackableLinear(ParallelModule):
    """A layer whose forward is one GEMM by ``weight``; on CPU the weight can be packed once for it.

    After ``pack_for_cpu(keep_dense=False)`` the dense weight is released (a meta tensor of the same shape
    stays as the parameter), so packing costs no memory; the layer takes no more weights after that.

    On CUDA one token's GEMM (batch-1 decode, a prompt's last position through the LM head) streams the weight
    through ``ops.weight_stream`` while ``stream_single_token`` is on (the worker's ``OMINIX_WEIGHT_STREAM``).
    """

    weight: nn.Parameter
    packed: torch.Tensor | None = None
    stream_single_token: ClassVar[bool] = True

    def warm_gemm(self, x: torch.Tensor) -> None:
        """The GEMM a step runs through this layer for input ``x`` (the LM head's: no bias), without any
        reduction across ranks (``ModelRunner.warm_up_gemm_rows``)."""
        self.gemm(x)

    def pack_for_cpu(self, keep_dense: bool) -> None:
        if self.packed is not None or not cpu_gemm.can_pack(self.weight):
            return
        self.packed = cpu_gemm.pack(self.weight)
        if not keep_dense:
            self.weight = nn.Parameter(self.weight.detach().to("meta"), requires_grad=False)

    def gemm(self, x: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
        if self.packed is not None:
            return cpu_gemm.linear(x, self.packed, bias)
        out = self.streamed(x)
        if out is not None:
            return out + bias if bias is not None else out
        return F.linear(x, self.weight, bias)

    def streamed(self, x: torch.Tensor, gated: bool = False) -> torch.Tensor | None:
        """One token's product through ``ops.weight_stream`` (``gated``: x is [gate | up] and the input is
        silu(gate) · up), or None where that kernel does not take it."""
        if (
            self.packed is not None
            or not self.stream_single_token
            or not _one_streamable_token(x, self.weight)
        ):
            return None
        from ominix_worker.ops.weight_stream import weight_stream_matmul  # Triton: CUDA only

        out = weight_stream_matmul(x.reshape(1, -1), self.weight, gated=gated)
        return out.reshape(*x.shape[:-1], out.shape[-1])


class ColumnParallelLinear(PackableLinear):
    """y = x Wᵀ (+ b) with W's output rows split; ``parts`` are the fused outputs' rows on this rank.

    ``full_sizes[i]`` is the output size of fused part i in the checkpoint; ``parts[i]`` the rows of it this
    rank holds. The local output is the parts' slices side by side (e.g. [q | k | v] of the rank's heads).
    """

    def __init__(
        self,
        in_features: int,
        full_sizes: Sequence[int],
        parts: Sequence[ShardRange],
        bias: bool,
    ) -> None:
        super().__init__()
        if len(full_sizes) != len(parts):
            raise ValueError("one shard range per fused output")
        self.full_sizes = list(full_sizes)
        self.parts = list(parts)
        self.offsets = [sum(p.size for p in self.parts[:i]) for i in range(len(self.parts))]
        out_features = sum(p.size for p in self.parts)
        self.weight = nn.Parameter(torch.empty(out_features, in_features))
        self.bias = nn.Parameter(torch.empty(out_features)) if bias else None

    @classmethod
    def split_evenly(
        cls, in_features: int, full_sizes: Sequence[int], bias: bool, tp: TensorParallel = SINGLE
    ) -> ColumnParallelLinear:
        return cls(in_features, full_sizes, [tp.split(n, "output features") for n in full_sizes], bias)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.matmul(x, self.bias)

    def warm_gemm(self, x: torch.Tensor) -> None:
        self.matmul(x, self.bias)

    def matmul(self, x: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
        """x Wᵀ (+ bias) with the local weight (quantized layers override it)."""
        return self.gemm(x, bias)

    def num_parts(self, param_name: str) -> int:
        return len(self.parts)

    def full_shape(self, param_name: str) -> tuple[int, ...] | None:
        return (sum(self.full_sizes), self.weight.shape[1]) if param_name == "weight" else None

    def load_full(self, param_name: str, full: torch.Tensor) -> None:
        for index, part in enumerate(full.split(self.full_sizes)):
            self.load_weight(param_name, TensorWeight(part), index)

    def load_weight(self, param_name: str, source: WeightSource, part: int | None = None) -> None:
        index = part or 0
        shard = self.parts[index]
        if source.shape[0] != self.full_sizes[index]:
            raise ValueError(
                f"{param_name}: {source.shape[0]} output rows, expected {self.full_sizes[index]}"
            )
        param = self.weight if param_name == "weight" else self.bias
        assert param is not None, f"no {param_name} in this layer"
        target = param.narrow(0, self.offsets[index], shard.size)
        _copy_checked(target, source.read(0, shard.start, shard.size), param_name)


class RowParallelLinear(PackableLinear):
    """y = all_reduce(x_local W_localᵀ) (+ b): W's input columns split, x arrives already split the same way.

    With ``reduce=False`` it returns the rank's partial product (no bias), for a caller that adds other
    partial sums first and reduces them together (a MoE layer's shared expert beside its routed experts)."""

    def __init__(
        self,
        in_features: int,
        out_features: int,
        bias: bool,
        tp: TensorParallel = SINGLE,
        reduce: bool = True,
    ) -> None:
        super().__init__()
        if bias and not reduce:
            raise ValueError("a row-parallel layer that leaves the reduction to its caller cannot add a bias")
        self.tp = tp
        self.reduce = reduce
        self.in_features = in_features
        self.shard = tp.split(in_features, "input features")
        self.weight = nn.Parameter(torch.empty(out_features, self.shard.size))
        self.bias = nn.Parameter(torch.empty(out_features)) if bias else None

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self._reduced(self.matmul(x, None))

    def warm_gemm(self, x: torch.Tensor) -> None:
        self.matmul(x, None)

    def forward_gated(
        self, gate_up: torch.Tensor, silu_and_mul: Callable[[torch.Tensor], torch.Tensor]
    ) -> torch.Tensor:
        """``forward(silu(gate) · up)`` for ``gate_up`` laid out [gate | up], the product computed by
        ``silu_and_mul`` (a quantized layer may fold it into the pass that quantizes its input)."""
        return self._reduced(self.matmul_gated(gate_up, silu_and_mul))

    def _reduced(self, out: torch.Tensor) -> torch.Tensor:
        if not self.reduce:
            return out
        out = self.tp.all_reduce(out)
        return out + self.bias if self.bias is not None else out

    def matmul(self, x: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
        """x_local W_localᵀ (+ bias), before any reduction (quantized layers override it)."""
        return self.gemm(x, bias)

    def matmul_gated(
        self, gate_up: torch.Tensor, silu_and_mul: Callable[[torch.Tensor], torch.Tensor]
    ) -> torch.Tensor:
        """``matmul(silu_and_mul(gate_up), None)`` (quantized layers override it). One token on CUDA streams the
        weight with the SiLU product formed in the GEMM's input loads: one kernel fewer per layer."""
        out = self.streamed(gate_up, gated=True)
        return out if out is not None else self.matmul(silu_and_mul(gate_up), None)

    def load_weight(self, param_name: str, source: WeightSource, part: int | None = None) -> None:
        if param_name == "bias":  # added once, after the reduction: every rank holds all of it
            assert self.bias is not None, "no bias in this layer"
            _copy_checked(self.bias, source.read(), param_name)
            return
        if source.shape[-1] != self.in_features:
            raise ValueError(f"{param_name}: {source.shape[-1]} input columns, expected {self.in_features}")
        _copy_checked(self.weight, source.read(1, self.shard.start, self.shard.size), param_name)

    def full_shape(self, param_name: str) -> tuple[int, ...] | None:
        return (self.weight.shape[0], self.in_features) if param_name == "weight" else None


class VocabParallelEmbedding(ParallelModule):
    """Token embedding with the vocabulary split in contiguous row ranges (padded to a multiple of the group)."""

    def __init__(self, vocab_size: int, hidden_size: int, tp: TensorParallel = SINGLE) -> None:
        super().__init__()
        self.tp = tp
        self.vocab_size = vocab_size
        self.shard = tp.padded_split(vocab_size)
        self.num_real_rows = max(0, min(self.shard.end, vocab_size) - self.shard.start)
        self.weight = nn.Parameter(torch.empty(self.shard.size, hidden_size))

    def forward(self, input_ids: torch.Tensor) -> torch.Tensor:
        if self.tp.size == 1:
            return F.embedding(input_ids, self.weight)
        local = input_ids - self.shard.start
        outside = (local < 0) | (local >= self.num_real_rows)
        embedded = F.embedding(local.masked_fill(outside, 0), self.weight)
        return self.tp.all_reduce(embedded.masked_fill(outside.unsqueeze(-1), 0.0))

    def load_weight(self, param_name: str, source: WeightSource, part: int | None = None) -> None:
        if source.shape[0] != self.vocab_size:
            raise ValueError(f"{param_name}: {source.shape[0]} vocabulary rows, expected {self.vocab_size}")
        rows = self.weight.narrow(0, 0, self.num_real_rows)
        _copy_checked(rows, source.read(0, self.shard.start, self.num_real_rows), param_name)
        with torch.no_grad():  # padding rows: never looked up, and their logits are cut off
            self.weight[self.num_real_rows :].zero_()

    def full_shape(self, param_name: str) -> tuple[int, ...] | None:
        return (self.vocab_size, self.weight.shape[1])


class ParallelLMHead(VocabParallelEmbedding, PackableLinear):
    """Output projection over the split vocabulary; ``logits`` gathers every rank's share."""

    def forward(self, hidden: torch.Tensor) -> torch.Tensor:
        return self.logits(hidden)

    def logits(self, hidden: torch.Tensor) -> torch.Tensor:
        local = self.gemm(hidden)
        if self.tp.size == 1:
            return local
        return self.tp.all_gather_last_dim(local)[..., : self.vocab_size]
