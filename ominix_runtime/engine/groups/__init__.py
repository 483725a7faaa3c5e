"""Worker groups: what the engine core drives, one group per backend (see worker_group.py)."""

from ominix_runtime.contract import BackendAdapter, BackendCapability, Granularity
from ominix_runtime.engine.config import EngineCoreConfig
from ominix_runtime.engine.groups.request_group import RequestWorkerGroup
from ominix_runtime.engine.groups.step_group import StepWorkerGroup
from ominix_runtime.engine.groups.worker_group import ErrorInfo, GroupHooks, RequestTimes, WorkerGroup

# The kind of group for each granularity a backend may state.
GROUP_KINDS: dict[Granularity, type[WorkerGroup]] = {
    Granularity.STEP: StepWorkerGroup,
    Granularity.REQUEST: RequestWorkerGroup,
}


def build_group(
    backend: BackendAdapter, capability: BackendCapability, config: EngineCoreConfig, hooks: GroupHooks
) -> WorkerGroup:
    """The group that drives ``backend`` the way its capability says it works."""
    return GROUP_KINDS[capability.granularity].create(backend, capability, config, hooks)


__all__ = [
    "GROUP_KINDS",
    "ErrorInfo",
    "GroupHooks",
    "RequestTimes",
    "RequestWorkerGroup",
    "StepWorkerGroup",
    "WorkerGroup",
    "build_group",
]
