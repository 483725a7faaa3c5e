"""``ominix-runtime serve``: the engine daemon against workers started elsewhere."""

from __future__ import annotations

import argparse

from ominix_runtime.cli.ports import check_ports_free
from ominix_runtime.cli.settings import ConfigError
from ominix_runtime.config import RuntimeConfig


def engine_ports(config: RuntimeConfig) -> list[tuple[str, int, str]]:
    """The ports the engine daemon binds, with the flag that moves each (a port of 0 is picked at bind)."""
    ports = [(config.server.host, config.server.port, "--port")]
    if config.server.metrics_port:
        ports.append((config.server.metrics_host, config.server.metrics_port, "--metrics-port"))
    if config.v0.port:
        ports.append((config.v0.host, config.v0.port, "--v0-port"))
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


def check_engine(config: RuntimeConfig) -> None:
    """The engine's settings that only make sense together, and its model, checked before anything starts
    (`serve`, and `launch` before its workers load); one line naming the flag otherwise. Ports are checked
    apart (``engine_ports``), with the launcher's own."""
    check_model(config)
    if bool(config.tls.cert) != bool(config.tls.key):
        # Half a pair would serve the engine port in plaintext.
        raise ConfigError("--tls-cert and --tls-key go together: pass both, or neither for plaintext")
    if config.v0.enabled and not config.v0.token:
        raise ConfigError("--v0-port needs --v0-token (every v0 route wants it)")


def run_serve(config: RuntimeConfig, options: argparse.Namespace) -> int:
    if not config.backends.workers and not config.backends.sglang_urls:
        raise ConfigError(
            "pass --worker HOST:PORT (or --sglang URL); `ominix-runtime launch` starts workers for you"
        )
    check_engine(config)
    check_ports_free(engine_ports(config))
    from ominix_runtime.server.app import run_server

    return run_server(config)
