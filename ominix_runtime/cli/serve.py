"""``ominix-runtime serve``: the engine daemon against workers started elsewhere."""

from __future__ import annotations

import argparse

from ominix_runtime.cli.ports import check_ports_free
from ominix_runtime.cli.settings import ConfigError
from ominix_runtime.config import RuntimeConfig


def engine_ports(config: RuntimeConfig) -> list[tuple[str, int, str]]:
    """The ports the engine daemon binds, with the flag that moves each."""
    ports = [(config.server.host, config.server.port, "--port")]
    if config.server.metrics_port:
        ports.append((config.server.metrics_host, config.server.metrics_port, "--metrics-port"))
    return ports


def check_model(config: RuntimeConfig) -> None:
    """The model source exists (a cheap look, nothing is loaded); one line naming --model otherwise."""
    if config.backends.sglang_urls and not config.model.path and not config.backends.workers:
        return  # SGLang alone needs no local model
    from ominix_runtime.contract import InvalidArgument
    from ominix_runtime.models import resolve_model

    try:
        resolve_model(config.model.path)
    except InvalidArgument as exc:
        raise ConfigError(f"--model: {exc.message}") from None


def run_serve(config: RuntimeConfig, options: argparse.Namespace) -> int:
    if not config.backends.workers and not config.backends.sglang_urls:
        raise ConfigError(
            "pass --worker HOST:PORT (or --sglang URL); `ominix-runtime launch` starts workers for you"
        )
    check_model(config)
    check_ports_free(engine_ports(config))
    from ominix_runtime.server.app import run_server

    return run_server(config)
