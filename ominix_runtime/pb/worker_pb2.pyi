from ominix_runtime.pb import common_pb2 as _common_pb2
from google.protobuf.internal import containers as _containers
from google.protobuf import descriptor as _descriptor
from google.protobuf import message as _message
from collections.abc import Iterable as _Iterable, Mapping as _Mapping
from typing import ClassVar as _ClassVar, Optional as _Optional, Union as _Union

DESCRIPTOR: _descriptor.FileDescriptor

class DescribeRequest(_message.Message):
    __slots__ = ()
    def __init__(self) -> None: ...

class HealthRequest(_message.Message):
    __slots__ = ()
    def __init__(self) -> None: ...

class HealthResponse(_message.Message):
    __slots__ = ("ready", "num_requests", "last_step_id", "launch_nonce", "pid")
    READY_FIELD_NUMBER: _ClassVar[int]
    NUM_REQUESTS_FIELD_NUMBER: _ClassVar[int]
    LAST_STEP_ID_FIELD_NUMBER: _ClassVar[int]
    LAUNCH_NONCE_FIELD_NUMBER: _ClassVar[int]
    PID_FIELD_NUMBER: _ClassVar[int]
    ready: bool
    num_requests: int
    last_step_id: int
    launch_nonce: str
    pid: int
    def __init__(self, ready: _Optional[bool] = ..., num_requests: _Optional[int] = ..., last_step_id: _Optional[int] = ..., launch_nonce: _Optional[str] = ..., pid: _Optional[int] = ...) -> None: ...

class NewRequest(_message.Message):
    __slots__ = ("request_id", "prompt_token_ids", "output_token_ids", "sampling", "kv_block_ids", "num_computed_tokens", "num_scheduled_tokens", "effective_seed", "traceparent", "group_kv_block_ids", "num_cached_kv_tokens")
    REQUEST_ID_FIELD_NUMBER: _ClassVar[int]
    PROMPT_TOKEN_IDS_FIELD_NUMBER: _ClassVar[int]
    OUTPUT_TOKEN_IDS_FIELD_NUMBER: _ClassVar[int]
    SAMPLING_FIELD_NUMBER: _ClassVar[int]
    KV_BLOCK_IDS_FIELD_NUMBER: _ClassVar[int]
    NUM_COMPUTED_TOKENS_FIELD_NUMBER: _ClassVar[int]
    NUM_SCHEDULED_TOKENS_FIELD_NUMBER: _ClassVar[int]
    EFFECTIVE_SEED_FIELD_NUMBER: _ClassVar[int]
    TRACEPARENT_FIELD_NUMBER: _ClassVar[int]
    GROUP_KV_BLOCK_IDS_FIELD_NUMBER: _ClassVar[int]
    NUM_CACHED_KV_TOKENS_FIELD_NUMBER: _ClassVar[int]
    request_id: str
    prompt_token_ids: _containers.RepeatedScalarFieldContainer[int]
    output_token_ids: _containers.RepeatedScalarFieldContainer[int]
    sampling: _common_pb2.SamplingParams
    kv_block_ids: _containers.RepeatedScalarFieldContainer[int]
    num_computed_tokens: int
    num_scheduled_tokens: int
    effective_seed: int
    traceparent: str
    group_kv_block_ids: _containers.RepeatedCompositeFieldContainer[_common_pb2.BlockTable]
    num_cached_kv_tokens: int
    def __init__(self, request_id: _Optional[str] = ..., prompt_token_ids: _Optional[_Iterable[int]] = ..., output_token_ids: _Optional[_Iterable[int]] = ..., sampling: _Optional[_Union[_common_pb2.SamplingParams, _Mapping]] = ..., kv_block_ids: _Optional[_Iterable[int]] = ..., num_computed_tokens: _Optional[int] = ..., num_scheduled_tokens: _Optional[int] = ..., effective_seed: _Optional[int] = ..., traceparent: _Optional[str] = ..., group_kv_block_ids: _Optional[_Iterable[_Union[_common_pb2.BlockTable, _Mapping]]] = ..., num_cached_kv_tokens: _Optional[int] = ...) -> None: ...

class RunningRequest(_message.Message):
    __slots__ = ("request_id", "new_kv_block_ids", "num_scheduled_tokens", "new_group_kv_block_ids")
    REQUEST_ID_FIELD_NUMBER: _ClassVar[int]
    NEW_KV_BLOCK_IDS_FIELD_NUMBER: _ClassVar[int]
    NUM_SCHEDULED_TOKENS_FIELD_NUMBER: _ClassVar[int]
    NEW_GROUP_KV_BLOCK_IDS_FIELD_NUMBER: _ClassVar[int]
    request_id: str
    new_kv_block_ids: _containers.RepeatedScalarFieldContainer[int]
    num_scheduled_tokens: int
    new_group_kv_block_ids: _containers.RepeatedCompositeFieldContainer[_common_pb2.BlockTable]
    def __init__(self, request_id: _Optional[str] = ..., new_kv_block_ids: _Optional[_Iterable[int]] = ..., num_scheduled_tokens: _Optional[int] = ..., new_group_kv_block_ids: _Optional[_Iterable[_Union[_common_pb2.BlockTable, _Mapping]]] = ...) -> None: ...

class DecodeStep(_message.Message):
    __slots__ = ("step_id", "new_requests", "running_requests", "finished_request_ids")
    STEP_ID_FIELD_NUMBER: _ClassVar[int]
    NEW_REQUESTS_FIELD_NUMBER: _ClassVar[int]
    RUNNING_REQUESTS_FIELD_NUMBER: _ClassVar[int]
    FINISHED_REQUEST_IDS_FIELD_NUMBER: _ClassVar[int]
    step_id: int
    new_requests: _containers.RepeatedCompositeFieldContainer[NewRequest]
    running_requests: _containers.RepeatedCompositeFieldContainer[RunningRequest]
    finished_request_ids: _containers.RepeatedScalarFieldContainer[str]
    def __init__(self, step_id: _Optional[int] = ..., new_requests: _Optional[_Iterable[_Union[NewRequest, _Mapping]]] = ..., running_requests: _Optional[_Iterable[_Union[RunningRequest, _Mapping]]] = ..., finished_request_ids: _Optional[_Iterable[str]] = ...) -> None: ...

class RequestOutput(_message.Message):
    __slots__ = ("request_id", "sampled_token_id", "logprobs", "error")
    REQUEST_ID_FIELD_NUMBER: _ClassVar[int]
    SAMPLED_TOKEN_ID_FIELD_NUMBER: _ClassVar[int]
    LOGPROBS_FIELD_NUMBER: _ClassVar[int]
    ERROR_FIELD_NUMBER: _ClassVar[int]
    request_id: str
    sampled_token_id: int
    logprobs: _common_pb2.SampledLogprobs
    error: _common_pb2.ErrorInfo
    def __init__(self, request_id: _Optional[str] = ..., sampled_token_id: _Optional[int] = ..., logprobs: _Optional[_Union[_common_pb2.SampledLogprobs, _Mapping]] = ..., error: _Optional[_Union[_common_pb2.ErrorInfo, _Mapping]] = ...) -> None: ...

class StepResult(_message.Message):
    __slots__ = ("step_id", "outputs", "compute_seconds", "num_tokens")
    STEP_ID_FIELD_NUMBER: _ClassVar[int]
    OUTPUTS_FIELD_NUMBER: _ClassVar[int]
    COMPUTE_SECONDS_FIELD_NUMBER: _ClassVar[int]
    NUM_TOKENS_FIELD_NUMBER: _ClassVar[int]
    step_id: int
    outputs: _containers.RepeatedCompositeFieldContainer[RequestOutput]
    compute_seconds: float
    num_tokens: int
    def __init__(self, step_id: _Optional[int] = ..., outputs: _Optional[_Iterable[_Union[RequestOutput, _Mapping]]] = ..., compute_seconds: _Optional[float] = ..., num_tokens: _Optional[int] = ...) -> None: ...

class Heartbeat(_message.Message):
    __slots__ = ("worker_time",)
    WORKER_TIME_FIELD_NUMBER: _ClassVar[int]
    worker_time: float
    def __init__(self, worker_time: _Optional[float] = ...) -> None: ...

class WorkerMessage(_message.Message):
    __slots__ = ("step_result", "heartbeat", "fatal_error")
    STEP_RESULT_FIELD_NUMBER: _ClassVar[int]
    HEARTBEAT_FIELD_NUMBER: _ClassVar[int]
    FATAL_ERROR_FIELD_NUMBER: _ClassVar[int]
    step_result: StepResult
    heartbeat: Heartbeat
    fatal_error: _common_pb2.ErrorInfo
    def __init__(self, step_result: _Optional[_Union[StepResult, _Mapping]] = ..., heartbeat: _Optional[_Union[Heartbeat, _Mapping]] = ..., fatal_error: _Optional[_Union[_common_pb2.ErrorInfo, _Mapping]] = ...) -> None: ...
