"""pyproject's dependency bounds match what the committed code requires (fast; the wheel test installs them)."""

from __future__ import annotations

import re
import sys
from pathlib import Path

if sys.version_info >= (3, 11):
    import tomllib
else:  # pragma: no cover
    import tomli as tomllib

ROOT = Path(__file__).resolve().parents[2]
PROJECT = tomllib.loads((ROOT / "pyproject.toml").read_text())


def _requirement(name: str) -> str:
    for req in PROJECT["project"]["dependencies"]:
        if re.match(rf"{re.escape(name)}\b(?![-_])", req):
            return str(req)
    raise AssertionError(f"{name} is not a base dependency")


def test_grpcio_floor_is_what_the_committed_stubs_require() -> None:
    """Finding 3: the stubs refused grpcio < 1.85.1 while pyproject allowed grpcio>=1.70."""
    versions = {
        re.search(r"GRPC_GENERATED_VERSION = '([\d.]+)'", p.read_text()).group(1)  # type: ignore[union-attr]  # every stub names it
        for p in (ROOT / "ominix_runtime" / "pb").glob("*_grpc.py")
    }
    assert len(versions) == 1
    assert _requirement("grpcio") == f"grpcio>={versions.pop()},<2"


def test_protobuf_range_covers_the_stubs_runtime_version() -> None:
    stub = (ROOT / "ominix_runtime" / "pb" / "common_pb2.py").read_text()
    match = re.search(
        r"ValidateProtobufRuntimeVersion\(\s*_runtime_version\.Domain\.PUBLIC,\s*(\d+),\s*(\d+),\s*(\d+)",
        stub,
    )
    assert match is not None
    major, minor, patch = match.groups()
    assert _requirement("protobuf") == f"protobuf>={major}.{minor}.{patch},<{int(major) + 1}"


def test_build_and_license_metadata() -> None:
    assert PROJECT["build-system"]["requires"] == ["setuptools>=77"]
    assert PROJECT["project"]["license"] == "Apache-2.0"
    assert (ROOT / "LICENSE").read_text().lstrip().startswith("Apache License")
    # Finding 2: the engine's tokenizer reads GGUF metadata, so gguf is a base dependency.
    assert _requirement("gguf").startswith("gguf>=")
