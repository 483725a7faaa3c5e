"""Helpers shared by the bench scripts: percentiles, JSON and plot writing, launching the service.

Importable both as ``bench.common`` (tests, other scripts) and from scripts run as ``python bench/X.py``.
Nothing here imports torch.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import gzip
import json
import math
import os
import shutil
import signal
import statistics
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable, Coroutine, Iterator, Sequence
from dataclasses import asdict, dataclass, field, is_dataclass
from pathlib import Path
from typing import Any, TypeVar

REPO_ROOT = Path(__file__).resolve().parent.parent
T = TypeVar("T")


def parse_counts(spec: str) -> list[int]:
    """Positive integers from ``START:STOP:STEP`` (a range, STOP excluded) or a comma-separated list; raises
    ValueError with the reason otherwise."""
    try:
        if ":" in spec:
            start, stop, step = (int(x) for x in spec.split(":"))
            counts = list(range(start, stop, step))
        else:
            counts = [int(x) for x in spec.split(",")]
    except ValueError:
        raise ValueError(
            f"{spec!r} is neither START:STOP:STEP nor a comma-separated list of integers"
        ) from None
    if not counts or min(counts) < 1:
        raise ValueError(f"{spec!r} must name at least one count, each at least 1")
    return counts


def counts_option(parser: argparse.ArgumentParser, option: str, spec: str) -> list[int]:
    """``parse_counts`` for a command-line option: a bad spec is the parser's usage error (exit 2)."""
    try:
        return parse_counts(spec)
    except ValueError as e:
        parser.error(f"{option}: {e}")


# ---------------------------------------------------------------- statistics


def percentile(values: Sequence[float], q: float) -> float:
    """The q-th percentile (0-100) with linear interpolation between ranks (numpy's default); NaN if empty."""
    if not values:
        return math.nan
    if not 0.0 <= q <= 100.0:
        raise ValueError(f"percentile must be within [0, 100], got {q}")
    ordered = sorted(values)
    rank = (len(ordered) - 1) * q / 100.0
    low = math.floor(rank)
    high = math.ceil(rank)
    fraction = rank - low
    return ordered[low] + (ordered[high] - ordered[low]) * fraction


def median_range(values: Sequence[float], digits: int, suffix: str = "") -> str:
    """``median (min–max)`` of ``values`` (the median alone for one value, ``-`` for none)."""
    if not values:
        return "-"
    mid = statistics.median(values)
    if len(values) == 1:
        return f"{mid:,.{digits}f}{suffix}"
    return f"{mid:,.{digits}f}{suffix} ({min(values):,.{digits}f}–{max(values):,.{digits}f})"


@dataclass(slots=True)
class Summary:
    """Distribution of one latency metric, in milliseconds."""

    count: int
    mean_ms: float
    median_ms: float
    p90_ms: float
    p99_ms: float
    min_ms: float
    max_ms: float
    std_ms: float


def summarize_seconds(values_s: Sequence[float]) -> Summary:
    """Summary (in ms) of a list of durations given in seconds."""
    values_ms = [v * 1000.0 for v in values_s]
    if not values_ms:
        nan = math.nan
        return Summary(0, nan, nan, nan, nan, nan, nan, nan)
    mean = sum(values_ms) / len(values_ms)
    variance = sum((v - mean) ** 2 for v in values_ms) / len(values_ms)
    return Summary(
        count=len(values_ms),
        mean_ms=mean,
        median_ms=percentile(values_ms, 50),
        p90_ms=percentile(values_ms, 90),
        p99_ms=percentile(values_ms, 99),
        min_ms=min(values_ms),
        max_ms=max(values_ms),
        std_ms=math.sqrt(variance),
    )


# ---------------------------------------------------------------- output files


def to_jsonable(value: Any) -> Any:
    """Dataclasses to dicts, NaN/inf to None (strict JSON has neither)."""
    if is_dataclass(value) and not isinstance(value, type):
        return to_jsonable(asdict(value))
    if isinstance(value, dict):
        return {str(k): to_jsonable(v) for k, v in value.items()}
    if isinstance(value, list | tuple):
        return [to_jsonable(v) for v in value]
    if isinstance(value, float) and not math.isfinite(value):
        return None
    if isinstance(value, Path):
        return str(value)
    return value


def read_json(path: str | Path) -> Any:
    """A JSON file as ``write_json`` writes it (gzip-compressed where the name ends in .gz)."""
    raw = Path(path).read_bytes()
    return json.loads(gzip.decompress(raw) if str(path).endswith(".gz") else raw)


def write_json(path: str | Path, payload: Any) -> Path:
    """``payload`` as indented JSON; gzip-compressed where the name ends in .gz (per-request lists run to tens
    of MB, more than a device call brings back)."""
    out = Path(path)
    out.parent.mkdir(parents=True, exist_ok=True)
    text = json.dumps(to_jsonable(payload), indent=2, allow_nan=False) + "\n"
    if out.name.endswith(".gz"):
        out.write_bytes(gzip.compress(text.encode(), mtime=0))
    else:
        out.write_text(text)
    return out


@dataclass(slots=True)
class PlotData:
    """Everything the latency/throughput figure needs, as plain lists (seconds)."""

    title: str
    ttft_s: list[float] = field(default_factory=list)
    tpot_s: list[float] = field(default_factory=list)
    itl_s: list[float] = field(default_factory=list)
    e2el_s: list[float] = field(default_factory=list)
    timeline_s: list[float] = field(default_factory=list)  # bin starts, seconds since the run began
    output_tokens_per_s: list[float] = field(default_factory=list)
    finished_requests_per_s: list[float] = field(default_factory=list)


def _histogram_with_cdf(axis: Any, values_ms: list[float], name: str, color: str) -> None:
    axis.set_title(f"{name} (n={len(values_ms)})")
    axis.set_xlabel("ms")
    axis.ticklabel_format(axis="x", style="plain", useOffset=False)
    axis.tick_params(axis="x", labelrotation=30)
    if not values_ms:
        axis.text(0.5, 0.5, "no data", ha="center", va="center", transform=axis.transAxes)
        return
    axis.hist(values_ms, bins=min(50, max(5, len(values_ms) // 4)), color=color, alpha=0.6)
    axis.set_ylabel("count")
    cdf_axis = axis.twinx()
    ordered = sorted(values_ms)
    cdf_axis.plot(ordered, [(i + 1) / len(ordered) for i in range(len(ordered))], color="black", lw=1)
    cdf_axis.set_ylim(0, 1.02)
    cdf_axis.set_ylabel("CDF")
    for q, style in ((50, "--"), (99, ":")):
        axis.axvline(percentile(ordered, q), color="black", ls=style, lw=0.8, label=f"p{q}")
    axis.legend(loc="center right", fontsize=7)


def write_plot(path: str | Path, data: PlotData) -> Path:
    """PNG with TTFT/TPOT/ITL/E2EL histograms (+CDF) and throughput over time. Uses the Agg backend."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(3, 2, figsize=(12, 11))
    fig.suptitle(data.title)
    _histogram_with_cdf(axes[0][0], [v * 1000 for v in data.ttft_s], "TTFT", "tab:blue")
    _histogram_with_cdf(axes[0][1], [v * 1000 for v in data.tpot_s], "TPOT", "tab:orange")
    _histogram_with_cdf(axes[1][0], [v * 1000 for v in data.itl_s], "ITL", "tab:green")
    _histogram_with_cdf(axes[1][1], [v * 1000 for v in data.e2el_s], "E2E latency", "tab:red")
    tokens_axis = axes[2][0]
    tokens_axis.set_title("output throughput over time")
    tokens_axis.set_xlabel("s since start")
    tokens_axis.set_ylabel("output tok/s")
    if data.timeline_s:
        tokens_axis.step(data.timeline_s, data.output_tokens_per_s, where="post", color="tab:purple")
    requests_axis = axes[2][1]
    requests_axis.set_title("finished requests over time")
    requests_axis.set_xlabel("s since start")
    requests_axis.set_ylabel("req/s")
    if data.timeline_s:
        requests_axis.step(data.timeline_s, data.finished_requests_per_s, where="post", color="tab:brown")
    fig.tight_layout()
    out = Path(path)
    out.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(out, dpi=100)
    plt.close(fig)
    return out


# ---------------------------------------------------------------- tables


def format_table(rows: Sequence[Sequence[str]], header: Sequence[str]) -> str:
    """Plain-text table (also valid Markdown)."""
    widths = [len(h) for h in header]
    for row in rows:
        widths = [max(w, len(cell)) for w, cell in zip(widths, row, strict=True)]

    def line(cells: Sequence[str]) -> str:
        return "| " + " | ".join(c.ljust(w) for c, w in zip(cells, widths, strict=True)) + " |"

    separator = "|" + "|".join("-" * (w + 2) for w in widths) + "|"
    return "\n".join([line(header), separator, *(line(r) for r in rows)])


def fmt(value: float | None, digits: int = 1) -> str:
    if value is None or (isinstance(value, float) and not math.isfinite(value)):
        return "-"
    return f"{value:,.{digits}f}"


# ---------------------------------------------------------------- service process


def free_port() -> int:
    """A loopback TCP port free right now that no other socket can be handed before the service binds it."""
    return free_ports(1)[0]


def free_ports(count: int) -> list[int]:
    """``count`` distinct such ports (separate :func:`free_port` calls may name the same one twice)."""
    from ominix_runtime.bind_probe import (
        free_ports as pick,  # here: peers import this module from their own envs
    )

    return pick(count)


def service_command() -> list[str]:
    """How to start the ``ominix-runtime`` CLI from this interpreter's environment."""
    beside = Path(sys.executable).with_name("ominix-runtime")
    if beside.is_file():
        return [str(beside)]
    found = shutil.which("ominix-runtime")
    if found:
        return [found]
    return [sys.executable, "-c", "import sys; from ominix_runtime.cli import main; sys.exit(main())"]


def health_status(address: str, timeout_s: float = 1.0) -> str:
    """grpc.health.v1 status of the whole server ("" service), or "UNREACHABLE"."""
    import grpc
    from grpc_health.v1 import health_pb2, health_pb2_grpc

    with grpc.insecure_channel(address) as channel:
        try:
            reply = health_pb2_grpc.HealthStub(channel).Check(
                health_pb2.HealthCheckRequest(service=""), timeout=timeout_s
            )
        except grpc.RpcError:
            return "UNREACHABLE"
    return str(health_pb2.HealthCheckResponse.ServingStatus.Name(reply.status))


def http_health_status(address: str, timeout_s: float = 1.0, path: str = "/health") -> str:
    """SERVING when ``GET http://ADDRESS/health`` answers 200 (an OpenAI-compatible server such as
    `vllm serve`), else UNREACHABLE or "HTTP <code>"."""
    import urllib.error
    import urllib.request

    try:
        with urllib.request.urlopen(f"http://{address}{path}", timeout=timeout_s) as reply:
            return "SERVING" if reply.status == 200 else f"HTTP {reply.status}"
    except urllib.error.HTTPError as exc:
        return f"HTTP {exc.code}"
    except (OSError, ValueError):
        return "UNREACHABLE"


class ServiceFailed(RuntimeError):
    """The launched service exited or never became healthy."""


class ServiceDied(ServiceFailed):
    """A process the bench started exited while the bench waited on it."""


class ServiceNotReady(ServiceFailed):
    """The service stayed up but did not become SERVING in time."""


def _log_tail(path: Path, num_lines: int) -> str:
    try:
        lines = path.read_text(errors="replace").splitlines()
    except OSError:
        return ""
    return "\n".join(lines[-num_lines:])


def _pid_exit(pid: int) -> str | None:
    """None while ``pid`` runs; else how it ended as far as can be told without being its parent."""
    try:
        stat = Path(f"/proc/{pid}/stat").read_text()
    except FileNotFoundError:
        return "exited"
    except OSError:  # no procfs: signal 0 tells whether it exists (a zombie still does)
        try:
            os.kill(pid, 0)
        except ProcessLookupError:
            return "exited"
        except PermissionError:
            return None
        return None
    state = stat.rsplit(")", 1)[-1].split()[0]  # the command name may hold spaces and parentheses
    return "exited (zombie)" if state in ("Z", "X") else None


@dataclass(slots=True)
class WatchedProcess:
    """A process a bench script started, watched while it waits: by Popen, or by pid when a shell started it."""

    name: str
    log_path: Path
    process: subprocess.Popen[bytes] | None = None
    pid: int | None = None

    def exit_status(self) -> str | None:
        """None while it runs, else e.g. "exited with code 1"."""
        if self.process is not None:
            code = self.process.poll()
            return None if code is None else f"exited with code {code}"
        if self.pid is None:
            raise ValueError(f"{self.name}: a watched process needs a Popen or a pid")
        return _pid_exit(self.pid)

    def log_tail(self, num_lines: int = 40) -> str:
        return _log_tail(self.log_path, num_lines)

    def failure(self, status: str, num_lines: int = 40) -> str:
        return f"{self.name} {status}; last lines of {self.log_path}:\n{self.log_tail(num_lines)}"


def wait_until_ready(
    probe: Callable[[], str],
    watched: Sequence[WatchedProcess],
    timeout_s: float,
    what: str,
    show_progress: bool = False,
    poll_s: float = 0.5,
) -> float:
    """Poll ``probe`` until it returns "SERVING"; returns the seconds waited.

    Before every probe each watched process is checked: the first one found dead raises ServiceFailed at once
    with its last log lines, so a service that died at start never costs the whole timeout.
    """
    started = time.monotonic()
    deadline = started + timeout_s
    status = "UNREACHABLE"
    while True:
        for proc in watched:
            exit_status = proc.exit_status()
            if exit_status is not None:
                raise ServiceDied(f"{what}: " + proc.failure(exit_status))
        status = probe()
        waited = time.monotonic() - started
        if status == "SERVING":
            if show_progress:
                print(file=sys.stderr)
            return waited
        if time.monotonic() >= deadline:
            break
        if show_progress:
            print(f"\rwaiting for {what}: {status} ({waited:.0f} s)", end="", file=sys.stderr, flush=True)
        time.sleep(poll_s)
    tails = "\n".join(p.failure("still running") for p in watched)
    raise ServiceNotReady(f"{what} not SERVING after {timeout_s:.0f} s (last: {status})\n{tails}")


@dataclass(slots=True)
class LaunchedService:
    address: str
    metrics_port: int
    process: subprocess.Popen[bytes]
    log_path: Path

    def log_tail(self, num_lines: int = 40) -> str:
        return _log_tail(self.log_path, num_lines)

    def watched(self) -> WatchedProcess:
        return WatchedProcess("ominix-runtime launch", self.log_path, process=self.process)


def _stop_process_group(process: subprocess.Popen[bytes], grace_s: float) -> None:
    """SIGTERM the launcher's group, then SIGKILL it after grace_s.

    The launcher stops its workers itself on SIGTERM, and they get SIGTERM from the kernel if it dies.
    """
    if process.poll() is not None:
        return
    try:
        os.killpg(process.pid, signal.SIGTERM)
    except ProcessLookupError:
        return
    try:
        process.wait(timeout=grace_s)
    except subprocess.TimeoutExpired:
        with contextlib.suppress(ProcessLookupError):
            os.killpg(process.pid, signal.SIGKILL)
        process.wait(timeout=30)


@contextlib.contextmanager
def launch_service(
    launch_args: Sequence[str] = (),
    *,
    port: int | None = None,
    metrics_port: int | None = None,
    ready_timeout_s: float = 900.0,
    stop_grace_s: float = 30.0,
    env: dict[str, str] | None = None,
    show_progress: bool | None = None,
) -> Iterator[LaunchedService]:
    """Start ``ominix-runtime launch`` with free ports, wait for health SERVING, stop it on exit.

    ``launch_args`` are passed through verbatim (``--model``, ``--devices``, serve and worker flags).
    The service's output goes to a log file whose tail is shown when it fails.
    """
    picked = iter(free_ports(3))
    port = port or next(picked)
    metrics_port = metrics_port or next(picked)
    address = f"127.0.0.1:{port}"
    command = [*service_command(), "launch", "--port", str(port), "--metrics-port", str(metrics_port)]
    if not any(a.split("=", 1)[0] == "--worker-base-port" for a in launch_args):
        # Not the fixed default: another service (or a test) may hold it. Workers take base + i.
        command += ["--worker-base-port", str(next(picked))]
    command += list(launch_args)
    log_fd, log_name = tempfile.mkstemp(prefix="ominix-bench-service-", suffix=".log")
    log_path = Path(log_name)
    show = sys.stderr.isatty() if show_progress is None else show_progress
    print(f"starting: {' '.join(command)}  (log: {log_path})", file=sys.stderr, flush=True)
    with os.fdopen(log_fd, "wb") as log_file:
        process = subprocess.Popen(
            command,
            stdout=log_file,
            stderr=subprocess.STDOUT,
            stdin=subprocess.DEVNULL,
            start_new_session=True,  # its own process group: stopping it cannot reach this script
            env={**os.environ, **(env or {})},
        )
    service = LaunchedService(address, metrics_port, process, log_path)
    try:
        wait_until_serving(service, ready_timeout_s, show)
        yield service
    finally:
        _stop_process_group(process, stop_grace_s)


def wait_until_serving(service: LaunchedService, timeout_s: float, show_progress: bool) -> None:
    waited = wait_until_ready(
        lambda: health_status(service.address, timeout_s=1.0),
        [service.watched()],
        timeout_s,
        f"service at {service.address}",
        show_progress,
    )
    print(f"service SERVING at {service.address} after {waited:.1f} s", file=sys.stderr, flush=True)


def run_while_alive(work: Coroutine[Any, Any, T], service: LaunchedService, poll_s: float = 0.5) -> T:
    """``asyncio.run(work)``, stopped at once with ServiceFailed (and the log tail) if the service dies."""
    return run_while_all_alive(work, [service.watched()], poll_s)


def run_while_all_alive(
    work: Coroutine[Any, Any, T], watched: Sequence[WatchedProcess], poll_s: float = 0.5
) -> T:
    """``asyncio.run(work)``, stopped at once with ServiceDied (and its log tail) when any watched process
    has died."""

    async def guarded() -> T:
        task = asyncio.ensure_future(work)
        while True:
            # Checked before the work first runs too: one dead already fails with its log, not a refused call.
            for proc in watched:
                status = proc.exit_status()
                if status is not None:
                    task.cancel()
                    with contextlib.suppress(asyncio.CancelledError):
                        await task
                    raise ServiceDied(proc.failure(status))
            await asyncio.wait({task}, timeout=poll_s)
            if task.done():
                return task.result()

    return asyncio.run(guarded())


def exit_code_of(script_main: Callable[[], int]) -> int:
    """Run a bench script's main; a service that died or never served ends it with its log tail, exit 1."""
    try:
        return script_main()
    except ServiceFailed as exc:
        print(f"{Path(sys.argv[0]).name}: {exc}", file=sys.stderr, flush=True)
        return 1


# ---------------------------------------------------------------- command line (for shell scripts)


def watch_spec(spec: str) -> WatchedProcess:
    """NAME:PID:LOG, a process a shell started, as a WatchedProcess."""
    name, pid, log = spec.split(":", 2)
    return WatchedProcess(name, Path(log), pid=int(pid))


def main(argv: Sequence[str] | None = None) -> int:
    """``python3 bench/common.py wait-serving ADDRESS --watch NAME:PID:LOG ...``: wait for health SERVING
    (grpc.health.v1, or ``GET /health`` = 200 with ``--http``), exit 1 at once (printing its last log lines)
    when a watched process has died, 2 on timeout. ``python3 bench/common.py free-port [N]``: print N distinct
    ports (default 1) as :func:`free_ports` picks them, space-separated (the shell benches' ports: one call
    for all the ports a start needs, since separate calls may name the same port twice)."""
    parser = argparse.ArgumentParser(prog="bench/common.py")
    sub = parser.add_subparsers(dest="command", required=True)
    ports = sub.add_parser(
        "free-port", help="print distinct loopback ports outside the kernel's ephemeral range"
    )
    ports.add_argument("count", nargs="?", type=int, default=1)
    wait = sub.add_parser("wait-serving", help="wait for grpc health SERVING while the given processes live")
    wait.add_argument("address")
    wait.add_argument("--timeout", type=float, default=600.0)
    wait.add_argument("--watch", action="append", default=[], type=watch_spec, metavar="NAME:PID:LOG")
    wait.add_argument("--http", action="store_true", help="probe GET http://ADDRESS/health instead of gRPC")
    args = parser.parse_args(argv)
    if args.command == "free-port":
        if args.count < 1:
            parser.error("free-port: the count must be at least 1")
        print(*free_ports(args.count))
        return 0
    probe = http_health_status if args.http else health_status
    try:
        waited = wait_until_ready(
            lambda: probe(args.address, timeout_s=1.0), args.watch, args.timeout, args.address
        )
    except ServiceDied as exc:
        print(str(exc), file=sys.stderr, flush=True)
        return 1
    except ServiceNotReady as exc:
        print(str(exc), file=sys.stderr, flush=True)
        return 2
    print(f"SERVING at {args.address} after {waited:.1f} s", flush=True)
    return 0


if __name__ == "__main__":
    if __package__ in (None, ""):
        sys.path[0] = str(REPO_ROOT)  # grpc stubs of the repository, not this folder
    sys.exit(main())
