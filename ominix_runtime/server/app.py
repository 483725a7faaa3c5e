"""The engine daemon: startup, serving loop and bounded graceful shutdown."""

from __future__ import annotations

import asyncio
import contextlib
import signal
import sys
import time
from collections.abc import Coroutine
from dataclasses import fields as dataclass_fields
from pathlib import Path

import grpc
import grpc.aio
from grpc_health.v1 import health, health_pb2, health_pb2_grpc
from grpc_reflection.v1alpha import reflection

from ominix_runtime import memory
from ominix_runtime.backends.grpc_worker import CHANNEL_OPTIONS, CLOSE_TIMEOUT_S, GrpcWorkerBackend
from ominix_runtime.config import RuntimeConfig, TLSConfig
from ominix_runtime.contract import BackendAdapter, OminixError, RuntimeErrorKind
from ominix_runtime.engine.core import EngineCore
from ominix_runtime.engine.negotiation import ServingTerms
from ominix_runtime.engine.stats import RunReport
from ominix_runtime.models import ModelFormat, ModelSource, resolve_model
from ominix_runtime.pb import engine_pb2, engine_pb2_grpc
from ominix_runtime.server.engine_service import EngineService, EngineServiceBase
from ominix_runtime.server.front_guard import FrontGuard
from ominix_runtime.server.front_hub import FRONT_STOP_TIMEOUT_S, FrontHub
from ominix_runtime.server.logging import configure_logging, get_logger
from ominix_runtime.server.metrics import EngineMetrics
from ominix_runtime.server.stats_line import StatsLine
from ominix_runtime.server.tracing import SHUTDOWN_TIMEOUT_S as TRACING_SHUTDOWN_TIMEOUT_S
from ominix_runtime.server.tracing import tracer_from_environment
from ominix_runtime.server.v0_http import SHUTDOWN_TIMEOUT_S as V0_SHUTDOWN_TIMEOUT_S
from ominix_runtime.server.v0_http import V0Front
from ominix_runtime.text import Tokenizer

ENGINE_SERVICE = engine_pb2.DESCRIPTOR.services_by_name["Engine"].full_name
HEALTH_SERVICE = health_pb2.DESCRIPTOR.services_by_name["Health"].full_name
METRICS_REFRESH_INTERVAL_S = 0.5
HEALTH_REFRESH_INTERVAL_S = 0.25
SHUTDOWN_FLUSH_S = 2.0


def longest_graceful_stop_s(drain_timeout: float) -> float:
    """The longest ``shutdown`` takes after a SIGTERM: the drain, closing worker streams that do not answer
    (half-close, then the reader), the flush of the last events, front processes that do not stop, the v0
    front's open connections, the gRPC server's grace and the last spans' export. A supervisor's kill timeout
    for the engine (systemd, Kubernetes) must exceed it; ``launch`` adds its workers' stop
    (``cli.launcher.longest_launch_stop_s``)."""
    return (
        drain_timeout
        + 2 * CLOSE_TIMEOUT_S
        + SHUTDOWN_FLUSH_S
        + FRONT_STOP_TIMEOUT_S
        + 2 * V0_SHUTDOWN_TIMEOUT_S
        + SHUTDOWN_FLUSH_S
        + TRACING_SHUTDOWN_TIMEOUT_S
    )


MIN_MESSAGE_BYTES = 1024  # below this no request fits: the engine would refuse every call

_log = get_logger("ominix.server")


def worker_credentials(tls: TLSConfig) -> grpc.ChannelCredentials | None:
    """How the engine (or a tool in its place) reaches workers: TLS with --tls-ca, else plaintext (None)."""
    if not tls.ca:
        return None
    # Mutual TLS: the engine proves itself to the workers with its own certificate when it has one.
    key = Path(tls.key).read_bytes() if tls.key else None
    cert = Path(tls.cert).read_bytes() if tls.cert else None
    return grpc.ssl_channel_credentials(
        root_certificates=Path(tls.ca).read_bytes(), private_key=key, certificate_chain=cert
    )


def _build_backends(config: RuntimeConfig) -> list[BackendAdapter]:
    worker_tls = worker_credentials(config.tls)
    backends: list[BackendAdapter] = [
        GrpcWorkerBackend(
            address,
            tls=worker_tls,
            step_timeout=config.backends.step_timeout,
            heartbeat_timeout=config.backends.heartbeat_timeout,
            engine_secret=read_secret(config.tls.engine_secret_file),
            launch_nonce=config.backends.launch_nonce,
        )
        for address in config.backends.workers
    ]
    if config.backends.sglang_urls:
        try:
            from ominix_runtime.backends.sglang import SGLangBackend
        except ImportError as exc:
            raise OminixError(
                RuntimeErrorKind.CAPABILITY_MISMATCH,
                f"--sglang needs the SGLang adapter and its dependencies (pip install 'ominix-runtime[sglang]'): {exc}",
            ) from exc
        backends.extend(
            SGLangBackend(url, api_key=config.backends.sglang_api_key) for url in config.backends.sglang_urls
        )
    if not backends:
        raise OminixError(RuntimeErrorKind.BACKEND_UNAVAILABLE, "no backend given: pass --worker or --sglang")
    return backends


async def _wait_workers_ready(backends: list[BackendAdapter], timeout: float) -> None:
    """Wait for the gRPC workers (the other backends answer at once or say why not in describe())."""
    workers = [b for b in backends if isinstance(b, GrpcWorkerBackend)]
    if workers:
        _log.info("waiting for workers", workers=[b.address for b in workers])
        await asyncio.gather(*(b.wait_ready(timeout) for b in workers))


def _grpcurl_hint(address: str, tls: TLSConfig, has_tokenizer: bool = True) -> str:
    # With TLS the client checks the engine's certificate against the CA that signed it (deploy/TLS.md); the
    # engine does not know that file (its --tls-ca verifies workers), so the docs' placeholder stands in. A
    # wildcard listen address is no name a certificate holds: localhost is (deploy/tls/make-certs.sh).
    host, _, port = address.rpartition(":")
    if host in ("0.0.0.0", "::", "[::]", ""):
        address = f"localhost:{port}"
    transport = "-cacert ca.pem" if tls.enabled else "-plaintext"
    request = _EXAMPLE_REQUEST if has_tokenizer else _EXAMPLE_IDS_REQUEST
    return f"grpcurl {transport} -d '{request}' {address} ominix.runtime.v1.Engine/Generate"


# A chat request: instruct models answer coherently through their chat template, not to a bare word.
_EXAMPLE_REQUEST = (
    '{"messages": {"messages": [{"role": "user", "content": "What is the capital of France? '
    'Answer in one sentence."}]}, "sampling": {"max_tokens": 40, "temperature": 0}}'
)
# An engine without a tokenizer (--sglang without --model, a dummy model without tokenizer files) takes
# token ids only; small ids are within every vocabulary.
_EXAMPLE_IDS_REQUEST = (
    '{"input_ids": {"ids": [100, 101, 102]}, "sampling": {"max_tokens": 16, "temperature": 0}}'
)


class EngineDaemon:
    """Owns the engine core, the gRPC server and the metrics endpoint of one process."""

    def __init__(self, config: RuntimeConfig, backends: list[BackendAdapter] | None = None) -> None:
        """``backends`` replaces the ones named in ``config`` (in-process backends for tests)."""
        self.config = config
        self._given_backends = backends
        self.metrics = EngineMetrics() if config.server.metrics_port > 0 else None
        self.tracer = tracer_from_environment()  # off unless OTEL_* variables configure it
        self.health = health.aio.HealthServicer()
        self.stop_requested = asyncio.Event()
        self.drain_cut = asyncio.Event()  # a second signal: stop draining
        self.bound_port = 0
        self.metrics_port = 0
        self._engine: EngineCore | None = None
        self._service: EngineService | None = None
        self._server: grpc.aio.Server | None = None
        self._backends: list[BackendAdapter] = []
        self._tasks: list[asyncio.Task[None]] = []
        self.v0_front: V0Front | None = None
        self._stats_line: StatsLine | None = None
        self._hub: FrontHub | None = None

    async def start(self) -> None:
        config = self.config
        memory.map_large_allocations()  # request buffers of megabytes must not stay in the heap after use
        if config.server.max_message_bytes < MIN_MESSAGE_BYTES:
            raise OminixError(
                RuntimeErrorKind.INVALID_ARGUMENT,
                f"--max-message-bytes must be at least {MIN_MESSAGE_BYTES}, got {config.server.max_message_bytes}",
            )
        backends = config.backends
        source = model_source(config)
        model_name = source.name if source is not None else ""
        self._backends = list(self._given_backends) if self._given_backends else _build_backends(config)
        engine = self._engine = EngineCore(self._backends, config.engine)
        service = EngineService(
            engine,
            None,
            model_name,
            self.metrics,
            config.front,
            self.tracer,
            served_names=config.model.served_model_names,
            queue_limit=config.engine.max_waiting_requests,
        )
        self._service = service

        # Every service is registered before the server starts; Generate answers UNAVAILABLE and health
        # says NOT_SERVING until the engine is ready. Without front processes this server binds the public
        # port, and alone (no share_port): `launch` checks the port before its workers load, and a server that
        # took it meanwhile must fail this bind, not share the port's connections with it.
        server = self._server = build_grpc_front(config, service, self.health)
        await set_health(self.health, serving=False)
        if config.front.procs:
            # Front processes serve the public port; this server only answers the calls they forward.
            self._hub = FrontHub(config, engine, service, self.metrics)
            server.add_insecure_port(self._hub.engine_address)
        else:
            self.bound_port = bind_grpc_front(server, config)
        await server.start()
        if self.metrics is not None:
            # Scraped from now on, while the workers load (minutes for a large model): a scrape that fails
            # means the daemon is down (deploy/prometheus's OminixEngineDown), not that it is starting.
            self.metrics_port = self._start_metrics_http(self.metrics)

        # The tokenizer (a GGUF metadata parse for the embedded model) loads while the workers get ready.
        tokenizer_loading = (
            asyncio.create_task(asyncio.to_thread(load_tokenizer, source))
            if source and has_tokenizer(source)
            else None
        )
        try:
            await _wait_workers_ready(self._backends, backends.ready_timeout)
            if tokenizer_loading is not None:
                service.tokenizer = await tokenizer_loading
        finally:
            if tokenizer_loading is not None and not tokenizer_loading.done():
                tokenizer_loading.cancel()
        tokenizer = service.tokenizer
        await engine.start(ServingTerms(model_name, tokenizer.vocab_size if tokenizer is not None else None))
        if not model_name:
            caps = engine.capabilities()
            service.model_name = caps[0].model.name if caps else ""
        if config.v0.enabled:
            if config.v0.port is None or not config.v0.token:
                raise OminixError(
                    RuntimeErrorKind.INVALID_ARGUMENT, "--v0-port needs --v0-token (every v0 route wants it)"
                )
            names = config.model.served_model_names
            served = names[0] if names else ""
            self.v0_front = V0Front(service, engine, config.v0.token, served)
            await self.v0_front.start(config.v0.host, config.v0.port)
        self._wire_observability(engine, service.model_name)
        if self._hub is not None:
            await self._hub.start()
            self.bound_port = self._hub.port
        await set_health(self.health, serving=True)
        self._tasks.append(asyncio.get_running_loop().create_task(self._follow_health(engine)))
        if config.server.stats_interval > 0:
            self._tasks.append(asyncio.get_running_loop().create_task(self._log_stats(engine)))
        address = f"{config.server.host}:{self.bound_port}"
        _log.info(
            "serving",
            address=address,
            model=service.model_name,
            served_model_names=list(config.model.served_model_names),
            workers=list(backends.workers),
            metrics_port=self.metrics_port or None,
            example=_grpcurl_hint(address, config.tls, tokenizer is not None),
            v0_front=f"http://{config.v0.host}:{self.v0_front.port}" if self.v0_front is not None else None,
        )

    def front_pids(self) -> list[int]:
        """The process ids of the front processes (``--front-procs``) now running."""
        return self._hub.pids() if self._hub is not None else []

    def _wire_observability(self, engine: EngineCore, model_name: str) -> None:
        metrics = self.metrics

        def on_run(report: RunReport) -> None:
            # shallow: asdict would copy every inter-token gap one by one
            fields = {f.name: getattr(report, f.name) for f in dataclass_fields(report)}
            fields["finish_reason"] = report.finish_reason.name
            gaps = fields.pop("inter_token_latencies")  # one per token: the log keeps the worst
            fields["max_inter_token_latency"] = max(gaps) if gaps else None
            if report.error_kind is not None:
                fields["error_kind"] = report.error_kind.name
            _log.info("request finished", **fields)
            if metrics is not None:
                metrics.observe_run(report)

        engine.add_listener(on_run)
        engine.add_listener(self.tracer.on_run_report)
        if metrics is None:
            return
        metrics.set_model_name(model_name)
        engine.add_step_listener(metrics.observe_step)
        self._tasks.append(asyncio.get_running_loop().create_task(self._refresh_metrics(engine)))

    def _start_metrics_http(self, metrics: EngineMetrics) -> int:
        """Serve /metrics; the port bound. The port was checked free at start-up, but it may have been taken
        while the workers loaded: that is the same one-line error naming --metrics-port, and ``serve`` stops
        what it started, rather than a traceback."""
        host, port = self.config.server.metrics_host, self.config.server.metrics_port
        try:
            return metrics.start_http(port, host)
        except OSError as exc:
            raise OminixError(
                RuntimeErrorKind.BACKEND_UNAVAILABLE,
                f"cannot serve metrics: port {port} on {host} is not available ({exc.strerror or exc}): "
                "stop what holds it or pass another --metrics-port",
            ) from exc

    async def _log_stats(self, engine: EngineCore) -> None:
        """One "stats" line every --stats-interval seconds while there is work (and once when it stops)."""
        line = self._stats_line = StatsLine(time.monotonic())
        was_idle = True
        while True:
            await asyncio.sleep(self.config.server.stats_interval)
            fields = line.fields(engine.stats())
            idle = StatsLine.idle(fields)
            if not (idle and was_idle):
                _log.info("stats", **fields)
            was_idle = idle

    def _log_final_stats(self) -> None:
        """At shutdown: the work since the last stats line, so a short run is reported too."""
        if self._stats_line is not None and self._engine is not None:
            fields = self._stats_line.fields(self._engine.stats())
            if not StatsLine.idle(fields):
                _log.info("stats", **fields)

    async def _follow_health(self, engine: EngineCore) -> None:
        """SERVING while at least one worker group serves; NOT_SERVING while none does (they reconnect)."""
        serving = True
        while True:
            await asyncio.sleep(HEALTH_REFRESH_INTERVAL_S)
            ready = engine.ready
            if ready != serving and not self.stop_requested.is_set():
                serving = ready
                await set_health(self.health, serving=ready)
                _log.warning("health changed", serving=ready)

    async def _refresh_metrics(self, engine: EngineCore) -> None:
        assert self.metrics is not None
        while True:
            try:
                self.metrics.update_workers(g.stats() for g in engine.groups)
            except Exception as exc:  # noqa: BLE001 - metrics must never take the daemon down
                _log.warning("metrics refresh failed", error=repr(exc))
            await asyncio.sleep(METRICS_REFRESH_INTERVAL_S)

    def on_signal(self) -> None:
        """SIGINT/SIGTERM. The first drains; the second ends every live stream at once, each with a terminal
        error event; a third exits without waiting."""
        if not self.stop_requested.is_set():
            self.stop_requested.set()
        elif not self.drain_cut.is_set():
            _log.warning("second signal: ending live requests now")
            self.drain_cut.set()
        else:
            _log.warning("third signal: exiting")
            sys.exit(1)

    async def shutdown(self) -> None:
        """NOT_SERVING, stop accepting, let live requests finish up to the drain timeout (or a second
        signal), end the rest with an error event each, then close the listener.

        The listener stays open while draining, so health checks see NOT_SERVING and new Generate calls get
        UNAVAILABLE with a reason, rather than a refused connection.
        """
        drain = self.config.server.drain_timeout
        _log.info("shutting down", drain_timeout=drain)
        with contextlib.suppress(Exception):
            await self.health.enter_graceful_shutdown()
        if self._hub is not None:
            self._hub.announce_stopping()
        if self._engine is not None:
            try:
                await self._drain_engine(self._engine, drain)
            except Exception as exc:  # noqa: BLE001 - shutdown goes on whatever failed
                _log.warning("shutdown step failed", error=repr(exc))
        self._log_final_stats()
        if self._service is not None:
            # The terminal events of the requests just ended are still on their way to the clients.
            await self._service.wait_idle(SHUTDOWN_FLUSH_S)
        if self._hub is not None:  # after the drain: the fronts have every terminal event to send
            await self._hub.stop()
        if self.v0_front is not None:  # after the drain, so live v0 streams got their terminal records
            await self.v0_front.stop()
        if self._service is not None:
            self._service.close()
        if self._server is not None:
            with contextlib.suppress(Exception):
                await self._server.stop(grace=SHUTDOWN_FLUSH_S)
        for task in self._tasks:
            task.cancel()
        for backend in self._backends:
            with contextlib.suppress(Exception):
                await asyncio.wait_for(backend.close(), timeout=2.0)
        if self.metrics is not None:
            self.metrics.stop_http()
        self.tracer.shutdown()
        _log.info("stopped")

    async def _drain_engine(self, engine: EngineCore, drain: float) -> None:
        stopping = asyncio.ensure_future(engine.stop(drain_timeout=drain))
        cut = asyncio.ensure_future(self.drain_cut.wait())
        await asyncio.wait({stopping, cut}, return_when=asyncio.FIRST_COMPLETED)
        cut.cancel()
        if stopping.done():
            stopping.result()
            return
        # Cut short: stop() is still waiting for the live requests; stop again without waiting, which
        # ends each of them with an error event.
        stopping.cancel()
        with contextlib.suppress(asyncio.CancelledError):
            await stopping
        await engine.stop(drain_timeout=0)


async def serve(config: RuntimeConfig) -> int:
    """Run the daemon until SIGINT/SIGTERM; 0 on a clean stop, 1 when startup failed."""
    daemon = EngineDaemon(config)
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGINT, signal.SIGTERM):
        with contextlib.suppress(NotImplementedError, RuntimeError, ValueError):  # not the main thread
            loop.add_signal_handler(sig, daemon.on_signal)
    try:
        start = loop.create_task(daemon.start())
        stop_wait = loop.create_task(daemon.stop_requested.wait())
        done, _ = await asyncio.wait({start, stop_wait}, return_when=asyncio.FIRST_COMPLETED)
        if start in done:
            start.result()
            memory.freeze_startup_heap()  # this process's own heap only: in-process daemons (tests) keep theirs
            await stop_wait
        else:
            start.cancel()
            with contextlib.suppress(BaseException):
                await start
    except OminixError as exc:
        print(f"ominix-runtime: error: {exc.message}", file=sys.stderr, flush=True)
        await daemon.shutdown()
        return 1
    await daemon.shutdown()
    return 0


def read_secret(path: str | None) -> str | None:
    """The engine secret of --engine-secret-file (checked readable and non-empty when the flag was read)."""
    if not path:
        return None
    return Path(path).read_text(encoding="utf-8").strip() or None


def build_grpc_front(
    config: RuntimeConfig,
    service: EngineServiceBase,
    health_servicer: health.aio.HealthServicer,
    *,
    share_port: bool = False,
) -> grpc.aio.Server:
    """The gRPC server clients call: the Engine service behind the API-key guard, health and reflection.

    ``share_port``: bind with SO_REUSEPORT, for the front processes of ``--front-procs`` that serve one port
    together. gRPC sets it by default; off, a port another server holds (even one that set it too) fails
    ``bind_grpc_front`` instead of being shared, the kernel splitting the connections between the two."""
    options = dict(CHANNEL_OPTIONS)
    options["grpc.max_receive_message_length"] = config.server.max_message_bytes
    options["grpc.so_reuseport"] = 1 if share_port else 0
    server = grpc.aio.server(options=list(options.items()), interceptors=[FrontGuard(config.front.api_keys)])
    engine_pb2_grpc.add_EngineServicer_to_server(service, server)
    health_pb2_grpc.add_HealthServicer_to_server(health_servicer, server)
    reflection.enable_server_reflection((ENGINE_SERVICE, HEALTH_SERVICE, reflection.SERVICE_NAME), server)
    return server


def bind_grpc_front(server: grpc.aio.Server, config: RuntimeConfig) -> int:
    """Bind the public address (TLS when configured); the port bound. Several processes may bind one port
    only when each built its server with ``share_port`` (the front processes of ``--front-procs`` do)."""
    try:
        if config.tls.enabled:
            assert config.tls.key and config.tls.cert
            key_and_cert = (Path(config.tls.key).read_bytes(), Path(config.tls.cert).read_bytes())
            credentials = grpc.ssl_server_credentials([key_and_cert])
            return server.add_secure_port(config.server.address, credentials)
        return server.add_insecure_port(config.server.address)
    except RuntimeError as exc:
        raise OminixError(
            RuntimeErrorKind.BACKEND_UNAVAILABLE,
            f"cannot bind {config.server.address} (port taken?): {exc}",
        ) from exc


async def set_health(health_servicer: health.aio.HealthServicer, serving: bool) -> None:
    status = health_pb2.HealthCheckResponse.SERVING if serving else health_pb2.HealthCheckResponse.NOT_SERVING
    for service in ("", ENGINE_SERVICE):
        await health_servicer.set(service, status)


def model_source(config: RuntimeConfig) -> ModelSource | None:
    """The model this engine serves itself (its tokenizer, its name); None for SGLang backends alone."""
    backends = config.backends
    if config.model.path or backends.workers or not backends.sglang_urls:
        return resolve_model(config.model.path)
    return None


def load_tokenizer(source: ModelSource) -> Tokenizer:
    return Tokenizer.from_source(source).prepare()


def has_tokenizer(source: ModelSource) -> bool:
    """A dummy (random-weight) model may come without tokenizer files: then clients send input_ids."""
    if source.format != ModelFormat.DUMMY:
        return True
    folder = source.path if source.path.is_dir() else source.path.parent
    return (folder / "tokenizer.json").is_file()


def run_server(config: RuntimeConfig) -> int:
    """Blocking entry point (uvloop when installed)."""
    configure_logging(config.log.level, config.log.json, component="engine")
    return run_event_loop(serve(config))


def run_event_loop(coro: Coroutine[None, None, int]) -> int:
    """Run ``coro`` to completion on uvloop when installed, else on asyncio's loop."""
    try:
        import uvloop
    except ImportError:
        return asyncio.run(coro)
    return uvloop.run(coro)
