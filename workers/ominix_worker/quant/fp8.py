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

import contextlib
import math
import re
from collections.abc import Callable, Iterable, Iterator, Sequence
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
# norms and routers stay in the run dtype (a router a checkpoint stores in FP8 is dequantized as it loads:
# ``dequantize_checkpoint_weight``).
QUANTIZED_PROJECTIONS = ("qkv_proj", "o_proj", "gate_up_proj", "down_proj")


class Fp8ConfigError(ValueError):
    """A quantization_config this loader cannot serve."""


@dataclass(frozen=True, slots=True)
class Fp8Scheme:
    """How a model's FP8 weights are scaled: ``block`` (rows, columns) per scale, or None for per-channel."""

    block: tuple[int, int] | None = None
    # modules_to_not_convert: transformers' module names (or patterns, see ``NotConverted``) left unquantized
    skip: tuple[str, ...] = ()

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
    listed = quantization.get("modules_to_not_convert")
    if listed is None:  # the older key, read by transformers when the new one is absent
        listed = quantization.get("ignored_layers")
    skip = tuple(str(m) for m in listed or ())
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


def dequantize_checkpoint_weight(
    q: torch.Tensor, scale: torch.Tensor, block: tuple[int, int] | None, dtype: torch.dtype
) -> torch.Tensor:
    """An FP8 checkpoint matrix (N, K) and its scale, in any layout checkpoints ship, as a ``dtype`` matrix:
    a block scale (ceil(N / bn), ceil(K / bk)) for the checkpoint's ``block``, one scale per output row ((N,)
    or (N, 1)), or one for the tensor. For weights that run in the model dtype (MoE routers)."""
    if q.dim() != 2 or not is_fp8_tensor(q):
        raise ValueError(f"expected an FP8 matrix, found {q.dtype} of shape {tuple(q.shape)}")
    rows, cols = (int(d) for d in q.shape)
    if scale.numel() == 1:
        tile = (rows, cols)
    elif block is not None and tuple(scale.shape) == scale_shape((rows, cols), block):
        tile = block
    elif tuple(scale.shape) in ((rows,), (rows, 1)):
        tile = (1, cols)
    else:
        expected = f"{scale_shape((rows, cols), block)} for blocks {block}, " if block is not None else ""
        raise ValueError(
            f"a scale of shape {tuple(scale.shape)} does not fit an FP8 weight of shape {(rows, cols)} "
            f"(expected {expected}({rows},) or (1,))"
        )
    return dequantize_fp8(q, scale.float().reshape(scale_shape((rows, cols), tile)), tile, dtype)


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
            raise ValueError(f"expected an FP8 weight, found {tensor.dtype}{NOT_LISTED}")
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


def _holder(tp: TensorParallel) -> str:
    """Who holds the rows a block check is about: a rank of a group, or the one worker (whose layer then does
    not divide into the checkpoint's blocks at all)."""
    return f"tensor-parallel rank {tp.rank} of {tp.size} holds" if tp.size > 1 else "the layer has"


def _remedy(tp: TensorParallel) -> str:
    return (
        "a tensor-parallel size that keeps them, or a per-channel checkpoint"
        if tp.size > 1
        else "a per-channel checkpoint (these blocks do not fit the model's own shapes)"
    )


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
            what = f"FP8 layer {name}: {_holder(tp)} {part} rows"
            check_block_aligned(what, shard.start, shard.size, full, bn, self.offsets[index], _remedy(tp))

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
        what = f"FP8 layer {name}: {_holder(tp)} input columns"
        check_block_aligned(
            what, self.shard.start, self.shard.size, self.in_features, self.block[1], None, _remedy(tp)
        )

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


# Why a checkpoint's float weight is refused where the model expects FP8.
NOT_LISTED = (
    " (a layer an FP8 checkpoint leaves unquantized must be listed in quantization_config."
    "modules_to_not_convert, by its transformers module name such as model.layers.0.self_attn)"
)


class NotConverted:
    """``modules_to_not_convert`` read as transformers reads it, against transformers' module names
    (``model.layers.0.self_attn.q_proj``, ``model.layers.0.mlp.experts``, ``lm_head``).

    An entry lists a module when it matches the start of the name as a regular expression and the match ends
    on a module boundary (``model.layers.1`` lists ``model.layers.1.mlp`` but not ``model.layers.11.mlp``;
    ``model.layers.*.self_attn`` lists every layer's attention), or when the name ends with the entry as plain
    text (``lm_head``, ``down_proj``). Mixtral entries are renamed first as transformers renames them
    (``block_sparse_moe`` → ``mlp``). An entry that is no regular expression is refused."""

    def __init__(self, entries: Sequence[str], arch: str = "") -> None:
        self.entries: tuple[str, ...] = tuple(
            f"{entry}.".replace(".block_sparse_moe.", ".mlp.", 1)[:-1] if arch == "mixtral" else entry
            for entry in entries
        )
        # Each entry, then ending on a boundary: its last character is a dot, or a dot or the end follows.
        alternatives = [f"(?:{entry})(?:(?<=[.])|(?=[.]|\\Z))" for entry in self.entries]
        self._patterns: list[re.Pattern[str]] = []
        for entry, alternative in zip(self.entries, alternatives, strict=True):
            try:
                self._patterns.append(re.compile(alternative))
            except re.error as exc:
                raise Fp8ConfigError(
                    f"quantization_config.modules_to_not_convert entry {entry!r} is not a pattern: {exc}"
                ) from None
        # One pattern for all (a model has thousands of expert names to try), unless an entry refers to its own
        # groups, which numbering them all together would change, or names one another entry names too.
        if len(alternatives) > 1 and not any(re.search(r"\\[1-9]|\(\?P=|\(\?\(", e) for e in self.entries):
            with contextlib.suppress(re.error):
                self._patterns = [re.compile("|".join(alternatives))]

    def lists(self, module: str) -> bool:
        return module.endswith(self.entries) or any(p.match(module) is not None for p in self._patterns)

    def leaves_unquantized(self, layer: str, parts: Sequence[str], whole: str | None = None) -> bool:
        """Whether our ``layer``, which holds the checkpoint modules ``parts`` (several when it fuses them),
        stays unquantized: every part listed (or ``whole``, transformers' one module for all of them). None
        listed: FP8. Some but not all: Fp8ConfigError, as one layer cannot mix FP8 and float parts."""
        if not self.entries:
            return False
        if whole is not None and self.lists(whole):
            return True
        listed = [part for part in parts if self.lists(part)]
        if not listed or len(listed) == len(parts):
            return bool(listed)
        unlisted = [part for part in parts if part not in set(listed)]

        def few(names: list[str]) -> str:
            return ", ".join(names[:4]) + (f" and {len(names) - 4} more" if len(names) > 4 else "")

        raise Fp8ConfigError(
            f"quantization_config.modules_to_not_convert leaves {few(listed)} unquantized but not "
            f"{few(unlisted)}, which {layer} holds as one layer: list all of them, or none"
        )


def hf_module_names(name: str) -> tuple[str, ...]:
    """transformers' names of the checkpoint modules our module ``name`` holds (``layers.0.self_attn.qkv_proj``
    → ``model.layers.0.self_attn.q_proj``, ``…k_proj``, ``…v_proj``)."""
    parent, _, leaf = name.rpartition(".")
    hf_parent = f"model.{parent}" if parent else "model"
    return tuple(f"{hf_parent}.{part}" for part in _FUSED_PART_NAMES.get(leaf, (leaf,)))


def _expert_projection_names(arch: str) -> tuple[str, str, str]:
    return ("w1", "w3", "w2") if arch == "mixtral" else ("gate_proj", "up_proj", "down_proj")


def experts_left_unquantized(name: str, num_experts: int, skip: NotConverted, arch: str = "") -> bool:
    """Whether the stacked experts ``name`` (``layers.0.mlp.experts``) stay unquantized: transformers' experts
    module (``model.layers.0.mlp.experts``) listed, or every expert's projections as checkpoints name them
    (``model.layers.0.mlp.experts.3.gate_proj``); some of those but not all is refused."""
    whole = f"model.{name}"
    parts = [f"{whole}.{e}.{p}" for e in range(num_experts) for p in _expert_projection_names(arch)]
    return skip.leaves_unquantized(name, parts, whole)


def _quantizable(name: str, module: nn.Module, skip: NotConverted) -> bool:
    leaf = name.rsplit(".", 1)[-1]
    return (
        type(module) in FP8_LAYERS
        and leaf in QUANTIZED_PROJECTIONS
        and not skip.leaves_unquantized(name, hf_module_names(name))
    )


def _not_converted(model: nn.Module, scheme: Fp8Scheme) -> tuple[NotConverted, str]:
    arch = str(getattr(getattr(model, "config", None), "arch", ""))
    return NotConverted(scheme.skip, arch), arch


def _set_module(root: nn.Module, name: str, module: nn.Module) -> None:
    parent, _, leaf = name.rpartition(".")
    setattr(root.get_submodule(parent) if parent else root, leaf, module)


def _model_tp(model: nn.Module) -> TensorParallel:
    tp = getattr(model, "tp", SINGLE)
    return tp if isinstance(tp, TensorParallel) else SINGLE


def prepare_fp8_model(model: nn.Module, scheme: Fp8Scheme) -> None:
    """Swap the model's projections (and experts) for FP8 ones before an FP8 checkpoint is loaded into them.

    Layers whose checkpoint modules ``modules_to_not_convert`` lists (``NotConverted``) stay in the run dtype;
    Fp8ConfigError when it lists some of the modules one fused layer holds (q_proj but not k_proj) but not all.
    Raises Fp8BlockSplitError, naming the layer and sizes, when this rank's shard of a block-scaled layer
    does not start and end on scale block boundaries (the group size splits a block)."""
    from ominix_worker.models.moe import FusedExperts

    tp = _model_tp(model)
    skip, arch = _not_converted(model, scheme)
    for name, module in list(model.named_modules()):
        if _quantizable(name, module, skip):
            layer = FP8_LAYERS[type(module)].like(module, scheme.block, module.weight.device)
            layer.check_blocks(name, tp)
            _set_module(model, name, layer)
        elif isinstance(module, FusedExperts) and not experts_left_unquantized(
            name, module.num_global_experts, skip, arch
        ):
            module.use_fp8(scheme.block, name)


def quantize_model(model: nn.Module, scheme: Fp8Scheme) -> None:
    """Quantize a loaded model's projections and experts in place (``--quantization fp8``). Under tensor
    parallelism each rank quantizes its own shard (per-channel scales over the columns it holds)."""
    from ominix_worker.models.moe import FusedExperts

    skip, arch = _not_converted(model, scheme)
    for name, module in list(model.named_modules()):
        if _quantizable(name, module, skip):
            _set_module(model, name, FP8_LAYERS[type(module)].from_linear(module, scheme.block))
        elif isinstance(module, FusedExperts) and not experts_left_unquantized(
            name, module.num_global_experts, skip, arch
        ):
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
