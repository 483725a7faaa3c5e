"""The runtime's configuration: one frozen tree for every process (engine daemon, worker, launcher).

The tree is built in one place (``ominix_runtime.cli.settings``) from command-line flags, ``OMINIX_<FLAG>``
environment variables and a ``--config`` file; each flag writes one or more paths of this tree
(``ominix_runtime.cli.flags``). A few debug-only switches are environment variables only; they are listed,
typed, in :data:`DEBUG_VARIABLES` and land in :class:`DebugConfig`. Nothing else reads the environment.
"""

from __future__ import annotations

import dataclasses
import os
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from typing import Any, TypeVar, cast

from ominix_runtime.engine.config import EngineCoreConfig, SchedulerConfig

__all__ = [
    "DEBUG_VARIABLES",
    "BackendsConfig",
    "DebugConfig",
    "DebugVariable",
    "EngineCoreConfig",
    "FrontConfig",
    "LaunchConfig",
    "LogConfig",
    "ModelConfig",
    "RuntimeConfig",
    "SchedulerConfig",
    "ServerConfig",
    "TLSConfig",
    "WorkerConfig",
    "get_path",
    "with_paths",
]

T = TypeVar("T")
DEFAULT_HOST = "127.0.0.1"
DEFAULT_ENGINE_PORT = 50061
DEFAULT_WORKER_PORT = 50071
DEFAULT_METRICS_PORT = 9400
CPU_KV_CACHE_MEMORY = "1GiB"  # a CPU worker's KV cache unless --kv-cache-memory says otherwise
DEFAULT_MAX_MESSAGE_BYTES = 4 * 1024 * 1024  # one GenerateRequest on the engine port (gRPC's own default)
DEFAULT_DIST_TIMEOUT_S = 30.0  # a tensor-parallel group's collectives and control messages
# A worker silent (no result, no heartbeat) this long is marked unhealthy and its requests fail over.
DEFAULT_WORKER_HEARTBEAT_TIMEOUT_S = 3.0
LOG_LEVELS = ("debug", "info", "warning", "error")
LOG_FORMATS = ("auto", "json", "console")


@dataclass(frozen=True, slots=True)
class ModelConfig:
    """What to serve: shared by the engine (tokenizer, name checks) and the worker (weights)."""

    path: str | None = None  # None: the embedded default model
    served_model_names: tuple[str, ...] = ()  # names requests may use; empty: the model's own name


@dataclass(frozen=True, slots=True)
class TLSConfig:
    """This process's identity and the CA of its peers (PEM paths); plaintext while unset.

    Engine: ``cert``/``key`` are served on the engine port and, when ``ca`` is set, presented to the workers
    as the client certificate; ``ca`` verifies the workers. Worker: ``cert``/``key`` are served on the worker
    port; ``ca`` makes the worker accept only clients (the engine) with a certificate it signed (mutual TLS).
    """

    cert: str | None = None
    key: str | None = None
    ca: str | None = None
    # Plaintext deployments: a file holding the secret the engine presents on Run and workers require.
    engine_secret_file: str | None = None
    # Worker with --tls-ca: names the engine's client certificate must carry (empty: the default identity).
    engine_identities: tuple[str, ...] = ()

    @property
    def enabled(self) -> bool:
        return bool(self.cert and self.key)


@dataclass(frozen=True, slots=True)
class FrontConfig:
    """How the front API treats its clients: who may call it and what their text may do."""

    api_keys: tuple[str, ...] = ()  # empty: no authentication; else `authorization: Bearer KEY` is required
    # Trusted callers only: special-token strings in a prompt / in chat content act as special tokens.
    allow_special_tokens_in_prompt: bool = False
    allow_special_tokens_in_chat: bool = False
    tokenizer_threads: int = 2  # threads that tokenize and render chat templates off the event loop
    max_pending_tokenizations: int = 64  # more waiting prompts are refused (RESOURCE_EXHAUSTED)
    # Processes that serve the clients' streams on the engine port (server/front_hub.py); 0: the engine
    # process serves them itself. None: `launch` starts one per GPU worker group (none on CPUs), `serve`
    # takes 0.
    procs: int | None = None


@dataclass(frozen=True, slots=True)
class ServerConfig:
    """The process's own gRPC server (engine front API, or a worker's Worker service) and its side ports."""

    host: str = DEFAULT_HOST
    port: int = DEFAULT_ENGINE_PORT
    metrics_host: str = DEFAULT_HOST
    metrics_port: int = DEFAULT_METRICS_PORT  # 0: no metrics HTTP server
    max_message_bytes: int = DEFAULT_MAX_MESSAGE_BYTES  # larger requests are refused (RESOURCE_EXHAUSTED)
    drain_timeout: float = 30.0  # seconds live requests may take to finish after SIGINT/SIGTERM
    stats_interval: float = 10.0  # seconds between periodic stats log lines; 0: none

    @property
    def address(self) -> str:
        return f"{self.host}:{self.port}"


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
class BackendsConfig:
    """The backends an engine drives."""

    workers: tuple[str, ...] = ()  # host:port of step-level workers
    sglang_urls: tuple[str, ...] = ()  # request-level SGLang servers
    sglang_api_key: str | None = None  # SGLang's --api-key, sent as a bearer token
    # Seconds to wait for every worker to report ready: loading a large checkpoint and profiling the KV cache
    # takes minutes (vLLM waits 600 s for its engine too); deploy/kubernetes gives the startup as long.
    ready_timeout: float = 600.0
    heartbeat_timeout: float = DEFAULT_WORKER_HEARTBEAT_TIMEOUT_S
    # A step may take this long, heartbeats or not; None: derived per stream from its measured steps.
    step_timeout: float | None = None
    # Set by `launch` for its engine: a worker is used, and reconnected after a restart, only while its Health
    # states this nonce (a foreign process that took a restarted worker's port is never driven).
    launch_nonce: str = ""


@dataclass(frozen=True, slots=True)
class WorkerConfig:
    """One worker process: its device, how the model is loaded and how large its KV cache is."""

    device: str = "cpu"
    dtype: str = "auto"
    quantization: str = "none"  # fp8: quantize a float checkpoint's projections and experts at load
    kv_cache_dtype: str = "auto"  # auto: the run dtype; fp8_e4m3: K and V stored in FP8
    # Bytes for the KV cache; "": CPU_KV_CACHE_MEMORY on a CPU, sized from gpu_memory_utilization on a GPU.
    kv_cache_memory: str = ""
    gpu_memory_utilization: float = 0.9  # GPU: fraction of device memory for weights, activations and KV
    block_size: int = 16
    max_batch_tokens: int | None = None  # None: the device profile's
    max_running_requests: int | None = None  # None: the device profile's
    max_model_len: int | None = None  # None: the model's max_position_embeddings
    attention: str | None = None  # None: chosen by the device
    num_threads: int = 0  # CPU threads for torch; 0: torch's default
    worker_id: str | None = None  # None: DEVICE@HOST:PORT
    launch_nonce: str = ""  # set by `launch`; stated in Health so it knows its own workers
    # Tensor parallelism: one process per rank; rank 0 serves the engine, the others follow it.
    tp_size: int = 1
    tp_rank: int = 0
    dist_init_addr: str | None = None  # HOST:PORT where rank 0 gathers its group
    dist_timeout: float = DEFAULT_DIST_TIMEOUT_S
    moe_parallel: str = "tensor"  # how a group splits MoE layers: tensor (slices) or expert (whole experts)
    # CUDA: a finished step's result leaves while the eager step after it is still being launched (off: after
    # that launch). Alone it made a step carrying two prompts one long client gap (ITL p99 1.34x vLLM's at 16
    # req/s); beside the scheduler's prefill_tokens_beside_decodes it gave the best ITL p99 at 4 and 8 req/s and
    # tied the old defaults at 16 on an H200 (bench/RESULTS.md, 2026-11-29 19:53 - 20:10 and 21:43 - 22:08).
    early_results: bool = True


@dataclass(frozen=True, slots=True)
class LaunchConfig:
    """``ominix-runtime launch``: one worker per device on loopback, then the engine."""

    devices: tuple[str, ...] = ("cpu",)
    worker_host: str = DEFAULT_HOST
    worker_base_port: int = DEFAULT_WORKER_PORT  # 0: free ports outside the kernel's ephemeral range
    worker_threads: int = 0  # torch threads per CPU worker; 0: the cores split among the CPU workers
    tensor_parallel_size: int = 1  # devices per worker group (consecutive devices, one backend per group)
    dist_base_port: int = 0  # group g's ranks meet on base + g; 0: free ports picked at start
    engine_in_child: bool = False


@dataclass(frozen=True, slots=True)
class LogConfig:
    level: str = "info"
    format: str = "auto"  # auto: console on a terminal, JSON otherwise

    @property
    def json(self) -> bool | None:
        """None: decide by whether stderr is a terminal."""
        return {"auto": None, "json": True, "console": False}[self.format]


@dataclass(frozen=True, slots=True)
class DebugConfig:
    """Debug-only switches; set from the ``OMINIX_*`` variables in :data:`DEBUG_VARIABLES` only."""

    log_steps: bool = False  # one log line per scheduler step
    pipeline: bool = True  # worker: overlap decode steps on CUDA
    pipeline_eager: bool = True  # worker: overlap prefill and mixed steps too (with ``pipeline``, on CUDA)
    cuda_graphs: bool = True  # worker: capture decode steps as CUDA graphs
    weight_stream: bool = True  # worker: one token's dense GEMMs on CUDA through the weight-streaming kernel
    triton_fast_launch: bool = True  # worker: repeat Triton launches skip Triton's per-call launch path
    pad_logits: bool = True  # worker: an eager step's LM head runs at a captured decode size of rows
    # worker, CUDA: each linear's GEMM warmed at start once per bucket of this many rows; 0: off
    warm_gemm_rows: int = 0
    # worker, CUDA: prefill and mixed steps of up to this many tokens replay piecewise CUDA graphs; 0: eager.
    # On an H200 their host launch took 3.1 - 3.8 ms instead of 12.6 - 24.4 for a 1,032-token mixed step, whose
    # device time grew 0.7 ms (padding rows, query copies); online ITL p99 moved -0.6 to +1.4 ms against eager
    # runs on the same hosts, whose launches stayed under the device time there (bench/RESULTS.md, 2026-11-30).
    # On, only bucket row counts reach the GEMMs, and a slower host's launch no longer outlasts the step.
    piecewise_graph_tokens: int = 2048
    # worker, CUDA: the pieces' bucket spacing in tokens (a step computes fewer padding rows than this; the last
    # bucket is the budget); finer spacing means more captures at start, each one bucket. cuBLAS runs some row
    # counts much slower than a few rows fewer (a layer's four GEMMs x 32: 21.9 ms at 1,032 rows, 24.0 at
    # 1,056). On an H200, Llama-3.1-8B shape (bench/RESULTS.md, 2026-11-30 18:41 - 18:57): a mixed step of 8
    # decodes and a 1,024-token prompt took 25.30 ms at 8 (the 1,032 bucket) against 27.14 at 32 (1,056); online
    # beside vLLM, 8 read TTFT p50 and ITL p99 4 - 5% lower than 32 at 4, 8 and 16 req/s, both rounds. The cost
    # is at start: 256 captures up to 2,048 tokens in 13.0 s, against 64 in 3.5 s.
    piecewise_token_step: int = 8
    # worker, CUDA, a lone rank: each piecewise bucket timed at start, and a step replays the fastest captured
    # bucket that holds it (cuBLAS runs some row counts slower than larger ones). Off: online beside vLLM it
    # moved nothing, as no larger bucket was faster than a 1,032-row step's (bench/RESULTS.md, 2026-11-30).
    piecewise_fastest_bucket: bool = False


@dataclass(frozen=True, slots=True)
class RuntimeConfig:
    """The root of the tree."""

    model: ModelConfig = field(default_factory=ModelConfig)
    engine: EngineCoreConfig = field(default_factory=EngineCoreConfig)
    backends: BackendsConfig = field(default_factory=BackendsConfig)
    server: ServerConfig = field(default_factory=ServerConfig)
    front: FrontConfig = field(default_factory=FrontConfig)
    v0: V0FrontConfig = field(default_factory=V0FrontConfig)
    tls: TLSConfig = field(default_factory=TLSConfig)
    worker: WorkerConfig = field(default_factory=WorkerConfig)
    launch: LaunchConfig = field(default_factory=LaunchConfig)
    log: LogConfig = field(default_factory=LogConfig)
    debug: DebugConfig = field(default_factory=DebugConfig)

    @property
    def scheduler(self) -> SchedulerConfig:
        return self.engine.scheduler


# ---- paths ----------------------------------------------------------------------------------------------


def get_path(tree: Any, path: str) -> Any:
    """The value at a dotted path, e.g. ``get_path(config, "engine.scheduler.max_batch_tokens")``."""
    node = tree
    for part in path.split("."):
        node = getattr(node, part)
    return node


def with_paths(tree: T, values: Mapping[str, Any]) -> T:
    """A copy of a frozen tree with the dotted paths in ``values`` replaced (unknown paths raise KeyError)."""
    node: Any = tree  # a dataclass instance: each branch of the tree is one
    here: dict[str, Any] = {}
    below: dict[str, dict[str, Any]] = {}
    names = {f.name for f in dataclasses.fields(node)}
    for path, value in values.items():
        head, _, rest = path.partition(".")
        if head not in names:
            raise KeyError(f"{type(tree).__name__} has no field {head!r} (path {path!r})")
        if rest:
            below.setdefault(head, {})[rest] = value
        else:
            here[head] = value
    for head, sub in below.items():
        here[head] = with_paths(here.get(head, getattr(tree, head)), sub)
    return cast(T, dataclasses.replace(node, **here))


# ---- debug variables ------------------------------------------------------------------------------------


def _whole(text: str, minimum: int, expected: str) -> int:
    try:
        value = int(text.strip())
    except ValueError:
        raise ValueError(f"expected {expected}, got {text!r}") from None
    if value < minimum:
        raise ValueError(f"expected {expected}, got {text!r}")
    return value


def _count(text: str) -> int:
    return _whole(text, 0, "a count (0: off)") if text.strip() else 0


def _positive(text: str) -> int:
    return _whole(text, 1, "a whole number of at least 1")


def _switch(text: str) -> bool:
    lowered = text.strip().lower()
    if lowered in ("1", "true", "yes", "on"):
        return True
    if lowered in ("0", "false", "no", "off", ""):
        return False
    raise ValueError(f"expected 0 or 1, got {text!r}")


@dataclass(frozen=True, slots=True)
class DebugVariable:
    """An environment-only debug switch: its variable, the tree path it sets and how its text is read."""

    name: str
    path: str
    parse: Callable[[str], Any]
    help: str


DEBUG_VARIABLES: tuple[DebugVariable, ...] = (
    DebugVariable("OMINIX_LOG_STEPS", "debug.log_steps", _switch, "1: one log line per scheduler step"),
    DebugVariable("OMINIX_PIPELINE", "debug.pipeline", _switch, "0: no overlapped decode steps on CUDA"),
    DebugVariable(
        "OMINIX_PIPELINE_EAGER",
        "debug.pipeline_eager",
        _switch,
        "0: prefill and mixed steps never overlapped (decode steps still are)",
    ),
    DebugVariable("OMINIX_CUDA_GRAPHS", "debug.cuda_graphs", _switch, "0: every CUDA step runs eagerly"),
    DebugVariable(
        "OMINIX_WEIGHT_STREAM",
        "debug.weight_stream",
        _switch,
        "0: one token's dense GEMMs on CUDA through cuBLAS instead of the weight-streaming kernel",
    ),
    DebugVariable(
        "OMINIX_TRITON_FAST_LAUNCH",
        "debug.triton_fast_launch",
        _switch,
        "0: every Triton kernel launched through Triton's own launch path (no fast launch)",
    ),
    DebugVariable(
        "OMINIX_PAD_LOGITS",
        "debug.pad_logits",
        _switch,
        "0: an eager step's LM head runs at its own count of sampled rows, not padded to a captured size",
    ),
    DebugVariable(
        "OMINIX_WARM_GEMM_ROWS",
        "debug.warm_gemm_rows",
        _count,
        "N: on CUDA, each linear layer's GEMM runs at start once per bucket of N rows up to the step budget "
        "(a first cuBLAS call at a new row count can wait for the device to drain); 0: off",
    ),
    DebugVariable(
        "OMINIX_PIECEWISE_GRAPH_TOKENS",
        "debug.piecewise_graph_tokens",
        _count,
        "N: on CUDA, prefill and mixed steps of up to N tokens (at most the step budget; default 2048) replay "
        "CUDA graphs captured at start in pieces between the layers' attention, per bucket of "
        "OMINIX_PIECEWISE_TOKEN_STEP tokens; 0: eager",
    ),
    DebugVariable(
        "OMINIX_PIECEWISE_TOKEN_STEP",
        "debug.piecewise_token_step",
        _positive,
        "N: the piecewise graphs' buckets every N tokens, the last at the budget (default 8; smaller: fewer "
        "padding rows, more captures: 2048 / N of them at the default budget)",
    ),
    DebugVariable(
        "OMINIX_PIECEWISE_FASTEST_BUCKET",
        "debug.piecewise_fastest_bucket",
        _switch,
        "1: on a lone CUDA worker, each piecewise bucket's replay is timed at start and a step replays the "
        "fastest captured bucket that holds it, not always the smallest",
    ),
)


def debug_values(env: Mapping[str, str] | None = None) -> dict[str, Any]:
    """Tree paths set by the debug variables present in ``env``; a malformed value raises ValueError."""
    env = os.environ if env is None else env
    values: dict[str, Any] = {}
    for var in DEBUG_VARIABLES:
        if var.name in env:
            try:
                values[var.path] = var.parse(env[var.name])
            except ValueError as exc:
                raise ValueError(f"{var.name}={env[var.name]!r}: {exc}") from None
    return values
