"""The commands of ``ominix-runtime``: which flag groups each takes and which function runs it.

A command's function receives the frozen config tree and its command options
(``run(config: RuntimeConfig, options: argparse.Namespace) -> int``); it is named as ``module:function``
and imported only when that command runs, so ``--help`` stays fast and torch-free.
"""

from __future__ import annotations

import importlib
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from typing import Any

from ominix_runtime.config import DEFAULT_WORKER_PORT


@dataclass(frozen=True, slots=True)
class Command:
    name: str
    help: str
    description: str
    groups: tuple[str, ...]
    run: str  # "module:function"
    defaults: Mapping[str, Any] = field(default_factory=dict)  # tree paths whose default differs here
    positionals: tuple[tuple[str, str], ...] = ()  # (name, help)
    extra_flags: tuple[str, ...] = ()  # single flags taken beyond the groups

    def function(self) -> Callable[..., int]:
        module, _, name = self.run.partition(":")
        function: Callable[..., int] = getattr(importlib.import_module(module), name)
        return function


_ENGINE_GROUPS = ("model", "served", "listen", "limits", "sglang", "engine", "server", "access", "tls", "log")

COMMANDS: tuple[Command, ...] = (
    Command(
        "serve",
        "run the engine daemon against workers",
        "Run the engine daemon; workers are started separately (`ominix-runtime launch` starts both).",
        ("workers", *_ENGINE_GROUPS),
        "ominix_runtime.cli.serve:run_serve",
    ),
    Command(
        "launch",
        "start one worker per device, then the engine",
        "Start one worker process per device on --worker-host, grouped --tensor-parallel-size at a time "
        "(group g serves on --worker-base-port + g), wait until each group is ready, then run the engine on "
        "--host:--port. Every serve and worker flag applies; the worker flags are passed on to each worker. "
        "A group whose process dies is restarted whole. Ctrl-C stops everything.",
        (*_ENGINE_GROUPS, "worker", "worker-access", "launch"),
        "ominix_runtime.cli.launcher:run_launch",
    ),
    Command(
        "worker",
        "run a worker process (one device, one model)",
        "Serve one model on one device to an ominix-runtime engine over gRPC (Worker service).",
        (
            "model",
            "listen",
            "limits",
            "worker",
            "worker-process",
            "tensor-parallel",
            "access",
            "worker-access",
            "tls",
            "log",
        ),
        "ominix_runtime.cli.worker_command:run_worker",
        defaults={"server.port": DEFAULT_WORKER_PORT},
    ),
    Command(
        "generate",
        "one-shot client: stream a completion",
        "Send one prompt to a running engine and stream the text to the terminal.",
        ("client", "generation"),
        "ominix_runtime.cli.generate:run_generate",
        positionals=(("prompt", "prompt text"),),
        extra_flags=("--model", "--api-key", "--tls-ca"),
    ),
)

# Commands with their own argument parser: everything after the name is handed over unparsed.
FORWARDED: Mapping[str, tuple[str, str]] = {
    "conformance": (
        "backend conformance suite (flags: ominix-runtime conformance --help)",
        "ominix_runtime.conformance.cli:main",
    ),
    "replay": (
        "replay a workload through the real scheduler with a simulated backend (docs/RELEASE.md)",
        "ominix_runtime.cli.release:replay",
    ),
    "gate": (
        "promote, hold or roll back a candidate from baseline/candidate observations",
        "ominix_runtime.cli.release:gate",
    ),
    "mirror-gate": (
        "the gate over vLLM/SGLang-style records of a mirrored run",
        "ominix_runtime.cli.release:mirror_gate",
    ),
}


def command(name: str) -> Command:
    for cmd in COMMANDS:
        if cmd.name == name:
            return cmd
    raise KeyError(name)
