"""The one place the config tree is built: defaults < ``--config`` file < ``OMINIX_<FLAG>`` < command line.

Also the way back: the command line (and environment) that gives a child process the same tree.
"""

from __future__ import annotations

import argparse
import os
import sys
from collections.abc import Callable, Mapping, Sequence
from pathlib import Path
from typing import Any, NoReturn

from ominix_runtime.cli import flags as readers
from ominix_runtime.cli.commands import Command
from ominix_runtime.cli.flags import FLAGS, Flag, by_group, by_name
from ominix_runtime.config import RuntimeConfig, debug_values, get_path, with_paths

CONFIG_ENV = "OMINIX_CONFIG"
_METAVARS: dict[Callable[[str], Any], str] = {
    readers.port: "PORT",
    readers.port_or_zero: "PORT",
    readers.positive_int: "N",
    readers.non_negative_int: "N",
    readers.fraction: "FRACTION",
    readers.positive_float: "SECONDS",
    readers.non_negative_float: "SECONDS",
}


class ConfigError(Exception):
    """A setting cannot be used; the message is one line naming the flag, variable or file."""


class _Parser(argparse.ArgumentParser):
    def error(self, message: str) -> NoReturn:
        raise ConfigError(message)


def command_flags(command: Command) -> tuple[Flag, ...]:
    flags = list(by_group(command.groups))
    flags += [by_name(name) for name in command.extra_flags if by_name(name) not in flags]
    return tuple(flags)


def base_tree(command: Command) -> RuntimeConfig:
    """The tree when nothing is set: the tree's defaults with this command's own."""
    return with_paths(RuntimeConfig(), command.defaults)


def _default_text(value: Any) -> str | None:
    if value is None or value == () or value == "":
        return None
    if isinstance(value, bool):
        return None
    if isinstance(value, tuple):
        return ",".join(str(v) for v in value)
    return str(value)


def _help(flag: Flag, base: RuntimeConfig) -> str:
    default = get_path(base, flag.targets[0]) if flag.targets else flag.default
    text = _default_text(default)
    return flag.help if text is None else f"{flag.help} (default: {text})"


def build_parser(command: Command) -> argparse.ArgumentParser:
    parser = _Parser(
        prog=f"ominix-runtime {command.name}",
        description=command.description,
        epilog="Every flag can also be set by an OMINIX_<FLAG> environment variable (OMINIX_MAX_MODEL_LEN=4096; "
        "repeatable flags take commas) or a --config file; the command line wins over the environment, which "
        "wins over the file.",
    )
    parser.add_argument(
        "--config",
        metavar="FILE",
        default=argparse.SUPPRESS,
        help=f"YAML or TOML file of flag values, keyed by flag name (max-model-len: 4096); also {CONFIG_ENV}",
    )
    for name, help_text in command.positionals:
        parser.add_argument(name, help=help_text)
    base = base_tree(command)
    sections: dict[str, argparse._ArgumentGroup] = {}
    for flag in command_flags(command):
        section = sections.get(flag.group)
        if section is None:
            section = sections[flag.group] = parser.add_argument_group(f"{flag.group} flags")
        kwargs: dict[str, Any] = {"dest": flag.dest, "default": argparse.SUPPRESS, "help": _help(flag, base)}
        if flag.switch:
            kwargs["action"] = "store_true"
        else:
            kwargs["metavar"] = flag.metavar or _METAVARS.get(flag.parse, flag.dest.upper())
            if flag.repeatable:
                kwargs["action"] = "append"
        section.add_argument(*flag.names, **kwargs)
    return parser


def _read(flag: Flag, raw: Any, source: str) -> Any:
    try:
        return flag.read(raw)
    except argparse.ArgumentTypeError as exc:
        raise ConfigError(f"{source}: {exc}") from None


def read_config_file(path: str, flags: Sequence[Flag]) -> dict[str, Any]:
    """``{flag dest: raw value}`` from a YAML or TOML file keyed by flag names (dashes or underscores);
    flags of other commands are skipped, so one file can configure `launch`, `serve` and `worker` alike."""
    file = Path(path).expanduser()
    try:
        text = file.read_text()
    except OSError as exc:
        raise ConfigError(f"--config {path}: {exc.strerror or exc}") from None
    try:
        if file.suffix == ".toml":
            if sys.version_info >= (3, 11):
                import tomllib
            else:  # pragma: no cover - Python 3.10
                import tomli as tomllib  # type: ignore[import-not-found,unused-ignore]  # 3.10 only
            data: Any = tomllib.loads(text)
        else:
            import yaml  # type: ignore[import-untyped,unused-ignore]  # stubs are a test extra at most

            data = yaml.safe_load(text) or {}
    except Exception as exc:  # noqa: BLE001 - any parser error is one line naming the file
        first = str(exc).strip().splitlines()[0] if str(exc).strip() else type(exc).__name__
        raise ConfigError(
            f"--config {path}: not valid {'TOML' if file.suffix == '.toml' else 'YAML'}: {first}"
        ) from None
    if not isinstance(data, dict):
        raise ConfigError(f"--config {path}: expected a mapping of flag names to values")

    def key_of(name: str) -> str:
        return name.removeprefix("--").replace("-", "_")

    known = {key_of(name): flag for flag in flags for name in flag.names}
    anywhere = {key_of(name) for flag in FLAGS for name in flag.names}
    values: dict[str, Any] = {}
    for key, raw in data.items():
        flag = known.get(key_of(str(key)))
        if flag is None:
            if key_of(str(key)) in anywhere:
                continue  # one file may serve several commands: another command's flag is not an error
            raise ConfigError(f"--config {path}: {key!r} is not a flag")
        values[flag.dest] = _read(flag, raw, f"--config {path}: {key}")
    return values


def resolve(
    command: Command, argv: Sequence[str], env: Mapping[str, str] | None = None
) -> tuple[RuntimeConfig, argparse.Namespace]:
    """The frozen tree and the command's own options; raises ConfigError with a one-line reason."""
    env = os.environ if env is None else env
    parsed = build_parser(command).parse_args(list(argv))
    flags = command_flags(command)
    values: dict[str, Any] = {}
    config_file = getattr(parsed, "config", None) or env.get(CONFIG_ENV)
    if config_file:
        values.update(read_config_file(config_file, flags))
    for flag in flags:
        if flag.env in env:
            values[flag.dest] = _read(flag, env[flag.env], flag.env)
    for flag in flags:
        if hasattr(parsed, flag.dest):
            values[flag.dest] = _read(flag, getattr(parsed, flag.dest), flag.name)
    try:
        paths = debug_values(env)
    except ValueError as exc:
        raise ConfigError(str(exc)) from None
    options: dict[str, Any] = {name: getattr(parsed, name) for name, _ in command.positionals}
    for flag in flags:
        value = values.get(flag.dest)
        if flag.targets:
            if value is not None:
                paths.update((target, value) for target in flag.targets)
        else:
            options[flag.dest] = flag.default if value is None else value
    return with_paths(base_tree(command), paths), argparse.Namespace(**options)


def child_command(command: Command, tree: RuntimeConfig) -> tuple[list[str], dict[str, str]]:
    """The words after ``ominix-runtime`` and the extra environment that give a child ``command`` the
    settings of ``tree`` (everything that differs from that command's defaults; secrets go by environment)."""
    base = base_tree(command)
    argv = [command.name]
    secrets: dict[str, str] = {}
    for flag in command_flags(command):
        if not flag.targets:
            continue
        value = get_path(tree, flag.targets[0])
        if value == get_path(base, flag.targets[0]):
            continue
        if flag.secret:
            secrets[flag.env] = ",".join(str(v) for v in value) if isinstance(value, tuple) else str(value)
        else:
            argv += flag.render(value)
    return argv, secrets


def child_environment(extra: Mapping[str, str] = {}) -> dict[str, str]:  # noqa: B006 - read only
    """This process's environment without the variables already folded into the tree: a child gets its
    settings from its command line, so a variable cannot silently override what the parent passed on."""
    consumed = {flag.env for flag in FLAGS} | {CONFIG_ENV}
    env = {k: v for k, v in os.environ.items() if k not in consumed}
    env.update(extra)
    return env
