"""The daemon's configuration: one frozen tree built from the command line.

Environment variables are only read for debug knobs, all prefixed ``OMINIX_`` (see :class:`DebugConfig`).
"""

from __future__ import annotations

import os
from dataclasses import dataclass, field

DEFAULT_HOST = "127.0.0.1"
DEFAULT_ENGINE_PORT = 50061
DEFAULT_WORKER_BASE_PORT = 50071
DEFAULT_METRICS_PORT = 9400
DEFAULT_DRAIN_TIMEOUT_S = 30.0
DEFAULT_WORKER_READY_TIMEOUT_S = 300.0
DEFAULT_WORKER_HEARTBEAT_TIMEOUT_S = 3.0
# Without --step-timeout the worker client derives each stream's step timeout from its measured step times;
# the engine core's own guard then only catches a backend that has no timeout of its own.
STEP_TIMEOUT_BACKSTOP_S = 600.0
DEFAULT_MAX_MESSAGE_BYTES = 4 * 1024 * 1024  # one GenerateRequest on the engine port (gRPC's own default)


@dataclass(frozen=True, slots=True)
class SchedulerConfig:
    """Overrides of what the backends state; None keeps the backend's own figure."""

    max_batch_tokens: int | None = None
    max_running_requests: int | None = None
    max_queue_len: int = 1024
    enable_prefix_caching: bool = True


@dataclass(frozen=True, slots=True)
class TLSConfig:
    """PEM paths; plaintext while unset.

    ``server_cert``/``server_key`` are the engine's identity: served on the engine port and, when
    ``worker_ca`` is set, presented to workers as the client certificate (mutual TLS). ``worker_ca`` verifies
    the workers' certificates.
    """

    server_cert: str | None = None
    server_key: str | None = None
    worker_ca: str | None = None

    @property
    def enabled(self) -> bool:
        return bool(self.server_cert and self.server_key)


@dataclass(frozen=True, slots=True)
class V0FrontConfig:
    """The ``ominix.worker.v0`` HTTP/SSE front OminiX-API speaks; off while ``port`` is None."""

    port: int | None = None  # 0: any free port
    host: str = DEFAULT_HOST  # loopback unless told otherwise
    token: str | None = None  # bearer token every route requires (mandatory when the front is on)

    @property
    def enabled(self) -> bool:
        return self.port is not None


@dataclass(frozen=True, slots=True)
class FrontConfig:
    """How the front API treats its clients: who may call it and what their text may do."""

    api_keys: tuple[str, ...] = ()  # empty: no authentication; else `authorization: Bearer KEY` is required
    # Trusted callers only: special-token strings in a prompt / in chat content act as special tokens.
    allow_special_tokens_in_prompt: bool = False
    allow_special_tokens_in_chat: bool = False
    tokenizer_threads: int = 2  # threads that tokenize and render chat templates off the event loop
    max_pending_tokenizations: int = 64  # more waiting prompts are refused (RESOURCE_EXHAUSTED)


@dataclass(frozen=True, slots=True)
class DebugConfig:
    """Knobs for debugging, read from OMINIX_* environment variables only."""

    log_steps: bool = False  # OMINIX_LOG_STEPS=1: one log line per scheduler step

    @classmethod
    def from_env(cls, env: dict[str, str] | None = None) -> DebugConfig:
        env = dict(os.environ) if env is None else env
        return cls(
            log_steps=env.get("OMINIX_LOG_STEPS", "") not in ("", "0", "false"),
        )


@dataclass(frozen=True, slots=True)
class EngineConfig:
    """Everything ``ominix-runtime serve`` needs."""

    model: str | None = None  # None: the embedded default model
    workers: tuple[str, ...] = ()  # host:port of step-level workers
    sglang_urls: tuple[str, ...] = ()  # request-level SGLang servers
    sglang_api_key: str | None = None  # SGLang's --api-key, sent as a bearer token
    served_model_names: tuple[str, ...] = ()  # other names requests may use for the model (first: v0's)
    host: str = DEFAULT_HOST
    port: int = DEFAULT_ENGINE_PORT
    metrics_port: int = DEFAULT_METRICS_PORT  # 0: no metrics HTTP server
    scheduler: SchedulerConfig = field(default_factory=SchedulerConfig)
    drain_timeout: float = DEFAULT_DRAIN_TIMEOUT_S
    worker_ready_timeout: float = DEFAULT_WORKER_READY_TIMEOUT_S
    log_level: str = "info"
    log_json: bool | None = None  # None: JSON unless stderr is a terminal
    tls: TLSConfig = field(default_factory=TLSConfig)
    max_message_bytes: int = DEFAULT_MAX_MESSAGE_BYTES  # larger requests are refused (RESOURCE_EXHAUSTED)
    v0: V0FrontConfig = field(default_factory=V0FrontConfig)
    front: FrontConfig = field(default_factory=FrontConfig)
    # A worker silent (no result, no heartbeat) this long is marked unhealthy and its requests fail over.
    worker_heartbeat_timeout: float = DEFAULT_WORKER_HEARTBEAT_TIMEOUT_S
    step_timeout: float | None = None  # None: derived from measured step times (see GrpcStepStream)
    engine_secret: str | None = None  # sent on Run to workers that require it (plaintext deployments)
    debug: DebugConfig = field(default_factory=DebugConfig)

    @property
    def address(self) -> str:
        return f"{self.host}:{self.port}"
