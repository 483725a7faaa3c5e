from google.protobuf.internal import containers as _containers
from google.protobuf.internal import enum_type_wrapper as _enum_type_wrapper
from google.protobuf import descriptor as _descriptor
from google.protobuf import message as _message
from collections.abc import Iterable as _Iterable, Mapping as _Mapping
from typing import ClassVar as _ClassVar, Optional as _Optional, Union as _Union

DESCRIPTOR: _descriptor.FileDescriptor

class Priority(int, metaclass=_enum_type_wrapper.EnumTypeWrapper):
    __slots__ = ()
    PRIORITY_UNSPECIFIED: _ClassVar[Priority]
    PRIORITY_REALTIME: _ClassVar[Priority]
    PRIORITY_INTERACTIVE: _ClassVar[Priority]
    PRIORITY_BATCH: _ClassVar[Priority]

class FinishReason(int, metaclass=_enum_type_wrapper.EnumTypeWrapper):
    __slots__ = ()
    FINISH_REASON_UNSPECIFIED: _ClassVar[FinishReason]
    FINISH_REASON_STOP: _ClassVar[FinishReason]
    FINISH_REASON_LENGTH: _ClassVar[FinishReason]
    FINISH_REASON_ABORT: _ClassVar[FinishReason]
    FINISH_REASON_ERROR: _ClassVar[FinishReason]

class ErrorCode(int, metaclass=_enum_type_wrapper.EnumTypeWrapper):
    __slots__ = ()
    ERROR_CODE_UNSPECIFIED: _ClassVar[ErrorCode]
    ERROR_CODE_ADMISSION_REJECTED: _ClassVar[ErrorCode]
    ERROR_CODE_BACKEND_UNAVAILABLE: _ClassVar[ErrorCode]
    ERROR_CODE_CAPABILITY_MISMATCH: _ClassVar[ErrorCode]
    ERROR_CODE_KV_CAPACITY_EXCEEDED: _ClassVar[ErrorCode]
    ERROR_CODE_TIMEOUT: _ClassVar[ErrorCode]
    ERROR_CODE_CANCELLED: _ClassVar[ErrorCode]
    ERROR_CODE_INTERNAL: _ClassVar[ErrorCode]
    ERROR_CODE_INVALID_ARGUMENT: _ClassVar[ErrorCode]

class BackendKind(int, metaclass=_enum_type_wrapper.EnumTypeWrapper):
    __slots__ = ()
    BACKEND_KIND_UNSPECIFIED: _ClassVar[BackendKind]
    BACKEND_KIND_CUDA: _ClassVar[BackendKind]
    BACKEND_KIND_ASCEND: _ClassVar[BackendKind]
    BACKEND_KIND_CPU: _ClassVar[BackendKind]
    BACKEND_KIND_SGLANG: _ClassVar[BackendKind]
    BACKEND_KIND_FAKE: _ClassVar[BackendKind]

class Granularity(int, metaclass=_enum_type_wrapper.EnumTypeWrapper):
    __slots__ = ()
    GRANULARITY_UNSPECIFIED: _ClassVar[Granularity]
    GRANULARITY_STEP: _ClassVar[Granularity]
    GRANULARITY_REQUEST: _ClassVar[Granularity]

class AttentionKind(int, metaclass=_enum_type_wrapper.EnumTypeWrapper):
    __slots__ = ()
    ATTENTION_KIND_UNSPECIFIED: _ClassVar[AttentionKind]
    ATTENTION_KIND_FULL: _ClassVar[AttentionKind]
    ATTENTION_KIND_SLIDING_WINDOW: _ClassVar[AttentionKind]
    ATTENTION_KIND_COMPRESSED: _ClassVar[AttentionKind]
PRIORITY_UNSPECIFIED: Priority
PRIORITY_REALTIME: Priority
PRIORITY_INTERACTIVE: Priority
PRIORITY_BATCH: Priority
FINISH_REASON_UNSPECIFIED: FinishReason
FINISH_REASON_STOP: FinishReason
FINISH_REASON_LENGTH: FinishReason
FINISH_REASON_ABORT: FinishReason
FINISH_REASON_ERROR: FinishReason
ERROR_CODE_UNSPECIFIED: ErrorCode
ERROR_CODE_ADMISSION_REJECTED: ErrorCode
ERROR_CODE_BACKEND_UNAVAILABLE: ErrorCode
ERROR_CODE_CAPABILITY_MISMATCH: ErrorCode
ERROR_CODE_KV_CAPACITY_EXCEEDED: ErrorCode
ERROR_CODE_TIMEOUT: ErrorCode
ERROR_CODE_CANCELLED: ErrorCode
ERROR_CODE_INTERNAL: ErrorCode
ERROR_CODE_INVALID_ARGUMENT: ErrorCode
BACKEND_KIND_UNSPECIFIED: BackendKind
BACKEND_KIND_CUDA: BackendKind
BACKEND_KIND_ASCEND: BackendKind
BACKEND_KIND_CPU: BackendKind
BACKEND_KIND_SGLANG: BackendKind
BACKEND_KIND_FAKE: BackendKind
GRANULARITY_UNSPECIFIED: Granularity
GRANULARITY_STEP: Granularity
GRANULARITY_REQUEST: Granularity
ATTENTION_KIND_UNSPECIFIED: AttentionKind
ATTENTION_KIND_FULL: AttentionKind
ATTENTION_KIND_SLIDING_WINDOW: AttentionKind
ATTENTION_KIND_COMPRESSED: AttentionKind

class SamplingParams(_message.Message):
    __slots__ = ("max_tokens", "temperature", "top_p", "top_k", "min_p", "seed", "stop", "stop_token_ids", "ignore_eos", "logprobs", "repetition_penalty", "frequency_penalty", "presence_penalty", "min_tokens")
    MAX_TOKENS_FIELD_NUMBER: _ClassVar[int]
    TEMPERATURE_FIELD_NUMBER: _ClassVar[int]
    TOP_P_FIELD_NUMBER: _ClassVar[int]
    TOP_K_FIELD_NUMBER: _ClassVar[int]
    MIN_P_FIELD_NUMBER: _ClassVar[int]
    SEED_FIELD_NUMBER: _ClassVar[int]
    STOP_FIELD_NUMBER: _ClassVar[int]
    STOP_TOKEN_IDS_FIELD_NUMBER: _ClassVar[int]
    IGNORE_EOS_FIELD_NUMBER: _ClassVar[int]
    LOGPROBS_FIELD_NUMBER: _ClassVar[int]
    REPETITION_PENALTY_FIELD_NUMBER: _ClassVar[int]
    FREQUENCY_PENALTY_FIELD_NUMBER: _ClassVar[int]
    PRESENCE_PENALTY_FIELD_NUMBER: _ClassVar[int]
    MIN_TOKENS_FIELD_NUMBER: _ClassVar[int]
    max_tokens: int
    temperature: float
    top_p: float
    top_k: int
    min_p: float
    seed: int
    stop: _containers.RepeatedScalarFieldContainer[str]
    stop_token_ids: _containers.RepeatedScalarFieldContainer[int]
    ignore_eos: bool
    logprobs: int
    repetition_penalty: float
    frequency_penalty: float
    presence_penalty: float
    min_tokens: int
    def __init__(self, max_tokens: _Optional[int] = ..., temperature: _Optional[float] = ..., top_p: _Optional[float] = ..., top_k: _Optional[int] = ..., min_p: _Optional[float] = ..., seed: _Optional[int] = ..., stop: _Optional[_Iterable[str]] = ..., stop_token_ids: _Optional[_Iterable[int]] = ..., ignore_eos: _Optional[bool] = ..., logprobs: _Optional[int] = ..., repetition_penalty: _Optional[float] = ..., frequency_penalty: _Optional[float] = ..., presence_penalty: _Optional[float] = ..., min_tokens: _Optional[int] = ...) -> None: ...

class Usage(_message.Message):
    __slots__ = ("prompt_tokens", "completion_tokens", "cached_tokens")
    PROMPT_TOKENS_FIELD_NUMBER: _ClassVar[int]
    COMPLETION_TOKENS_FIELD_NUMBER: _ClassVar[int]
    CACHED_TOKENS_FIELD_NUMBER: _ClassVar[int]
    prompt_tokens: int
    completion_tokens: int
    cached_tokens: int
    def __init__(self, prompt_tokens: _Optional[int] = ..., completion_tokens: _Optional[int] = ..., cached_tokens: _Optional[int] = ...) -> None: ...

class ErrorInfo(_message.Message):
    __slots__ = ("code", "message", "retryable")
    CODE_FIELD_NUMBER: _ClassVar[int]
    MESSAGE_FIELD_NUMBER: _ClassVar[int]
    RETRYABLE_FIELD_NUMBER: _ClassVar[int]
    code: ErrorCode
    message: str
    retryable: bool
    def __init__(self, code: _Optional[_Union[ErrorCode, str]] = ..., message: _Optional[str] = ..., retryable: _Optional[bool] = ...) -> None: ...

class TokenLogprob(_message.Message):
    __slots__ = ("token_id", "logprob")
    TOKEN_ID_FIELD_NUMBER: _ClassVar[int]
    LOGPROB_FIELD_NUMBER: _ClassVar[int]
    token_id: int
    logprob: float
    def __init__(self, token_id: _Optional[int] = ..., logprob: _Optional[float] = ...) -> None: ...

class SampledLogprobs(_message.Message):
    __slots__ = ("sampled", "top")
    SAMPLED_FIELD_NUMBER: _ClassVar[int]
    TOP_FIELD_NUMBER: _ClassVar[int]
    sampled: TokenLogprob
    top: _containers.RepeatedCompositeFieldContainer[TokenLogprob]
    def __init__(self, sampled: _Optional[_Union[TokenLogprob, _Mapping]] = ..., top: _Optional[_Iterable[_Union[TokenLogprob, _Mapping]]] = ...) -> None: ...

class ModelInfo(_message.Message):
    __slots__ = ("name", "architecture", "vocab_size", "max_model_len", "eos_token_ids", "bos_token_id", "num_layers", "hidden_size", "num_attention_heads", "num_kv_heads", "head_dim", "num_parameters", "num_experts", "num_experts_per_tok")
    NAME_FIELD_NUMBER: _ClassVar[int]
    ARCHITECTURE_FIELD_NUMBER: _ClassVar[int]
    VOCAB_SIZE_FIELD_NUMBER: _ClassVar[int]
    MAX_MODEL_LEN_FIELD_NUMBER: _ClassVar[int]
    EOS_TOKEN_IDS_FIELD_NUMBER: _ClassVar[int]
    BOS_TOKEN_ID_FIELD_NUMBER: _ClassVar[int]
    NUM_LAYERS_FIELD_NUMBER: _ClassVar[int]
    HIDDEN_SIZE_FIELD_NUMBER: _ClassVar[int]
    NUM_ATTENTION_HEADS_FIELD_NUMBER: _ClassVar[int]
    NUM_KV_HEADS_FIELD_NUMBER: _ClassVar[int]
    HEAD_DIM_FIELD_NUMBER: _ClassVar[int]
    NUM_PARAMETERS_FIELD_NUMBER: _ClassVar[int]
    NUM_EXPERTS_FIELD_NUMBER: _ClassVar[int]
    NUM_EXPERTS_PER_TOK_FIELD_NUMBER: _ClassVar[int]
    name: str
    architecture: str
    vocab_size: int
    max_model_len: int
    eos_token_ids: _containers.RepeatedScalarFieldContainer[int]
    bos_token_id: int
    num_layers: int
    hidden_size: int
    num_attention_heads: int
    num_kv_heads: int
    head_dim: int
    num_parameters: int
    num_experts: int
    num_experts_per_tok: int
    def __init__(self, name: _Optional[str] = ..., architecture: _Optional[str] = ..., vocab_size: _Optional[int] = ..., max_model_len: _Optional[int] = ..., eos_token_ids: _Optional[_Iterable[int]] = ..., bos_token_id: _Optional[int] = ..., num_layers: _Optional[int] = ..., hidden_size: _Optional[int] = ..., num_attention_heads: _Optional[int] = ..., num_kv_heads: _Optional[int] = ..., head_dim: _Optional[int] = ..., num_parameters: _Optional[int] = ..., num_experts: _Optional[int] = ..., num_experts_per_tok: _Optional[int] = ...) -> None: ...

class RankInfo(_message.Message):
    __slots__ = ("rank", "device", "host", "memory_total_bytes", "weight_bytes", "kv_cache_bytes", "kv_head_start", "kv_num_heads")
    RANK_FIELD_NUMBER: _ClassVar[int]
    DEVICE_FIELD_NUMBER: _ClassVar[int]
    HOST_FIELD_NUMBER: _ClassVar[int]
    MEMORY_TOTAL_BYTES_FIELD_NUMBER: _ClassVar[int]
    WEIGHT_BYTES_FIELD_NUMBER: _ClassVar[int]
    KV_CACHE_BYTES_FIELD_NUMBER: _ClassVar[int]
    KV_HEAD_START_FIELD_NUMBER: _ClassVar[int]
    KV_NUM_HEADS_FIELD_NUMBER: _ClassVar[int]
    rank: int
    device: str
    host: str
    memory_total_bytes: int
    weight_bytes: int
    kv_cache_bytes: int
    kv_head_start: int
    kv_num_heads: int
    def __init__(self, rank: _Optional[int] = ..., device: _Optional[str] = ..., host: _Optional[str] = ..., memory_total_bytes: _Optional[int] = ..., weight_bytes: _Optional[int] = ..., kv_cache_bytes: _Optional[int] = ..., kv_head_start: _Optional[int] = ..., kv_num_heads: _Optional[int] = ...) -> None: ...

class BackendCapability(_message.Message):
    __slots__ = ("worker_id", "kind", "device", "dtype", "supported_dtypes", "kv_block_size", "kv_num_blocks", "kv_bytes_per_block", "max_batch_tokens", "max_running_requests", "granularity", "supports_paged_kv", "supports_prefix_caching", "supports_chunked_prefill", "supports_graph_capture", "supports_fp8_kv", "tensor_parallel_size", "collective_backend", "custom_all_reduce", "attention_backend", "model", "version", "ranks", "kv_groups", "weight_dtype", "kv_cache_dtype", "supports_prefill_decode_split", "contract_kind", "moe_parallel", "supports_whole_prompt_hits")
    WORKER_ID_FIELD_NUMBER: _ClassVar[int]
    KIND_FIELD_NUMBER: _ClassVar[int]
    DEVICE_FIELD_NUMBER: _ClassVar[int]
    DTYPE_FIELD_NUMBER: _ClassVar[int]
    SUPPORTED_DTYPES_FIELD_NUMBER: _ClassVar[int]
    KV_BLOCK_SIZE_FIELD_NUMBER: _ClassVar[int]
    KV_NUM_BLOCKS_FIELD_NUMBER: _ClassVar[int]
    KV_BYTES_PER_BLOCK_FIELD_NUMBER: _ClassVar[int]
    MAX_BATCH_TOKENS_FIELD_NUMBER: _ClassVar[int]
    MAX_RUNNING_REQUESTS_FIELD_NUMBER: _ClassVar[int]
    GRANULARITY_FIELD_NUMBER: _ClassVar[int]
    SUPPORTS_PAGED_KV_FIELD_NUMBER: _ClassVar[int]
    SUPPORTS_PREFIX_CACHING_FIELD_NUMBER: _ClassVar[int]
    SUPPORTS_CHUNKED_PREFILL_FIELD_NUMBER: _ClassVar[int]
    SUPPORTS_GRAPH_CAPTURE_FIELD_NUMBER: _ClassVar[int]
    SUPPORTS_FP8_KV_FIELD_NUMBER: _ClassVar[int]
    TENSOR_PARALLEL_SIZE_FIELD_NUMBER: _ClassVar[int]
    COLLECTIVE_BACKEND_FIELD_NUMBER: _ClassVar[int]
    CUSTOM_ALL_REDUCE_FIELD_NUMBER: _ClassVar[int]
    ATTENTION_BACKEND_FIELD_NUMBER: _ClassVar[int]
    MODEL_FIELD_NUMBER: _ClassVar[int]
    VERSION_FIELD_NUMBER: _ClassVar[int]
    RANKS_FIELD_NUMBER: _ClassVar[int]
    KV_GROUPS_FIELD_NUMBER: _ClassVar[int]
    WEIGHT_DTYPE_FIELD_NUMBER: _ClassVar[int]
    KV_CACHE_DTYPE_FIELD_NUMBER: _ClassVar[int]
    SUPPORTS_PREFILL_DECODE_SPLIT_FIELD_NUMBER: _ClassVar[int]
    CONTRACT_KIND_FIELD_NUMBER: _ClassVar[int]
    MOE_PARALLEL_FIELD_NUMBER: _ClassVar[int]
    SUPPORTS_WHOLE_PROMPT_HITS_FIELD_NUMBER: _ClassVar[int]
    worker_id: str
    kind: BackendKind
    device: str
    dtype: str
    supported_dtypes: _containers.RepeatedScalarFieldContainer[str]
    kv_block_size: int
    kv_num_blocks: int
    kv_bytes_per_block: int
    max_batch_tokens: int
    max_running_requests: int
    granularity: Granularity
    supports_paged_kv: bool
    supports_prefix_caching: bool
    supports_chunked_prefill: bool
    supports_graph_capture: bool
    supports_fp8_kv: bool
    tensor_parallel_size: int
    collective_backend: str
    custom_all_reduce: bool
    attention_backend: str
    model: ModelInfo
    version: str
    ranks: _containers.RepeatedCompositeFieldContainer[RankInfo]
    kv_groups: _containers.RepeatedCompositeFieldContainer[KVGroup]
    weight_dtype: str
    kv_cache_dtype: str
    supports_prefill_decode_split: bool
    contract_kind: str
    moe_parallel: str
    supports_whole_prompt_hits: bool
    def __init__(self, worker_id: _Optional[str] = ..., kind: _Optional[_Union[BackendKind, str]] = ..., device: _Optional[str] = ..., dtype: _Optional[str] = ..., supported_dtypes: _Optional[_Iterable[str]] = ..., kv_block_size: _Optional[int] = ..., kv_num_blocks: _Optional[int] = ..., kv_bytes_per_block: _Optional[int] = ..., max_batch_tokens: _Optional[int] = ..., max_running_requests: _Optional[int] = ..., granularity: _Optional[_Union[Granularity, str]] = ..., supports_paged_kv: _Optional[bool] = ..., supports_prefix_caching: _Optional[bool] = ..., supports_chunked_prefill: _Optional[bool] = ..., supports_graph_capture: _Optional[bool] = ..., supports_fp8_kv: _Optional[bool] = ..., tensor_parallel_size: _Optional[int] = ..., collective_backend: _Optional[str] = ..., custom_all_reduce: _Optional[bool] = ..., attention_backend: _Optional[str] = ..., model: _Optional[_Union[ModelInfo, _Mapping]] = ..., version: _Optional[str] = ..., ranks: _Optional[_Iterable[_Union[RankInfo, _Mapping]]] = ..., kv_groups: _Optional[_Iterable[_Union[KVGroup, _Mapping]]] = ..., weight_dtype: _Optional[str] = ..., kv_cache_dtype: _Optional[str] = ..., supports_prefill_decode_split: _Optional[bool] = ..., contract_kind: _Optional[str] = ..., moe_parallel: _Optional[str] = ..., supports_whole_prompt_hits: _Optional[bool] = ...) -> None: ...

class KVGroup(_message.Message):
    __slots__ = ("kind", "layer_indices", "block_size", "num_blocks", "bytes_per_token_per_layer", "sliding_window", "compress_ratio")
    KIND_FIELD_NUMBER: _ClassVar[int]
    LAYER_INDICES_FIELD_NUMBER: _ClassVar[int]
    BLOCK_SIZE_FIELD_NUMBER: _ClassVar[int]
    NUM_BLOCKS_FIELD_NUMBER: _ClassVar[int]
    BYTES_PER_TOKEN_PER_LAYER_FIELD_NUMBER: _ClassVar[int]
    SLIDING_WINDOW_FIELD_NUMBER: _ClassVar[int]
    COMPRESS_RATIO_FIELD_NUMBER: _ClassVar[int]
    kind: AttentionKind
    layer_indices: _containers.RepeatedScalarFieldContainer[int]
    block_size: int
    num_blocks: int
    bytes_per_token_per_layer: int
    sliding_window: int
    compress_ratio: int
    def __init__(self, kind: _Optional[_Union[AttentionKind, str]] = ..., layer_indices: _Optional[_Iterable[int]] = ..., block_size: _Optional[int] = ..., num_blocks: _Optional[int] = ..., bytes_per_token_per_layer: _Optional[int] = ..., sliding_window: _Optional[int] = ..., compress_ratio: _Optional[int] = ...) -> None: ...

class BlockTable(_message.Message):
    __slots__ = ("block_ids",)
    BLOCK_IDS_FIELD_NUMBER: _ClassVar[int]
    block_ids: _containers.RepeatedScalarFieldContainer[int]
    def __init__(self, block_ids: _Optional[_Iterable[int]] = ...) -> None: ...
