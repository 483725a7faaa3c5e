"""Settings `serve` and `launch` refuse before anything starts: a TLS file that cannot be read, half a TLS pair,
a taken or doubly given --v0-port and one without --v0-token, a malformed --worker address (and
--dist-init-addr, `generate --address`), a secret file that is not text, and a config file's list where a flag
takes one value. Each is one line on stderr naming the flag, exit code 1, and neither
the engine nor (under `launch`) any worker was started."""

from __future__ import annotations

import socket
from collections.abc import Iterator
from pathlib import Path

import pytest

from ominix_runtime.bind_probe import free_ports
from ominix_runtime.cli import main
from ominix_runtime.cli.commands import command
from ominix_runtime.cli.settings import ConfigError, resolve

SERVE, LAUNCH = command("serve"), command("launch")


@pytest.fixture
def started(monkeypatch: pytest.MonkeyPatch) -> list[str]:
    """What a setting that passed every check would start: `serve`'s engine or `launch`'s workers."""
    reached: list[str] = []

    def run_server(config: object) -> int:
        reached.append("engine")
        return 0

    def launch(config: object, *args: object) -> int:
        reached.append("workers")
        return 0

    monkeypatch.setattr("ominix_runtime.server.app.run_server", run_server)
    monkeypatch.setattr("ominix_runtime.cli.launcher._launch", launch)
    return reached


@pytest.fixture
def taken_port() -> Iterator[int]:
    """A loopback port another socket listens on for the test's duration."""
    with socket.socket() as holder:
        holder.bind(("127.0.0.1", 0))
        holder.listen()
        yield holder.getsockname()[1]


def _argv(name: str) -> list[str]:
    """`name` on free ports (launch: free worker ports), so only the flags a test adds can fail."""
    port, metrics = free_ports(2)
    argv = [name, "--port", str(port), "--metrics-port", str(metrics)]
    return argv + (["--worker", "127.0.0.1:1"] if name == "serve" else ["--worker-base-port", "0"])


def _error_line(capsys: pytest.CaptureFixture[str]) -> str:
    lines = capsys.readouterr().err.strip().splitlines()
    assert len(lines) == 1, lines
    return lines[0]


@pytest.fixture
def pem_pair(tmp_path: Path) -> tuple[Path, Path]:
    """Readable certificate and key files (their content is not parsed before the servers start)."""
    cert, key = tmp_path / "cert.pem", tmp_path / "key.pem"
    cert.write_text("-----BEGIN CERTIFICATE-----\n")
    key.write_text("-----BEGIN PRIVATE KEY-----\n")
    return cert, key


def test_the_checks_pass_and_reach_the_engine_and_the_workers(
    started: list[str], pem_pair: tuple[Path, Path]
) -> None:
    """The fixture's stand-ins are reached when nothing is wrong, so a refusal below means a check caught it."""
    cert, key = pem_pair
    assert main([*_argv("serve"), "--tls-cert", str(cert), "--tls-key", str(key)]) == 0
    v0 = ["--v0-port", str(free_ports(1)[0]), "--v0-token", "t"]
    assert main([*_argv("launch"), *v0]) == 0
    assert main([*_argv("serve"), "--v0-port", "0", "--v0-token", "t"]) == 0  # 0: a free port at bind
    assert started == ["engine", "workers", "engine"]


@pytest.mark.parametrize("name", ["serve", "launch"])
@pytest.mark.parametrize("flag", ["--tls-cert", "--tls-key", "--tls-ca"])
def test_a_tls_file_that_cannot_be_read_is_refused_naming_its_flag(
    name: str,
    flag: str,
    started: list[str],
    pem_pair: tuple[Path, Path],
    tmp_path: Path,
    capsys: pytest.CaptureFixture[str],
) -> None:
    """The servers read these files only as they start, after `launch` has loaded every worker: a missing
    one was a traceback from inside the engine's startup."""
    cert, key = pem_pair
    files = {"--tls-cert": str(cert), "--tls-key": str(key), "--tls-ca": str(cert)}
    files[flag] = str(tmp_path / "missing.pem")
    tls = [word for item in files.items() for word in item]
    assert main([*_argv(name), *tls]) == 1
    line = _error_line(capsys)
    assert f"{flag}: cannot read {tmp_path / 'missing.pem'}" in line, line
    empty = tmp_path / "empty.pem"
    empty.write_text("\n")
    files[flag] = str(empty)
    assert main([*_argv(name), *(word for item in files.items() for word in item)]) == 1
    assert f"{flag}: {empty} is empty" in _error_line(capsys)
    assert started == []


@pytest.mark.parametrize("name", ["serve", "launch"])
@pytest.mark.parametrize("flag", ["--tls-cert", "--tls-key"])
def test_half_a_tls_pair_is_refused(
    name: str, flag: str, started: list[str], pem_pair: tuple[Path, Path], capsys: pytest.CaptureFixture[str]
) -> None:
    """A certificate without its key (or the reverse) served the engine port in plaintext."""
    assert main([*_argv(name), flag, str(pem_pair[0])]) == 1
    assert "--tls-cert and --tls-key go together" in _error_line(capsys)
    assert started == []


@pytest.mark.parametrize("name", ["serve", "launch"])
def test_a_taken_v0_port_is_refused_before_anything_starts(
    name: str, taken_port: int, started: list[str], capsys: pytest.CaptureFixture[str]
) -> None:
    """--v0-port was found taken only once the engine started, after `launch` had loaded every worker."""
    assert main([*_argv(name), "--v0-port", str(taken_port), "--v0-token", "t"]) == 1
    line = _error_line(capsys)
    assert f"port {taken_port}" in line and "--v0-port" in line, line
    assert started == []


@pytest.mark.parametrize(
    ("name", "other"),
    [
        ("serve", "--port"),
        ("serve", "--metrics-port"),
        ("launch", "--port"),
        ("launch", "--worker-base-port"),
    ],
)
def test_a_v0_port_given_to_another_server_is_refused(
    name: str, other: str, started: list[str], capsys: pytest.CaptureFixture[str]
) -> None:
    """--v0-port equal to the engine's, the metrics' or a worker's port was never caught before binding."""
    port = free_ports(1)[0]
    argv = [*_argv(name), other, str(port), "--v0-port", str(port), "--v0-token", "t"]
    assert main(argv) == 1
    line = _error_line(capsys)
    assert f"port {port} is given to both" in line and other in line and "--v0-port" in line, line
    assert started == []


@pytest.mark.parametrize("name", ["serve", "launch"])
def test_a_v0_port_without_a_token_is_refused_before_anything_starts(
    name: str, started: list[str], capsys: pytest.CaptureFixture[str]
) -> None:
    """The engine found it only after every worker was ready."""
    assert main([*_argv(name), "--v0-port", str(free_ports(1)[0])]) == 1
    assert "--v0-port needs --v0-token" in _error_line(capsys)
    assert started == []


@pytest.mark.parametrize(
    "address",
    ["no-port-here", "127.0.0.1:99999", "127.0.0.1:0", "127.0.0.1:x", ":50071", "::1:50071", "unix:"],
)
def test_a_malformed_worker_address_is_refused(
    address: str, started: list[str], capsys: pytest.CaptureFixture[str]
) -> None:
    """The engine waited --worker-ready-timeout (300 s) for an address gRPC could never reach."""
    assert main(["serve", "--worker", address, "--port", str(free_ports(1)[0]), "--metrics-port", "0"]) == 1
    line = _error_line(capsys)
    assert "--worker" in line and repr(address) in line, line
    assert started == []


def test_worker_addresses_grpc_reaches_are_kept(tmp_path: Path) -> None:
    """Host names, IPv4, bracketed IPv6 and gRPC's targets with a scheme, from flags, the environment and a
    file."""
    addresses = ["localhost:50071", "10.0.0.7:1", "[::1]:50071", "[fe80::1%eth0]:65535", "unix:/run/w.sock"]
    addresses += ["unix:///run/w.sock", "dns:///workers.internal:50071", "ipv4:10.0.0.7:1,10.0.0.8:1"]
    addresses += ["unix-abstract:ominix-w0"]
    config, _ = resolve(SERVE, [word for a in addresses for word in ("--worker", a)], env={})
    assert config.backends.workers == tuple(addresses)
    config, _ = resolve(SERVE, [], env={"OMINIX_WORKER": "a:1,[::1]:2"})
    assert config.backends.workers == ("a:1", "[::1]:2")
    file = tmp_path / "c.yaml"
    file.write_text("worker: [a:1, '[::1]:2']\n")
    assert resolve(SERVE, ["--config", str(file)], env={})[0].backends.workers == ("a:1", "[::1]:2")
    with pytest.raises(ConfigError, match="OMINIX_WORKER: expected HOST:PORT, got 'b'"):
        resolve(SERVE, [], env={"OMINIX_WORKER": "a:1,b"})


@pytest.mark.parametrize(
    ("name", "text"), [("c.yaml", "devices: [cpu, cpu]\n"), ("c.toml", 'devices = ["cpu", "cpu"]\n')]
)
def test_a_config_file_list_of_devices_is_the_device_list(tmp_path: Path, name: str, text: str) -> None:
    """It was read as the text of the list, devices "['cpu'" and "'cpu']"."""
    file = tmp_path / name
    file.write_text(text)
    config, _ = resolve(LAUNCH, ["--config", str(file)], env={})
    assert config.launch.devices == ("cpu", "cpu")


@pytest.mark.parametrize(
    ("text", "kind"),
    [
        ("model: [a.gguf, b.gguf]\n", "a list"),
        ("port: [7000, 7001]\n", "a list"),
        ("host: {a: 1}\n", "a mapping"),
    ],
)
def test_a_config_file_list_for_a_flag_of_one_value_is_refused(tmp_path: Path, text: str, kind: str) -> None:
    """--model was set to the text of the list; the error names the file and the flag."""
    file = tmp_path / "c.yaml"
    file.write_text(text)
    key = text.partition(":")[0]
    with pytest.raises(ConfigError, match=rf"^--config {file}: {key}: takes one value, got {kind}"):
        resolve(SERVE, ["--config", str(file)], env={})


@pytest.mark.parametrize(
    ("cmd", "argv", "flag"),
    [
        ("worker", ["--dist-init-addr", "rank0-without-port"], "--dist-init-addr"),
        ("worker", ["--dist-init-addr", "10.0.0.1:70000"], "--dist-init-addr"),
        ("generate", ["hi", "--address", "localhost"], "--address"),
        ("generate", ["hi", "--address", "unix:"], "--address"),
    ],
)
def test_other_addresses_are_checked_as_they_are_read(cmd: str, argv: list[str], flag: str) -> None:
    """--dist-init-addr (where rank 0 gathers its group: ranks waited --dist-timeout for an address that can
    never be reached) and `generate --address` are HOST:PORT (the latter any gRPC target) like --worker."""
    with pytest.raises(ConfigError, match=flag):
        resolve(command(cmd), argv, env={})
    kept = "[::1]:29500" if flag == "--dist-init-addr" else "dns:///engine.internal:50061"
    config, options = resolve(command(cmd), [*argv[:-2], flag, kept], env={})
    assert kept in (config.worker.dist_init_addr, getattr(options, "address", None))


def test_a_secret_file_that_is_not_text_is_refused_naming_its_flag(tmp_path: Path) -> None:
    """It was a UnicodeDecodeError traceback."""
    secret = tmp_path / "secret.bin"
    secret.write_bytes(b"\xff\xfe\x00binary")
    with pytest.raises(ConfigError, match=r"--engine-secret-file.*not UTF-8 text"):
        resolve(SERVE, ["--engine-secret-file", str(secret)], env={})
