"""Regenerate the protobuf/gRPC modules from proto/ (``make proto``).

Output is flattened into this package and imports are rewritten to ``ominix_runtime.pb`` so the modules do
not need ``proto/`` on ``sys.path``. ``tests/unit/test_pb_fresh.py`` regenerates into a temporary folder and
fails when the committed files differ.
"""

from __future__ import annotations

import re
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
PROTO_DIR = ROOT / "proto"
PROTO_FILES = ["common.proto", "worker.proto", "engine.proto"]
PB_DIR = Path(__file__).resolve().parent
_IMPORT_RE = re.compile(r"^from ominix\.runtime\.v1 import (\w+) as", re.M)


def generate(out_dir: Path) -> list[Path]:
    import grpc_tools  # only needed at build time
    from grpc_tools import protoc

    well_known = Path(grpc_tools.__file__).parent / "_proto"  # google/protobuf/*.proto
    with tempfile.TemporaryDirectory() as tmp:
        args = [
            "protoc",
            f"-I{PROTO_DIR}",
            f"-I{well_known}",
            f"--python_out={tmp}",
            f"--pyi_out={tmp}",
            f"--grpc_python_out={tmp}",
            *[str(PROTO_DIR / "ominix/runtime/v1" / name) for name in PROTO_FILES],
        ]
        if protoc.main(args) != 0:
            raise RuntimeError("protoc failed")
        written = []
        for src in sorted((Path(tmp) / "ominix/runtime/v1").iterdir()):
            text = _IMPORT_RE.sub(r"from ominix_runtime.pb import \1 as", src.read_text())
            dst = out_dir / src.name
            dst.write_text(text)
            written.append(dst)
        return written


if __name__ == "__main__":
    for path in generate(PB_DIR):
        print(f"wrote {path.relative_to(ROOT)}", file=sys.stderr)
