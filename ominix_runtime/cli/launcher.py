"""``ominix-runtime launch``: check every port, start one worker per device, wait for its own workers, run
the engine; restart workers that die later (:class:`WorkerSupervisor`)."""

from __future__ import annotations

import argparse
import os
import secrets
import shutil
import signal
import subprocess
import sys
import tempfile
import threading
import time
from collections.abc import Collection, Sequence
from dataclasses import dataclass, replace
from pathlib import Path

from ominix_runtime.bind_probe import free_ports
from ominix_runtime.cli.commands import command
from ominix_runtime.cli.ports import check_ports_free
from ominix_runtime.cli.serve import check_engine, engine_ports
from ominix_runtime.cli.settings import ConfigError, child_command, child_environment
from ominix_runtime.config import RuntimeConfig, with_paths
from ominix_runtime.server.logging import configure_logging, get_logger

_log = get_logger("ominix.launch")
MAX_PORT = 65535
READY_POLL_S = 0.2
# How long a stopped child (worker or engine) may take to exit after SIGTERM before it is killed.
STOP_TIMEOUT_S = 15.0


class LaunchError(RuntimeError):
    """The launch cannot go on; the message is one line."""


@dataclass(frozen=True, slots=True)
class WorkerPlan:
    """One worker group: a rank per device (one rank without tensor parallelism); rank 0 serves the engine."""

    devices: tuple[str, ...]
    port: int
    address: str  # where the engine reaches rank 0
    argvs: tuple[tuple[str, ...], ...]  # one command line per rank

    @property
    def name(self) -> str:
        return "+".join(self.devices)


def _connect_host(bind_host: str) -> str:
    return "127.0.0.1" if bind_host in ("0.0.0.0", "", "::") else bind_host


def device_groups(config: RuntimeConfig) -> list[tuple[str, ...]]:
    """--devices split into consecutive groups of --tensor-parallel-size."""
    devices, size = config.launch.devices, config.launch.tensor_parallel_size
    if len(devices) % size:
        raise ConfigError(
            f"--devices lists {len(devices)} devices, which do not split into groups of "
            f"--tensor-parallel-size {size}"
        )
    return [tuple(devices[g * size : (g + 1) * size]) for g in range(len(devices) // size)]


def _consecutive_ports(base: int, count: int, flag: str) -> list[int]:
    last = base + count - 1
    if last > MAX_PORT:
        raise ConfigError(f"{flag} {base} leaves no room for {count} worker groups (last port {last})")
    return [base + i for i in range(count)]


def worker_ports(config: RuntimeConfig, avoid: Collection[int] = ()) -> list[int]:
    """The port of each group's rank 0; picked ones are none of ``avoid`` (ports given to other processes)."""
    launch = config.launch
    count = len(device_groups(config))
    if launch.worker_base_port == 0:
        return _free_ports(launch.worker_host, count, "--worker-base-port", avoid)
    return _consecutive_ports(launch.worker_base_port, count, "--worker-base-port")


def rendezvous_ports(config: RuntimeConfig, avoid: Collection[int] = ()) -> list[int]:
    """Where each tensor-parallel group's ranks meet (none without tensor parallelism); picked ones are none
    of ``avoid``."""
    launch = config.launch
    if launch.tensor_parallel_size == 1:
        return []
    count = len(device_groups(config))
    if launch.dist_base_port:
        return _consecutive_ports(launch.dist_base_port, count, "--dist-base-port")
    return _free_ports("127.0.0.1", count, "--dist-base-port", avoid)


def _free_ports(host: str, count: int, flag: str, avoid: Collection[int]) -> list[int]:
    try:
        return free_ports(count, host, avoid=avoid)
    except OSError as exc:
        raise ConfigError(f"{exc}: pass {flag}") from None


def _cpu_threads_per_worker(config: RuntimeConfig) -> int:
    """Threads for each CPU worker, so that several of them do not oversubscribe the cores (0: torch's)."""
    launch = config.launch
    if launch.worker_threads > 0:
        return launch.worker_threads
    num_cpu_workers = sum(1 for d in launch.devices if d == "cpu")
    if num_cpu_workers <= 1:
        return config.worker.num_threads
    return max(1, (os.cpu_count() or 1) // num_cpu_workers)


def plan_workers(
    config: RuntimeConfig, ports: Sequence[int], nonce: str, dist_ports: Sequence[int] = ()
) -> list[WorkerPlan]:
    """One command line per rank of each group: every worker flag of ``config`` passed on, the per-process
    ones (device, address, id, threads, nonce, rank) set here. Worker links use TLS only with --tls-ca."""
    worker_command = command("worker")
    host = config.launch.worker_host
    threads = _cpu_threads_per_worker(config)
    size = config.launch.tensor_parallel_size
    plans = []
    for g, (group, port) in enumerate(zip(device_groups(config), ports, strict=True)):
        name = "+".join(group)
        argvs = []
        for rank, device in enumerate(group):
            paths: dict[str, object] = {
                "worker.device": device,
                "server.host": host,
                "server.port": port,
                "worker.worker_id": f"{name}@{host}:{port}",
                "worker.num_threads": threads if device == "cpu" else config.worker.num_threads,
                "worker.launch_nonce": nonce,
                # Plaintext worker links unless --tls-ca; the engine secret goes along either way.
                "tls": config.tls if config.tls.ca else replace(config.tls, cert=None, key=None, ca=None),
                # A worker's stderr is a pipe to the launcher: it renders as the launcher's own terminal does.
                "log.format": _resolved_log_format(config),
            }
            if size > 1:
                paths.update(
                    {
                        "worker.tp_size": size,
                        "worker.tp_rank": rank,
                        "worker.dist_init_addr": f"{_connect_host(host)}:{dist_ports[g]}",
                    }
                )
            words, _ = child_command(worker_command, with_paths(config, paths))
            argvs.append((sys.executable, "-m", "ominix_runtime", *words))
        plans.append(WorkerPlan(group, port, f"{_connect_host(host)}:{port}", tuple(argvs)))
    return plans


def _resolved_log_format(config: RuntimeConfig) -> str:
    if config.log.format != "auto":
        return config.log.format
    return "console" if sys.stderr.isatty() else "json"


def _set_parent_death_signal() -> None:
    """Linux: a worker receives SIGTERM when the launcher dies, even by SIGKILL (no orphans)."""
    try:
        import ctypes

        libc = ctypes.CDLL("libc.so.6", use_errno=True)
        pr_set_pdeathsig = 1
        libc.prctl(pr_set_pdeathsig, signal.SIGTERM)
    except (OSError, AttributeError):
        pass


def _spawn(argv: Sequence[str], env: dict[str, str], stderr: int | None = None) -> subprocess.Popen[bytes]:
    # Own session: a terminal's Ctrl-C reaches only the launcher, which drains the engine first and then
    # stops the workers itself.
    return subprocess.Popen(  # noqa: PLW1509
        list(argv), env=env, stderr=stderr, start_new_session=True, preexec_fn=_set_parent_death_signal
    )


class WorkerOutput(threading.Thread):
    """Copies a worker's stderr into the launcher's (one stream) and keeps its last line: a worker that dies
    before it is ready is reported by the launcher in one line with the worker's own reason."""

    FATAL_PREFIX = "ominix-worker: error: "

    def __init__(self, proc: subprocess.Popen[bytes]) -> None:
        super().__init__(name="ominix-worker-output", daemon=True)
        self._proc = proc
        self.last_line = ""
        self.hold_fatal = True  # until ready: the launcher reports a fatal line itself

    def run(self) -> None:
        assert self._proc.stderr is not None
        for raw in self._proc.stderr:
            line = raw.decode(errors="replace").rstrip("\n")
            if not line:
                continue
            self.last_line = line
            if self.hold_fatal and line.startswith(self.FATAL_PREFIX):
                continue
            sys.stderr.write(line + "\n")
            sys.stderr.flush()

    def reason(self) -> str:
        self.join(timeout=2.0)  # the pipe closes when the process is gone
        return self.last_line.removeprefix(self.FATAL_PREFIX)


def _start_worker(argv: Sequence[str], env: dict[str, str]) -> tuple[subprocess.Popen[bytes], WorkerOutput]:
    proc = _spawn(argv, env, stderr=subprocess.PIPE)
    output = WorkerOutput(proc)
    output.start()
    return proc, output


def longest_launch_stop_s(drain_timeout: float) -> float:
    """The longest ``launch`` takes to exit after a SIGTERM: the engine's graceful stop, then its workers'
    (SIGKILL after ``STOP_TIMEOUT_S``). A container's stop timeout must exceed it."""
    from ominix_runtime.server.app import longest_graceful_stop_s  # the engine's modules load only to serve

    return longest_graceful_stop_s(drain_timeout) + STOP_TIMEOUT_S


def _stop_processes(procs: Sequence[subprocess.Popen[bytes]], timeout: float = STOP_TIMEOUT_S) -> None:
    """SIGTERM each process, then SIGKILL any still running ``timeout`` seconds later (logged: a worker stops
    by itself well within it, see ``ominix_worker.server.SHUTDOWN_DEADLINE_S``)."""
    for proc in procs:
        if proc.poll() is None:
            proc.send_signal(signal.SIGTERM)
    deadline = time.monotonic() + timeout
    for proc in procs:
        try:
            proc.wait(timeout=max(0.1, deadline - time.monotonic()))
        except subprocess.TimeoutExpired:
            _log.warning("process did not stop after SIGTERM; killing it", pid=proc.pid, timeout_s=timeout)
            proc.kill()
            proc.wait(timeout=5)
    if procs:
        _log.info("processes stopped", exit_codes={p.pid: p.returncode for p in procs})


def wait_workers_ready(
    groups: Sequence[Sequence[subprocess.Popen[bytes]]],
    plans: Sequence[WorkerPlan],
    nonce: str,
    timeout: float,
    outputs: Sequence[Sequence[WorkerOutput]] = (),
) -> None:
    """Until every group this launcher started says ready (its rank 0); a rank that exits first (it could not
    bind, load or start) or a process answering with another nonce ends the launch."""
    import grpc

    from ominix_runtime.pb import worker_pb2, worker_pb2_grpc

    channels = [grpc.insecure_channel(p.address) for p in plans]
    try:
        pending = set(range(len(plans)))
        deadline = time.monotonic() + timeout
        while pending:
            for i in sorted(pending):
                for rank, proc in enumerate(groups[i]):
                    code = proc.poll()
                    if code is None:
                        continue
                    output = outputs[i][rank] if i < len(outputs) else None
                    reason = output.reason() if output is not None else ""
                    who = f"worker {plans[i].address} ({plans[i].name})"
                    who += f" rank {rank}" if len(groups[i]) > 1 else ""
                    raise LaunchError(
                        f"{who} exited with code {code} before it was ready: {reason or 'no reason given'}"
                    )
                try:
                    resp = worker_pb2_grpc.WorkerStub(channels[i]).Health(
                        worker_pb2.HealthRequest(), timeout=2.0
                    )
                except grpc.RpcError:
                    continue
                if resp.launch_nonce != nonce:
                    raise LaunchError(
                        f"another process (pid {resp.pid or 'unknown'}) answers on worker port {plans[i].port}: "
                        "stop it or pass another --worker-base-port"
                    )
                if resp.ready:
                    pending.discard(i)
                    _log.info("worker ready", worker_id=f"{plans[i].name}@{plans[i].address}", pid=resp.pid)
            if pending:
                if time.monotonic() > deadline:
                    late = ", ".join(plans[i].address for i in sorted(pending))
                    raise LaunchError(
                        f"workers not ready within {timeout:.0f}s (--worker-ready-timeout): {late}"
                    )
                time.sleep(READY_POLL_S)
    finally:
        for ch in channels:
            ch.close()


class WorkerSupervisor(threading.Thread):
    """Restarts worker groups whose processes exit while the launcher runs, with exponential backoff per group.

    A group is restarted whole: when one rank exits, the others are stopped first (a tensor-parallel group
    never runs half-alive). The engine notices the crash (broken stream), resumes the group's requests
    elsewhere and reconnects once the restarted rank 0 answers again. ``groups`` is updated in place.
    """

    POLL_S = 0.5
    BACKOFF_INITIAL_S = 1.0
    BACKOFF_MAX_S = 30.0
    STABLE_S = 60.0  # up this long: the next crash starts from the initial backoff again

    def __init__(
        self, groups: list[list[subprocess.Popen[bytes]]], plans: Sequence[WorkerPlan], env: dict[str, str]
    ) -> None:
        super().__init__(name="ominix-worker-supervisor", daemon=True)
        self.groups = groups
        self._plans = list(plans)
        self._env = env
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
        plan = self._plans[i]
        if self._restart_at[i] is None:
            self._restart_at[i] = now + self._backoff[i]
            exited = {d: c for d, c in zip(plan.devices, codes, strict=True) if c is not None}
            _log.warning(
                "worker exited; restarting the group"
                if len(plan.devices) > 1
                else "worker exited; restarting",
                worker=plan.address,
                exit_codes=exited,
                restart_in_s=self._backoff[i],
            )
            _stop_processes(self.groups[i], timeout=5.0)
            return
        restart_at = self._restart_at[i]
        if restart_at is not None and now < restart_at:
            return
        started = [_start_worker(argv, self._env) for argv in plan.argvs]
        for _, output in started:
            output.hold_fatal = False
        self.groups[i] = [proc for proc, _ in started]
        self.restarts[i] += 1
        self._restart_at[i] = None
        self._started_at[i] = now
        self._backoff[i] = min(self._backoff[i] * 2, self.BACKOFF_MAX_S)

    def stop(self) -> None:
        """No more restarts (call before stopping the workers)."""
        self._stopping.set()
        with self._lock:  # a restart in progress completes before the caller stops the processes
            pass


def run_launch(config: RuntimeConfig, options: argparse.Namespace) -> int:
    configure_logging(config.log.level, config.log.json, component="launcher")
    check_engine(config)
    # Ports picked here are none of those already given: two picks apart could name one port twice.
    engine = engine_ports(config)
    given = {port for _, port, _ in engine}
    ports = worker_ports(config, avoid=given)
    dist_ports = rendezvous_ports(config, avoid=given | set(ports))
    # Every port before anything loads: a taken one is found in milliseconds, not after the weights. One taken
    # while the workers load still fails at the engine's bind: it binds --port without SO_REUSEPORT (several
    # front processes excepted), so it cannot end up sharing the port with another gRPC server.
    host = config.launch.worker_host
    check_ports_free(
        [
            *engine,
            *((host, p, "--worker-base-port") for p in ports),
            *((_connect_host(host), p, "--dist-base-port") for p in dist_ports),
        ]
    )
    nonce = secrets.token_hex(8)
    secret_dir = None
    if config.tls.engine_secret_file is None:
        # Only this launch's engine may drive its workers: a fresh secret, readable by this user only.
        secret_dir = tempfile.mkdtemp(prefix="ominix-launch-")
        secret_path = Path(secret_dir) / "engine.secret"
        secret_path.write_text(secrets.token_urlsafe(32), encoding="utf-8")
        secret_path.chmod(0o600)
        config = with_paths(config, {"tls.engine_secret_file": str(secret_path)})
    try:
        return _launch(config, ports, dist_ports, nonce)
    finally:
        if secret_dir is not None:
            shutil.rmtree(secret_dir, ignore_errors=True)


def default_front_procs(config: RuntimeConfig, num_groups: int) -> int:
    """Front processes when ``--front-procs`` is unset: one per group on GPUs, none on CPUs.

    Several GPU groups stream more tokens than one event loop can both schedule and write to the clients
    (bench/RESULTS.md, data parallel); with one group the engine's loop still gets its next step out sooner
    when the client streams are elsewhere (bench/engine_overhead.py). CPU workers produce too few tokens to
    need it and share the cores anyway.
    """
    on_gpus = any(d.startswith("cuda") for d in config.launch.devices)
    return num_groups if on_gpus else 0


def _launch(config: RuntimeConfig, ports: Sequence[int], dist_ports: Sequence[int], nonce: str) -> int:
    plans = plan_workers(config, ports, nonce, dist_ports)
    # The engine checks the nonce too, each time it (re)connects to a worker: after a restart, the process on a
    # worker port must still be one this launch started.
    engine_config = with_paths(
        config, {"backends.workers": tuple(p.address for p in plans), "backends.launch_nonce": nonce}
    )
    if config.front.procs is None:
        engine_config = with_paths(engine_config, {"front.procs": default_front_procs(config, len(plans))})
    _, secret_env = child_command(command("serve"), engine_config)
    env = child_environment()
    if "cpu" in config.launch.devices:
        # CPU workers share cores with the engine: OpenMP threads spinning between steps starve the engine's
        # event loop (p99 inter-token gaps of seconds on 2 cores); passive waiting keeps them off the cores.
        env.setdefault("OMP_WAIT_POLICY", "PASSIVE")
        os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")
    if any(d.startswith("cuda") for d in config.launch.devices):
        env.setdefault("NCCL_NVLS_ENABLE", "0")  # NVLink SHARP buffers fail on some machines

    groups: list[list[subprocess.Popen[bytes]]] = []
    engines: list[subprocess.Popen[bytes]] = []
    supervisor: WorkerSupervisor | None = None

    def on_term(signum: int, frame: object) -> None:
        raise SystemExit(128 + signum)

    previous_term = signal.signal(signal.SIGTERM, on_term)
    try:
        outputs: list[list[WorkerOutput]] = []
        for plan in plans:
            started = [_start_worker(argv, env) for argv in plan.argvs]
            groups.append([proc for proc, _ in started])
            outputs.append([output for _, output in started])
        _log.info("workers started", workers=[p.address for p in plans], devices=list(config.launch.devices))
        wait_workers_ready(groups, plans, nonce, config.backends.ready_timeout, outputs)
        for output in (o for group_outputs in outputs for o in group_outputs):
            output.hold_fatal = False
        supervisor = WorkerSupervisor(groups, plans, env)
        supervisor.start()
        if config.launch.engine_in_child:
            serve_words, _ = child_command(command("serve"), engine_config)
            engine = _spawn([sys.executable, "-m", "ominix_runtime", *serve_words], {**env, **secret_env})
            engines.append(engine)
            signal.signal(signal.SIGTERM, lambda s, f: engine.send_signal(signal.SIGTERM))
            signal.signal(signal.SIGINT, lambda s, f: engine.send_signal(signal.SIGINT))
            return engine.wait()
        signal.signal(signal.SIGTERM, previous_term)
        from ominix_runtime.server.app import run_server

        return run_server(engine_config)
    except LaunchError as exc:
        failure = str(exc)
    except KeyboardInterrupt:
        return 130
    finally:
        signal.signal(signal.SIGINT, signal.SIG_IGN)  # a second Ctrl-C must not leave workers behind
        if supervisor is not None:
            supervisor.stop()
        _stop_processes([*engines, *(proc for group in groups for proc in group)])  # kept current by restarts
        signal.signal(signal.SIGINT, signal.default_int_handler)
    # Printed after the stop's own log lines: the failure is the last line an operator sees.
    print(f"ominix-runtime launch: error: {failure}", file=sys.stderr, flush=True)
    return 1
