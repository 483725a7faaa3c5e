"""The engine process's side of ``--front-procs N``: starts the front processes and serves their links.

With one process, the engine's event loop also writes every client's stream: one gRPC message per request per
step, which costs more CPU than scheduling the step. Behind several worker groups that loop becomes the
limit. Front processes take the client streams (two or more each bind the public port with SO_REUSEPORT, so
the kernel spreads connections over them; a single one binds it alone); this process keeps the engine core and
sends each front one frame per turn of its loop with the events of all that front's requests.

Here a front's request is admitted into the EngineCore with a sink that queues its events for that front's
link, and tracked by the EngineService of this process, so Abort (forwarded by any front), GetStats and the
drain at shutdown see it. A front that dies has its requests aborted (their KV freed) and is started again on
the same port unless the engine is stopping. This process leads the shutdown: the fronts ignore SIGTERM and
SIGINT (a signal to the process group reaches them too) and stop when ``stop`` tells them, after the drain.
"""

from __future__ import annotations

import asyncio
import contextlib
import os
import pickle
import shutil
import subprocess
import sys
import tempfile
import threading
from dataclasses import dataclass, replace
from pathlib import Path

from ominix_runtime.config import RuntimeConfig
from ominix_runtime.contract import (
    BackendCapability,
    GenerateRequest,
    OminixError,
    RuntimeErrorKind,
    WorkerEvent,
    is_terminal,
)
from ominix_runtime.engine.core import EngineCore
from ominix_runtime.server import front_link as link
from ominix_runtime.server.engine_service import AlreadyLive, EngineService, rejection_reason
from ominix_runtime.server.logging import get_logger
from ominix_runtime.server.metrics import EngineMetrics

READINESS_POLL_S = 0.25
FRONT_START_TIMEOUT_S = 120.0  # a front loads the tokenizer before it binds
FRONT_STOP_TIMEOUT_S = 10.0
RESTART_DELAY_S = 0.5  # doubling up to MAX_RESTART_DELAY_S while a front fails to start again
MAX_RESTART_DELAY_S = 10.0

_log = get_logger("ominix.front_hub")


@dataclass(frozen=True, slots=True)
class FrontSpec:
    """What a front process is started with (pickled into a file of the hub's directory, named on its
    command line)."""

    config: RuntimeConfig  # server.host/port: the address to bind (the port the first front bound)
    index: int
    link_path: str


def _exit_of(proc: subprocess.Popen[bytes]) -> asyncio.Future[int]:
    """A future of ``proc``'s exit status, waited for on a thread of its own (not the loop's executor, which a
    few fronts would fill)."""
    loop = asyncio.get_running_loop()
    done: asyncio.Future[int] = loop.create_future()

    def settle(status: int) -> None:
        if not done.done():
            done.set_result(status)

    def wait() -> None:
        status = proc.wait()
        with contextlib.suppress(RuntimeError):  # the loop closed first
            loop.call_soon_threadsafe(settle, status)

    threading.Thread(target=wait, name=f"ominix-front-wait-{proc.pid}", daemon=True).start()
    return done


class _FrontLink:
    """One connected front: its frame writer and its live requests; the EventSink of those requests."""

    def __init__(self, writer: asyncio.StreamWriter, service: EngineService) -> None:
        self.frames = link.FrameWriter(writer)
        self.live: set[str] = set()
        self.resolving: dict[str, str] = {}  # requests announced before their Submit -> their owner
        self._service = service
        self.index = -1

    def put(self, event: WorkerEvent) -> None:
        self.frames.send_event(event)
        if is_terminal(event):
            self.live.discard(event.request_id)
            self._service.forget(event.request_id)


class FrontHub:
    """Starts ``config.front.procs`` (at least one) front processes, serves their links and restarts one that dies."""

    def __init__(
        self,
        config: RuntimeConfig,
        engine: EngineCore,
        service: EngineService,
        metrics: EngineMetrics | None = None,
    ) -> None:
        self._config = config
        self._metrics = metrics
        self._engine = engine
        self._service = service
        service.fronts = self  # Drain, Undrain and Abort reach the fronts through it
        self._dir = Path(tempfile.mkdtemp(prefix="ominix-fronts-"))  # mode 0700: this user only
        self.link_path = str(self._dir / "link.sock")
        # The engine process's own gRPC server listens here (admin calls the fronts forward).
        self.engine_address = f"unix:{self._dir / 'engine.sock'}"
        self.port = 0
        self._server: asyncio.AbstractServer | None = None
        self._links: set[_FrontLink] = set()
        self._procs: dict[int, subprocess.Popen[bytes]] = {}  # fronts that bound the port
        self._starting: set[subprocess.Popen[bytes]] = set()
        self._bound: dict[int, asyncio.Future[int]] = {}
        self._tasks: list[asyncio.Task[None]] = []
        self._stopping = False
        self._readiness: tuple[bool, tuple[BackendCapability, ...]] | None = None

    async def start(self) -> None:
        """Listen for links, start the fronts (the first one picks the port), follow the engine's readiness."""
        await self.listen()
        self.port = await self._start_front(0, self._config.server.port)
        count = self._config.front.procs or 1
        await asyncio.gather(*(self._start_front(i, self.port) for i in range(1, count)))
        self._tasks.append(asyncio.get_running_loop().create_task(self._follow_readiness()))
        _log.info("front processes serving", fronts=count, port=self.port)

    async def listen(self) -> None:
        """Serve front links on ``link_path`` (this user only), without starting any front process."""
        self._server = await asyncio.start_unix_server(self._serve_link, self.link_path)
        os.chmod(self.link_path, 0o600)

    async def _start_front(self, index: int, port: int) -> int:
        """Start front ``index`` and wait until it listens on ``port`` (0: any); the port it bound. From then
        on a task keeps it running: started again (with backoff) whenever it exits, until ``stop``."""
        exited, bound_port = await self._spawn(index, port)
        self._tasks.append(asyncio.get_running_loop().create_task(self._keep(index, exited)))
        return bound_port

    async def _spawn(self, index: int, port: int) -> tuple[asyncio.Future[int], int]:
        """Start front ``index`` and wait until it listens on ``port``: the future of its exit status, and the
        port it bound."""
        if self._stopping:
            raise OminixError(RuntimeErrorKind.BACKEND_UNAVAILABLE, "the engine is stopping")
        config = replace(self._config, server=replace(self._config.server, port=port))
        bound: asyncio.Future[int] = asyncio.get_running_loop().create_future()
        self._bound[index] = bound
        spec_path = self._dir / f"front{index}.spec"  # in the hub's directory: this user only
        spec_path.write_bytes(pickle.dumps(FrontSpec(config, index, self.link_path)))
        # posix_spawn, not fork: this process runs gRPC threads, and gRPC's fork handlers in a forked child
        # can abort it before the exec (seen: "Check failed: next_worker->state == KICKED" under uvloop,
        # whose subprocesses fork). subprocess uses posix_spawn with close_fds=False; nothing leaks, since
        # Python and gRPC open every descriptor close-on-exec.
        proc = subprocess.Popen(
            [sys.executable, "-m", "ominix_runtime.server.front_process", str(spec_path)],
            stdin=subprocess.DEVNULL,
            close_fds=False,
        )
        self._starting.add(proc)
        try:
            exited = _exit_of(proc)
            done, _ = await asyncio.wait(
                {bound, exited}, timeout=FRONT_START_TIMEOUT_S, return_when="FIRST_COMPLETED"
            )
        finally:
            self._starting.discard(proc)
        if bound not in done:
            exited.cancel()
            if proc.returncode is None:
                proc.kill()
            why = f"exited with status {proc.returncode}" if exited in done else "did not bind in time"
            raise OminixError(
                RuntimeErrorKind.BACKEND_UNAVAILABLE, f"front process {index} {why} (port {port})"
            )
        self._procs[index] = proc
        self._count_serving()
        return exited, bound.result()

    def _count_serving(self) -> None:
        if self._metrics is not None:
            self._metrics.front_processes.set(len(self.pids()))

    async def _keep(self, index: int, exited: asyncio.Future[int]) -> None:
        while True:
            status = await exited
            if self._stopping:
                return
            _log.warning("front process exited; starting it again", front=index, status=status)
            self._count_serving()
            if self._metrics is not None:
                self._metrics.front_restarts.inc()
            restarted = await self._respawn(index)
            if restarted is None:
                return
            exited = restarted

    async def _respawn(self, index: int) -> asyncio.Future[int] | None:
        """Front ``index`` started again on the hub's port, retried with backoff; None once the hub stops."""
        delay = RESTART_DELAY_S
        while True:
            try:
                exited, _ = await self._spawn(index, self.port)
                return exited
            except OminixError as exc:
                if self._stopping:
                    return None
                _log.error("front process did not start again", front=index, error=exc.message, retry_s=delay)
                await asyncio.sleep(delay)
                delay = min(delay * 2, MAX_RESTART_DELAY_S)

    async def _serve_link(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        front = _FrontLink(writer, self._service)
        self._links.add(front)
        engine = self._engine
        front.frames.send(
            link.Hello(
                self._service.model_name,
                self.engine_address,
                engine.ready,
                tuple(engine.capabilities()),
            )
        )
        if self._stopping:  # a front that started while the engine began to stop
            front.frames.send(link.Readiness(False, tuple(engine.capabilities())))
            front.frames.send(link.StopServing())
        try:
            while (messages := await link.read_frame(reader)) is not None:
                for message in messages:
                    self._on_message(front, message)
        except Exception as exc:  # noqa: BLE001 - a bad link ends that link only
            _log.warning("front link failed", front=front.index, error=repr(exc))
        finally:
            self._links.discard(front)
            front.resolving.clear()
            for rid in list(front.live):  # the clients are gone with their front: free the KV now
                self._engine.abort(rid)
                self._service.forget(rid)
            front.live.clear()
            front.frames.close()

    def _on_message(self, front: _FrontLink, message: object) -> None:
        engine = self._engine
        match message:
            case link.Submit(request):
                self._submit(front, request)
            case link.Resolving(rid, owner):
                front.resolving[rid] = owner
            case link.Resolved(rid):
                front.resolving.pop(rid, None)
            case link.AbortRequest(rid):
                if rid in front.live:
                    engine.abort(rid)
            case link.FinishRequest(rid, reason, matched_stop):
                if rid in front.live:
                    engine.finish(rid, reason, matched_stop)
            case link.SettleRequest(rid, matched_stop):
                engine.settle(rid, matched_stop)  # ended already: only a held run report is touched
            case link.FrontRefusal(text, reason, model):
                self._service.count_refusal(text, reason, counted_by_engine=False, model=model)
            case link.Bound(index, port):
                front.index = index
                bound = self._bound.get(index)
                if bound is not None and not bound.done():
                    bound.set_result(port)
            case _:
                raise ValueError(f"unexpected front link message {type(message).__name__}")

    def _submit(self, front: _FrontLink, request: GenerateRequest) -> None:
        rid = request.request_id
        if self._service.is_live(rid) or self._engine.holds(rid):  # the latter: its previous request ending
            duplicate = AlreadyLive(f"request_id '{rid}' is already live")
            self._service.count_refusal(
                duplicate.message, rejection_reason(duplicate), counted_by_engine=False
            )
            front.frames.send(link.Refused(rid, duplicate.kind, duplicate.message, duplicate=True))
            return
        try:
            self._engine.submit(request, sink=front)
        except OminixError as exc:
            self._service.count_refusal(
                exc.message, rejection_reason(exc), counted_by_engine=True, model=request.model
            )
            front.frames.send(link.Refused(rid, exc.kind, exc.message, duplicate=False))
            return
        except Exception as exc:  # noqa: BLE001 - a bug on one request must not end the front's link
            _log.exception("submit failed", request_id=rid)
            text = f"the engine could not take the request: {exc!r}"
            self._service.count_refusal(text, "internal", counted_by_engine=False)
            front.frames.send(link.Refused(rid, RuntimeErrorKind.INTERNAL, text, duplicate=False))
            return
        front.live.add(rid)
        self._service.track(rid, request.owner)
        front.frames.send(link.Admitted(rid))

    def resolving_owner(self, request_id: str) -> str | None:
        """The owner of a request some front announced and has not submitted yet; None when none has."""
        for front in self._links:
            owner = front.resolving.get(request_id)
            if owner is not None:
                return owner
        return None

    def abort_resolving(self, request_id: str) -> None:
        """Tell the fronts holding ``request_id`` before its Submit to abort it."""
        for front in self._links:
            if request_id in front.resolving:
                front.frames.send(link.AbortResolving(request_id))

    async def _follow_readiness(self) -> None:
        while True:
            self.push_readiness()
            await asyncio.sleep(READINESS_POLL_S)

    def push_readiness(self) -> None:
        """Tell the fronts the engine's readiness and capabilities if they changed since last told."""
        state = (self._engine.ready, tuple(self._engine.capabilities()))
        if state != self._readiness and not self._stopping:
            self._readiness = state
            self.broadcast(link.Readiness(state[0], state[1]))
            for front in self._links:  # written now: ahead of a Drain or Undrain answer that follows
                front.frames.flush()

    def pids(self) -> list[int]:
        return [p.pid for p in self._procs.values() if p.returncode is None]

    def announce_stopping(self) -> None:
        """The engine takes no new requests: the fronts' health says NOT_SERVING from now on."""
        self._stopping = True
        self._readiness = (False, tuple(self._engine.capabilities()))
        self.broadcast(link.Readiness(*self._readiness))

    def broadcast(self, message: object) -> None:
        for front in self._links:
            front.frames.send(message)

    async def stop(self) -> None:
        """Tell every front to finish its streams and exit; kill the ones that do not within the timeout."""
        self._stopping = True
        for task in self._tasks:
            task.cancel()
        self.broadcast(link.StopServing())
        procs = [p for p in [*self._procs.values(), *self._starting] if p.returncode is None]
        if procs:
            _, pending = await asyncio.wait([_exit_of(p) for p in procs], timeout=FRONT_STOP_TIMEOUT_S)
            for p in procs:
                if p.returncode is None:
                    _log.warning("front process did not stop; killing it", pid=p.pid)
                    with contextlib.suppress(ProcessLookupError):
                        p.kill()
            for waiting in pending:
                with contextlib.suppress(Exception):
                    await asyncio.wait_for(waiting, 5.0)
        if self._server is not None:
            self._server.close()
        for front in list(self._links):
            front.frames.close()
        shutil.rmtree(self._dir, ignore_errors=True)
