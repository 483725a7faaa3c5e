"""The backend-neutral contract between the engine, its front API and every backend. No torch here."""

from ominix_runtime.contract.adapter import BackendAdapter, RequestBackend, StepBackend, StepStream
from ominix_runtime.contract.capability import (
    ASCEND_PROFILE,
    CPU_PROFILE,
    CUDA_PROFILE,
    FAKE_PROFILE,
    PROFILES,
    SGLANG_PROFILE,
    BackendCapability,
    BackendKind,
    Granularity,
    ModelInfo,
    stated_profile,
)
from ominix_runtime.contract.errors import AdmissionRejected, InvalidArgument, OminixError, RuntimeErrorKind
from ominix_runtime.contract.events import Done, Error, PrefillDone, Token, Usage, WorkerEvent, is_terminal
from ominix_runtime.contract.kv import KVLease
from ominix_runtime.contract.request import GenerateRequest, Priority
from ominix_runtime.contract.sampling import SamplingParams
from ominix_runtime.contract.state import (
    ALLOWED_TRANSITIONS,
    TERMINAL_STATES,
    FinishReason,
    IllegalTransition,
    RequestState,
    check_transition,
    terminal_state_for,
)
from ominix_runtime.contract.step import (
    BatchPlan,
    DecodeStep,
    NewRequestData,
    RequestOutput,
    RunningRequestData,
    SampledLogprobs,
    StepResult,
    TokenLogprob,
)

__all__ = [
    "ALLOWED_TRANSITIONS",
    "ASCEND_PROFILE",
    "AdmissionRejected",
    "BackendAdapter",
    "BackendCapability",
    "BackendKind",
    "BatchPlan",
    "CPU_PROFILE",
    "CUDA_PROFILE",
    "DecodeStep",
    "Done",
    "Error",
    "FAKE_PROFILE",
    "FinishReason",
    "GenerateRequest",
    "Granularity",
    "IllegalTransition",
    "InvalidArgument",
    "KVLease",
    "ModelInfo",
    "NewRequestData",
    "OminixError",
    "PROFILES",
    "PrefillDone",
    "Priority",
    "RequestBackend",
    "RequestOutput",
    "RequestState",
    "RunningRequestData",
    "RuntimeErrorKind",
    "SGLANG_PROFILE",
    "SampledLogprobs",
    "SamplingParams",
    "StepBackend",
    "StepResult",
    "StepStream",
    "TERMINAL_STATES",
    "Token",
    "TokenLogprob",
    "Usage",
    "WorkerEvent",
    "check_transition",
    "is_terminal",
    "stated_profile",
    "terminal_state_for",
]
