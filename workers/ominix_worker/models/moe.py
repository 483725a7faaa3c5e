"""Mixture-of-experts decoders: Qwen3-MoE, Qwen2-MoE (with its gated shared expert) and Mixtral.

Attention, norms, rotary and the dense MLP are the Llama-family ones (``models/llama.py``); only the MLP of
the sparse layers (``config.moe_layers``) changes: a router picks the top-k experts per token and
``FusedExperts`` runs them. Expert weights are stacked per layer, ``w13`` (E, 2I, H) [gate rows | up rows]
and ``w2`` (E, H, I).

In a tensor-parallel group (``tp.moe``, ``--moe-parallel``) a rank holds either every expert's slice of I
(TENSOR: w13's gate and up rows and w2's columns split like the dense MLP) or E / size whole experts (EXPERT:
a slice of dim 0; assignments routed to other ranks' experts contribute zero). The router and Qwen2-MoE's
shared-expert gate are replicated, the shared expert is split like the dense MLP, and the layer's partial
sums (routed and shared) meet in one all-reduce, as the dense MLP's down projection does.
"""

from __future__ import annotations

import re
from collections.abc import Iterable, Iterator
from dataclasses import replace
from types import ModuleType
from typing import ClassVar

import torch
from torch import nn

from ominix_worker.config import ModelConfig
from ominix_worker.models.llama import MLP, LlamaForCausalLM
from ominix_worker.ops.moe_ref import fused_experts_ref, select_experts
from ominix_worker.parallel import (
    SINGLE,
    ColumnParallelLinear,
    ParallelModule,
    TensorParallel,
    WeightSource,
    as_weight_source,
)

_FUSED_MOE: ModuleType | None = None
_FUSED_MOE_TRIED = False


def fused_moe_ops(x: torch.Tensor) -> ModuleType | None:
    """The Triton fused MoE (``ops/fused_moe.py``) for CUDA tensors; None on other devices or without triton."""
    global _FUSED_MOE, _FUSED_MOE_TRIED
    if not x.is_cuda:
        return None
    if not _FUSED_MOE_TRIED:
        _FUSED_MOE_TRIED = True
        try:
            from ominix_worker.ops import fused_moe

            _FUSED_MOE = fused_moe
        except ImportError:
            _FUSED_MOE = None
    return _FUSED_MOE


class FusedExperts(nn.Module):
    """E SiLU-gated experts as two stacked weights; ``forward`` applies the routed, weighted sum.

    Under tensor parallelism the stacks hold this rank's share (``tp.experts``, ``tp.expert_intermediate``)
    and ``forward`` returns the rank's partial sum; the caller reduces it. ``num_experts`` and
    ``intermediate_size`` are the local sizes, ``num_global_experts`` the router's width.

    In FP8 (``use_fp8`` before an FP8 checkpoint loads, ``quantize_fp8`` after a bf16 one) the weights are
    e4m3 with float32 scale buffers ``w13_scale``/``w2_scale`` (E, rows / block, columns / block)."""

    def __init__(
        self, num_experts: int, hidden_size: int, intermediate_size: int, tp: TensorParallel = SINGLE
    ) -> None:
        super().__init__()
        self.num_global_experts = num_experts
        self.full_intermediate_size = intermediate_size
        self.expert_range = tp.experts(num_experts)
        self.intermediate_range = tp.expert_intermediate(intermediate_size)
        self.num_experts = num_experts = self.expert_range.size
        self.hidden_size = hidden_size
        self.intermediate_size = intermediate_size = self.intermediate_range.size
        # Global expert id → local index, -1 for another rank's expert (expert parallelism only); filled by
        # ``build_expert_map`` once the module is on its device.
        self.expert_map: torch.Tensor | None
        self.register_buffer("expert_map", None, persistent=False)
        self.w13_weight = nn.Parameter(torch.empty(num_experts, 2 * intermediate_size, hidden_size))
        self.w2_weight = nn.Parameter(torch.empty(num_experts, hidden_size, intermediate_size))
        self.w13_scale: torch.Tensor | None
        self.w2_scale: torch.Tensor | None
        self.register_buffer("w13_scale", None)  # set by use_fp8 / quantize_fp8
        self.register_buffer("w2_scale", None)
        self.w13_block = self.w2_block = (0, 0)
        self.per_channel = False
        self.tp = tp

    # ---- FP8 ---------------------------------------------------------------------------------------

    @property
    def is_fp8(self) -> bool:
        return self.w13_scale is not None

    def _blocks(self, block: tuple[int, int] | None) -> None:
        # Per-channel (block None): one scale per output row, all columns.
        self.per_channel = block is None
        self.w13_block = block or (1, self.hidden_size)
        self.w2_block = block or (1, self.intermediate_size)

    def check_blocks(self, name: str) -> None:
        """Block scales are cut with the intermediate dimension (TENSOR): this rank's rows of gate and up and
        columns of down must start and end on scale block boundaries (Fp8BlockSplitError names the layer)."""
        from ominix_worker.quant.fp8 import check_block_aligned

        if self.per_channel:
            return
        rows, full, tp = self.intermediate_range, self.full_intermediate_size, self.tp
        what = f"FP8 experts {name}: tensor-parallel rank {tp.rank} of {tp.size} holds intermediate rows"
        remedy = "--moe-parallel expert (whole experts per rank) or a tensor-parallel size that keeps them"
        # gate rows at local offset 0, up rows after them, down's columns
        check_block_aligned(what, rows.start, rows.size, full, self.w13_block[0], 0, remedy)
        check_block_aligned(what, rows.start, rows.size, full, self.w13_block[0], rows.size, remedy)
        check_block_aligned(what, rows.start, rows.size, full, self.w2_block[1], None, remedy)

    def use_fp8(self, block: tuple[int, int] | None, name: str = "experts") -> None:
        """Empty FP8 weights and unit scales, for an FP8 checkpoint to load into."""
        from ominix_worker.quant.fp8 import FP8_DTYPE, scale_shape

        self._blocks(block)
        self.check_blocks(name)
        device = self.w13_weight.device
        self.w13_weight = nn.Parameter(
            torch.empty(self.w13_weight.shape, dtype=FP8_DTYPE, device=device), False
        )
        self.w2_weight = nn.Parameter(
            torch.empty(self.w2_weight.shape, dtype=FP8_DTYPE, device=device), False
        )
        self.register_buffer("w13_scale", torch.ones(scale_shape(tuple(self.w13_weight.shape), self.w13_block),
                                                     device=device))  # fmt: skip
        self.register_buffer("w2_scale", torch.ones(scale_shape(tuple(self.w2_weight.shape), self.w2_block),
                                                    device=device))  # fmt: skip

    def quantize_fp8(self, block: tuple[int, int] | None) -> None:
        """Quantize the loaded weights in place, one expert at a time (bounded extra memory)."""
        from ominix_worker.quant.fp8 import FP8_DTYPE, quantize_fp8_blocks, scale_shape

        self._blocks(block)
        for attr, scale_attr, blk in (
            ("w13_weight", "w13_scale", self.w13_block),
            ("w2_weight", "w2_scale", self.w2_block),
        ):
            full = getattr(self, attr)
            q = torch.empty(full.shape, dtype=FP8_DTYPE, device=full.device)
            scale = torch.empty(scale_shape(tuple(full.shape), blk), dtype=torch.float32, device=full.device)
            for e in range(self.num_experts):
                q[e], scale[e] = quantize_fp8_blocks(full[e].detach(), blk)
            delattr(self, attr)
            setattr(self, attr, nn.Parameter(q, requires_grad=False))
            self.register_buffer(scale_attr, scale)

    def load_scale(self, expert: int, part: str, source: WeightSource) -> str | None:
        """Read this rank's share of one expert projection's checkpoint scale (the scale rows of its gate/up
        rows, the scale columns of its down columns) into its slice; returns its load key, None (nothing
        read) when another rank holds the expert."""
        from ominix_worker.quant.fp8 import load_column_scales, load_row_scales

        if self.w13_scale is None or self.w2_scale is None:
            raise ValueError("a weight scale for experts that are not FP8")
        local = self.local_expert(expert)
        if local is None:
            return None
        rows, size = self.intermediate_range, self.intermediate_size
        if part == "down":
            block = None if self.per_channel else self.w2_block
            load_column_scales(self.w2_scale[local], source, rows.start, rows.size, block)
            return f"w2_scale#{expert}"
        shard = 0 if part == "gate" else 1
        bn = self.w13_block[0]
        load_row_scales(self.w13_scale[local], source, rows.start, rows.size, shard * size, bn)
        return f"w13_scale#{expert}.{shard}"

    # ---- expert parallelism ------------------------------------------------------------------------

    @property
    def holds_all_experts(self) -> bool:
        return self.num_experts == self.num_global_experts

    def build_expert_map(self, device: torch.device) -> None:
        if self.holds_all_experts:
            return
        expert_map = torch.full((self.num_global_experts,), -1, dtype=torch.int32)
        start, size = self.expert_range.start, self.expert_range.size
        expert_map[start : start + size] = torch.arange(size, dtype=torch.int32)
        self.register_buffer("expert_map", expert_map.to(device), persistent=False)

    def local_expert(self, expert: int) -> int | None:
        """The local index of global expert ``expert``; None when another rank holds it."""
        local = expert - self.expert_range.start
        return local if 0 <= local < self.num_experts else None

    # ---- compute -----------------------------------------------------------------------------------

    def expert_weights(
        self, expert: int, dtype: torch.dtype | None = None
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """Expert ``expert``'s (w13, w2) in the run dtype (the reference path's view of one expert)."""
        if self.w13_scale is None or self.w2_scale is None:
            return self.w13_weight[expert], self.w2_weight[expert]
        from ominix_worker.quant.fp8 import dequantize_fp8

        dtype = dtype or torch.bfloat16
        return (
            dequantize_fp8(self.w13_weight[expert], self.w13_scale[expert], self.w13_block, dtype),
            dequantize_fp8(self.w2_weight[expert], self.w2_scale[expert], self.w2_block, dtype),
        )

    def forward(self, x: torch.Tensor, topk_weights: torch.Tensor, topk_ids: torch.Tensor) -> torch.Tensor:
        """This rank's share of the routed sum: every token's assignments to the experts it holds."""
        expert_map = self.expert_map
        if not self.holds_all_experts and expert_map is None:
            raise RuntimeError("build_expert_map() was not called")
        ops = fused_moe_ops(x)
        if ops is None:
            local_ids = topk_ids if expert_map is None else expert_map[topk_ids.long()]
            return fused_experts_ref(
                x, lambda e: self.expert_weights(e, x.dtype), self.num_experts, topk_weights, local_ids
            )
        if not self.is_fp8:
            return ops.fused_experts(
                x, self.w13_weight, self.w2_weight, topk_weights, topk_ids, expert_map=expert_map
            )
        from ominix_worker.quant.fp8 import dequantize_fp8, fp8_gemm_supported

        if fp8_gemm_supported(x.device, self.w13_block[1], self.w2_block[1]):
            return ops.fused_experts(
                x, self.w13_weight, self.w2_weight, topk_weights, topk_ids, self.w13_scale, self.w2_scale,
                self.w13_block, self.w2_block, expert_map=expert_map,
            )  # fmt: skip
        # No FP8 tensor cores (or narrow scale blocks): dequantize the layer for this call (slow, no host sync).
        assert self.w13_scale is not None and self.w2_scale is not None
        w13 = dequantize_fp8(self.w13_weight, self.w13_scale, self.w13_block, x.dtype)
        w2 = dequantize_fp8(self.w2_weight, self.w2_scale, self.w2_block, x.dtype)
        return ops.fused_experts(x, w13, w2, topk_weights, topk_ids, expert_map=expert_map)

    # ---- loading -----------------------------------------------------------------------------------

    def load_expert(self, expert: int, part: str, source: WeightSource) -> str | None:
        """Copy this rank's share of one Hugging Face expert projection (gate, up or down) into its slice;
        returns its load key, None (nothing read) when another rank holds the expert."""
        from ominix_worker.quant.fp8 import NOT_LISTED, is_fp8_tensor

        local = self.local_expert(expert)
        if local is None:
            return None
        size, full = self.intermediate_size, self.full_intermediate_size
        rows = self.intermediate_range
        # gate/up are (I, H): this rank's rows; down is (H, I): its columns.
        dim = 1 if part == "down" else 0
        if len(source.shape) != 2 or source.shape[dim] != full:
            raise ValueError(f"expert {expert} {part}: shape {source.shape}, expected {full} along dim {dim}")
        tensor = source.read(dim, rows.start, rows.size)
        if is_fp8_tensor(tensor) != self.is_fp8:  # a copy would convert e4m3 values as they are, unscaled
            if self.is_fp8:
                raise ValueError(
                    f"expert {expert} {part}: expected an FP8 weight, found {tensor.dtype}{NOT_LISTED}"
                )
            raise ValueError(
                f"expert {expert} {part}: an FP8 weight ({tensor.dtype}) for experts that are not FP8"
            )
        with torch.no_grad():
            if part == "down":
                target, key = self.w2_weight[local], f"w2_weight#{expert}"
            else:
                shard = 0 if part == "gate" else 1
                target = self.w13_weight[local].narrow(0, shard * size, size)
                key = f"w13_weight#{expert}.{shard}"
            if target.shape != tensor.shape:
                raise ValueError(
                    f"expert {expert} {part}: shape {tuple(tensor.shape)} != {tuple(target.shape)}"
                )
            target.copy_(tensor)
        return key

    def load_keys(self) -> set[str]:
        """What a checkpoint must provide: each held expert's three projections (and their scales when FP8),
        keyed by global expert id."""
        names = ("weight", "scale") if self.is_fp8 else ("weight",)
        held = range(self.expert_range.start, self.expert_range.end)
        keys = {f"w2_{n}#{e}" for e in held for n in names}
        keys.update(f"w13_{n}#{e}.{s}" for e in held for s in (0, 1) for n in names)
        return keys

    def init_dummy_weights(self, seed: int) -> None:
        """Random experts (std 0.02), each drawn whole from a generator seeded by (seed, global expert id)
        and cut to this rank's share, so every split of a group holds slices of the same model."""
        device = self.w13_weight.device
        rows = self.intermediate_range
        full, hidden = self.full_intermediate_size, self.hidden_size
        with torch.no_grad():
            for local in range(self.num_experts):
                expert = self.expert_range.start + local
                generator = torch.Generator(device=device).manual_seed(seed * 1_000_003 + expert)
                w13 = torch.empty(2 * full, hidden, device=device).normal_(0.0, 0.02, generator=generator)
                w2 = torch.empty(hidden, full, device=device).normal_(0.0, 0.02, generator=generator)
                gate, up = w13.split(full)
                local_w13 = torch.cat((gate[rows.start : rows.end], up[rows.start : rows.end]))
                self.w13_weight[local].copy_(local_w13)
                self.w2_weight[local].copy_(w2[:, rows.start : rows.end])


class SparseMoeBlock(nn.Module):
    """Router + experts (+ Qwen2-MoE's shared expert, scaled by sigmoid(shared_expert_gate(x))).

    Under tensor parallelism both the experts and the shared expert give partial sums; one all-reduce
    completes the layer. A family with other experts or a biased router subclasses ``build_experts`` and
    ``router_bias``."""

    router_bias: bool = False  # the router (``gate``) is a linear layer with a bias

    def __init__(self, config: ModelConfig, tp: TensorParallel = SINGLE) -> None:
        super().__init__()
        self.tp = tp
        self.top_k = config.num_experts_per_tok
        self.renormalize = config.norm_topk_prob
        self.scoring_func = config.scoring_func
        # Replicated on every rank (SINGLE); a ColumnParallelLinear so that it takes the same GEMM paths as the
        # projections (oneDNN packing on CPU, the weight-streaming kernel for one token on CUDA).
        self.gate = ColumnParallelLinear.split_evenly(
            config.hidden_size, [config.num_experts], self.router_bias
        )
        self.experts = self.build_experts(config, tp)
        self.shared_expert: MLP | None = None
        self.shared_expert_gate: nn.Linear | None = None
        if config.shared_expert_intermediate_size:
            self.shared_expert = MLP(
                replace(config, intermediate_size=config.shared_expert_intermediate_size),
                tp,
                reduce_results=False,
            )
            self.shared_expert_gate = nn.Linear(config.hidden_size, 1, bias=False)

    def build_experts(self, config: ModelConfig, tp: TensorParallel) -> FusedExperts:
        return FusedExperts(config.num_experts, config.hidden_size, config.moe_intermediate_size, tp)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        # No host sync on any device, so CUDA graphs capture the routing too; one kernel on CUDA.
        ops = fused_moe_ops(x)
        route = select_experts if ops is None else ops.select_experts
        topk_weights, topk_ids = route(self.gate(x), self.top_k, self.renormalize, self.scoring_func)
        out = self.experts(x, topk_weights, topk_ids)
        if self.shared_expert is not None and self.shared_expert_gate is not None:
            # The gate is per token and replicated: scaling each rank's partial sum scales their total.
            out = out + torch.sigmoid(self.shared_expert_gate(x)) * self.shared_expert(x)
        return self.tp.all_reduce(out)


# layers.<i>.(mlp|block_sparse_moe).experts.<e>.<projection>.(weight|weight_scale_inv)
_EXPERT_RE = re.compile(
    r"^layers\.(\d+)\.(?:mlp|block_sparse_moe)\.experts\.(\d+)\.(\w+)\.(weight|weight_scale_inv)$"
)
EXPERT_PARTS = {
    "gate_proj": "gate",
    "w1": "gate",
    "up_proj": "up",
    "w3": "up",
    "down_proj": "down",
    "w2": "down",
}
_SHARED_SHARDS = {"gate_proj": 0, "up_proj": 1}
# The router and Qwen2-MoE's shared-expert gate: they run in the model dtype, but FP8 checkpoints may store them
# in e4m3 with a scale (transformers' FP8 quantizer does unless modules_to_not_convert lists them).
_ROUTER_RE = re.compile(r"^(layers\.\d+\.mlp\.(?:gate|shared_expert_gate))\.(weight|weight_scale_inv)$")
# Qwen2-MoE with shared_expert_intermediate_size 0: transformers still builds and saves a zero-width shared
# expert and its gate, whose output is zero; such a layer is built without them and their tensors are skipped.
_SHARED_RE = re.compile(r"^layers\.(\d+)\.mlp\.shared_expert(\.\w+|_gate)\.(weight|weight_scale_inv)$")


class _FP8Routers:
    """Router weights (``mlp.gate``, ``mlp.shared_expert_gate``) on their way to the dense loader: a float one
    passes as it is; an FP8 one waits for its scale (or the scale for it, in whichever order the checkpoint
    lists them) and passes dequantized to the model dtype, as transformers loads it."""

    def __init__(self, model: MoeForCausalLM) -> None:
        self.quantization = model.config.quantization
        self.dtype = model.embed_tokens.weight.dtype
        self.pending: dict[str, dict[str, tuple[str, torch.Tensor]]] = {}
        self.float_weights: set[str] = set()

    def take(
        self, module: str, kind: str, hf_name: str, weight: torch.Tensor | WeightSource
    ) -> Iterator[tuple[str, torch.Tensor | WeightSource]]:
        from ominix_worker.quant.fp8 import dequantize_checkpoint_weight, is_fp8_tensor, scheme_from_config

        tensor = as_weight_source(weight).read()  # replicated on every rank, and small: read whole
        if kind == "weight" and not is_fp8_tensor(tensor) and module not in self.pending:
            self.float_weights.add(module)
            yield f"{module}.weight", tensor
            return
        if module in self.float_weights or (kind == "weight" and not is_fp8_tensor(tensor)):
            raise ValueError(f"{hf_name}: a weight scale for a router weight that is not FP8")
        parts = self.pending.setdefault(module, {})
        if kind in parts:
            raise ValueError(f"{hf_name}: stored twice")
        parts[kind] = (hf_name, tensor)
        if len(parts) < 2:
            return
        del self.pending[module]
        weight_name, q = parts["weight"]
        scheme = scheme_from_config(self.quantization) if self.quantization else None
        block = scheme.block if scheme is not None else None  # None: a scale per row or per tensor
        try:
            dequantized = dequantize_checkpoint_weight(q, parts["weight_scale_inv"][1], block, self.dtype)
        except ValueError as exc:
            raise ValueError(f"{weight_name}: {exc}") from None
        yield f"{module}.weight", dequantized

    def check_complete(self) -> None:
        for parts in self.pending.values():
            if "weight" in parts:
                raise ValueError(f"{parts['weight'][0]}: an FP8 router weight without its weight_scale_inv")
            raise ValueError(f"{parts['weight_scale_inv'][0]}: a weight scale without its router weight")


class MoeForCausalLM(LlamaForCausalLM):
    """A Llama-family decoder whose sparse layers (``config.moe_layers``) use ``moe_block_class``."""

    moe_block_class: type[SparseMoeBlock] = SparseMoeBlock
    # Padding rows all route to the same experts, unlike a step's tokens, and each added row costs expert work:
    # a bucket's timed pieces do not stand for the steps padded to it.
    piecewise_bucket_timing: ClassVar[bool] = False

    def build_mlp(self, config: ModelConfig, layer_index: int) -> nn.Module | None:
        if layer_index not in config.moe_layers:
            return None
        return self.moe_block_class(config, self.tp)

    def _moe_block(self, layer_index: int) -> SparseMoeBlock:
        block = self.layers[layer_index].mlp
        if not isinstance(block, SparseMoeBlock):
            raise KeyError(f"layer {layer_index} has no experts")
        return block

    def load_weights(self, weights: Iterable[tuple[str, torch.Tensor | WeightSource]]) -> set[str]:
        loaded: set[str] = set()
        dense = self._load_moe_weights(weights, loaded)
        loaded |= super().load_weights(dense)
        return loaded

    def _load_moe_weights(
        self, weights: Iterable[tuple[str, torch.Tensor | WeightSource]], loaded: set[str]
    ) -> Iterator[tuple[str, torch.Tensor | WeightSource]]:
        """Loads expert and shared-expert shards here; yields everything else for the dense loader, FP8 routers
        dequantized (``_FP8Routers``)."""
        routers = _FP8Routers(self)
        for hf_name, weight in weights:
            name = hf_name.removeprefix("model.").replace(".block_sparse_moe.", ".mlp.")
            absent = _SHARED_RE.match(name)
            if absent is not None and self._moe_block(int(absent.group(1))).shared_expert is None:
                shape = as_weight_source(weight).shape
                if absent.group(2) != "_gate" and absent.group(3) == "weight" and 0 not in shape:
                    raise ValueError(
                        f"{hf_name}: a shared expert's weight of shape {list(shape)}, but the config's "
                        "shared_expert_intermediate_size is 0"
                    )
                continue
            router = _ROUTER_RE.match(name)
            if router is not None:
                yield from routers.take(router.group(1), router.group(2), hf_name, weight)
                continue
            match = _EXPERT_RE.match(name)
            if match is not None:
                layer, expert, projection = int(match.group(1)), int(match.group(2)), match.group(3)
                if projection not in EXPERT_PARTS:
                    raise KeyError(f"unexpected weight {hf_name!r}")
                experts = self._moe_block(layer).experts
                source = as_weight_source(weight)
                try:
                    if match.group(4) == "weight":
                        key = experts.load_expert(expert, EXPERT_PARTS[projection], source)
                    else:
                        key = experts.load_scale(expert, EXPERT_PARTS[projection], source)
                except ValueError as exc:
                    raise ValueError(f"{hf_name}: {exc}") from None
                if key is not None:
                    loaded.add(f"layers.{layer}.mlp.experts.{key}")
                continue
            shared = re.match(
                r"^layers\.(\d+)\.mlp\.shared_expert\.(gate_proj|up_proj)\.(weight|weight_scale_inv)$", name
            )
            if shared is not None:
                block = self._moe_block(int(shared.group(1)))
                assert block.shared_expert is not None
                shard, param = _SHARED_SHARDS[shared.group(2)], shared.group(3)
                gate_up = block.shared_expert.gate_up_proj
                assert isinstance(gate_up, ParallelModule)
                try:
                    gate_up.load_weight(param, as_weight_source(weight), shard)
                except ValueError as exc:
                    raise ValueError(f"{hf_name}: {exc}") from None
                loaded.add(f"layers.{shared.group(1)}.mlp.shared_expert.gate_up_proj.{param}#{shard}")
                continue
            yield name, weight
        routers.check_complete()

    def expected_weight_keys(self) -> set[str]:
        keys = {
            k
            for k in super().expected_weight_keys()
            if ".mlp.experts." not in k and ".mlp.shared_expert.gate_up_proj." not in k
        }
        for index in self.config.moe_layers:
            block = self._moe_block(index)
            keys.update(f"layers.{index}.mlp.experts.{k}" for k in block.experts.load_keys())
            if block.shared_expert is not None:
                fused = block.shared_expert.gate_up_proj
                params = [n for n, _ in fused.named_parameters()]
                keys.update(
                    f"layers.{index}.mlp.shared_expert.gate_up_proj.{p}#{s}" for p in params for s in (0, 1)
                )
        return keys

    def init_dummy_weights(self, seed: int = 0) -> None:
        """As the dense model, with experts drawn per global expert (see ``FusedExperts.init_dummy_weights``)."""
        super().init_dummy_weights(seed)
        for index in self.config.moe_layers:
            self._moe_block(index).experts.init_dummy_weights(seed * 7919 + index)

    def post_load(self, device: torch.device) -> None:
        super().post_load(device)
        for index in self.config.moe_layers:
            self._moe_block(index).experts.build_expert_map(device)


def model_class(config: ModelConfig) -> type[LlamaForCausalLM]:
    """The module class that runs ``config``: the MoE decoder for sparse models, else the dense one."""
    return MoeForCausalLM if config.is_moe else LlamaForCausalLM


__all__ = ["FusedExperts", "MoeForCausalLM", "SparseMoeBlock", "fused_moe_ops", "model_class"]
