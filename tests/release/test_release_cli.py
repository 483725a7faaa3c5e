"""The release commands through the real ``ominix-runtime`` entry point, in a process of their own."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

FIXTURES = Path(__file__).resolve().parent / "fixtures"
REPO = Path(__file__).resolve().parents[2]


def _cli(*args: str) -> subprocess.CompletedProcess[str]:
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(REPO), os.environ.get("PYTHONPATH", "")])}
    return subprocess.run(
        [sys.executable, "-m", "ominix_runtime", *args], capture_output=True, text=True, env=env, timeout=120
    )


def test_replay_gate_and_mirror_gate_from_the_command_line(tmp_path: Path) -> None:
    report = tmp_path / "report.json"
    done = _cli("replay", "--input", str(FIXTURES / "replay_priorities.json"), "--output", str(report))
    assert done.returncode == 0, done.stderr
    expected = json.loads((FIXTURES / "replay_priorities.expected.json").read_text())["trace_fingerprint"]
    assert json.loads(report.read_text())["trace_fingerprint"] == expected
    assert expected in done.stdout

    decision = tmp_path / "decision.json"
    for name, code, word in (("gate_safe", 0, "promote"), ("gate_missing_evidence", 3, "hold")):
        done = _cli("gate", "--input", str(FIXTURES / f"{name}.json"), "--output", str(decision))
        assert done.returncode == code and f"decision: {word}" in done.stdout, done.stderr
    done = _cli(
        "mirror-gate", "--input", str(FIXTURES / "mirror_vllm_to_sglang.json"), "--output", str(decision)
    )
    assert done.returncode == 0 and json.loads(decision.read_text())["decision"] == "promote"

    done = _cli("gate", "--input", str(tmp_path / "absent.json"), "--output", str(decision))
    assert done.returncode == 2 and "cannot read the gate input" in done.stderr
    assert "Traceback" not in done.stderr
