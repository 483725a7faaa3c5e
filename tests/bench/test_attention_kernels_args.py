"""bench/attention_kernels.py's case and tile arguments (the script needs triton to import; no device)."""

from __future__ import annotations

import argparse

import pytest

pytest.importorskip("triton")

from bench import attention_kernels  # noqa: E402


def _parser() -> argparse.ArgumentParser:
    return argparse.ArgumentParser(prog="attention_kernels.py")


def test_prefill_tiles_parse_and_follow_the_default() -> None:
    tiles = attention_kernels.parse_prefill_tiles(_parser(), "64,32,4,2;128, 32, 4, 3")
    assert tiles == [(64, 32, 4, 2), (128, 32, 4, 3)]
    assert attention_kernels.prefill_configs(False, tiles) == [None, (64, 32, 4, 2), (128, 32, 4, 3)]
    assert attention_kernels.prefill_configs(False) == [None]


@pytest.mark.parametrize("bad", ["64,32,4", "64,32,4,0", "64,x,4,2", "64,32,4,2;", ""])
def test_a_malformed_tile_is_a_usage_error(bad: str, capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit) as exc:
        attention_kernels.parse_prefill_tiles(_parser(), bad)
    assert exc.value.code == 2
    assert "--prefill-tiles" in capsys.readouterr().err


def test_the_sweep_holds_the_default_once() -> None:
    configs = attention_kernels.prefill_configs(True)
    assert configs[0] is None and attention_kernels.PREFILL_CONFIG not in configs
    assert len(configs) == len(set(configs)) == 36


def test_prefill_cases_parse() -> None:
    cases = attention_kernels.parse_prefill_cases(_parser(), "1x1024,12x512,1x512+2048")
    assert cases == [(1, 1024, 0), (12, 512, 0), (1, 512, 2048)]
    with pytest.raises(SystemExit):
        attention_kernels.parse_prefill_cases(_parser(), "1024")


def test_the_default_tile_is_timed_once_and_a_repeat_once() -> None:
    default = attention_kernels.PREFILL_CONFIG
    configs = attention_kernels.prefill_configs(False, [default, (64, 32, 4, 2), (64, 32, 4, 2)])
    assert configs == [None, (64, 32, 4, 2)]


def test_a_non_ascii_digit_is_a_usage_error() -> None:
    with pytest.raises(SystemExit):
        attention_kernels.parse_prefill_tiles(_parser(), "64,32,4,²")
    with pytest.raises(SystemExit):
        attention_kernels.parse_prefill_cases(_parser(), "1x²")


@pytest.mark.parametrize(
    "argv",
    [
        ["--sweep-prefill", "--prefill-tiles", "64,32,4,2"],  # one or the other
        ["--prefill-tiles", ""],
        ["--prefill-only", ""],
        ["--prefix-only", "--prefill-tiles", "64,32,4,2"],  # no prefill case to time them on
        ["--sweep-decode", "--prefill-tiles", "64,32,4,2"],
    ],
)
def test_main_refuses_arguments_before_touching_a_device(argv: list[str]) -> None:
    with pytest.raises(SystemExit) as exc:
        attention_kernels.main(argv)
    assert exc.value.code == 2
