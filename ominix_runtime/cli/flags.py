"""Every command-line flag, defined once: its name, the config-tree paths it sets, how its text is read.

A command takes whole groups of flags (``ominix_runtime.cli.commands``). To add a flag, append one
:class:`Flag` to :data:`FLAGS` with a ``group`` the right commands take (and, when it configures something, a
field in ``ominix_runtime.config`` for its ``targets``): `--help`, ``OMINIX_<FLAG>``, ``--config`` files and
`launch` (which passes every worker and serve flag on to its children) pick it up from here.
"""

from __future__ import annotations

import argparse
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from ominix_runtime.byte_sizes import DTYPE_ALIASES, DTYPE_NAMES, parse_bytes
from ominix_runtime.config import LOG_FORMATS, LOG_LEVELS

# ---- value readers (text → value; ArgumentTypeError says what is wrong in one line) -------------------------


def _int(text: str) -> int:
    try:
        return int(str(text).strip())
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected an integer, got {text!r}") from None


def _float(text: str) -> float:
    try:
        return float(str(text).strip())
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected a number, got {text!r}") from None


def port(text: str) -> int:
    value = _int(text)
    if not 1 <= value <= 65535:
        raise argparse.ArgumentTypeError(f"port {value} is outside 1-65535")
    return value


def port_or_zero(text: str) -> int:
    value = _int(text)
    if not 0 <= value <= 65535:
        raise argparse.ArgumentTypeError(f"port {value} is outside 0-65535")
    return value


def positive_int(text: str) -> int:
    value = _int(text)
    if value < 1:
        raise argparse.ArgumentTypeError(f"expected an integer >= 1, got {value}")
    return value


def non_negative_int(text: str) -> int:
    value = _int(text)
    if value < 0:
        raise argparse.ArgumentTypeError(f"expected an integer >= 0, got {value}")
    return value


def non_negative_float(text: str) -> float:
    value = _float(text)
    if value < 0:
        raise argparse.ArgumentTypeError(f"expected a number >= 0, got {value:g}")
    return value


def positive_float(text: str) -> float:
    value = _float(text)
    if value <= 0:
        raise argparse.ArgumentTypeError(f"expected a number > 0, got {value:g}")
    return value


def fraction(text: str) -> float:
    value = _float(text)
    if not 0.0 < value <= 1.0:
        raise argparse.ArgumentTypeError(f"expected a fraction in (0, 1], got {value:g}")
    return value


def byte_size(text: str) -> str:
    """A size as --kv-cache-memory takes it (1073741824, 512MiB, 1GiB), checked here and kept as written."""
    try:
        parse_bytes(text)
    except ValueError as exc:
        raise argparse.ArgumentTypeError(str(exc)) from None
    return str(text).strip()


def dtype_name(text: str) -> str:
    """--dtype: auto, float32, bfloat16, float16, or one of their short names (bf16, fp16, ...)."""
    value = str(text).strip().lower()
    if value != "auto" and value not in DTYPE_NAMES and value not in DTYPE_ALIASES:
        names = ", ".join(("auto", *DTYPE_NAMES))
        raise argparse.ArgumentTypeError(f"{text!r} is not one of {names} (or {', '.join(DTYPE_ALIASES)})")
    return value


def lowercase_choice(choices: Sequence[str]) -> Callable[[str], str]:
    """Case-insensitive choice: ``INFO`` and ``info`` are the same level."""

    def read(text: str) -> str:
        value = str(text).strip().lower()
        if value not in choices:
            raise argparse.ArgumentTypeError(f"{text!r} is not one of {', '.join(choices)}")
        return value

    return read


def device_list(text: str) -> tuple[str, ...]:
    devices = tuple(d.strip() for d in str(text).split(",") if d.strip())
    if not devices:
        raise argparse.ArgumentTypeError("no device given (e.g. cpu, cpu,cpu or cuda:0,cuda:1)")
    return devices


# Readers of one flag value that is itself a comma-separated list: a config file's list is that list.
LIST_READERS: frozenset[Callable[[str], Any]] = frozenset({device_list})


# gRPC target names with a resolver scheme, passed to gRPC as they are (it resolves them).
_GRPC_TARGET_SCHEMES = ("unix:", "unix-abstract:", "dns:", "ipv4:", "ipv6:", "vsock:")


def host_port(text: str) -> str:
    """``HOST:PORT`` (an IPv6 host in brackets: ``[::1]:50071``), port 1 – 65535; the text is kept."""
    text = str(text).strip()
    host, colon, port_text = text.rpartition(":")
    if not colon or not host:
        raise argparse.ArgumentTypeError(f"expected HOST:PORT, got {text!r}")
    if host.startswith("["):
        if not host.endswith("]") or len(host) < 3:
            raise argparse.ArgumentTypeError(f"expected [IPv6]:PORT, got {text!r}")
    elif ":" in host:
        raise argparse.ArgumentTypeError(f"an IPv6 host goes in brackets ([::1]:50071), got {text!r}")
    try:
        port(port_text)
    except argparse.ArgumentTypeError as exc:
        raise argparse.ArgumentTypeError(f"{text!r}: {exc}") from None
    return text


def grpc_target(text: str) -> str:
    """``HOST:PORT`` or a gRPC target with its scheme (``unix:PATH``, ``dns:///HOST:PORT``, ...); the text is
    kept. gRPC takes the address unchanged and a caller waits for it (the engine --worker-ready-timeout), so a
    malformed one is refused here rather than found minutes later."""
    text = str(text).strip()
    scheme = next((s for s in _GRPC_TARGET_SCHEMES if text.startswith(s)), None)
    if scheme is None:
        return host_port(text)
    if not text.removeprefix(scheme).lstrip("/"):
        raise argparse.ArgumentTypeError(f"expected {scheme}TARGET, got {text!r}")
    return text


def api_keys(text: str) -> tuple[str, ...]:
    """A key, or ``@FILE`` with one key per line (blank lines and ``#`` comments skipped)."""
    text = str(text)
    if not text.startswith("@"):
        if not text.strip():
            raise argparse.ArgumentTypeError("an API key cannot be empty")
        return (text.strip(),)
    path = Path(text[1:]).expanduser()
    try:
        lines = path.read_text().splitlines()
    except OSError as exc:
        raise argparse.ArgumentTypeError(f"cannot read API keys from {path}: {exc.strerror or exc}") from None
    keys = tuple(k.strip() for k in lines if k.strip() and not k.strip().startswith("#"))
    if not keys:
        raise argparse.ArgumentTypeError(f"{path} holds no API key")
    return keys


def secret_file(text: str) -> str:
    """A readable file holding a non-empty secret; the path is kept (each process reads the file)."""
    path = Path(str(text)).expanduser()
    try:
        secret = path.read_text(encoding="utf-8").strip()
    except OSError as exc:
        raise argparse.ArgumentTypeError(f"cannot read {path}: {exc.strerror or exc}") from None
    except UnicodeDecodeError:
        raise argparse.ArgumentTypeError(f"{path} is not UTF-8 text") from None
    if not secret:
        raise argparse.ArgumentTypeError(f"{path} is empty")
    return str(path)


def pem_file(text: str) -> str:
    """A readable, non-empty file (PEM certificate, key or CA bundle); the path is kept (each process reads
    the file). The servers read it only once they start, after `launch` has loaded every worker."""
    path = Path(str(text)).expanduser()
    try:
        content = path.read_bytes()
    except OSError as exc:
        raise argparse.ArgumentTypeError(f"cannot read {path}: {exc.strerror or exc}") from None
    if not content.strip():
        raise argparse.ArgumentTypeError(f"{path} is empty")
    return str(path)


def _render_scalar(value: Any) -> str:
    if isinstance(value, tuple):
        return ",".join(str(v) for v in value)
    return str(value)


# ---- the flag -------------------------------------------------------------------------------------------


@dataclass(frozen=True, slots=True)
class Flag:
    """One command-line flag.

    ``targets``: config-tree paths the value is written to (empty: a command option, read from the parsed
    arguments by the command itself). ``repeatable``: each use adds values (a tuple). ``switch``: takes no
    value and sets ``switch_value``. ``secret``: passed to child processes through the environment, never
    on a command line others can read.
    """

    name: str
    group: str
    help: str
    targets: tuple[str, ...] = ()
    parse: Callable[[str], Any] = str
    aliases: tuple[str, ...] = ()
    repeatable: bool = False
    switch: bool = False
    switch_value: Any = True
    default: Any = None  # command options only; a target's default is the tree's
    metavar: str | None = None
    secret: bool = False

    @property
    def dest(self) -> str:
        return self.name.removeprefix("--").replace("-", "_")

    @property
    def env(self) -> str:
        return "OMINIX_" + self.dest.upper()

    @property
    def names(self) -> tuple[str, ...]:
        return (self.name, *self.aliases)

    def read(self, text: Any) -> Any:
        """One value from text (a command line, an environment variable, a config file entry)."""
        if self.switch:
            if isinstance(text, bool):
                return self.switch_value if text else None
            lowered = str(text).strip().lower()
            if lowered in ("1", "true", "yes", "on"):
                return self.switch_value
            if lowered in ("0", "false", "no", "off", ""):
                return None
            raise argparse.ArgumentTypeError(f"expected 0 or 1, got {text!r}")
        if self.repeatable:
            items = text if isinstance(text, list | tuple) else str(text).split(",")
            out: list[Any] = []
            for item in items:
                value = self.parse(str(item))
                out.extend(value if isinstance(value, tuple) else (value,))
            return tuple(out)
        if isinstance(text, list | tuple | dict):
            # A config file's list or mapping: str() of it would be read as one garbled value ("['cpu'").
            if self.parse in LIST_READERS and not isinstance(text, dict):
                return self.parse(",".join(str(item) for item in text))
            kind = "a mapping" if isinstance(text, dict) else "a list"
            raise argparse.ArgumentTypeError(f"takes one value, got {kind}: {text!r}")
        return self.parse(str(text))

    def render(self, value: Any) -> list[str]:
        """Command-line words that give ``value`` back when read (nothing for an unset value)."""
        if value is None:
            return []
        if self.switch:
            return [self.name] if value == self.switch_value else []
        if self.repeatable:
            return [word for item in value for word in (self.name, str(item))]
        return [self.name, _render_scalar(value)]


def _port_help(what: str) -> str:
    return f"{what} (1-65535)"


# ---- the registry ---------------------------------------------------------------------------------------

FLAGS: tuple[Flag, ...] = (
    # model: what is served (engine and worker)
    Flag(
        "--model",
        "model",
        "a .gguf file, a Hugging Face folder or dummy:CONFIG (unset: the embedded SmolLM2-135M-Instruct)",
        ("model.path",),
        metavar="MODEL",
    ),
    Flag(
        "--served-model-name",
        "served",
        "a name requests may use for the model besides its own (GGUF general.name, the Hugging Face "
        "folder or repo name, the dummy config's file name); repeatable",
        ("model.served_model_names",),
        repeatable=True,
        metavar="NAME",
    ),
    # listen: this process's own gRPC server
    Flag("--host", "listen", "address this process's gRPC server binds", ("server.host",)),
    Flag("--port", "listen", _port_help("port of this process's gRPC server"), ("server.port",), port),
    # limits: stated by a worker, overridden by the engine
    Flag(
        "--max-batch-tokens",
        "limits",
        "most tokens one step computes (unset: the worker's device profile, 2048 CPU / 8192 GPU)",
        ("engine.scheduler.max_batch_tokens", "worker.max_batch_tokens"),
        positive_int,
        aliases=("--max-num-batched-tokens",),
    ),
    Flag(
        "--max-running-requests",
        "limits",
        "most requests one step holds (unset: the worker's device profile, 64 CPU / 256 GPU)",
        ("engine.scheduler.max_running_requests", "worker.max_running_requests"),
        positive_int,
        aliases=("--max-num-seqs",),
    ),
    # backends: what an engine drives
    Flag(
        "--worker",
        "workers",
        "a step-level worker to drive (repeatable)",
        ("backends.workers",),
        grpc_target,
        repeatable=True,
        metavar="HOST:PORT",
    ),
    Flag(
        "--sglang",
        "sglang",
        "an SGLang server to drive at request level (repeatable)",
        ("backends.sglang_urls",),
        repeatable=True,
        metavar="URL",
    ),
    Flag(
        "--sglang-api-key",
        "sglang",
        "bearer token for the SGLang servers (their --api-key)",
        ("backends.sglang_api_key",),
        metavar="KEY",
        secret=True,
    ),
    # the ominix.worker.v0 HTTP/SSE front (OminiX-API's worker protocol), on the same engine
    Flag(
        "--v0-port",
        "server",
        "serve the ominix.worker.v0 HTTP/SSE protocol OminiX-API speaks on this port (needs --v0-token; "
        "unset: off)",
        ("v0.port",),
        port_or_zero,
    ),
    Flag("--v0-host", "server", "address the v0 front binds", ("v0.host",)),
    Flag(
        "--v0-token",
        "server",
        "bearer token every v0 route requires",
        ("v0.token",),
        metavar="TOKEN",
        secret=True,
    ),
    Flag(
        "--worker-launch-nonce",
        "workers",
        "set by `launch` for its engine: use (and reconnect to) a worker only while its Health states this "
        "--launch-nonce",
        ("backends.launch_nonce",),
    ),
    Flag(
        "--worker-ready-timeout",
        "engine",
        "seconds to wait for the workers to report ready",
        ("backends.ready_timeout",),
        positive_float,
    ),
    # engine: scheduling and lifecycle
    Flag(
        "--max-queue-len",
        "engine",
        "requests waiting for admission before new ones are refused (0: no limit)",
        ("engine.max_waiting_requests",),
        non_negative_int,
    ),
    Flag(
        "--no-prefix-caching",
        "engine",
        "disable the prefix cache",
        ("engine.scheduler.enable_prefix_caching",),
        switch=True,
        switch_value=False,
    ),
    Flag(
        "--prefill-tokens-beside-decodes",
        "engine",
        "a step that carries decodes admits new prompt tokens only up to this many prefill tokens in the step "
        "while the waiting prompts would fit in this step and the next under it; running prompts' chunks count "
        "toward it; a prompt's first chunk is cut to what is left of it; a prompt it held back takes the budget "
        "from the next step on; a larger backlog lifts the limit; only with chunked prefill (0: no limit)",
        ("engine.scheduler.prefill_tokens_beside_decodes",),
        non_negative_int,
    ),
    Flag(
        "--prefill-backlog-tokens",
        "engine",
        "waiting prompt tokens past what is left of --prefill-tokens-beside-decodes in a step that the limit "
        "still holds back; more is a backlog, which lifts it (0: the limit itself, one more step under it)",
        ("engine.scheduler.prefill_backlog_tokens",),
        non_negative_int,
    ),
    Flag(
        "--max-batch-tokens-with-decodes",
        "engine",
        "token budget of a step that carries decodes, its decodes and prompt chunks together, backlog or not "
        "(a burst: --max-batch-tokens-in-burst); "
        "a step without decodes keeps --max-batch-tokens; at least --max-running-requests, at most "
        "--max-batch-tokens; only with chunked prefill (0: --max-batch-tokens)",
        ("engine.scheduler.max_batch_tokens_with_decodes",),
        non_negative_int,
    ),
    Flag(
        "--burst-backlog-tokens",
        "engine",
        "waiting tokens that make a burst when every waiting request has a free running slot and the free or "
        "reusable KV holds them all (and no running request is of a higher class): a step with decodes then "
        "takes up to --max-batch-tokens-in-burst; only with chunked prefill, and only where --max-batch-tokens "
        "is above --max-batch-tokens-with-decodes (default 16,384; 0: off)",
        ("engine.scheduler.burst_backlog_tokens",),
        non_negative_int,
    ),
    Flag(
        "--max-batch-tokens-in-burst",
        "engine",
        "token budget of a step with decodes while a burst is taken in (--burst-backlog-tokens); at least "
        "--max-batch-tokens-with-decodes, at most --max-batch-tokens (default 6,144; 0: off)",
        ("engine.scheduler.max_batch_tokens_in_burst",),
        non_negative_int,
    ),
    Flag(
        "--backlog-admission-slots",
        "engine",
        "under a backlog (more waiting than free running slots), a step that carries decodes admits waiting "
        "requests only once this many running slots are free, or after backlog_admission_max_wait_steps (4) "
        "steps of waiting with a slot free, and never holds a request of a higher class than a running one; "
        "fewer steps then carry a prompt beside the decodes (default 2; 0 or 1: each slot is filled as it frees)",
        ("engine.scheduler.backlog_admission_slots",),
        non_negative_int,
    ),
    Flag(
        "--max-inflight-steps",
        "engine",
        "steps sent to a worker ahead of its results (1: none; 3: step N+1 reaches a pipelined GPU worker about "
        "one device step before it is due, so the device does not wait for the engine)",
        ("engine.max_inflight_steps",),
        positive_int,
    ),
    Flag(
        "--light-load-below-running",
        "engine",
        "while fewer requests than this run on a worker and none waits for admission, at most 2 steps are in "
        "flight: a new request joins a step one device step sooner, the device may wait for a step "
        "(0: always --max-inflight-steps)",
        ("engine.light_load_below_running",),
        non_negative_int,
    ),
    Flag(
        "--drain-timeout",
        "engine",
        "seconds live requests may take to finish after SIGINT/SIGTERM",
        ("server.drain_timeout",),
        non_negative_float,
    ),
    Flag(
        "--worker-heartbeat-timeout",
        "engine",
        "seconds without a heartbeat or result before a worker is marked unhealthy and its requests fail over",
        ("backends.heartbeat_timeout",),
        positive_float,
    ),
    Flag(
        "--step-timeout",
        "engine",
        "seconds a step may take before its worker is marked unhealthy, heartbeats or not (unset: 10x the "
        "slowest step measured on that worker, at least 30)",
        ("backends.step_timeout", "engine.step_timeout"),
        positive_float,
    ),
    Flag(
        "--stats-interval",
        "engine",
        "seconds between stats log lines (running, waiting, KV usage, tok/s); 0: none",
        ("server.stats_interval",),
        non_negative_float,
    ),
    # server: the engine's front API and side ports
    Flag(
        "--metrics-port",
        "server",
        "Prometheus /metrics HTTP port (0 disables it)",
        ("server.metrics_port",),
        port_or_zero,
    ),
    Flag("--metrics-host", "server", "address the /metrics HTTP server binds", ("server.metrics_host",)),
    Flag(
        "--max-message-bytes",
        "server",
        "largest request accepted on the engine port; bigger ones get RESOURCE_EXHAUSTED",
        ("server.max_message_bytes",),
        positive_int,
    ),
    Flag(
        "--api-key",
        "server",
        "require `authorization: Bearer KEY` on the front API (repeatable; @FILE reads one key per line; "
        "unset: no authentication)",
        ("front.api_keys",),
        api_keys,
        repeatable=True,
        metavar="KEY|@FILE",
        secret=True,
    ),
    Flag(
        "--allow-special-tokens-in-prompt",
        "server",
        "trusted callers only: special-token strings in a prompt act as special tokens (else plain text)",
        ("front.allow_special_tokens_in_prompt",),
        switch=True,
    ),
    Flag(
        "--allow-special-tokens-in-chat",
        "server",
        "trusted callers only: special-token strings in chat message content act as special tokens",
        ("front.allow_special_tokens_in_chat",),
        switch=True,
    ),
    Flag(
        "--tokenizer-threads",
        "server",
        "threads that tokenize prompts and render chat templates (off the event loop)",
        ("front.tokenizer_threads",),
        positive_int,
    ),
    Flag(
        "--max-pending-tokenizations",
        "server",
        "prompts waiting to be tokenized before new ones get RESOURCE_EXHAUSTED",
        ("front.max_pending_tokenizations",),
        positive_int,
    ),
    Flag(
        "--front-procs",
        "server",
        "processes that serve the clients' streams on the engine port (SO_REUSEPORT), so writing tokens to "
        "clients does not load the engine's event loop; worth it behind several worker groups; 0: the "
        "engine process serves them itself",
        ("front.procs",),
        non_negative_int,
    ),
    # engine access: which engine may drive a worker
    Flag(
        "--engine-secret-file",
        "access",
        "a file holding the secret the engine presents on Run and workers started with the same flag require "
        "(plaintext deployments; `launch` makes one for its workers when unset)",
        ("tls.engine_secret_file",),
        secret_file,
        metavar="FILE",
    ),
    Flag(
        "--engine-identity",
        "worker-access",
        "with --tls-ca: the subject CN or SAN entry the engine's client certificate must carry to open Run "
        "(repeatable; unset: the engine identity deploy/tls/make-certs.sh issues)",
        ("tls.engine_identities",),
        repeatable=True,
        metavar="NAME",
    ),
    # tls
    Flag(
        "--tls-cert",
        "tls",
        "PEM certificate of this process: served on its port (with --tls-key) and, on the engine with "
        "--tls-ca, presented to the workers (unset: plaintext)",
        ("tls.cert",),
        pem_file,
    ),
    Flag("--tls-key", "tls", "PEM private key of --tls-cert", ("tls.key",), pem_file),
    Flag(
        "--tls-ca",
        "tls",
        "PEM CA bundle of the peers: the engine connects to workers over TLS and verifies them; a worker "
        "accepts only clients with a certificate it signed (mutual TLS)",
        ("tls.ca",),
        pem_file,
        aliases=("--worker-ca",),
    ),
    # worker: one device, one model
    Flag("--device", "worker-process", "cpu, cuda:N or npu:N", ("worker.device",)),
    Flag(
        "--dtype",
        "worker",
        "auto (bfloat16; float32 on a CPU without AVX512-BF16 or AMX), float32, bfloat16 or float16",
        ("worker.dtype",),
        dtype_name,
    ),
    Flag(
        "--quantization",
        "worker",
        "none, or fp8: quantize a float checkpoint's projections and experts to FP8 (e4m3, per-channel "
        "scales) at load; FP8 checkpoints load as FP8 either way",
        ("worker.quantization",),
        lowercase_choice(("none", "fp8")),
    ),
    Flag(
        "--kv-cache-dtype",
        "worker",
        "auto (the run dtype) or fp8_e4m3 (K and V stored in FP8: half the bytes of bf16 per token)",
        ("worker.kv_cache_dtype",),
        lowercase_choice(("auto", "fp8_e4m3")),
    ),
    Flag(
        "--kv-cache-memory",
        "worker",
        "bytes for the KV cache (e.g. 1073741824, 512MiB, 1GiB); default: 1GiB on a CPU, on a GPU what "
        "--gpu-memory-utilization leaves (given, it replaces that measure)",
        ("worker.kv_cache_memory",),
        byte_size,
        aliases=("--kv-cache-memory-bytes",),
    ),
    Flag(
        "--gpu-memory-utilization",
        "worker",
        "GPU only: fraction of device memory for weights, activations and the KV cache",
        ("worker.gpu_memory_utilization",),
        fraction,
    ),
    Flag(
        "--block-size",
        "worker",
        "tokens per KV block (128 is forced on npu)",
        ("worker.block_size",),
        positive_int,
    ),
    Flag(
        "--max-model-len",
        "worker",
        "longest sequence accepted (unset: the model's max_position_embeddings)",
        ("worker.max_model_len",),
        positive_int,
    ),
    Flag(
        "--attention",
        "worker",
        "attention backend: torch, triton or ascend (unset: chosen by the device)",
        ("worker.attention",),
        lowercase_choice(("torch", "triton", "ascend")),
    ),
    Flag(
        "--no-early-results",
        "worker",
        "CUDA: hold a finished step's tokens until the launch of the prefill or mixed step after it ends, "
        "instead of sending them at the first layer boundary of that launch after they reach the host (the "
        "default)",
        ("worker.early_results",),
        switch=True,
        switch_value=False,
    ),
    Flag(
        "--num-threads",
        "worker-process",
        "CPU threads for torch (0: torch's default); lower it when several workers share the cores",
        ("worker.num_threads",),
        non_negative_int,
    ),
    Flag(
        "--worker-id",
        "worker-process",
        "worker id stated in Describe (unset: DEVICE@HOST:PORT)",
        ("worker.worker_id",),
    ),
    Flag(
        "--launch-nonce",
        "worker-process",
        "set by `launch`: stated in Describe and Health so the launcher knows the worker is its own",
        ("worker.launch_nonce",),
    ),
    # tensor parallelism (one worker process per rank)
    Flag(
        "--tp-size",
        "tensor-parallel",
        "ranks in this worker's tensor-parallel group, one process per device",
        ("worker.tp_size",),
        positive_int,
    ),
    Flag(
        "--tp-rank",
        "tensor-parallel",
        "this process's rank in the group: 0 serves the engine, the others follow it",
        ("worker.tp_rank",),
        non_negative_int,
    ),
    Flag(
        "--dist-init-addr",
        "tensor-parallel",
        "HOST:PORT where rank 0 gathers its group (required with --tp-size > 1; ranks may run on other "
        "hosts that reach it)",
        ("worker.dist_init_addr",),
        host_port,
    ),
    Flag(
        "--dist-timeout",
        "worker",  # not "tensor-parallel": launch sets the rank and address, and passes this one on
        "seconds any collective or control message of the group may wait for a peer before the group "
        "gives up (every rank then exits)",
        ("worker.dist_timeout",),
        positive_float,
    ),
    Flag(
        "--moe-parallel",
        "worker",
        "how a tensor-parallel group splits mixture-of-experts layers: tensor (every rank holds a slice of "
        "every expert) or expert (each rank holds num_experts / --tp-size whole experts)",
        ("worker.moe_parallel",),
        lowercase_choice(("tensor", "expert")),
    ),
    # launch
    Flag(
        "--devices",
        "launch",
        "comma-separated devices, one worker each, e.g. cpu,cpu or cuda:0,cuda:1",
        ("launch.devices",),
        device_list,
    ),
    Flag(
        "--worker-host",
        "launch",
        "address the workers bind (plaintext unless --tls-ca: keep it on loopback)",
        ("launch.worker_host",),
    ),
    Flag(
        "--worker-base-port",
        "launch",
        "port of the first worker; worker i listens on base + i (0: free ports outside the kernel's ephemeral range)",
        ("launch.worker_base_port",),
        port_or_zero,
    ),
    Flag(
        "--tensor-parallel-size",
        "launch",
        "devices per worker group: --devices is split into groups of this many consecutive devices, each one "
        "tensor-parallel backend (e.g. four GPUs at 2 = two groups of two)",
        ("launch.tensor_parallel_size",),
        positive_int,
    ),
    Flag(
        "--dist-base-port",
        "launch",
        "port where group g's ranks meet is base + g (0: free ports picked at start)",
        ("launch.dist_base_port",),
        port_or_zero,
    ),
    Flag(
        "--worker-threads",
        "launch",
        "torch CPU threads per CPU worker (0: the machine's cores split among the CPU workers)",
        ("launch.worker_threads",),
        non_negative_int,
    ),
    Flag(
        "--engine-in-child",
        "launch",
        "run the engine as a child process instead of in this process",
        ("launch.engine_in_child",),
        switch=True,
    ),
    # log
    Flag(
        "--log-level",
        "log",
        f"log level, case-insensitive: {', '.join(LOG_LEVELS)}",
        ("log.level",),
        lowercase_choice(LOG_LEVELS),
    ),
    Flag(
        "--log-format",
        "log",
        "log format on stderr (auto: console on a terminal, JSON lines otherwise)",
        ("log.format",),
        lowercase_choice(LOG_FORMATS),
    ),
    # client: `generate`
    Flag(
        "--address",
        "client",
        "engine address HOST:PORT",
        parse=grpc_target,
        default="localhost:50061",
        metavar="HOST:PORT",
    ),
    Flag("--timeout", "client", "seconds before giving up", parse=positive_float, default=600.0),
    Flag("--chat", "generation", "send the prompt as a user chat turn (chat template)", switch=True),
    Flag("--max-tokens", "generation", "most tokens to generate", parse=positive_int, default=64),
    Flag("--temperature", "generation", "0 is greedy", parse=non_negative_float, default=0.0, metavar="T"),
    Flag("--top-p", "generation", "nucleus mass (unset: 1)", parse=fraction, metavar="P"),
    Flag("--top-k", "generation", "0: no limit", parse=non_negative_int, default=0),
    Flag("--seed", "generation", "sampling seed", parse=_int),
    Flag("--stop", "generation", "stop string (repeatable)", repeatable=True, default=()),
    Flag(
        "--priority",
        "generation",
        "scheduling class: realtime, interactive or batch",
        parse=lowercase_choice(("realtime", "interactive", "batch")),
        default="interactive",
    ),
    Flag("--request-id", "generation", "request id (unset: generated by the engine)", default=""),
    Flag("--json", "generation", "print every event as a JSON line", switch=True),
)


def by_group(groups: Sequence[str]) -> tuple[Flag, ...]:
    """The flags of ``groups``, in registry order."""
    unknown = set(groups) - {f.group for f in FLAGS}
    if unknown:
        raise KeyError(f"no flag group {sorted(unknown)}")
    return tuple(f for f in FLAGS if f.group in groups)


def by_name(name: str) -> Flag:
    for flag in FLAGS:
        if name in flag.names:
            return flag
    raise KeyError(name)
