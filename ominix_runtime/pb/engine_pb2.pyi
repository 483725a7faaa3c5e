from google.protobuf import struct_pb2 as _struct_pb2
from ominix_runtime.pb import common_pb2 as _common_pb2
from google.protobuf.internal import containers as _containers
from google.protobuf.internal import enum_type_wrapper as _enum_type_wrapper
from google.protobuf import descriptor as _descriptor
from google.protobuf import message as _message
from collections.abc import Iterable as _Iterable, Mapping as _Mapping
from typing import ClassVar as _ClassVar, Optional as _Optional, Union as _Union

DESCRIPTOR: _descriptor.FileDescriptor

class BackendHealth(int, metaclass=_enum_type_wrapper.EnumTypeWrapper):
    __slots__ = ()
    BACKEND_HEALTH_UNSPECIFIED: _ClassVar[BackendHealth]
    BACKEND_HEALTH_STARTING: _ClassVar[BackendHealth]
    BACKEND_HEALTH_AVAILABLE: _ClassVar[BackendHealth]
    BACKEND_HEALTH_DRAINING: _ClassVar[BackendHealth]
    BACKEND_HEALTH_UNHEALTHY: _ClassVar[BackendHealth]
    BACKEND_HEALTH_OFFLINE: _ClassVar[BackendHealth]
BACKEND_HEALTH_UNSPECIFIED: BackendHealth
BACKEND_HEALTH_STARTING: BackendHealth
BACKEND_HEALTH_AVAILABLE: BackendHealth
BACKEND_HEALTH_DRAINING: BackendHealth
BACKEND_HEALTH_UNHEALTHY: BackendHealth
BACKEND_HEALTH_OFFLINE: BackendHealth

class ChatMessage(_message.Message):
    __slots__ = ("role", "content")
    ROLE_FIELD_NUMBER: _ClassVar[int]
    CONTENT_FIELD_NUMBER: _ClassVar[int]
    role: str
    content: str
    def __init__(self, role: _Optional[str] = ..., content: _Optional[str] = ...) -> None: ...

class ChatMessages(_message.Message):
    __slots__ = ("messages", "chat_template_kwargs")
    MESSAGES_FIELD_NUMBER: _ClassVar[int]
    CHAT_TEMPLATE_KWARGS_FIELD_NUMBER: _ClassVar[int]
    messages: _containers.RepeatedCompositeFieldContainer[ChatMessage]
    chat_template_kwargs: _struct_pb2.Struct
    def __init__(self, messages: _Optional[_Iterable[_Union[ChatMessage, _Mapping]]] = ..., chat_template_kwargs: _Optional[_Union[_struct_pb2.Struct, _Mapping]] = ...) -> None: ...

class TokenIds(_message.Message):
    __slots__ = ("ids",)
    IDS_FIELD_NUMBER: _ClassVar[int]
    ids: _containers.RepeatedScalarFieldContainer[int]
    def __init__(self, ids: _Optional[_Iterable[int]] = ...) -> None: ...

class GenerateRequest(_message.Message):
    __slots__ = ("request_id", "model", "prompt", "messages", "input_ids", "sampling", "priority", "deadline_ms", "stream")
    REQUEST_ID_FIELD_NUMBER: _ClassVar[int]
    MODEL_FIELD_NUMBER: _ClassVar[int]
    PROMPT_FIELD_NUMBER: _ClassVar[int]
    MESSAGES_FIELD_NUMBER: _ClassVar[int]
    INPUT_IDS_FIELD_NUMBER: _ClassVar[int]
    SAMPLING_FIELD_NUMBER: _ClassVar[int]
    PRIORITY_FIELD_NUMBER: _ClassVar[int]
    DEADLINE_MS_FIELD_NUMBER: _ClassVar[int]
    STREAM_FIELD_NUMBER: _ClassVar[int]
    request_id: str
    model: str
    prompt: str
    messages: ChatMessages
    input_ids: TokenIds
    sampling: _common_pb2.SamplingParams
    priority: _common_pb2.Priority
    deadline_ms: int
    stream: bool
    def __init__(self, request_id: _Optional[str] = ..., model: _Optional[str] = ..., prompt: _Optional[str] = ..., messages: _Optional[_Union[ChatMessages, _Mapping]] = ..., input_ids: _Optional[_Union[TokenIds, _Mapping]] = ..., sampling: _Optional[_Union[_common_pb2.SamplingParams, _Mapping]] = ..., priority: _Optional[_Union[_common_pb2.Priority, str]] = ..., deadline_ms: _Optional[int] = ..., stream: _Optional[bool] = ...) -> None: ...

class GenerateBatchRequest(_message.Message):
    __slots__ = ("requests",)
    REQUESTS_FIELD_NUMBER: _ClassVar[int]
    requests: _containers.RepeatedCompositeFieldContainer[GenerateRequest]
    def __init__(self, requests: _Optional[_Iterable[_Union[GenerateRequest, _Mapping]]] = ...) -> None: ...

class GenerateEventBatch(_message.Message):
    __slots__ = ("events",)
    EVENTS_FIELD_NUMBER: _ClassVar[int]
    events: _containers.RepeatedCompositeFieldContainer[GenerateEvent]
    def __init__(self, events: _Optional[_Iterable[_Union[GenerateEvent, _Mapping]]] = ...) -> None: ...

class PrefillDone(_message.Message):
    __slots__ = ("prompt_tokens", "cached_tokens", "ttft_seconds")
    PROMPT_TOKENS_FIELD_NUMBER: _ClassVar[int]
    CACHED_TOKENS_FIELD_NUMBER: _ClassVar[int]
    TTFT_SECONDS_FIELD_NUMBER: _ClassVar[int]
    prompt_tokens: int
    cached_tokens: int
    ttft_seconds: float
    def __init__(self, prompt_tokens: _Optional[int] = ..., cached_tokens: _Optional[int] = ..., ttft_seconds: _Optional[float] = ...) -> None: ...

class TokenChunk(_message.Message):
    __slots__ = ("token_ids", "text", "logprobs")
    TOKEN_IDS_FIELD_NUMBER: _ClassVar[int]
    TEXT_FIELD_NUMBER: _ClassVar[int]
    LOGPROBS_FIELD_NUMBER: _ClassVar[int]
    token_ids: _containers.RepeatedScalarFieldContainer[int]
    text: str
    logprobs: _containers.RepeatedCompositeFieldContainer[_common_pb2.SampledLogprobs]
    def __init__(self, token_ids: _Optional[_Iterable[int]] = ..., text: _Optional[str] = ..., logprobs: _Optional[_Iterable[_Union[_common_pb2.SampledLogprobs, _Mapping]]] = ...) -> None: ...

class Done(_message.Message):
    __slots__ = ("finish_reason", "text", "matched_stop")
    FINISH_REASON_FIELD_NUMBER: _ClassVar[int]
    TEXT_FIELD_NUMBER: _ClassVar[int]
    MATCHED_STOP_FIELD_NUMBER: _ClassVar[int]
    finish_reason: _common_pb2.FinishReason
    text: str
    matched_stop: str
    def __init__(self, finish_reason: _Optional[_Union[_common_pb2.FinishReason, str]] = ..., text: _Optional[str] = ..., matched_stop: _Optional[str] = ...) -> None: ...

class GenerateEvent(_message.Message):
    __slots__ = ("request_id", "prefill_done", "token", "usage", "done", "error")
    REQUEST_ID_FIELD_NUMBER: _ClassVar[int]
    PREFILL_DONE_FIELD_NUMBER: _ClassVar[int]
    TOKEN_FIELD_NUMBER: _ClassVar[int]
    USAGE_FIELD_NUMBER: _ClassVar[int]
    DONE_FIELD_NUMBER: _ClassVar[int]
    ERROR_FIELD_NUMBER: _ClassVar[int]
    request_id: str
    prefill_done: PrefillDone
    token: TokenChunk
    usage: _common_pb2.Usage
    done: Done
    error: _common_pb2.ErrorInfo
    def __init__(self, request_id: _Optional[str] = ..., prefill_done: _Optional[_Union[PrefillDone, _Mapping]] = ..., token: _Optional[_Union[TokenChunk, _Mapping]] = ..., usage: _Optional[_Union[_common_pb2.Usage, _Mapping]] = ..., done: _Optional[_Union[Done, _Mapping]] = ..., error: _Optional[_Union[_common_pb2.ErrorInfo, _Mapping]] = ...) -> None: ...

class AbortRequest(_message.Message):
    __slots__ = ("request_id",)
    REQUEST_ID_FIELD_NUMBER: _ClassVar[int]
    request_id: str
    def __init__(self, request_id: _Optional[str] = ...) -> None: ...

class AbortResponse(_message.Message):
    __slots__ = ("found",)
    FOUND_FIELD_NUMBER: _ClassVar[int]
    found: bool
    def __init__(self, found: _Optional[bool] = ...) -> None: ...

class GetLoadRequest(_message.Message):
    __slots__ = ()
    def __init__(self) -> None: ...

class BackendLoad(_message.Message):
    __slots__ = ("worker_id", "queued_requests", "running_requests", "waiting_tokens", "kv_bytes_used", "kv_bytes_capacity", "estimated_decode_tokens_per_second", "healthy", "health", "timestamp_ms", "model_ids", "served_aliases", "capabilities", "backend_kind")
    WORKER_ID_FIELD_NUMBER: _ClassVar[int]
    QUEUED_REQUESTS_FIELD_NUMBER: _ClassVar[int]
    RUNNING_REQUESTS_FIELD_NUMBER: _ClassVar[int]
    WAITING_TOKENS_FIELD_NUMBER: _ClassVar[int]
    KV_BYTES_USED_FIELD_NUMBER: _ClassVar[int]
    KV_BYTES_CAPACITY_FIELD_NUMBER: _ClassVar[int]
    ESTIMATED_DECODE_TOKENS_PER_SECOND_FIELD_NUMBER: _ClassVar[int]
    HEALTHY_FIELD_NUMBER: _ClassVar[int]
    HEALTH_FIELD_NUMBER: _ClassVar[int]
    TIMESTAMP_MS_FIELD_NUMBER: _ClassVar[int]
    MODEL_IDS_FIELD_NUMBER: _ClassVar[int]
    SERVED_ALIASES_FIELD_NUMBER: _ClassVar[int]
    CAPABILITIES_FIELD_NUMBER: _ClassVar[int]
    BACKEND_KIND_FIELD_NUMBER: _ClassVar[int]
    worker_id: str
    queued_requests: int
    running_requests: int
    waiting_tokens: int
    kv_bytes_used: int
    kv_bytes_capacity: int
    estimated_decode_tokens_per_second: float
    healthy: bool
    health: BackendHealth
    timestamp_ms: int
    model_ids: _containers.RepeatedScalarFieldContainer[str]
    served_aliases: _containers.RepeatedScalarFieldContainer[str]
    capabilities: _containers.RepeatedScalarFieldContainer[str]
    backend_kind: str
    def __init__(self, worker_id: _Optional[str] = ..., queued_requests: _Optional[int] = ..., running_requests: _Optional[int] = ..., waiting_tokens: _Optional[int] = ..., kv_bytes_used: _Optional[int] = ..., kv_bytes_capacity: _Optional[int] = ..., estimated_decode_tokens_per_second: _Optional[float] = ..., healthy: _Optional[bool] = ..., health: _Optional[_Union[BackendHealth, str]] = ..., timestamp_ms: _Optional[int] = ..., model_ids: _Optional[_Iterable[str]] = ..., served_aliases: _Optional[_Iterable[str]] = ..., capabilities: _Optional[_Iterable[str]] = ..., backend_kind: _Optional[str] = ...) -> None: ...

class DrainRequest(_message.Message):
    __slots__ = ("worker_id",)
    WORKER_ID_FIELD_NUMBER: _ClassVar[int]
    worker_id: str
    def __init__(self, worker_id: _Optional[str] = ...) -> None: ...

class DrainResponse(_message.Message):
    __slots__ = ("backends",)
    BACKENDS_FIELD_NUMBER: _ClassVar[int]
    backends: _containers.RepeatedCompositeFieldContainer[BackendLoad]
    def __init__(self, backends: _Optional[_Iterable[_Union[BackendLoad, _Mapping]]] = ...) -> None: ...

class GetLoadResponse(_message.Message):
    __slots__ = ("total", "backends")
    TOTAL_FIELD_NUMBER: _ClassVar[int]
    BACKENDS_FIELD_NUMBER: _ClassVar[int]
    total: BackendLoad
    backends: _containers.RepeatedCompositeFieldContainer[BackendLoad]
    def __init__(self, total: _Optional[_Union[BackendLoad, _Mapping]] = ..., backends: _Optional[_Iterable[_Union[BackendLoad, _Mapping]]] = ...) -> None: ...

class GetStatsRequest(_message.Message):
    __slots__ = ()
    def __init__(self) -> None: ...

class GetStatsResponse(_message.Message):
    __slots__ = ("requests_accepted", "requests_finished", "requests_aborted", "requests_failed", "requests_rejected", "prompt_tokens", "generated_tokens", "cached_tokens", "preemptions", "steps", "kv_blocks_used", "kv_blocks_total", "uptime_seconds")
    REQUESTS_ACCEPTED_FIELD_NUMBER: _ClassVar[int]
    REQUESTS_FINISHED_FIELD_NUMBER: _ClassVar[int]
    REQUESTS_ABORTED_FIELD_NUMBER: _ClassVar[int]
    REQUESTS_FAILED_FIELD_NUMBER: _ClassVar[int]
    REQUESTS_REJECTED_FIELD_NUMBER: _ClassVar[int]
    PROMPT_TOKENS_FIELD_NUMBER: _ClassVar[int]
    GENERATED_TOKENS_FIELD_NUMBER: _ClassVar[int]
    CACHED_TOKENS_FIELD_NUMBER: _ClassVar[int]
    PREEMPTIONS_FIELD_NUMBER: _ClassVar[int]
    STEPS_FIELD_NUMBER: _ClassVar[int]
    KV_BLOCKS_USED_FIELD_NUMBER: _ClassVar[int]
    KV_BLOCKS_TOTAL_FIELD_NUMBER: _ClassVar[int]
    UPTIME_SECONDS_FIELD_NUMBER: _ClassVar[int]
    requests_accepted: int
    requests_finished: int
    requests_aborted: int
    requests_failed: int
    requests_rejected: int
    prompt_tokens: int
    generated_tokens: int
    cached_tokens: int
    preemptions: int
    steps: int
    kv_blocks_used: int
    kv_blocks_total: int
    uptime_seconds: float
    def __init__(self, requests_accepted: _Optional[int] = ..., requests_finished: _Optional[int] = ..., requests_aborted: _Optional[int] = ..., requests_failed: _Optional[int] = ..., requests_rejected: _Optional[int] = ..., prompt_tokens: _Optional[int] = ..., generated_tokens: _Optional[int] = ..., cached_tokens: _Optional[int] = ..., preemptions: _Optional[int] = ..., steps: _Optional[int] = ..., kv_blocks_used: _Optional[int] = ..., kv_blocks_total: _Optional[int] = ..., uptime_seconds: _Optional[float] = ...) -> None: ...

class ListBackendsRequest(_message.Message):
    __slots__ = ()
    def __init__(self) -> None: ...

class ListBackendsResponse(_message.Message):
    __slots__ = ("backends",)
    BACKENDS_FIELD_NUMBER: _ClassVar[int]
    backends: _containers.RepeatedCompositeFieldContainer[_common_pb2.BackendCapability]
    def __init__(self, backends: _Optional[_Iterable[_Union[_common_pb2.BackendCapability, _Mapping]]] = ...) -> None: ...
