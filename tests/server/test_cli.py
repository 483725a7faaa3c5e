"""The ominix-runtime command line: one definition per flag, one frozen tree from flags, environment and a
config file, flags passed on by `launch`, one-line errors."""

from __future__ import annotations

import dataclasses
import subprocess
import sys
from pathlib import Path

import pytest

from ominix_runtime.cli import main
from ominix_runtime.cli.commands import COMMANDS, command
from ominix_runtime.cli.flags import FLAGS
from ominix_runtime.cli.launcher import default_front_procs, device_groups, plan_workers
from ominix_runtime.cli.settings import (
    ConfigError,
    build_parser,
    child_command,
    command_flags,
    resolve,
)
from ominix_runtime.config import RuntimeConfig, get_path

SERVE, LAUNCH, WORKER = command("serve"), command("launch"), command("worker")


def _option_strings(cmd_name: str) -> set[str]:
    parser = build_parser(command(cmd_name))
    return {s for a in parser._actions for s in a.option_strings}  # noqa: SLF001 - argparse has no public API


def test_every_flag_is_defined_once() -> None:
    names = [n for f in FLAGS for n in f.names]
    assert len(names) == len(set(names))
    envs = [f.env for f in FLAGS]
    assert len(envs) == len(set(envs))


@pytest.mark.parametrize("name", [c.name for c in COMMANDS])
def test_help_documents_every_flag_with_its_default(name: str, capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit) as info:
        main([name, "--help"])
    assert info.value.code == 0
    text = capsys.readouterr().out
    for flag in command_flags(command(name)):
        for option in flag.names:
            assert option in text
    assert "(default:" in text and "OMINIX_" in text


def test_serve_flags_build_a_frozen_tree() -> None:
    config, _ = resolve(
        SERVE,
        ["--worker", "127.0.0.1:1", "--worker", "127.0.0.1:2", "--port", "7000", "--metrics-port", "0"]
        + [
            "--max-batch-tokens",
            "256",
            "--no-prefix-caching",
            "--drain-timeout",
            "3",
            "--max-queue-len",
            "7",
        ],
        env={},
    )
    assert config.backends.workers == ("127.0.0.1:1", "127.0.0.1:2")
    assert config.server.address == "127.0.0.1:7000" and config.server.metrics_port == 0
    # One scheduler config: the flag lands where the engine core reads it, no copy on the way.
    assert config.engine.scheduler.max_batch_tokens == 256
    assert not config.engine.scheduler.enable_prefix_caching
    assert config.engine.max_waiting_requests == 7 and config.server.drain_timeout == 3
    assert config.model.path is None  # the embedded default
    with pytest.raises(dataclasses.FrozenInstanceError):
        config.server.port = 1  # type: ignore[misc]  # frozen: the assignment must fail


def test_operator_aliases() -> None:
    config, _ = resolve(SERVE, ["--max-num-seqs", "8", "--max-num-batched-tokens", "512"], env={})
    assert config.engine.scheduler.max_running_requests == 8
    assert config.engine.scheduler.max_batch_tokens == 512


def test_launch_accepts_every_serve_and_worker_flag() -> None:
    # --worker and --worker-launch-nonce: the launcher sets them for its engine (its workers and their nonce).
    serve = _option_strings("serve") - {"--worker", "--worker-launch-nonce"}
    # Per-worker settings are the launcher's to set (--devices, --worker-base-port, --worker-threads); it
    # starts single-rank workers, so the per-rank tensor-parallel flags are not its to pass on.
    per_process = {"--device", "--num-threads", "--worker-id", "--launch-nonce"}
    per_rank = {"--tp-size", "--tp-rank", "--dist-init-addr", "--dist-timeout"}
    worker = _option_strings("worker") - per_process - per_rank
    assert serve | worker <= _option_strings("launch")


def test_launch_passes_every_worker_flag_on() -> None:
    """Finding 5: --max-model-len, --gpu-memory-utilization, --attention and --log-level reached no worker."""
    argv = ["--devices", "cpu,cpu", "--model", "dummy:x", "--max-model-len", "512", "--dtype", "bfloat16"]
    argv += ["--gpu-memory-utilization", "0.5", "--attention", "torch", "--log-level", "DEBUG"]
    argv += [
        "--kv-cache-memory",
        "64MiB",
        "--block-size",
        "32",
        "--max-num-seqs",
        "4",
        "--log-format",
        "json",
        "--no-early-results",
    ]
    config, _ = resolve(LAUNCH, argv, env={})
    assert not config.worker.early_results
    plans = plan_workers(config, [41000, 41001], "nonce")
    for i, plan in enumerate(plans):
        (argv,) = plan.argvs
        assert argv[1:4] == ("-m", "ominix_runtime", "worker")
        child, _ = resolve(WORKER, list(argv[4:]), env={})
        # Everything the worker reads equals what the launcher was given, except what it assigns per worker.
        assert child.model == config.model and child.log == config.log
        expected = dataclasses.replace(
            config.worker,
            launch_nonce="nonce",
            worker_id=f"cpu@127.0.0.1:{41000 + i}",
            num_threads=child.worker.num_threads,
        )
        assert child.worker == expected
        assert child.server.port == 41000 + i and child.server.host == "127.0.0.1"
    assert config.log.level == "debug"


def test_early_results_and_the_prefill_limit_beside_decodes_are_on_by_default() -> None:
    config, _ = resolve(LAUNCH, ["--devices", "cpu", "--model", "dummy:x"], env={})
    assert config.worker.early_results
    assert config.engine.scheduler.prefill_tokens_beside_decodes == 1024
    ((argv,),) = (plan.argvs for plan in plan_workers(config, [41000], "nonce"))
    assert "--no-early-results" not in argv
    child, _ = resolve(WORKER, list(argv[4:]), env={})
    assert child.worker.early_results
    off, _ = resolve(SERVE, ["--prefill-tokens-beside-decodes", "0"], env={})
    assert off.engine.scheduler.prefill_tokens_beside_decodes == 0
    assert config.engine.scheduler.prefill_backlog_tokens == 0
    held, _ = resolve(
        SERVE, ["--prefill-tokens-beside-decodes", "512", "--prefill-backlog-tokens", "2048"], env={}
    )
    assert (
        held.engine.scheduler.prefill_tokens_beside_decodes,
        held.engine.scheduler.prefill_backlog_tokens,
    ) == (
        512,
        2048,
    )


def test_the_budget_of_a_step_with_decodes_is_4096_by_default_and_set_by_its_flag() -> None:
    default, _ = resolve(SERVE, [], env={})
    assert default.engine.scheduler.max_batch_tokens_with_decodes == 4096
    config, _ = resolve(LAUNCH, ["--devices", "cpu", "--max-batch-tokens-with-decodes", "0"], env={})
    assert config.engine.scheduler.max_batch_tokens_with_decodes == 0
    larger, _ = resolve(SERVE, ["--max-batch-tokens-with-decodes", "6144"], env={})
    assert larger.engine.scheduler.max_batch_tokens_with_decodes == 6144
    with pytest.raises(ConfigError, match="expected an integer >= 0"):
        resolve(SERVE, ["--max-batch-tokens-with-decodes", "-1"], env={})


def test_a_backlog_is_admitted_two_slots_at_a_time_by_default_and_set_by_its_flag() -> None:
    default, _ = resolve(SERVE, [], env={})
    assert default.engine.scheduler.backlog_admission_slots == 2
    config, _ = resolve(LAUNCH, ["--devices", "cpu", "--backlog-admission-slots", "0"], env={})
    assert config.engine.scheduler.backlog_admission_slots == 0
    with pytest.raises(ConfigError, match="expected an integer >= 0"):
        resolve(SERVE, ["--backlog-admission-slots", "-1"], env={})


def test_a_burst_budget_is_on_by_default_and_set_by_its_flags() -> None:
    def burst(config: RuntimeConfig) -> tuple[int, int]:
        return config.engine.scheduler.burst_backlog_tokens, config.engine.scheduler.max_batch_tokens_in_burst

    assert burst(resolve(SERVE, [], env={})[0]) == (16384, 6144)
    argv = ["--devices", "cpu", "--burst-backlog-tokens", "2048", "--max-batch-tokens-in-burst", "3072"]
    assert burst(resolve(LAUNCH, argv, env={})[0]) == (2048, 3072)
    assert burst(resolve(LAUNCH, ["--devices", "cpu", "--burst-backlog-tokens", "0"], env={})[0]) == (0, 6144)
    for flag in ("--burst-backlog-tokens", "--max-batch-tokens-in-burst"):
        with pytest.raises(ConfigError, match="expected an integer >= 0"):
            resolve(SERVE, [flag, "-1"], env={})


def test_launch_groups_devices_for_tensor_parallelism() -> None:
    argv = ["--devices", "cpu,cpu,cpu,cpu", "--tensor-parallel-size", "2", "--max-model-len", "256"]
    config, _ = resolve(LAUNCH, argv, env={})
    plans = plan_workers(config, [41000, 41001], "nonce", [30000, 30001])
    assert [p.devices for p in plans] == [("cpu", "cpu"), ("cpu", "cpu")]
    for g, plan in enumerate(plans):
        ranks = [resolve(WORKER, list(argv[4:]), env={})[0] for argv in plan.argvs]
        assert [r.worker.tp_rank for r in ranks] == [0, 1]
        for rank in ranks:
            assert rank.worker.tp_size == 2 and rank.worker.dist_init_addr == f"127.0.0.1:{30000 + g}"
            assert rank.server.port == 41000 + g and rank.worker.worker_id == f"cpu+cpu@127.0.0.1:{41000 + g}"
            assert rank.worker.max_model_len == 256 and rank.worker.launch_nonce == "nonce"
    odd, _ = resolve(LAUNCH, ["--devices", "cpu,cpu,cpu", "--tensor-parallel-size", "2"], env={})
    with pytest.raises(ConfigError, match="do not split into groups of --tensor-parallel-size 2"):
        plan_workers(odd, [41000], "n")


def test_launch_gives_gpu_groups_a_front_process_each_unless_told() -> None:
    def fronts(argv: list[str]) -> int | None:
        config, _ = resolve(LAUNCH, argv, env={})
        if config.front.procs is not None:
            return config.front.procs
        return default_front_procs(config, len(device_groups(config)))

    assert fronts(["--devices", "cuda:0,cuda:1"]) == 2
    assert fronts(["--devices", "cuda:0,cuda:1,cuda:2,cuda:3", "--tensor-parallel-size", "2"]) == 2
    assert fronts(["--devices", "cuda:0,cuda:1", "--tensor-parallel-size", "2"]) == 1  # one group
    assert fronts(["--devices", "cpu,cpu"]) == 0
    assert fronts(["--devices", "cuda:0,cuda:1", "--front-procs", "3"]) == 3
    assert fronts(["--devices", "cuda:0,cuda:1", "--front-procs", "0"]) == 0
    serve, _ = resolve(SERVE, ["--front-procs", "2"], env={})
    words, _ = child_command(SERVE, serve)
    assert resolve(SERVE, words[1:], env={})[0].front.procs == 2


def test_engine_child_gets_every_serve_setting() -> None:
    argv = ["--port", "7001", "--metrics-port", "0", "--max-queue-len", "5", "--no-prefix-caching"]
    argv += [
        "--served-model-name",
        "a",
        "--served-model-name",
        "b",
        "--api-key",
        "k1",
        "--stats-interval",
        "2",
    ]
    config, _ = resolve(LAUNCH, argv, env={})
    words, secret_env = child_command(SERVE, config)
    assert "k1" not in words and secret_env == {"OMINIX_API_KEY": "k1"}
    child, _ = resolve(SERVE, words[1:], env=secret_env)
    for section in ("model", "engine", "server", "front", "backends", "log", "tls"):
        assert getattr(child, section) == getattr(config, section), section


def test_environment_and_config_file(tmp_path: Path) -> None:
    yaml_file = tmp_path / "ominix.yaml"
    yaml_file.write_text("max-model-len: 1024\nlog_level: WARNING\nworker: [a:1, b:2]\nport: 7100\n")
    toml_file = tmp_path / "ominix.toml"
    toml_file.write_text('max-model-len = 2048\nserved-model-name = ["tiny"]\n')
    config, _ = resolve(LAUNCH, ["--config", str(yaml_file)], env={})
    assert config.worker.max_model_len == 1024 and config.log.level == "warning"
    config, _ = resolve(SERVE, ["--config", str(yaml_file)], env={"OMINIX_PORT": "7200"})
    assert config.backends.workers == ("a:1", "b:2") and config.server.port == 7200  # env beats file
    config, _ = resolve(SERVE, ["--config", str(yaml_file), "--port", "7300"], env={"OMINIX_PORT": "7200"})
    assert config.server.port == 7300  # the command line beats both
    config, _ = resolve(LAUNCH, [], env={"OMINIX_CONFIG": str(toml_file), "OMINIX_MAX_NUM_SEQS": "3"})
    assert config.worker.max_model_len == 2048 and config.model.served_model_names == ("tiny",)
    assert config.engine.scheduler.max_running_requests is None  # only primary names are variables
    config, _ = resolve(LAUNCH, [], env={"OMINIX_MAX_RUNNING_REQUESTS": "3", "OMINIX_NO_PREFIX_CACHING": "1"})
    assert config.engine.scheduler.max_running_requests == 3 and config.worker.max_running_requests == 3
    assert not config.engine.scheduler.enable_prefix_caching
    bad = tmp_path / "bad.yaml"
    bad.write_text("no-such-flag: 1\n")
    with pytest.raises(ConfigError, match="'no-such-flag' is not a flag"):
        resolve(SERVE, ["--config", str(bad)], env={})


def test_debug_variables_are_typed_and_land_in_the_tree() -> None:
    env = {
        "OMINIX_LOG_STEPS": "1",
        "OMINIX_PIPELINE": "0",
        "OMINIX_CUDA_GRAPHS": "0",
        "OMINIX_PIPELINE_EAGER": "0",
        "OMINIX_WEIGHT_STREAM": "0",
        "OMINIX_TRITON_FAST_LAUNCH": "0",
        "OMINIX_PAD_LOGITS": "0",
        "OMINIX_WARM_GEMM_ROWS": "8",
        "OMINIX_PIECEWISE_GRAPH_TOKENS": "0",
        "OMINIX_PIECEWISE_FASTEST_BUCKET": "1",
        "OMINIX_PIECEWISE_TOKEN_STEP": "32",
    }
    config, _ = resolve(WORKER, [], env=env)
    assert config.debug.log_steps
    assert not config.debug.pipeline and not config.debug.cuda_graphs and not config.debug.pipeline_eager
    assert not config.debug.weight_stream and not config.debug.triton_fast_launch
    assert RuntimeConfig().debug.pipeline_eager and RuntimeConfig().debug.weight_stream
    assert RuntimeConfig().debug.triton_fast_launch
    assert not config.debug.pad_logits and RuntimeConfig().debug.pad_logits
    assert config.debug.warm_gemm_rows == 8 and RuntimeConfig().debug.warm_gemm_rows == 0
    assert config.debug.piecewise_graph_tokens == 0 and RuntimeConfig().debug.piecewise_graph_tokens == 2048
    assert config.debug.piecewise_fastest_bucket and not RuntimeConfig().debug.piecewise_fastest_bucket
    assert config.debug.piecewise_token_step == 32 and RuntimeConfig().debug.piecewise_token_step == 8
    assert RuntimeConfig().debug.pipeline and not RuntimeConfig().debug.log_steps
    with pytest.raises(ConfigError, match="OMINIX_PIPELINE"):
        resolve(WORKER, [], env={"OMINIX_PIPELINE": "maybe"})
    for name in ("OMINIX_WARM_GEMM_ROWS", "OMINIX_PIECEWISE_GRAPH_TOKENS"):
        for bad in ("-8", "eight"):
            with pytest.raises(ConfigError, match=name):
                resolve(WORKER, [], env={name: bad})
    for bad in ("0", "-8", "eight", ""):  # a spacing has no off
        with pytest.raises(ConfigError, match="OMINIX_PIECEWISE_TOKEN_STEP"):
            resolve(WORKER, [], env={"OMINIX_PIECEWISE_TOKEN_STEP": bad})


def test_worker_process_reads_no_environment_itself() -> None:
    """Issue 12.3: OMINIX_PIPELINE / OMINIX_CUDA_GRAPHS were read deep inside the worker's runner."""
    worker = Path(__file__).resolve().parents[2] / "workers" / "ominix_worker"
    for module in ("runner.py", "ops/launch.py"):
        source = (worker / module).read_text()
        assert "os.environ" not in source and "getenv" not in source, module


def test_api_keys_from_a_file(tmp_path: Path) -> None:
    keys = tmp_path / "keys"
    keys.write_text("# operators\nalpha\n\nbeta\n")
    config, _ = resolve(SERVE, ["--api-key", f"@{keys}", "--api-key", "gamma"], env={})
    assert config.front.api_keys == ("alpha", "beta", "gamma")
    with pytest.raises(ConfigError, match="cannot read API keys"):
        resolve(SERVE, ["--api-key", f"@{tmp_path / 'none'}"], env={})


def test_log_level_is_case_insensitive_with_one_set_of_choices() -> None:
    for name in ("serve", "launch", "worker"):
        assert resolve(command(name), ["--log-level", "WARNING"], env={})[0].log.level == "warning"
        with pytest.raises(ConfigError, match="'verbose' is not one of debug, info, warning, error"):
            resolve(command(name), ["--log-level", "verbose"], env={})


@pytest.mark.parametrize(
    ("argv", "message"),
    [
        (["serve", "--worker", "h:1", "--port", "99999"], "--port: port 99999 is outside 1-65535"),
        (["launch", "--port", "0"], "--port: port 0 is outside 1-65535"),
        (["launch", "--log-level", "verbose"], "--log-level: 'verbose' is not one of"),
        (["launch", "--gpu-memory-utilization", "2"], "--gpu-memory-utilization: expected a fraction"),
        (["launch", "--dtype", "fp64"], "--dtype: 'fp64' is not one of auto, float32, bfloat16, float16"),
        (["worker", "--dtype", "double"], "--dtype: 'double' is not one of"),
        (["launch", "--kv-cache-memory", "12XB"], "--kv-cache-memory: bad byte size '12XB'"),
        (
            ["launch", "--worker-base-port", "65535", "--devices", "cpu,cpu"],
            "leaves no room for 2 worker groups",
        ),
        (["serve"], "pass --worker HOST:PORT"),
        (["serve", "--no-such-flag"], "unrecognized arguments: --no-such-flag"),
        (["frobnicate"], "unknown command"),
    ],
)
def test_setup_errors_are_one_line_and_exit_1(
    argv: list[str], message: str, capsys: pytest.CaptureFixture[str]
) -> None:
    assert main(argv) == 1
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and message in err[0], err


def test_launch_takes_the_worker_flags_it_passes_on() -> None:
    """--dist-timeout, --dtype and --kv-cache-memory reach launch's config as written (their short names too)."""
    config, _ = resolve(
        command("launch"),
        ["--dist-timeout", "10", "--dtype", "BF16", "--kv-cache-memory", "512MiB"],
        env={},
    )
    assert (config.worker.dist_timeout, config.worker.dtype, config.worker.kv_cache_memory) == (
        10.0,
        "bf16",
        "512MiB",
    )


def test_version(capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["--version"]) == 0
    out = capsys.readouterr().out.strip()
    assert out.startswith("ominix-runtime 0.") and len(out.splitlines()) == 1


def test_tree_defaults_are_the_flag_defaults() -> None:
    """One definition of each default: --help prints the tree's own value."""
    config, _ = resolve(SERVE, [], env={})
    assert config == dataclasses.replace(RuntimeConfig())
    worker, _ = resolve(WORKER, [], env={})
    assert worker.server.port == 50071 and get_path(worker, "worker.block_size") == 16


def test_worker_and_conformance_run_from_the_command_line() -> None:
    worker = subprocess.run(
        [sys.executable, "-m", "ominix_worker", "--help"], capture_output=True, text=True, timeout=120
    )
    assert worker.returncode == 0 and "--kv-cache-memory" in worker.stdout
    conformance = subprocess.run(
        [sys.executable, "-m", "ominix_runtime", "conformance", "--help"],
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert conformance.returncode == 0, conformance.stderr


def test_serve_on_a_taken_port_fails_in_one_line(capsys: pytest.CaptureFixture[str]) -> None:
    import socket

    with socket.socket() as holder:
        holder.bind(("127.0.0.1", 0))
        holder.listen()
        taken = holder.getsockname()[1]
        assert main(["serve", "--worker", "127.0.0.1:1", "--port", str(taken), "--metrics-port", "0"]) == 1
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and f"port {taken}" in err[0] and "--port" in err[0]


def test_launch_passes_the_moe_split_to_every_worker_only_when_given() -> None:
    argv = ["--devices", "cpu,cpu", "--tensor-parallel-size", "2", "--moe-parallel", "expert"]
    config, _ = resolve(LAUNCH, argv, env={})
    for words in plan_workers(config, [41000], "n", [30000])[0].argvs:
        assert words[words.index("--moe-parallel") + 1] == "expert"
    default, _ = resolve(LAUNCH, [], env={})
    assert "--moe-parallel" not in plan_workers(default, [41000], "n")[0].argvs[0]


def test_hardening_flags_reach_the_config(tmp_path: Path) -> None:
    keys = tmp_path / "keys"
    keys.write_text("k2\n# a comment\n\nk3\n")
    secret = tmp_path / "secret"
    secret.write_text("  s3cret \n")
    argv = ["--worker", "127.0.0.1:1", "--api-key", "k1", "--api-key", f"@{keys}"]
    argv += ["--allow-special-tokens-in-chat", "--worker-heartbeat-timeout", "1.5", "--step-timeout", "20"]
    argv += ["--engine-secret-file", str(secret), "--max-pending-tokenizations", "8"]
    config, _ = resolve(SERVE, argv, env={})
    assert config.front.api_keys == ("k1", "k2", "k3")
    assert config.front.allow_special_tokens_in_chat and not config.front.allow_special_tokens_in_prompt
    assert config.front.max_pending_tokenizations == 8
    assert (config.backends.heartbeat_timeout, config.backends.step_timeout) == (1.5, 20.0)
    assert config.engine.step_timeout == 20.0  # the engine core's guard follows an explicit step timeout
    assert config.tls.engine_secret_file == str(secret)
    defaults, _ = resolve(SERVE, ["--worker", "h:1"], env={})
    assert defaults.backends.heartbeat_timeout == 3.0 and defaults.backends.step_timeout is None
    assert defaults.front.api_keys == () and defaults.tls.engine_secret_file is None
    # The worker reads the same secret file; launch passes it on (and makes one when unset).
    worker, _ = resolve(WORKER, ["--engine-secret-file", str(secret), "--engine-identity", "eng"], env={})
    assert worker.tls.engine_secret_file == str(secret) and worker.tls.engine_identities == ("eng",)
    empty = tmp_path / "empty"
    empty.write_text("\n")
    with pytest.raises(ConfigError, match="is empty"):
        resolve(SERVE, ["--engine-secret-file", str(empty)], env={})


def test_bad_hardening_values_are_one_line_errors(capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["serve", "--worker", "h:1", "--worker-heartbeat-timeout", "0"]) == 1
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "--worker-heartbeat-timeout" in err[0]
