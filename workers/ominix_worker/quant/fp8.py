"""FP8 (e4m3) weights: Hugging Face FP8 checkpoints and quantization of bf16 weights at load.

One representation covers the three scale layouts checkpoints ship: a weight (N, K) in float8_e4m3fn with a
float32 scale per (bn × bk) block, shape (ceil(N / bn), ceil(K / bk)); the real weight is ``q · scale``.
- block-scaled (``weight_block_size`` [128, 128], scales named ``weight_scale_inv``): block (128, 128);
- per-channel (one scale per output row): block (1, K);
- per-tensor (one scale): stored as per-channel, every row of the tensor (or of its shard in a fused
  projection such as q/k/v) holding the same value.
``--quantization fp8`` quantizes bf16 weights per channel (dynamic per-token activation scales at run time).

Which GEMM runs (``Fp8Linear.forward``): on GPUs with FP8 tensor cores (compute capability 8.9+, Hopper) a
W8A8 GEMM: ``torch._scaled_mm`` for per-channel weights (activations quantized per token), the Triton block
kernel (``ops/fp8_gemm.py``) for block scales (activations quantized per token and 128-column group);
elsewhere, the CPU included, the weight is dequantized to the run dtype for each call (the reference path).
"""

from __future__ import annotations

from collections.abc import Iterable, Iterator
from dataclasses import dataclass
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

from ominix_worker.parallel import ColumnParallelLinear, ParallelModule, RowParallelLinear, WeightSource

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


def _load_scale_rows(
    target: torch.Tensor, tensor: torch.Tensor, row_offset: int, rows: int, block: tuple[int, int]
) -> None:
    """Copy a checkpoint scale for output rows [row_offset, row_offset + rows) into ``target``'s scale rows."""
    if block[0] == 1 and tensor.numel() == 1:  # per-tensor scale into per-channel storage
        target.narrow(0, row_offset, rows).fill_(float(tensor.reshape(())))
        return
    bn = block[0]
    if row_offset % bn:
        raise ValueError(f"a shard starting at row {row_offset} does not start on a {bn}-row scale block")
    part = target.narrow(0, row_offset // bn, -(-rows // bn))
    if part.numel() != tensor.numel():
        raise ValueError(f"scale of {tuple(tensor.shape)} != expected {tuple(part.shape)}")
    part.copy_(tensor.reshape(part.shape))


class Fp8Linear(ParallelModule):
    """A bias-optional linear layer with an e4m3 weight (N, K) and float32 block scales ``weight_scale_inv``.

    It loads like the layer it replaces: ``shard_sizes`` are the output rows of the checkpoint tensors fused
    into it (q, k, v or gate, up), and each arrives as one part of ``weight``, ``weight_scale_inv`` and
    ``bias``, so a missing scale is a missing weight key."""

    def __init__(
        self,
        in_features: int,
        out_features: int,
        bias: bool,
        block: tuple[int, int],
        shard_sizes: tuple[int, ...] = (),
    ) -> None:
        super().__init__()
        self.in_features = in_features
        self.out_features = out_features
        self.block = block
        self.shard_sizes = shard_sizes or (out_features,)
        self.weight = nn.Parameter(
            torch.empty(out_features, in_features, dtype=FP8_DTYPE), requires_grad=False
        )
        self.weight_scale_inv = nn.Parameter(
            torch.ones(scale_shape((out_features, in_features), block), dtype=torch.float32),
            requires_grad=False,
        )
        self.bias = nn.Parameter(torch.empty(out_features)) if bias else None

    @classmethod
    def from_linear(cls, linear: nn.Module, block: tuple[int, int] | None) -> Fp8Linear:
        """Quantize a loaded linear layer (``--quantization fp8``); per-channel when ``block`` is None."""
        w = linear.weight.detach()
        block = block or (1, w.shape[1])
        bias = getattr(linear, "bias", None)
        layer = cls(w.shape[1], w.shape[0], bias is not None, block, _shard_sizes(linear))
        q, scale = quantize_fp8_blocks(w, block)
        layer.weight = nn.Parameter(q, requires_grad=False)
        layer.weight_scale_inv = nn.Parameter(scale, requires_grad=False)
        layer.bias = bias
        return layer

    def num_parts(self, param_name: str) -> int:
        return len(self.shard_sizes)

    def load_weight(self, param_name: str, source: WeightSource, part: int | None = None) -> None:
        index = part or 0
        offset, rows = sum(self.shard_sizes[:index]), self.shard_sizes[index]
        tensor = source.read()
        with torch.no_grad():
            if param_name == "weight_scale_inv":
                _load_scale_rows(self.weight_scale_inv, tensor.float(), offset, rows, self.block)
                return
            if param_name == "weight" and not is_fp8_tensor(tensor):
                raise ValueError(f"expected an FP8 weight, found {tensor.dtype}")
            param = self.weight if param_name == "weight" else self.bias
            assert param is not None, f"no {param_name} in this layer"
            target = param.narrow(0, offset, rows)
            if tuple(target.shape) != tuple(tensor.shape):
                raise ValueError(
                    f"{param_name}: shape {tuple(tensor.shape)} != expected {tuple(target.shape)}"
                )
            target.copy_(tensor)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if fp8_gemm_supported(x.device, self.block[1]):
            from ominix_worker.ops.fp8_gemm import fp8_linear

            return fp8_linear(x, self.weight, self.weight_scale_inv, self.block, self.bias)
        w = dequantize_fp8(self.weight, self.weight_scale_inv, self.block, x.dtype)
        return F.linear(x, w, self.bias)


def _shard_sizes(linear: nn.Module) -> tuple[int, ...]:
    """Output rows per fused checkpoint tensor of a column-parallel layer (one part otherwise)."""
    if isinstance(linear, ColumnParallelLinear):
        return tuple(part.size for part in linear.parts)
    return (int(linear.weight.shape[0]),)


def _quantizable(name: str, module: nn.Module, scheme: Fp8Scheme) -> bool:
    leaf = name.rsplit(".", 1)[-1]
    return (
        isinstance(module, (ColumnParallelLinear, RowParallelLinear))
        and leaf in QUANTIZED_PROJECTIONS
        and not any(skip in name for skip in scheme.skip)
    )


def _single_rank(model: nn.Module) -> None:
    tp = getattr(model, "tp", None)
    if tp is not None and tp.size > 1:
        raise ValueError("FP8 weights under tensor parallelism are not supported yet")


def _set_module(root: nn.Module, name: str, module: nn.Module) -> None:
    parent, _, leaf = name.rpartition(".")
    setattr(root.get_submodule(parent) if parent else root, leaf, module)


def prepare_fp8_model(model: nn.Module, scheme: Fp8Scheme) -> None:
    """Swap the model's projections (and experts) for FP8 ones before an FP8 checkpoint is loaded into them."""
    from ominix_worker.models.moe import FusedExperts

    _single_rank(model)
    for name, module in list(model.named_modules()):
        if _quantizable(name, module, scheme):
            weight = module.weight
            layer = Fp8Linear(
                int(weight.shape[1]),
                int(weight.shape[0]),
                getattr(module, "bias", None) is not None,
                scheme.block_for((int(weight.shape[0]), int(weight.shape[1]))),
                _shard_sizes(module),
            )
            _set_module(model, name, layer)
        elif isinstance(module, FusedExperts):
            module.use_fp8(scheme.block)


def quantize_model(model: nn.Module, scheme: Fp8Scheme) -> None:
    """Quantize a loaded model's projections and experts in place (``--quantization fp8``)."""
    from ominix_worker.models.moe import FusedExperts

    _single_rank(model)
    for name, module in list(model.named_modules()):
        if _quantizable(name, module, scheme):
            _set_module(model, name, Fp8Linear.from_linear(module, scheme.block))
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
