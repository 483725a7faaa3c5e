"""The engine: policy core (scheduler, KV registry), worker groups and the asyncio EngineCore."""

from ominix_runtime.engine.config import EngineCoreConfig, SchedulerConfig
from ominix_runtime.engine.core import EngineCore, RequestHandle
from ominix_runtime.engine.kv_registry import IntegrityError, KVRegistry, PrefixHit
from ominix_runtime.engine.scheduler import Scheduler
from ominix_runtime.engine.stats import EngineStats, LoadSnapshot, RunReport, StepReport

__all__ = [
    "EngineCore",
    "EngineCoreConfig",
    "EngineStats",
    "IntegrityError",
    "KVRegistry",
    "LoadSnapshot",
    "PrefixHit",
    "RequestHandle",
    "RunReport",
    "Scheduler",
    "SchedulerConfig",
    "StepReport",
]
