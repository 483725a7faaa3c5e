"""bench/moe_routing.py on our runner, on the CPU with a small Qwen3-MoE config: every router is hooked and the
decode batch's distinct experts are counted per layer, within what the config allows."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(REPO))  # bench/ as a namespace package: its modules must not shadow installed ones

from bench.moe_routing import expected_distinct  # noqa: E402


def test_expected_distinct_experts_of_uniform_routing() -> None:
    assert expected_distinct(128, 8, 1) == 8.0
    assert expected_distinct(8, 2, 10_000) == 8.0
    assert 8 < expected_distinct(128, 8, 4) < 32


def test_counts_the_decode_batch_of_our_runner(tmp_path: Path) -> None:
    config = json.loads((REPO / "bench/configs/qwen3-30b-a3b-config.json").read_text())
    config.update(
        hidden_size=64, intermediate_size=96, moe_intermediate_size=32, num_experts=16, num_experts_per_tok=4,
        num_hidden_layers=3, num_attention_heads=4, num_key_value_heads=2, head_dim=16, vocab_size=500,
    )  # fmt: skip
    path = tmp_path / "config.json"
    path.write_text(json.dumps(config))
    done = subprocess.run(
        [sys.executable, str(REPO / "bench/moe_routing.py"), "--engine", "ours", "--device", "cpu", "--config",
         str(path), "--vocab", "500", "--num-requests", "6", "--input-len", "20"],
        capture_output=True, text=True, timeout=300, cwd=REPO,
    )  # fmt: skip
    assert done.returncode == 0, done.stderr[-2000:]
    assert "routers hooked: 3" in done.stdout
    result = json.loads(done.stdout.strip().splitlines()[-1])
    assert result["engine"] == "ours" and result["batch"] == 6 and result["layer_calls"] == 3
    assert len(result["distinct_experts_per_layer"]) == 3
    # Six rows of four experts each hit between 4 and 16 of the 16.
    assert all(4 <= d <= 16 for d in result["distinct_experts_per_layer"])
    assert result["uniform_routing_expects"] == round(expected_distinct(16, 4, 6), 1)
