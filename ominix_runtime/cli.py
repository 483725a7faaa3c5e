"""``ominix-runtime``: serve, worker, launch, generate and conformance subcommands."""

from __future__ import annotations

import argparse
import contextlib
import os
import secrets
import shutil
import signal
import subprocess
import sys
import tempfile
import threading
import time
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

from ominix_runtime.config import (
    DEFAULT_DRAIN_TIMEOUT_S,
    DEFAULT_ENGINE_PORT,
    DEFAULT_HOST,
    DEFAULT_MAX_MESSAGE_BYTES,
    DEFAULT_METRICS_PORT,
    DEFAULT_WORKER_BASE_PORT,
    DEFAULT_WORKER_HEARTBEAT_TIMEOUT_S,
    DEFAULT_WORKER_READY_TIMEOUT_S,
    DebugConfig,
    EngineConfig,
    FrontConfig,
    SchedulerConfig,
    TLSConfig,
    V0FrontConfig,
)
from ominix_runtime.models import DEFAULT_MODEL_NAME

_FORWARDED = ("worker", "conformance")
_Formatter = argparse.ArgumentDefaultsHelpFormatter


# ---- parser -----------------------------------------------------------------------------------------


def _add_model_flag(p: argparse.ArgumentParser) -> None:
    p.add_argument(
        "--model",
        default=None,
        help=f"a .gguf file, a Hugging Face folder or dummy:CONFIG; unset means the embedded {DEFAULT_MODEL_NAME}",
    )


def _add_serve_flags(p: argparse.ArgumentParser, with_backends: bool) -> None:
    _add_model_flag(p)
    if with_backends:
        p.add_argument(
            "--worker",
            action="append",
            default=[],
            metavar="HOST:PORT",
            help="a step-level worker to drive (repeat for several)",
        )
    p.add_argument(
        "--sglang",
        action="append",
        default=[],
        metavar="URL",
        help="an SGLang server to drive at request level (repeat for several)",
    )
    p.add_argument(
        "--sglang-api-key",
        default=None,
        help="bearer token for the SGLang servers (their --api-key)",
    )
    p.add_argument(
        "--served-model-name",
        action="append",
        default=[],
        metavar="NAME",
        help="another name requests may use for the model (repeatable; the first is the v0 served model)",
    )
    p.add_argument(
        "--v0-port",
        type=int,
        default=None,
        help="serve the ominix.worker.v0 HTTP/SSE protocol OminiX-API speaks on this port (needs --v0-token)",
    )
    p.add_argument("--v0-host", default=DEFAULT_HOST, help="address the v0 front binds")
    p.add_argument("--v0-token", default=None, help="bearer token every v0 route requires")
    p.add_argument("--host", default=DEFAULT_HOST, help="address the engine's gRPC server binds")
    p.add_argument("--port", type=int, default=DEFAULT_ENGINE_PORT, help="engine gRPC port")
    p.add_argument(
        "--metrics-port",
        type=int,
        default=DEFAULT_METRICS_PORT,
        help="Prometheus /metrics HTTP port (0 disables it)",
    )
    p.add_argument(
        "--max-batch-tokens",
        type=int,
        default=None,
        help="token budget per step (unset: what each worker states)",
    )
    p.add_argument(
        "--max-running-requests",
        type=int,
        default=None,
        help="requests per step (unset: what each worker states)",
    )
    p.add_argument(
        "--max-queue-len",
        type=int,
        default=1024,
        help="requests waiting for admission before new ones are refused (0: no limit)",
    )
    p.add_argument("--no-prefix-caching", action="store_true", help="disable the prefix cache")
    p.add_argument(
        "--drain-timeout",
        type=float,
        default=DEFAULT_DRAIN_TIMEOUT_S,
        help="seconds live requests may take to finish after SIGINT/SIGTERM",
    )
    p.add_argument(
        "--worker-ready-timeout",
        type=float,
        default=DEFAULT_WORKER_READY_TIMEOUT_S,
        help="seconds to wait for workers to report ready",
    )
    p.add_argument(
        "--log-level", default="info", choices=["debug", "info", "warning", "error"], help="log level"
    )
    p.add_argument(
        "--log-format",
        default="auto",
        choices=["auto", "json", "console"],
        help="log format on stderr (auto: console on a terminal, JSON otherwise)",
    )
    p.add_argument(
        "--tls-cert",
        default=None,
        help="PEM certificate for TLS on the engine port (with --tls-key; unset: plaintext)",
    )
    p.add_argument("--tls-key", default=None, help="PEM private key for TLS on the engine port")
    p.add_argument(
        "--tls-ca",
        "--worker-ca",
        dest="worker_ca",
        default=None,
        help="PEM CA bundle that signs the workers' certificates: connect to workers over TLS, presenting "
        "--tls-cert/--tls-key as the client certificate (unset: plaintext)",
    )
    p.add_argument(
        "--max-message-bytes",
        type=int,
        default=DEFAULT_MAX_MESSAGE_BYTES,
        help="largest request accepted on the engine port; bigger ones get RESOURCE_EXHAUSTED",
    )
    p.add_argument(
        "--api-key",
        action="append",
        default=[],
        metavar="KEY",
        help="require `authorization: Bearer KEY` on the Engine API (repeatable; @FILE: one key per line); "
        "health and reflection stay open",
    )
    p.add_argument(
        "--allow-special-tokens-in-prompt",
        action="store_true",
        help="trusted callers only: special-token strings in a prompt act as special tokens (else plain text)",
    )
    p.add_argument(
        "--allow-special-tokens-in-chat",
        action="store_true",
        help="trusted callers only: special-token strings in chat message content act as special tokens",
    )
    p.add_argument(
        "--tokenizer-threads",
        type=int,
        default=FrontConfig().tokenizer_threads,
        help="threads that tokenize prompts and render chat templates (off the event loop)",
    )
    p.add_argument(
        "--max-pending-tokenizations",
        type=int,
        default=FrontConfig().max_pending_tokenizations,
        help="prompts waiting to be tokenized before new ones get RESOURCE_EXHAUSTED",
    )
    p.add_argument(
        "--worker-heartbeat-timeout",
        type=float,
        default=DEFAULT_WORKER_HEARTBEAT_TIMEOUT_S,
        help="seconds without a heartbeat or result before a worker is marked unhealthy and its requests "
        "fail over",
    )
    p.add_argument(
        "--step-timeout",
        type=float,
        default=None,
        help="seconds a step may take before its worker is marked unhealthy, heartbeats or not (unset: 10x "
        "the slowest step measured on that worker, at least 30)",
    )
    p.add_argument(
        "--engine-secret-file",
        default=None,
        metavar="FILE",
        help="a file holding the secret workers started with the same flag require on Run (plaintext "
        "deployments; `launch` makes one for its workers when unset)",
    )


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="ominix-runtime",
        formatter_class=_Formatter,
        description="Runtime policy layer for LLM inference serving (engine daemon, workers, client).",
    )
    sub = parser.add_subparsers(dest="command", required=True, metavar="COMMAND")

    serve = sub.add_parser(
        "serve",
        formatter_class=_Formatter,
        help="run the engine daemon against workers",
        description="Run the engine daemon; workers are started separately.",
    )
    _add_serve_flags(serve, with_backends=True)

    launch = sub.add_parser(
        "launch",
        formatter_class=_Formatter,
        help="start one worker per device, then the engine",
        description="Start one worker process per device, grouped --tensor-parallel-size at a time (group g "
        "serves on --worker-base-port + g), wait until each group is ready, then run the engine; every serve "
        "flag applies. A group whose process dies is restarted whole. Ctrl-C stops everything.",
    )
    launch.add_argument(
        "--devices", default="cpu", help="comma-separated devices, e.g. cpu,cpu or cuda:0,cuda:1"
    )
    launch.add_argument(
        "--worker-base-port",
        type=int,
        default=DEFAULT_WORKER_BASE_PORT,
        help="port of the first worker; worker i listens on base + i",
    )
    launch.add_argument("--dtype", default=None, help="worker dtype (unset: the device's default)")
    launch.add_argument(
        "--quantization",
        default=None,
        choices=("none", "fp8"),
        help="worker weight quantization (unset: none)",
    )
    launch.add_argument(
        "--kv-cache-dtype",
        default=None,
        choices=("auto", "fp8_e4m3"),
        help="worker KV cache dtype (unset: the run dtype)",
    )
    launch.add_argument(
        "--kv-cache-memory", default=None, help="worker KV cache size (passed to each worker)"
    )
    launch.add_argument("--block-size", type=int, default=None, help="KV block size (passed to each worker)")
    launch.add_argument(
        "--tensor-parallel-size",
        type=int,
        default=1,
        help="devices per worker group: --devices is split into groups of this many consecutive devices, each "
        "one tensor-parallel backend (e.g. four GPUs at 2 = two groups of two)",
    )
    launch.add_argument(
        "--moe-parallel",
        default=None,
        choices=("tensor", "expert"),
        help="how each group splits mixture-of-experts layers: tensor (a slice of every expert per rank) or "
        "expert (whole experts per rank) (unset: the worker's default, tensor)",
    )
    launch.add_argument(
        "--dist-base-port",
        type=int,
        default=0,
        help="port where group g's ranks meet is base + g (0: free ports picked at start)",
    )
    launch.add_argument(
        "--worker-threads",
        type=int,
        default=0,
        help="torch CPU threads per CPU worker (0: the machine's cores split among the CPU workers)",
    )
    launch.add_argument(
        "--engine-in-child",
        action="store_true",
        help="run the engine as a child process instead of in this process",
    )
    _add_serve_flags(launch, with_backends=False)

    gen = sub.add_parser(
        "generate",
        formatter_class=_Formatter,
        help="one-shot client: stream a completion",
        description="Send one prompt to a running engine and stream the text to the terminal.",
    )
    gen.add_argument("prompt", help="prompt text")
    gen.add_argument("--address", default=f"localhost:{DEFAULT_ENGINE_PORT}", help="engine address")
    _add_model_flag(gen)
    gen.add_argument(
        "--chat", action="store_true", help="send the prompt as a user chat turn (chat template)"
    )
    gen.add_argument("--max-tokens", type=int, default=64, help="most tokens to generate")
    gen.add_argument("--temperature", type=float, default=0.0, help="0 is greedy")
    gen.add_argument("--top-p", type=float, default=None, help="nucleus mass (unset: 1)")
    gen.add_argument("--top-k", type=int, default=0, help="0: no limit")
    gen.add_argument("--seed", type=int, default=None, help="sampling seed")
    gen.add_argument("--stop", action="append", default=[], help="stop string (repeatable)")
    gen.add_argument(
        "--priority",
        choices=["realtime", "interactive", "batch"],
        default="interactive",
        help="scheduling class",
    )
    gen.add_argument("--request-id", default="", help="request id (unset: generated by the engine)")
    gen.add_argument("--timeout", type=float, default=600.0, help="seconds before giving up")
    gen.add_argument("--json", action="store_true", help="print every event as a JSON line")

    sub.add_parser(
        "worker", add_help=False, help="run a worker process (flags: ominix-runtime worker --help)"
    )
    sub.add_parser(
        "conformance",
        add_help=False,
        help="backend conformance suite (flags: ominix-runtime conformance --help)",
    )
    from ominix_runtime.release.commands import COMMANDS as RELEASE_COMMANDS

    for name, (summary, _add_arguments, _run) in RELEASE_COMMANDS.items():
        sub.add_parser(name, add_help=False, help=f"{summary} (flags: ominix-runtime {name} --help)")
    return parser


# ---- config -----------------------------------------------------------------------------------------


def _api_keys(values: Sequence[str]) -> tuple[str, ...]:
    """Keys from --api-key values: a key, or @FILE with one key per line (blank lines and # comments skipped)."""
    keys: list[str] = []
    for value in values:
        if value.startswith("@"):
            lines = Path(value[1:]).expanduser().read_text(encoding="utf-8").splitlines()
            keys += [k.strip() for k in lines if k.strip() and not k.strip().startswith("#")]
        elif value.strip():
            keys.append(value.strip())
    if values and not keys:
        raise ValueError("--api-key names no key")
    return tuple(keys)


def _read_secret(path: str | None) -> str | None:
    if not path:
        return None
    secret = Path(path).read_text(encoding="utf-8").strip()
    if not secret:
        raise ValueError(f"--engine-secret-file {path} is empty")
    return secret


def engine_config_from_args(args: argparse.Namespace, workers: Sequence[str]) -> EngineConfig:
    log_json = {"auto": None, "json": True, "console": False}[args.log_format]
    if args.worker_heartbeat_timeout <= 0 or (args.step_timeout is not None and args.step_timeout <= 0):
        raise ValueError("--worker-heartbeat-timeout and --step-timeout must be > 0")
    if args.tokenizer_threads < 1 or args.max_pending_tokenizations < 1:
        raise ValueError("--tokenizer-threads and --max-pending-tokenizations must be >= 1")
    return EngineConfig(
        model=args.model,
        workers=tuple(workers),
        sglang_urls=tuple(args.sglang),
        sglang_api_key=args.sglang_api_key,
        served_model_names=tuple(args.served_model_name),
        v0=V0FrontConfig(port=args.v0_port, host=args.v0_host, token=args.v0_token),
        host=args.host,
        port=args.port,
        metrics_port=args.metrics_port,
        scheduler=SchedulerConfig(
            max_batch_tokens=args.max_batch_tokens,
            max_running_requests=args.max_running_requests,
            max_queue_len=args.max_queue_len,
            enable_prefix_caching=not args.no_prefix_caching,
        ),
        drain_timeout=args.drain_timeout,
        worker_ready_timeout=args.worker_ready_timeout,
        log_level=args.log_level,
        log_json=log_json,
        tls=TLSConfig(server_cert=args.tls_cert, server_key=args.tls_key, worker_ca=args.worker_ca),
        max_message_bytes=args.max_message_bytes,
        front=FrontConfig(
            api_keys=_api_keys(args.api_key),
            allow_special_tokens_in_prompt=args.allow_special_tokens_in_prompt,
            allow_special_tokens_in_chat=args.allow_special_tokens_in_chat,
            tokenizer_threads=args.tokenizer_threads,
            max_pending_tokenizations=args.max_pending_tokenizations,
        ),
        worker_heartbeat_timeout=args.worker_heartbeat_timeout,
        step_timeout=args.step_timeout,
        engine_secret=_read_secret(args.engine_secret_file),
        debug=DebugConfig.from_env(),
    )


def _serve_argv(args: argparse.Namespace, workers: Sequence[str]) -> list[str]:
    """The serve command line equivalent to ``args`` (for an engine child process)."""
    argv = [
        "serve",
        "--host",
        args.host,
        "--port",
        str(args.port),
        "--metrics-port",
        str(args.metrics_port),
        "--max-queue-len",
        str(args.max_queue_len),
        "--drain-timeout",
        str(args.drain_timeout),
        "--worker-ready-timeout",
        str(args.worker_ready_timeout),
        "--log-level",
        args.log_level,
        "--log-format",
        args.log_format,
    ]
    if args.model:
        argv += ["--model", args.model]
    for worker in workers:
        argv += ["--worker", worker]
    for url in args.sglang:
        argv += ["--sglang", url]
    for name in args.served_model_name:
        argv += ["--served-model-name", name]
    for flag, value in (
        ("--sglang-api-key", args.sglang_api_key),
        ("--v0-port", args.v0_port),
        ("--v0-token", args.v0_token),
    ):
        if value is not None:
            argv += [flag, str(value)]
    argv += ["--v0-host", args.v0_host]
    for flag, value in (
        ("--max-batch-tokens", args.max_batch_tokens),
        ("--max-running-requests", args.max_running_requests),
    ):
        if value is not None:
            argv += [flag, str(value)]
    if args.no_prefix_caching:
        argv.append("--no-prefix-caching")
    for flag, value in (
        ("--tls-cert", args.tls_cert),
        ("--tls-key", args.tls_key),
        ("--tls-ca", args.worker_ca),
        ("--max-message-bytes", args.max_message_bytes),
        ("--tokenizer-threads", args.tokenizer_threads),
        ("--max-pending-tokenizations", args.max_pending_tokenizations),
        ("--worker-heartbeat-timeout", args.worker_heartbeat_timeout),
        ("--step-timeout", args.step_timeout),
        ("--engine-secret-file", args.engine_secret_file),
    ):
        if value is not None:
            argv += [flag, str(value)]
    for key in args.api_key:
        argv += ["--api-key", key]
    for flag, on in (
        ("--allow-special-tokens-in-prompt", args.allow_special_tokens_in_prompt),
        ("--allow-special-tokens-in-chat", args.allow_special_tokens_in_chat),
    ):
        if on:
            argv.append(flag)
    return argv


# ---- commands ---------------------------------------------------------------------------------------


def cmd_serve(args: argparse.Namespace) -> int:
    from ominix_runtime.server.app import run_server

    if not args.worker and not args.sglang:
        print(
            "ominix-runtime serve: pass --worker HOST:PORT (or --sglang URL); "
            "`ominix-runtime launch` starts workers for you",
            file=sys.stderr,
        )
        return 2
    if args.v0_port is not None and not args.v0_token:
        print("ominix-runtime serve: --v0-port needs --v0-token (every v0 route wants it)", file=sys.stderr)
        return 2
    try:
        config = engine_config_from_args(args, args.worker)
    except (OSError, ValueError) as exc:
        print(f"ominix-runtime serve: {exc}", file=sys.stderr)
        return 1
    return run_server(config)


def cmd_worker(argv: list[str]) -> int:
    # The one place ominix_runtime reaches into the worker package (and so into torch).
    try:
        from ominix_worker.server import main as worker_main
    except ImportError as exc:
        print(
            f"ominix-runtime worker: the worker package is not installed ({exc}); "
            "pip install 'ominix-runtime[worker]'",
            file=sys.stderr,
        )
        return 2
    return int(worker_main(argv) or 0)


def cmd_conformance(argv: list[str]) -> int:
    from ominix_runtime.conformance.cli import main as conformance_main

    return int(conformance_main(argv) or 0)


def _set_parent_death_signal() -> None:
    """Linux: a worker receives SIGTERM when the launcher dies, even by SIGKILL (no orphans)."""
    try:
        import ctypes

        libc = ctypes.CDLL("libc.so.6", use_errno=True)
        pr_set_pdeathsig = 1
        libc.prctl(pr_set_pdeathsig, signal.SIGTERM)
    except (OSError, AttributeError):
        pass


def _cpu_threads_per_worker(args: argparse.Namespace, devices: Sequence[str]) -> int | None:
    """Threads for each CPU worker, so that several of them do not oversubscribe the cores."""
    if args.worker_threads > 0:
        return int(args.worker_threads)
    num_cpu_workers = sum(1 for d in devices if d == "cpu")
    if num_cpu_workers <= 1:
        return None
    return max(1, (os.cpu_count() or 1) // num_cpu_workers)


@dataclass(frozen=True, slots=True)
class GroupPlan:
    """One worker group: a rank per device; rank 0 serves the engine on ``port``."""

    devices: tuple[str, ...]
    port: int
    dist_port: int  # where the ranks meet (unused by a group of one)
    commands: tuple[tuple[str, ...], ...]


def plan_groups(args: argparse.Namespace, devices: Sequence[str], num_threads: int | None) -> list[GroupPlan]:
    """Consecutive devices grouped --tensor-parallel-size at a time; raises ValueError when they do not divide."""
    size = args.tensor_parallel_size
    if size < 1 or len(devices) % size:
        raise ValueError(
            f"--devices lists {len(devices)} devices, which do not split into groups of --tensor-parallel-size {size}"
        )
    num_groups = len(devices) // size
    if args.dist_base_port:
        dist_ports = [args.dist_base_port + g for g in range(num_groups)]
    else:
        dist_ports = _rendezvous_ports(num_groups) if size > 1 else [0] * num_groups
    plans = []
    for g in range(num_groups):
        group = tuple(devices[g * size : (g + 1) * size])
        port = args.worker_base_port + g
        commands = []
        for rank, device in enumerate(group):
            cmd = _worker_command(args, device, port, num_threads)
            if size > 1:
                cmd[cmd.index("--worker-id") + 1] = f"{'+'.join(group)}@{args.host}:{port}"
                cmd += ["--tp-size", str(size), "--tp-rank", str(rank)]
                cmd += ["--dist-init-addr", f"{args.host}:{dist_ports[g]}"]
            commands.append(tuple(cmd))
        plans.append(GroupPlan(group, port, dist_ports[g], tuple(commands)))
    return plans


def _rendezvous_ports(n: int) -> list[int]:
    """Free ports below the kernel's ephemeral range for groups to meet at: a rank retrying to connect to a
    port inside the range can be handed that port as its own and connect to itself, taking it from rank 0."""
    import random
    import socket

    low = 32768
    with contextlib.suppress(OSError, ValueError):
        low = int(Path("/proc/sys/net/ipv4/ip_local_port_range").read_text().split()[0])
    candidates = list(range(max(1024, low - 12000), low))
    random.shuffle(candidates)
    ports: list[int] = []
    for port in candidates:
        with socket.socket() as s:
            try:
                s.bind(("127.0.0.1", port))
            except OSError:
                continue
        ports.append(port)
        if len(ports) == n:
            return ports
    raise RuntimeError(f"no {n} free ports below {low} for the groups to meet at (pass --dist-base-port)")


def _worker_command(args: argparse.Namespace, device: str, port: int, num_threads: int | None) -> list[str]:
    cmd = [
        sys.executable,
        "-m",
        "ominix_runtime",
        "worker",
        "--device",
        device,
        "--host",
        args.host,
        "--port",
        str(port),
        "--worker-id",
        f"{device}@{args.host}:{port}",
    ]
    if args.model:
        cmd += ["--model", args.model]
    for flag, value in (
        ("--dtype", args.dtype),
        ("--quantization", args.quantization),
        ("--kv-cache-dtype", args.kv_cache_dtype),
        ("--moe-parallel", args.moe_parallel),
        ("--kv-cache-memory", args.kv_cache_memory),
        ("--block-size", args.block_size),
        ("--max-batch-tokens", args.max_batch_tokens),
        ("--max-running-requests", args.max_running_requests),
    ):
        if value is not None:
            cmd += [flag, str(value)]
    if device == "cpu" and num_threads is not None:
        cmd += ["--num-threads", str(num_threads)]
    if args.engine_secret_file:
        cmd += ["--engine-secret-file", args.engine_secret_file]
    return cmd


def _stop_processes(procs: Sequence[subprocess.Popen[bytes]], timeout: float = 15.0) -> None:
    for proc in procs:
        if proc.poll() is None:
            proc.send_signal(signal.SIGTERM)
    deadline = time.monotonic() + timeout
    for proc in procs:
        try:
            proc.wait(timeout=max(0.1, deadline - time.monotonic()))
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait(timeout=5)


def _wait_workers_ready(
    groups: Sequence[Sequence[subprocess.Popen[bytes]]], addresses: Sequence[str], timeout: float
) -> None:
    """Until every group's leader says ready; any rank that exits first ends the launch."""
    import grpc

    from ominix_runtime.pb import worker_pb2, worker_pb2_grpc

    channels = [grpc.insecure_channel(a) for a in addresses]
    try:
        pending = set(range(len(addresses)))
        deadline = time.monotonic() + timeout
        while pending:
            for i in sorted(pending):
                for rank, proc in enumerate(groups[i]):
                    code = proc.poll()
                    if code is not None:
                        who = f"worker {addresses[i]}" + (f" rank {rank}" if len(groups[i]) > 1 else "")
                        raise RuntimeError(f"{who} exited with code {code} before it was ready")
                try:
                    resp = worker_pb2_grpc.WorkerStub(channels[i]).Health(
                        worker_pb2.HealthRequest(), timeout=2.0
                    )
                except grpc.RpcError:
                    continue
                if resp.ready:
                    pending.discard(i)
                    print(f"worker {addresses[i]} ready", file=sys.stderr, flush=True)
            if pending:
                if time.monotonic() > deadline:
                    raise RuntimeError(
                        f"workers not ready within {timeout:.0f}s: "
                        f"{', '.join(addresses[i] for i in sorted(pending))}"
                    )
                time.sleep(0.2)
    finally:
        for ch in channels:
            ch.close()


class WorkerSupervisor(threading.Thread):
    """Restarts worker groups whose processes exit while the launcher runs, with exponential backoff per group.

    A group is restarted whole: when one rank exits, the others are stopped first (a tensor-parallel group
    never runs half-alive; its ranks would leave on their own within --dist-timeout anyway). The engine
    notices the crash (broken stream), resumes the group's requests elsewhere and reconnects once the restarted
    leader answers again. ``groups`` is updated in place with the new processes.
    """

    POLL_S = 0.5
    BACKOFF_INITIAL_S = 1.0
    BACKOFF_MAX_S = 30.0
    STABLE_S = 60.0  # up this long: the next crash starts from the initial backoff again

    def __init__(
        self, groups: list[list[subprocess.Popen[bytes]]], plans: Sequence[GroupPlan], host: str
    ) -> None:
        super().__init__(name="ominix-worker-supervisor", daemon=True)
        self.groups = groups
        self._plans = list(plans)
        self._host = host
        self._stopping = threading.Event()
        self._lock = threading.Lock()
        n = len(groups)
        self.restarts = [0] * n
        self._backoff = [self.BACKOFF_INITIAL_S] * n
        self._restart_at: list[float | None] = [None] * n
        self._started_at = [time.monotonic()] * n

    def run(self) -> None:
        while not self._stopping.wait(self.POLL_S):
            with self._lock:
                for i in range(len(self.groups)):
                    self._check(i, time.monotonic())

    def _check(self, i: int, now: float) -> None:
        codes = [proc.poll() for proc in self.groups[i]]
        if all(code is None for code in codes):
            if now - self._started_at[i] > self.STABLE_S:
                self._backoff[i] = self.BACKOFF_INITIAL_S
            return
        if self._restart_at[i] is None:
            self._restart_at[i] = now + self._backoff[i]
            plan = self._plans[i]
            exited = ", ".join(
                f"{d} (code {c})" for d, c in zip(plan.devices, codes, strict=True) if c is not None
            )
            print(
                f"worker {self._host}:{plan.port}: {exited} exited; restarting "
                f"{'the group' if len(plan.devices) > 1 else 'it'} in {self._backoff[i]:.0f}s",
                file=sys.stderr,
                flush=True,
            )
            _stop_processes(self.groups[i], timeout=5.0)
            return
        restart_at = self._restart_at[i]
        if restart_at is not None and now < restart_at:
            return
        self.groups[i] = [_spawn_worker(command) for command in self._plans[i].commands]
        self.restarts[i] += 1
        self._restart_at[i] = None
        self._started_at[i] = now
        self._backoff[i] = min(self._backoff[i] * 2, self.BACKOFF_MAX_S)

    def stop(self) -> None:
        """No more restarts (call before stopping the workers)."""
        self._stopping.set()
        with self._lock:  # a restart in progress completes before the caller stops the processes
            pass


def _spawn_worker(command: Sequence[str]) -> subprocess.Popen[bytes]:
    # Own session: a terminal's Ctrl-C reaches only the launcher, which drains the engine first and then
    # stops the workers itself.
    return subprocess.Popen(list(command), start_new_session=True, preexec_fn=_set_parent_death_signal)  # noqa: PLW1509


def cmd_launch(args: argparse.Namespace) -> int:
    devices = [d.strip() for d in args.devices.split(",") if d.strip()]
    if not devices:
        print("ominix-runtime launch: --devices is empty", file=sys.stderr)
        return 2
    if args.v0_port is not None and not args.v0_token:
        print("ominix-runtime launch: --v0-port needs --v0-token (every v0 route wants it)", file=sys.stderr)
        return 2
    secret_dir = None
    if not args.engine_secret_file:
        # Only this launch's engine may drive its workers: a fresh secret, readable by this user only.
        secret_dir = tempfile.mkdtemp(prefix="ominix-launch-")
        secret_path = Path(secret_dir) / "engine.secret"
        secret_path.write_text(secrets.token_urlsafe(32), encoding="utf-8")
        secret_path.chmod(0o600)
        args.engine_secret_file = str(secret_path)
    num_threads = _cpu_threads_per_worker(args, devices)
    try:
        plans = plan_groups(args, devices, num_threads)
        addresses = [f"{args.host}:{plan.port}" for plan in plans]
        config = engine_config_from_args(args, addresses)  # bad values fail before any worker starts
    except (OSError, ValueError, RuntimeError) as exc:
        print(f"ominix-runtime launch: {exc}", file=sys.stderr)
        if secret_dir is not None:
            shutil.rmtree(secret_dir, ignore_errors=True)
        return 2
    groups: list[list[subprocess.Popen[bytes]]] = []

    def on_term(signum: int, frame: object) -> None:
        raise SystemExit(128 + signum)

    if "cpu" in devices:
        # CPU workers share cores with the engine: OpenMP threads spinning between steps starve the engine's
        # event loop (p99 inter-token gaps of seconds on 2 cores); passive waiting keeps them off the cores.
        os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")
    if any(d.startswith("cuda") for d in devices):
        os.environ.setdefault("NCCL_NVLS_ENABLE", "0")  # NVLink SHARP buffers fail on some machines
    supervisor: WorkerSupervisor | None = None
    engines: list[subprocess.Popen[bytes]] = []
    previous_term = signal.signal(signal.SIGTERM, on_term)
    try:
        for plan in plans:
            groups.append([_spawn_worker(command) for command in plan.commands])
        print(
            f"started {len(devices)} worker(s) in {len(plans)} group(s): {', '.join(addresses)}",
            file=sys.stderr,
            flush=True,
        )
        _wait_workers_ready(groups, addresses, args.worker_ready_timeout)
        supervisor = WorkerSupervisor(groups, plans, args.host)
        supervisor.start()
        if args.engine_in_child:
            engine = subprocess.Popen(
                [sys.executable, "-m", "ominix_runtime", *_serve_argv(args, addresses)],
                preexec_fn=_set_parent_death_signal,
            )  # noqa: PLW1509
            engines.append(engine)
            signal.signal(signal.SIGTERM, lambda s, f: engine.send_signal(signal.SIGTERM))
            signal.signal(signal.SIGINT, lambda s, f: engine.send_signal(signal.SIGINT))
            code = engine.wait()
            return code
        signal.signal(signal.SIGTERM, previous_term)
        from ominix_runtime.server.app import run_server

        return run_server(config)
    except RuntimeError as exc:
        print(f"ominix-runtime launch: {exc}", file=sys.stderr, flush=True)
        return 1
    except KeyboardInterrupt:
        return 130
    finally:
        signal.signal(signal.SIGINT, signal.SIG_IGN)  # a second Ctrl-C must not leave workers behind
        if supervisor is not None:
            supervisor.stop()
        _stop_processes([*engines, *(proc for group in groups for proc in group)])  # kept current by restarts
        signal.signal(signal.SIGINT, signal.default_int_handler)
        if secret_dir is not None:
            shutil.rmtree(secret_dir, ignore_errors=True)


def cmd_generate(args: argparse.Namespace) -> int:
    import grpc
    from google.protobuf import json_format

    from ominix_runtime.pb import common_pb2, engine_pb2, engine_pb2_grpc

    sampling = common_pb2.SamplingParams(
        max_tokens=args.max_tokens, temperature=args.temperature, top_k=args.top_k, stop=args.stop
    )
    if args.top_p is not None:
        sampling.top_p = args.top_p
    if args.seed is not None:
        sampling.seed = args.seed
    priority = {"realtime": 1, "interactive": 2, "batch": 3}[args.priority]
    request = engine_pb2.GenerateRequest(request_id=args.request_id, sampling=sampling, priority=priority)
    if args.model:
        from ominix_runtime.models import resolve_model

        request.model = resolve_model(args.model).name
    if args.chat:
        request.messages.messages.add(role="user", content=args.prompt)
    else:
        request.prompt = args.prompt
    exit_code = 1
    with grpc.insecure_channel(args.address) as channel:
        stub = engine_pb2_grpc.EngineStub(channel)
        try:
            for event in stub.Generate(request, timeout=args.timeout):
                kind = event.WhichOneof("event")
                if args.json:
                    line = json_format.MessageToJson(event, indent=None, preserving_proto_field_name=True)
                    print(line, flush=True)
                elif kind == "token":
                    sys.stdout.write(event.token.text)
                    sys.stdout.flush()
                if kind == "done":
                    exit_code = 0
                    if not args.json:
                        reason = common_pb2.FinishReason.Name(event.done.finish_reason)
                        print(f"\n[{reason.removeprefix('FINISH_REASON_').lower()}]", file=sys.stderr)
                elif kind == "error" and not args.json:
                    print(f"\nerror: {event.error.message}", file=sys.stderr)
        except grpc.RpcError as exc:
            print(f"ominix-runtime generate: {exc.code().name}: {exc.details()}", file=sys.stderr)
            return 1
        except KeyboardInterrupt:
            return 130
    return exit_code


def main(argv: Sequence[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    if argv and argv[0] in _FORWARDED:
        return cmd_worker(argv[1:]) if argv[0] == "worker" else cmd_conformance(argv[1:])
    from ominix_runtime.release.commands import COMMANDS as RELEASE_COMMANDS
    from ominix_runtime.release.commands import main as release_main

    if argv and argv[0] in RELEASE_COMMANDS:  # they parse their own arguments
        return release_main(argv[0], argv[1:])
    args = build_parser().parse_args(argv)
    if args.command == "serve":
        return cmd_serve(args)
    if args.command == "launch":
        return cmd_launch(args)
    if args.command == "generate":
        return cmd_generate(args)
    raise AssertionError(f"unhandled command {args.command}")


if __name__ == "__main__":  # pragma: no cover
    sys.exit(main())
