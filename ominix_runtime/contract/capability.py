"""What a backend states about itself, plus the stated profiles per backend kind."""

from __future__ import annotations

from dataclasses import dataclass, replace
from enum import IntEnum
from typing import Any

from ominix_runtime.contract.kv_layout import AttentionKind, KVGroup, layout_problems


class BackendKind(IntEnum):
    """Values match ``ominix.runtime.v1.BackendKind``."""

    CUDA = 1
    ASCEND = 2
    CPU = 3
    SGLANG = 4
    FAKE = 5

    @property
    def contract_name(self) -> str:
        """The upstream OminiX contract's name of this kind (its Rust ``BackendKind``; CPU is an extension)."""
        return CONTRACT_KIND_NAMES[self]


# One to one with the upstream Rust ``BackendKind`` {Sglang, OminiXCuda, OminiXAscend, Fake}; the CPU worker
# (the same torch worker on the CPU) has no upstream variant and keeps its own name.
CONTRACT_KIND_NAMES: dict[BackendKind, str] = {
    BackendKind.CUDA: "OminiXCuda",
    BackendKind.ASCEND: "OminiXAscend",
    BackendKind.CPU: "OminiXCpu",
    BackendKind.SGLANG: "Sglang",
    BackendKind.FAKE: "Fake",
}


class Granularity(IntEnum):
    STEP = 1
    REQUEST = 2


@dataclass(frozen=True, slots=True)
class ModelInfo:
    name: str
    vocab_size: int
    max_model_len: int
    eos_token_ids: tuple[int, ...]
    architecture: str = "LlamaForCausalLM"
    bos_token_id: int | None = None
    num_layers: int = 0
    hidden_size: int = 0
    num_attention_heads: int = 0
    num_kv_heads: int = 0
    head_dim: int = 0
    num_parameters: int = 0
    # Mixture of experts (0: a dense model): routed experts per MoE layer and how many each token uses.
    num_experts: int = 0
    num_experts_per_tok: int = 0


# Bytes per element of the dtype names capabilities use (the engine never imports torch).
DTYPE_BYTES = {
    "float32": 4,
    "bfloat16": 2,
    "float16": 2,
    "float8_e4m3fn": 1,
    "fp8_e4m3": 1,
    "float8_e5m2": 1,
}


# BackendCapability.moe_parallel: "" (dense), or how a group splits the experts.
MOE_PARALLEL_MODES = ("", "tensor", "expert")


@dataclass(frozen=True, slots=True)
class RankInfo:
    """One rank of a tensor-parallel worker group (a single worker states itself as rank 0 of 1)."""

    rank: int
    device: str
    host: str = ""
    memory_total_bytes: int = 0  # 0: unknown (CPU)
    weight_bytes: int = 0
    kv_cache_bytes: int = 0
    kv_head_start: int = 0
    kv_num_heads: int = 0


@dataclass(frozen=True, slots=True)
class BackendCapability:
    worker_id: str
    kind: BackendKind
    device: str
    dtype: str
    model: ModelInfo
    kv_block_size: int
    kv_num_blocks: int
    kv_bytes_per_block: int
    max_batch_tokens: int
    max_running_requests: int
    granularity: Granularity = Granularity.STEP
    supported_dtypes: tuple[str, ...] = ()
    supports_paged_kv: bool = True
    supports_prefix_caching: bool = True
    supports_chunked_prefill: bool = True
    supports_graph_capture: bool = False
    supports_fp8_kv: bool = False
    tensor_parallel_size: int = 1
    collective_backend: str = "none"
    custom_all_reduce: bool = False
    attention_backend: str = ""
    version: str = ""
    ranks: tuple[RankInfo, ...] = ()
    # Dtype of the stored weights ("float8_e4m3fn" for FP8 checkpoints or --quantization fp8) and of the KV
    # cache ("fp8_e4m3" with --kv-cache-dtype); empty: the run dtype.
    weight_dtype: str = ""
    kv_cache_dtype: str = ""
    supports_prefill_decode_split: bool = False
    # Honours NewRequestData.num_cached_kv_tokens: a prompt found whole in the prefix cache then computes its
    # last token alone (no KV written), not its whole last block.
    supports_whole_prompt_hits: bool = False
    # How a group splits MoE layers: "tensor" (a slice of every expert per rank) or "expert" (whole experts,
    # num_experts / tensor_parallel_size per rank); empty for a dense model (or a backend that does not say).
    moe_parallel: str = ""
    # The KV groups of a hybrid layout; empty: one full-attention group over every layer, sized by
    # kv_block_size / kv_num_blocks / kv_bytes_per_block (see kv_layout).
    kv_groups: tuple[KVGroup, ...] = ()

    @property
    def kv_layout(self) -> tuple[KVGroup, ...]:
        """The stated KV groups, or the one full-attention group a uniform model implies."""
        if self.kv_groups:
            return self.kv_groups
        layers = self.model.num_layers
        per_token = (
            self.kv_bytes_per_block // (self.kv_block_size * layers) if self.kv_block_size and layers else 0
        )
        return (
            KVGroup(
                kind=AttentionKind.FULL,
                layer_indices=tuple(range(layers)),
                block_size=self.kv_block_size,
                num_blocks=self.kv_num_blocks,
                bytes_per_token_per_layer=per_token,
            ),
        )

    @property
    def kv_capacity_tokens(self) -> int:
        return self.kv_block_size * self.kv_num_blocks

    @property
    def effective_kv_cache_dtype(self) -> str:
        return self.kv_cache_dtype or self.dtype

    def kv_bytes_per_block_for_model(self) -> int:
        """K and V bytes of one block as the model shape and the KV dtype imply (0: shape or dtype unstated)."""
        m = self.model
        element = DTYPE_BYTES.get(self.effective_kv_cache_dtype, 0)
        return 2 * m.num_layers * self.kv_block_size * m.num_kv_heads * m.head_dim * element

    @property
    def kv_bytes_capacity(self) -> int:
        return self.kv_bytes_per_block * self.kv_num_blocks

    def capability_strings(self) -> list[str]:
        """What a router matches a request's required capabilities against (upstream examples: ``cuda``,
        ``ascend``, ``tp8``, ``prefill``, ``decode``)."""
        family = {BackendKind.CUDA: "cuda", BackendKind.ASCEND: "ascend", BackendKind.CPU: "cpu"}.get(
            self.kind
        )
        if family is None:  # request-level and fake backends: the device they state
            family = self.device.split(":", 1)[0] if self.device and "/" not in self.device else ""
        out = [self.kind.name.lower()]
        if family and family not in out:
            out.append(family)
        out += [f"tp{self.tensor_parallel_size}", "prefill", "decode"]
        if (
            "fp8" in f"{self.dtype} {self.weight_dtype} {self.kv_cache_dtype}"
            or "float8" in self.weight_dtype
        ):
            out.append("fp8")
        flags = (
            (self.supports_paged_kv, "paged_kv"),
            (self.supports_prefix_caching, "prefix_cache"),
            (self.supports_chunked_prefill, "chunked_prefill"),
            (self.supports_graph_capture, "graph_capture"),
            (self.supports_prefill_decode_split, "prefill_decode_split"),
        )
        return out + [name for on, name in flags if on]

    def problems(self) -> list[str]:
        """Self-consistency problems of this declaration (empty when complete and consistent)."""
        out: list[str] = []
        if not self.worker_id:
            out.append("worker_id is empty")
        if not self.device:
            out.append("device is empty")
        if not self.dtype:
            out.append("dtype is empty")
        if self.supported_dtypes and self.dtype not in self.supported_dtypes:
            out.append(f"dtype {self.dtype} not in supported_dtypes {self.supported_dtypes}")
        # A request-level backend tokenizes, detokenizes and stops by itself: it may leave the vocabulary and
        # EOS ids unstated (0 / empty = unknown); a step-level worker must state both.
        tokenizer_facts_required = self.granularity == Granularity.STEP
        if self.model.vocab_size <= 0 and tokenizer_facts_required:
            out.append("model.vocab_size must be > 0")
        if self.model.max_model_len <= 0:
            out.append("model.max_model_len must be > 0")
        if not self.model.eos_token_ids and tokenizer_facts_required:
            out.append("model.eos_token_ids is empty")
        if self.model.vocab_size > 0 and any(
            not 0 <= t < self.model.vocab_size for t in self.model.eos_token_ids
        ):
            out.append("model.eos_token_ids outside the vocabulary")
        if self.max_running_requests <= 0:
            out.append("max_running_requests must be > 0")
        if self.granularity == Granularity.STEP:
            if self.kv_block_size <= 0 or self.kv_num_blocks <= 0:
                out.append("a step-level backend must state kv_block_size and kv_num_blocks > 0")
            if self.kv_bytes_per_block <= 0:
                out.append("kv_bytes_per_block must be > 0")
            if self.max_batch_tokens <= 0:
                out.append("max_batch_tokens must be > 0")
            if not self.supports_paged_kv:
                out.append("a step-level backend must support a paged KV cache")
            if self.supports_prefix_caching and not self.supports_paged_kv:
                out.append("prefix caching needs a paged KV cache")
            if not self.supports_chunked_prefill and self.max_batch_tokens < self.model.max_model_len:
                out.append("without chunked prefill max_batch_tokens must cover max_model_len")
            implied = self.kv_bytes_per_block_for_model()
            if implied and self.kv_bytes_per_block < implied:
                out.append(
                    f"kv_bytes_per_block {self.kv_bytes_per_block} is less than the {implied} bytes the model "
                    f"shape needs in {self.effective_kv_cache_dtype}"
                )
            if self.kv_groups:
                out.extend(layout_problems(self.kv_groups, self.model.num_layers))
                if self.kv_groups[0].block_size != self.kv_block_size:
                    out.append("kv_block_size must equal the kv groups' block_size")
                if self.kv_groups[0].num_blocks != self.kv_num_blocks:
                    out.append("kv_num_blocks must equal kv group 0's num_blocks")
        if self.kv_cache_dtype.startswith("fp8") and not self.supports_fp8_kv:
            out.append(f"kv_cache_dtype {self.kv_cache_dtype} needs supports_fp8_kv")
        if self.tensor_parallel_size < 1:
            out.append("tensor_parallel_size must be >= 1")
        if self.tensor_parallel_size > 1 and self.collective_backend == "none":
            out.append("tensor_parallel_size > 1 needs a collective backend")
        if self.ranks and [r.rank for r in self.ranks] != list(range(self.tensor_parallel_size)):
            out.append(f"ranks must list ranks 0..{self.tensor_parallel_size - 1} in order")
        if self.moe_parallel not in MOE_PARALLEL_MODES:
            out.append(f"moe_parallel {self.moe_parallel!r} is not one of {MOE_PARALLEL_MODES}")
        elif self.moe_parallel and self.model.num_experts <= 0:
            out.append("moe_parallel is stated for a model without experts")
        elif self.moe_parallel == "expert" and self.model.num_experts % self.tensor_parallel_size:
            out.append(
                f"{self.model.num_experts} experts do not divide over {self.tensor_parallel_size} ranks"
            )
        if self.kind == BackendKind.ASCEND:
            if self.kv_block_size != 128:
                out.append("Ascend workers use KV block size 128")
            if self.custom_all_reduce:
                out.append("Ascend workers have no custom all-reduce")
            if self.dtype not in ("float16", "bfloat16"):
                out.append("Ascend workers run float16 or bfloat16")
        return out


_UNSET_MODEL = ModelInfo(name="", vocab_size=0, max_model_len=0, eos_token_ids=())

# Stated profiles: what each backend kind declares before measuring memory. A worker fills in the model,
# its id and device, and the block count it could allocate (``dataclasses.replace``).
CUDA_PROFILE = BackendCapability(
    worker_id="",
    kind=BackendKind.CUDA,
    device="cuda:0",
    dtype="bfloat16",
    model=_UNSET_MODEL,
    kv_block_size=16,
    kv_num_blocks=0,
    kv_bytes_per_block=0,
    max_batch_tokens=8192,
    max_running_requests=256,
    supported_dtypes=("bfloat16", "float16", "float32"),
    supports_graph_capture=True,
    collective_backend="nccl",
    custom_all_reduce=False,
    attention_backend="triton-paged",
    supports_whole_prompt_hits=True,  # the Triton store skips slot -1 (a layout of full-attention groups)
)
ASCEND_PROFILE = BackendCapability(
    worker_id="",
    kind=BackendKind.ASCEND,
    device="npu:0",
    dtype="bfloat16",
    model=_UNSET_MODEL,
    kv_block_size=128,
    kv_num_blocks=0,
    kv_bytes_per_block=0,
    max_batch_tokens=8192,
    max_running_requests=256,
    supported_dtypes=("bfloat16", "float16"),
    supports_graph_capture=True,  # ACL graph for uniform decode
    collective_backend="hccl",
    custom_all_reduce=False,
    attention_backend="npu-paged",
)
CPU_PROFILE = BackendCapability(
    worker_id="",
    kind=BackendKind.CPU,
    device="cpu",
    dtype="float32",
    model=_UNSET_MODEL,
    kv_block_size=16,
    kv_num_blocks=0,
    kv_bytes_per_block=0,
    max_batch_tokens=2048,
    max_running_requests=64,
    supported_dtypes=("float32", "bfloat16"),
    supports_graph_capture=False,
    collective_backend="none",
    attention_backend="torch-sdpa",
    supports_whole_prompt_hits=True,  # the reference store filters slot -1 out (full-attention groups)
)
SGLANG_PROFILE = BackendCapability(
    worker_id="",
    kind=BackendKind.SGLANG,
    device="",
    dtype="bfloat16",
    model=_UNSET_MODEL,
    kv_block_size=1,
    kv_num_blocks=0,
    kv_bytes_per_block=0,
    max_batch_tokens=0,
    max_running_requests=256,
    granularity=Granularity.REQUEST,
    supports_paged_kv=True,
    supports_prefix_caching=True,
    supports_chunked_prefill=True,
    supports_graph_capture=True,
    collective_backend="nccl",
    attention_backend="sglang",
)
FAKE_PROFILE = BackendCapability(
    worker_id="fake-0",
    kind=BackendKind.FAKE,
    device="fake",
    dtype="float32",
    model=_UNSET_MODEL,
    kv_block_size=16,
    kv_num_blocks=256,
    kv_bytes_per_block=1024,
    max_batch_tokens=512,
    max_running_requests=64,
    supported_dtypes=("float32",),
    attention_backend="fake",
)

PROFILES: dict[BackendKind, BackendCapability] = {
    BackendKind.CUDA: CUDA_PROFILE,
    BackendKind.ASCEND: ASCEND_PROFILE,
    BackendKind.CPU: CPU_PROFILE,
    BackendKind.SGLANG: SGLANG_PROFILE,
    BackendKind.FAKE: FAKE_PROFILE,
}


def stated_profile(kind: BackendKind, **overrides: Any) -> BackendCapability:
    """The stated profile of ``kind`` with ``overrides`` applied."""
    # Any: field values of every type; replace() refuses unknown names and problems() judges the values.
    return replace(PROFILES[kind], **overrides)


__all__ = [
    "DTYPE_BYTES",
    "BackendKind",
    "CONTRACT_KIND_NAMES",
    "Granularity",
    "ModelInfo",
    "BackendCapability",
    "PROFILES",
    "stated_profile",
    "CUDA_PROFILE",
    "ASCEND_PROFILE",
    "CPU_PROFILE",
    "SGLANG_PROFILE",
    "FAKE_PROFILE",
]
