"""The ominix-runtime command line: help text, flag plumbing into the frozen config, forwarding."""

from __future__ import annotations

import dataclasses
import subprocess
import sys

import pytest

from ominix_runtime.cli import build_parser, engine_config_from_args, main
from ominix_runtime.config import DebugConfig, EngineConfig


@pytest.mark.parametrize("command", ["serve", "launch", "generate"])
def test_help_documents_every_flag_with_its_default(command: str, capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit) as info:
        main([command, "--help"])
    assert info.value.code == 0
    text = capsys.readouterr().out
    parser = build_parser()
    sub = parser._subparsers._group_actions[0].choices[command]  # noqa: SLF001 - argparse has no public API
    for action in sub._actions:  # noqa: SLF001
        for flag in action.option_strings:
            assert flag in text
    assert "(default:" in text


def test_serve_flags_build_a_frozen_config() -> None:
    args = build_parser().parse_args(
        [
            "serve",
            "--worker",
            "127.0.0.1:1",
            "--worker",
            "127.0.0.1:2",
            "--port",
            "7000",
            "--metrics-port",
            "0",
            "--max-batch-tokens",
            "256",
            "--no-prefix-caching",
            "--drain-timeout",
            "3",
        ]
    )
    config = engine_config_from_args(args, args.worker)
    assert config.workers == ("127.0.0.1:1", "127.0.0.1:2")
    assert config.address == "127.0.0.1:7000" and config.metrics_port == 0
    assert config.scheduler.max_batch_tokens == 256 and not config.scheduler.enable_prefix_caching
    assert config.model is None  # the embedded default
    with pytest.raises(dataclasses.FrozenInstanceError):
        config.port = 1  # type: ignore[misc]  # frozen: the assignment must fail


def test_launch_accepts_every_serve_flag() -> None:
    parser = build_parser()
    choices = parser._subparsers._group_actions[0].choices  # noqa: SLF001
    serve_flags = {f for a in choices["serve"]._actions for f in a.option_strings} - {"--worker"}  # noqa: SLF001
    launch_flags = {f for a in choices["launch"]._actions for f in a.option_strings}  # noqa: SLF001
    assert serve_flags <= launch_flags


def test_debug_knobs_come_from_ominix_env_vars() -> None:
    debug = DebugConfig.from_env({"OMINIX_LOG_STEPS": "1"})
    assert debug == DebugConfig(log_steps=True)
    assert EngineConfig().debug == DebugConfig()


def test_serve_without_backends_explains(capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["serve"]) == 2
    assert "--worker" in capsys.readouterr().err


def test_worker_and_conformance_are_forwarded() -> None:
    worker = subprocess.run(
        [sys.executable, "-m", "ominix_runtime", "worker", "--help"],
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert worker.returncode == 0 and "--kv-cache-memory" in worker.stdout
    conformance = subprocess.run(
        [sys.executable, "-m", "ominix_runtime", "conformance", "--help"],
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert conformance.returncode == 0, conformance.stderr


def test_launch_passes_the_moe_split_to_every_worker_only_when_given() -> None:
    from ominix_runtime.cli import _worker_command

    parser = build_parser()
    given = parser.parse_args(["launch", "--tensor-parallel-size", "2", "--moe-parallel", "expert"])
    cmd = _worker_command(given, "cuda:0", 50071, None)
    assert cmd[cmd.index("--moe-parallel") + 1] == "expert"
    assert "--moe-parallel" not in _worker_command(parser.parse_args(["launch"]), "cuda:0", 50071, None)


def test_hardening_flags_reach_the_config(tmp_path) -> None:  # noqa: ANN001
    keys = tmp_path / "keys"
    keys.write_text("k2\n# a comment\n\nk3\n")
    secret = tmp_path / "secret"
    secret.write_text("  s3cret \n")
    args = build_parser().parse_args(
        [
            "serve",
            "--worker",
            "127.0.0.1:1",
            "--api-key",
            "k1",
            "--api-key",
            f"@{keys}",
            "--allow-special-tokens-in-chat",
            "--worker-heartbeat-timeout",
            "1.5",
            "--step-timeout",
            "20",
            "--engine-secret-file",
            str(secret),
            "--max-pending-tokenizations",
            "8",
        ]
    )
    config = engine_config_from_args(args, args.worker)
    assert config.front.api_keys == ("k1", "k2", "k3")
    assert config.front.allow_special_tokens_in_chat and not config.front.allow_special_tokens_in_prompt
    assert config.front.max_pending_tokenizations == 8
    assert (config.worker_heartbeat_timeout, config.step_timeout) == (1.5, 20.0)
    assert config.engine_secret == "s3cret"
    defaults = engine_config_from_args(build_parser().parse_args(["serve", "--worker", "h:1"]), ["h:1"])
    assert defaults.worker_heartbeat_timeout == 3.0 and defaults.step_timeout is None
    assert defaults.front.api_keys == () and defaults.engine_secret is None


def test_bad_hardening_values_are_one_line_errors(capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["serve", "--worker", "h:1", "--worker-heartbeat-timeout", "0"]) == 1
    assert "--worker-heartbeat-timeout" in capsys.readouterr().err
