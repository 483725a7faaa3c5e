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

import re
from collections.abc import Iterable, Iterator
from dataclasses import dataclass
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

FP8_DTYPE = torch.float8_e4m3fn
FP8_MAX = float(torch.finfo(FP8_DTYPE).max)  # 448
SCALE_SUFFIXES = (".weight_scale_inv", ".weight_scale")
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


def fp8_gemm_supported(device: torch.device) -> bool:
    """FP8 tensor cores: compute capability 8.9 (Ada) or newer."""
    return device.type == "cuda" and torch.cuda.get_device_capability(device) >= (8, 9)


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


class Fp8Linear(nn.Module):
    """A bias-optional linear layer with an e4m3 weight (N, K) and float32 block scales."""

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
        self.shard_sizes = shard_sizes or (out_features,)  # output rows per checkpoint tensor (fused q/k/v)
        self.weight = nn.Parameter(
            torch.empty(out_features, in_features, dtype=FP8_DTYPE), requires_grad=False
        )
        # A buffer, not a parameter: the checkpoint's scales are loaded and checked apart from the weights.
        self.register_buffer(
            "weight_scale_inv",
            torch.ones(scale_shape((out_features, in_features), block), dtype=torch.float32),
        )
        self.bias = nn.Parameter(torch.empty(out_features)) if bias else None
        self.scales_loaded: set[int] = set()

    @classmethod
    def from_linear(cls, linear: nn.Linear, block: tuple[int, int] | None) -> Fp8Linear:
        """Quantize a loaded linear layer (``--quantization fp8``); per-channel when ``block`` is None."""
        w = linear.weight.detach()
        block = block or (1, w.shape[1])
        layer = cls.__new__(cls)
        nn.Module.__init__(layer)
        layer.in_features, layer.out_features, layer.block = w.shape[1], w.shape[0], block
        layer.shard_sizes = (w.shape[0],)
        q, scale = quantize_fp8_blocks(w, block)
        layer.weight = nn.Parameter(q, requires_grad=False)
        layer.register_buffer("weight_scale_inv", scale)
        layer.bias = linear.bias
        layer.scales_loaded = {0}
        return layer

    def load_scale(self, shard: int | None, tensor: torch.Tensor) -> None:
        index = shard or 0
        offset = sum(self.shard_sizes[:index])
        with torch.no_grad():
            _load_scale_rows(
                self.weight_scale_inv, tensor.float(), offset, self.shard_sizes[index], self.block
            )
        self.scales_loaded.add(index)

    def missing_scales(self) -> int:
        return len(self.shard_sizes) - len(self.scales_loaded)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if fp8_gemm_supported(x.device):
            from ominix_worker.ops.fp8_gemm import fp8_linear

            return fp8_linear(x, self.weight, self.weight_scale_inv, self.block, self.bias)
        w = dequantize_fp8(self.weight, self.weight_scale_inv, self.block, x.dtype)
        return F.linear(x, w, self.bias)


def _quantizable(name: str, module: nn.Module, scheme: Fp8Scheme) -> bool:
    leaf = name.rsplit(".", 1)[-1]
    return (
        type(module) is nn.Linear
        and leaf in QUANTIZED_PROJECTIONS
        and not any(skip in name for skip in scheme.skip)
    )


def _set_module(root: nn.Module, name: str, module: nn.Module) -> None:
    parent, _, leaf = name.rpartition(".")
    setattr(root.get_submodule(parent) if parent else root, leaf, module)


def prepare_fp8_model(model: nn.Module, scheme: Fp8Scheme, shard_sizes: Any) -> None:
    """Swap the model's projections (and experts) for FP8 ones before an FP8 checkpoint is loaded into them.

    ``shard_sizes(name)`` gives the checkpoint rows (q, k, v) that make up the fused projection ``name``."""
    from ominix_worker.models.moe import FusedExperts

    for name, module in list(model.named_modules()):
        if _quantizable(name, module, scheme):
            assert isinstance(module, nn.Linear)
            sizes: tuple[int, ...] = ()
            if name.endswith("qkv_proj"):
                sizes = tuple(shard_sizes(name))
            elif name.endswith("gate_up_proj"):  # dense MLP or shared expert: [gate | up], equal halves
                sizes = (module.out_features // 2,) * 2
            layer = Fp8Linear(
                module.in_features,
                module.out_features,
                module.bias is not None,
                scheme.block_for((module.out_features, module.in_features)),
                sizes,
            )
            _set_module(model, name, layer)
        elif isinstance(module, FusedExperts):
            module.use_fp8(scheme.block)


def quantize_model(model: nn.Module, scheme: Fp8Scheme) -> None:
    """Quantize a loaded model's projections and experts in place (``--quantization fp8``)."""
    from ominix_worker.models.moe import FusedExperts

    for name, module in list(model.named_modules()):
        if _quantizable(name, module, scheme):
            assert isinstance(module, nn.Linear)
            _set_module(model, name, Fp8Linear.from_linear(module, scheme.block))
        elif isinstance(module, FusedExperts):
            module.quantize_fp8(scheme.block)


def split_scales(
    weights: Iterable[tuple[str, torch.Tensor]], scales: dict[str, torch.Tensor]
) -> Iterator[tuple[str, torch.Tensor]]:
    """Yields the weights; scale tensors (and unused static input scales) are collected into ``scales``."""
    for name, tensor in weights:
        if name.endswith(SCALE_SUFFIXES):
            scales[name] = tensor
        elif name.endswith(".input_scale"):
            continue  # dynamic activation scales are computed per token
        else:
            yield name, tensor


def is_fp8_tensor(tensor: torch.Tensor) -> bool:
    return tensor.dtype in (torch.float8_e4m3fn, torch.float8_e5m2)


def checkpoint_tensor(
    name: str, tensor: torch.Tensor, device: torch.device, dtype: torch.dtype
) -> torch.Tensor:
    """A checkpoint tensor on ``device``: FP8 values keep their dtype, scales become float32, the rest ``dtype``."""
    if is_fp8_tensor(tensor):
        return tensor.to(device)
    if name.endswith(SCALE_SUFFIXES):
        return tensor.to(device=device, dtype=torch.float32)
    return tensor.to(device=device, dtype=dtype)


# layers.<i>.mlp.experts.<e>.<projection> (Mixtral's block_sparse_moe renamed to mlp first)
_EXPERT_SCALE_RE = re.compile(r"^layers\.(\d+)\.mlp\.experts\.(\d+)\.(\w+)$")
_FUSED_LEAVES = {
    "q_proj": ("qkv_proj", 0),
    "k_proj": ("qkv_proj", 1),
    "v_proj": ("qkv_proj", 2),
    "gate_proj": ("gate_up_proj", 0),
    "up_proj": ("gate_up_proj", 1),
}


def load_scales(model: nn.Module, scales: dict[str, torch.Tensor]) -> None:
    """Put each checkpoint scale into its FP8 module (fused shards and stacked experts included); raises
    ValueError when a scale has no FP8 module or an FP8 module lacks a scale."""
    from ominix_worker.models.moe import EXPERT_PARTS, FusedExperts

    for hf_name, tensor in scales.items():
        path = hf_name.removeprefix("model.").replace(".block_sparse_moe.", ".mlp.")
        path = path[: path.rindex(".weight_scale")]
        expert = _EXPERT_SCALE_RE.match(path)
        if expert is not None:
            module = model.get_submodule(f"layers.{expert.group(1)}.mlp.experts")
            if not isinstance(module, FusedExperts) or expert.group(3) not in EXPERT_PARTS:
                raise ValueError(f"unexpected scale {hf_name!r}")
            module.load_scale(int(expert.group(2)), EXPERT_PARTS[expert.group(3)], tensor)
            continue
        parent, _, leaf = path.rpartition(".")
        shard = None
        if leaf in _FUSED_LEAVES:
            leaf, shard = _FUSED_LEAVES[leaf]
        try:
            module = model.get_submodule(f"{parent}.{leaf}")
        except AttributeError:
            raise ValueError(f"unexpected scale {hf_name!r}") from None
        if not isinstance(module, Fp8Linear):
            raise ValueError(f"scale {hf_name!r} belongs to a module that is not FP8")
        module.load_scale(shard, tensor)
    missing = [
        name
        for name, module in model.named_modules()
        if isinstance(module, (Fp8Linear, FusedExperts)) and module.missing_scales()
    ]
    if missing:
        raise ValueError(f"{len(missing)} FP8 modules lack weight scales, e.g. {', '.join(missing[:3])}")
