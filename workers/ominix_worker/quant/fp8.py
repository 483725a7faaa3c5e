"""FP8 (e4m3) weights: Hugging Face FP8 checkpoints and quantization of bf16 weights at load.

One representation covers the three scale layouts checkpoints ship: a weight (N, K) in float8_e4m3fn with a
float32 scale per (bn × bk) block, shape (ceil(N / bn), ceil(K / bk)); the real weight is ``q · scale``.
- block-scaled (``weight_block_size`` [128, 128], scales named ``weight_scale_inv``): block (128, 128);
- per-channel (one scale per output row): block (1, K);
- per-tensor (one scale): stored as per-channel, every row of the tensor (or of its shard in a fused
  projection such as q/k/v) holding the same value.
``--quantization fp8`` quantizes bf16 weights per channel (dynamic per-token activation scales at run time).

Under tensor parallelism each FP8 layer is the FP8 form of the sharded layer it replaces (``Fp8ColumnParallelLinear``,
``Fp8RowParallelLinear``): a rank reads its rows (column-parallel) or columns (row-parallel) of the e4m3 weight
and the scale rows or columns that cover them, nothing else; per-channel and per-tensor scales follow the
output rows. A block scale can only be cut on block boundaries, so a rank's shard (or a fused part inside it)
must start and end on them: ``prepare_fp8_model`` refuses any other shape at startup, naming the layer.

Which GEMM runs (``Fp8Linear.forward``): on GPUs with FP8 tensor cores (compute capability 8.9+, Hopper) a
W8A8 GEMM: ``torch._scaled_mm`` for per-channel weights (activations quantized per token), the Triton block
kernel (``ops/fp8_gemm.py``) for block scales (activations quantized per token and 128-column group); steps of
at most 16 tokens take the weight-only kernel there instead (e4m3 widened in registers, activations unquantized);
elsewhere, the CPU included, the weight is dequantized to the run dtype for each call (the reference path).
"""

from __future__ import annotations

import math
from collections.abc import Callable, Iterable, Iterator
from dataclasses import dataclass
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

from ominix_worker.parallel import (
    SINGLE,
    ColumnParallelLinear,
    ParallelModule,
    RowParallelLinear,
    TensorParallel,
    WeightSource,
)

FP8_DTYPE = torch.float8_e4m3fn
FP8_MAX = float(torch.finfo(FP8_DTYPE).max)  # 448
# Projections that run in FP8: attention and MLP (dense and shared expert) matrices. Embeddings, the LM head,
# norms and routers stay in the run dtype, as FP8 checkpoints ship them.
QUANTIZED_PROJECTIONS = ("qkv_proj", "o_proj", "gate_up_proj", "down_proj")


class Fp8ConfigError(ValueError):
    """A quantization_config this loader cannot serve."""


@dataclass(frozen=True, slots=True)
class Fp8Scheme:
    """How a model's FP8 weights are scaled: ``block`` (rows, columns) per scale, or None for per-channel."""

    block: tuple[int, int] | None = None
    skip: tuple[str, ...] = ()  # module names left unquantized (modules_to_not_convert)

    def block_for(self, shape: tuple[int, int]) -> tuple[int, int]:
        return self.block if self.block is not None else (1, shape[1])


def scheme_from_config(quantization: dict[str, Any]) -> Fp8Scheme | None:
    """The FP8 scheme of a Hugging Face ``quantization_config`` (None when the checkpoint is not quantized)."""
    if not quantization:
        return None
    method = str(quantization.get("quant_method", "")).lower()
    if method != "fp8":
        raise Fp8ConfigError(f"quantization method {method!r} is not supported (fp8 only)")
    fmt = str(quantization.get("fmt", "e4m3")).lower()
    if fmt not in ("e4m3", "float8_e4m3fn"):
        raise Fp8ConfigError(f"FP8 format {fmt!r} is not supported (e4m3 only)")
    if str(quantization.get("activation_scheme", "dynamic")).lower() != "dynamic":
        raise Fp8ConfigError(
            "static FP8 activation scales are not supported (activation_scheme dynamic only)"
        )
    block = quantization.get("weight_block_size")
    skip = tuple(str(m) for m in quantization.get("modules_to_not_convert") or ())
    if block is None:
        return Fp8Scheme(None, skip)
    if len(block) != 2 or min(int(b) for b in block) <= 0:
        raise Fp8ConfigError(f"bad weight_block_size {block!r}")
    return Fp8Scheme((int(block[0]), int(block[1])), skip)


def scale_shape(shape: tuple[int, ...], block: tuple[int, int]) -> tuple[int, ...]:
    *lead, n, k = shape
    return (*lead, -(-n // block[0]), -(-k // block[1]))


def quantize_fp8_blocks(w: torch.Tensor, block: tuple[int, int]) -> tuple[torch.Tensor, torch.Tensor]:
    """(..., N, K) weights → e4m3 values and float32 scales (..., ceil(N/bn), ceil(K/bk)), scale = amax / 448."""
    *lead, n, k = w.shape
    bn, bk = block
    pn, pk = -(-n // bn) * bn, -(-k // bk) * bk
    padded = F.pad(w.float(), (0, pk - k, 0, pn - n))
    tiles = padded.reshape(*lead, pn // bn, bn, pk // bk, bk)
    amax = tiles.abs().amax(dim=(-3, -1), keepdim=True).clamp(min=1e-12)
    scale = amax / FP8_MAX
    q = (tiles / scale).clamp(-FP8_MAX, FP8_MAX).to(FP8_DTYPE)
    q = q.reshape(*lead, pn, pk)[..., :n, :k].contiguous()
    return q, scale.reshape(*lead, pn // bn, pk // bk).contiguous()


def dequantize_fp8(
    q: torch.Tensor, scale: torch.Tensor, block: tuple[int, int], dtype: torch.dtype
) -> torch.Tensor:
    """q (..., N, K) e4m3 and block scales → the weight in ``dtype``."""
    n, k = q.shape[-2:]
    expanded = scale.repeat_interleave(block[0], dim=-2)[..., :n, :]
    expanded = expanded.repeat_interleave(block[1], dim=-1)[..., :k]
    return (q.float() * expanded).to(dtype)


def fp8_gemm_supported(device: torch.device, *scale_columns: int) -> bool:
    """FP8 tensor cores (compute capability 8.9+, Ada or Hopper), and weight scale blocks at least 32 columns
    wide: an 8-bit tensor-core dot takes K tiles of 32 or more, and a tile never straddles two scale blocks."""
    if device.type != "cuda" or any(c % 32 for c in scale_columns):
        return False
    return torch.cuda.get_device_capability(device) >= (8, 9)


class Fp8BlockSplitError(ValueError):
    """A tensor-parallel shard (or a fused part) boundary falls inside a weight scale block."""


def check_block_aligned(
    what: str,
    start: int,
    size: int,
    full: int,
    block: int,
    local_offset: int | None = None,
    remedy: str = "a tensor-parallel size that keeps them, or a per-channel checkpoint",
) -> None:
    """Rows (or columns) [start, start + size) of a ``full``-long checkpoint dimension, placed at
    ``local_offset`` of the local tensor, must start on a ``block`` boundary and end on one or at ``full``:
    a scale block read by two ranks (or covering two fused parts) cannot be used by either."""
    if block <= 1:
        return
    end = start + size
    local = start if local_offset is None else local_offset
    if start % block or local % block or (size % block and end != full):
        raise Fp8BlockSplitError(
            f"{what} [{start}, {end}) of {full} (local offset {local}), which splits a {block}-wide weight "
            f"scale block: an FP8 block-scaled checkpoint needs shard boundaries on multiples of {block} "
            f"(use {remedy})"
        )


def load_row_scales(
    target: torch.Tensor,
    source: WeightSource,
    start: int,
    size: int,
    local_offset: int,
    block_rows: int,
) -> None:
    """Scales of checkpoint output rows [start, start + size) into ``target``'s scale rows for local rows
    [local_offset, local_offset + size). ``source`` is a block scale (rows / block_rows, columns / bk), a
    per-channel one (rows, 1) or (rows,), or a per-tensor scalar (``block_rows`` 1); only the rows needed
    are read."""
    with torch.no_grad():
        if block_rows == 1 and math.prod(source.shape) == 1:  # per tensor, into per-channel storage
            target.narrow(0, local_offset, size).fill_(float(source.read().reshape(())))
            return
        first, count = start // block_rows, -(-size // block_rows)
        part = target.narrow(0, local_offset // block_rows, count)
        tensor = source.read(0, first, count).float()
        if part.numel() != tensor.numel():
            raise ValueError(f"scale rows of {tuple(tensor.shape)} != expected {tuple(part.shape)}")
        part.copy_(tensor.reshape(part.shape))


def load_column_scales(
    target: torch.Tensor, source: WeightSource, start: int, size: int, block: tuple[int, int] | None
) -> None:
    """Scales of checkpoint input columns [start, start + size) (a row-parallel shard) into ``target``: block
    scales are cut along their column blocks; per-channel and per-tensor scales (``block`` None) cover every
    column and are read whole."""
    with torch.no_grad():
        if block is None:
            tensor = source.read().float()
            if tensor.numel() == 1:
                target.fill_(float(tensor.reshape(())))
                return
        else:
            tensor = source.read(len(source.shape) - 1, start // block[1], -(-size // block[1])).float()
        if target.numel() != tensor.numel():
            raise ValueError(f"scale of {tuple(tensor.shape)} != expected {tuple(target.shape)}")
        target.copy_(tensor.reshape(target.shape))


class _Fp8Source(WeightSource):
    """A checkpoint tensor that must be FP8: checked as each slice is read."""

    def __init__(self, source: WeightSource) -> None:
        self._source = source

    @property
    def shape(self) -> tuple[int, ...]:
        return self._source.shape

    def read(self, dim: int = 0, start: int = 0, length: int | None = None) -> torch.Tensor:
        tensor = self._source.read(dim, start, length)
        if not is_fp8_tensor(tensor):
            raise ValueError(f"expected an FP8 weight, found {tensor.dtype}")
        return tensor


class Fp8Linear(ParallelModule):
    """The FP8 form of a sharded linear layer: an e4m3 weight (N, K) (this rank's shard) and float32 scales
    ``weight_scale_inv`` per (bn × bk) block; per-channel scales are blocks (1, K).

    Subclasses pair it with the layer they replace (column- or row-parallel), which keeps its shard geometry
    and its collectives; they add how a checkpoint scale is cut. ``per_channel``: one scale per output row
    (per-channel and per-tensor checkpoints, ``--quantization fp8``) rather than 2-D blocks."""

    weight: nn.Parameter
    bias: nn.Parameter | None
    block: tuple[int, int]
    per_channel: bool

    def _use_fp8(self, block: tuple[int, int] | None, device: torch.device) -> None:
        """Replace the float weight with an empty e4m3 one of the same shape, and unit scales."""
        rows, cols = (int(d) for d in self.weight.shape)
        self.per_channel = block is None
        self.block = block or (1, cols)
        self.weight = nn.Parameter(
            torch.empty(rows, cols, dtype=FP8_DTYPE, device=device), requires_grad=False
        )
        self.weight_scale_inv = nn.Parameter(
            torch.ones(scale_shape((rows, cols), self.block), dtype=torch.float32, device=device),
            requires_grad=False,
        )

    def _quantized_from(self, weight: torch.Tensor) -> None:
        q, scale = quantize_fp8_blocks(weight.detach(), self.block)
        self.weight = nn.Parameter(q, requires_grad=False)
        self.weight_scale_inv = nn.Parameter(scale, requires_grad=False)

    def check_blocks(self, name: str, tp: TensorParallel) -> None:
        """Raise Fp8BlockSplitError (naming ``name``) when a checkpoint's scale blocks cannot be cut for this
        rank's shard."""

    def matmul(self, x: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
        if fp8_gemm_supported(x.device, self.block[1]):
            from ominix_worker.ops.fp8_gemm import fp8_linear

            return fp8_linear(x, self.weight, self.weight_scale_inv, self.block, bias)
        w = dequantize_fp8(self.weight, self.weight_scale_inv, self.block, x.dtype)
        return F.linear(x, w, bias)


# The checkpoint tensors fused into a column-parallel projection, in order (for error messages).
_FUSED_PART_NAMES = {"qkv_proj": ("q_proj", "k_proj", "v_proj"), "gate_up_proj": ("gate_proj", "up_proj")}


class Fp8ColumnParallelLinear(Fp8Linear, ColumnParallelLinear):
    """Column-parallel FP8: each fused part's rows (q, k, v or gate, up) and their scale rows are read for
    this rank's shard."""

    @classmethod
    def like(
        cls, layer: ColumnParallelLinear, block: tuple[int, int] | None, device: torch.device
    ) -> Fp8ColumnParallelLinear:
        with torch.device("meta"):
            fp8 = cls(int(layer.weight.shape[1]), layer.full_sizes, layer.parts, layer.bias is not None)
        fp8._use_fp8(block, device)
        fp8.bias = layer.bias
        return fp8

    @classmethod
    def from_linear(
        cls, layer: ColumnParallelLinear, block: tuple[int, int] | None
    ) -> Fp8ColumnParallelLinear:
        """Quantize a loaded layer (``--quantization fp8``); per-channel when ``block`` is None."""
        fp8 = cls.like(layer, block, layer.weight.device)
        fp8._quantized_from(layer.weight)
        return fp8

    def check_blocks(self, name: str, tp: TensorParallel) -> None:
        bn = 1 if self.per_channel else self.block[0]
        parts = _FUSED_PART_NAMES.get(name.rsplit(".", 1)[-1], ())
        for index, (shard, full) in enumerate(zip(self.parts, self.full_sizes, strict=True)):
            part = parts[index] if index < len(parts) else f"fused part {index}"
            what = f"FP8 layer {name}: tensor-parallel rank {tp.rank} of {tp.size} holds {part} rows"
            check_block_aligned(what, shard.start, shard.size, full, bn, self.offsets[index])

    def load_weight(self, param_name: str, source: WeightSource, part: int | None = None) -> None:
        if param_name == "weight":
            source = _Fp8Source(source)
        if param_name != "weight_scale_inv":
            super().load_weight(param_name, source, part)
            return
        index = part or 0
        shard = self.parts[index]
        bn = 1 if self.per_channel else self.block[0]
        load_row_scales(self.weight_scale_inv, source, shard.start, shard.size, self.offsets[index], bn)


class Fp8RowParallelLinear(Fp8Linear, RowParallelLinear):
    """Row-parallel FP8: this rank's input columns of the weight and, for block scales, their scale columns;
    per-channel and per-tensor scales (per output row) are read whole."""

    @classmethod
    def like(
        cls, layer: RowParallelLinear, block: tuple[int, int] | None, device: torch.device
    ) -> Fp8RowParallelLinear:
        with torch.device("meta"):
            fp8 = cls(
                layer.in_features, int(layer.weight.shape[0]), layer.bias is not None, layer.tp, layer.reduce
            )
        fp8._use_fp8(block, device)
        fp8.bias = layer.bias
        return fp8

    @classmethod
    def from_linear(cls, layer: RowParallelLinear, block: tuple[int, int] | None) -> Fp8RowParallelLinear:
        """Quantize a loaded layer (``--quantization fp8``); per-channel (over this rank's columns) when
        ``block`` is None."""
        fp8 = cls.like(layer, block, layer.weight.device)
        fp8._quantized_from(layer.weight)
        return fp8

    def check_blocks(self, name: str, tp: TensorParallel) -> None:
        if self.per_channel:
            return
        what = f"FP8 layer {name}: tensor-parallel rank {tp.rank} of {tp.size} holds input columns"
        check_block_aligned(what, self.shard.start, self.shard.size, self.in_features, self.block[1])

    def load_weight(self, param_name: str, source: WeightSource, part: int | None = None) -> None:
        if param_name == "weight":
            source = _Fp8Source(source)
        if param_name != "weight_scale_inv":
            super().load_weight(param_name, source, part)
            return
        block = None if self.per_channel else self.block
        load_column_scales(self.weight_scale_inv, source, self.shard.start, self.shard.size, block)

    def matmul_gated(
        self, gate_up: torch.Tensor, silu_and_mul: Callable[[torch.Tensor], torch.Tensor]
    ) -> torch.Tensor:
        if fp8_gemm_supported(gate_up.device, self.block[1]):
            from ominix_worker.ops.fp8_gemm import fp8_linear_gated

            return fp8_linear_gated(gate_up, self.weight, self.weight_scale_inv, self.block)
        return super().matmul_gated(gate_up, silu_and_mul)


# The FP8 form of each sharded linear layer kind.
FP8_LAYERS: dict[type[nn.Module], type[Fp8ColumnParallelLinear] | type[Fp8RowParallelLinear]] = {
    ColumnParallelLinear: Fp8ColumnParallelLinear,
    RowParallelLinear: Fp8RowParallelLinear,
}


def _quantizable(name: str, module: nn.Module, scheme: Fp8Scheme) -> bool:
    leaf = name.rsplit(".", 1)[-1]
    return (
        type(module) in FP8_LAYERS
        and leaf in QUANTIZED_PROJECTIONS
        and not any(skip in name for skip in scheme.skip)
    )


def _set_module(root: nn.Module, name: str, module: nn.Module) -> None:
    parent, _, leaf = name.rpartition(".")
    setattr(root.get_submodule(parent) if parent else root, leaf, module)


def _model_tp(model: nn.Module) -> TensorParallel:
    tp = getattr(model, "tp", SINGLE)
    return tp if isinstance(tp, TensorParallel) else SINGLE


def prepare_fp8_model(model: nn.Module, scheme: Fp8Scheme) -> None:
    """Swap the model's projections (and experts) for FP8 ones before an FP8 checkpoint is loaded into them.

    Raises Fp8BlockSplitError, naming the layer and sizes, when this rank's shard of a block-scaled layer
    does not start and end on scale block boundaries (the group size splits a block)."""
    from ominix_worker.models.moe import FusedExperts

    tp = _model_tp(model)
    for name, module in list(model.named_modules()):
        if _quantizable(name, module, scheme):
            layer = FP8_LAYERS[type(module)].like(module, scheme.block, module.weight.device)  # type: ignore[arg-type]
            layer.check_blocks(name, tp)
            _set_module(model, name, layer)
        elif isinstance(module, FusedExperts):
            module.use_fp8(scheme.block, name)


def quantize_model(model: nn.Module, scheme: Fp8Scheme) -> None:
    """Quantize a loaded model's projections and experts in place (``--quantization fp8``). Under tensor
    parallelism each rank quantizes its own shard (per-channel scales over the columns it holds)."""
    from ominix_worker.models.moe import FusedExperts

    for name, module in list(model.named_modules()):
        if _quantizable(name, module, scheme):
            _set_module(model, name, FP8_LAYERS[type(module)].from_linear(module, scheme.block))  # type: ignore[arg-type]
        elif isinstance(module, FusedExperts):
            module.quantize_fp8(scheme.block)


def fp8_checkpoint_names(
    weights: Iterable[tuple[str, torch.Tensor | WeightSource]],
) -> Iterator[tuple[str, torch.Tensor | WeightSource]]:
    """An FP8 checkpoint's tensors under the names the FP8 layers load: ``weight_scale`` (per tensor or per
    channel) becomes ``weight_scale_inv`` (both multiply the e4m3 values); static activation scales are
    dropped (activations are scaled per token at run time)."""
    for name, weight in weights:
        if name.endswith(".input_scale"):
            continue
        if name.endswith(".weight_scale"):
            name = f"{name}_inv"
        yield name, weight


def is_fp8_tensor(tensor: torch.Tensor) -> bool:
    return tensor.dtype in (torch.float8_e4m3fn, torch.float8_e5m2)
