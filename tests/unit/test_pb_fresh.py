"""The committed protobuf modules must match what `make proto` generates from proto/."""

from __future__ import annotations

from pathlib import Path

from ominix_runtime.pb import generate


def test_generated_modules_are_fresh(tmp_path: Path) -> None:
    written = generate.generate(tmp_path)
    assert written, "protoc produced nothing"
    stale = []
    for fresh in written:
        committed = generate.PB_DIR / fresh.name
        if not committed.is_file() or committed.read_text() != fresh.read_text():
            stale.append(fresh.name)
    assert not stale, f"ominix_runtime/pb is stale for {stale}: run `make proto` and commit the result"


def test_every_proto_field_and_message_is_documented() -> None:
    """Every message, field, enum value and rpc in proto/ has a comment line right above it."""
    undocumented = []
    for proto in sorted((generate.PROTO_DIR / "ominix/runtime/v1").glob("*.proto")):
        lines = proto.read_text().splitlines()
        for i, raw in enumerate(lines):
            line = raw.strip()
            if not line or line.startswith(("//", "}", "syntax", "package", "import", "option")):
                continue
            if line.startswith("oneof"):
                continue
            prev = lines[i - 1].strip() if i else ""
            if not prev.startswith("//"):
                undocumented.append(f"{proto.name}:{i + 1}: {line}")
    assert not undocumented, "undocumented proto elements:\n" + "\n".join(undocumented)


def test_contract_enums_carry_the_wire_numbers() -> None:
    """wire.py passes contract enums to protobuf as their int values: each must name the same wire value."""
    from ominix_runtime.contract import BackendKind, FinishReason, Granularity, RuntimeErrorKind
    from ominix_runtime.pb import common_pb2

    for kind in RuntimeErrorKind:
        assert common_pb2.ErrorCode.Name(int(kind)) == f"ERROR_CODE_{kind.name}"
    for reason in FinishReason:
        assert common_pb2.FinishReason.Name(int(reason)) == f"FINISH_REASON_{reason.name}"
    for kind in BackendKind:
        assert common_pb2.BackendKind.Name(int(kind)) == f"BACKEND_KIND_{kind.name}"
    for granularity in Granularity:
        assert common_pb2.Granularity.Name(int(granularity)) == f"GRANULARITY_{granularity.name}"
