"""bench/moe_routing.py on our runner, on the CPU with a small Qwen3-MoE config: every router is hooked and the
decode batch's distinct experts are counted per layer, within what the config allows. The scripts that drive vLLM
(moe_routing.py --engine vllm, peer_vllm.py) run against a stand-in for vLLM's offline API (tests/bench/fake_vllm):
their plumbing, the kernel-side count, unit norms and the temporary model folder."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path
from unittest import mock

import pytest
import torch
from torch import nn

REPO = Path(__file__).resolve().parents[2]
STAND_IN = Path(__file__).resolve().parent / "fake_vllm"
sys.path.insert(0, str(REPO))  # bench/ as a namespace package: its modules must not shadow installed ones

from bench.moe_routing import expected_distinct  # noqa: E402


def test_expected_distinct_experts_of_uniform_routing() -> None:
    assert expected_distinct(128, 8, 1) == 8.0
    assert expected_distinct(8, 2, 10_000) == 8.0
    assert 8 < expected_distinct(128, 8, 4) < 32


def run_on_our_runner(
    tmp_path: Path, base: str, input_len: int, **overrides: object
) -> subprocess.CompletedProcess[str]:
    """``moe_routing.py --engine ours`` on the CPU, 6 requests, with bench/configs/``base`` made small by
    ``overrides``."""
    config = json.loads((REPO / "bench/configs" / base).read_text())
    config.update(overrides)
    path = tmp_path / "config.json"
    path.write_text(json.dumps(config))
    done = subprocess.run(
        [sys.executable, str(REPO / "bench/moe_routing.py"), "--engine", "ours", "--device", "cpu", "--config",
         str(path), "--vocab", "500", "--num-requests", "6", "--input-len", str(input_len)],
        capture_output=True, text=True, timeout=300, cwd=REPO,
    )  # fmt: skip
    assert done.returncode == 0, done.stderr[-2000:]
    return done


def test_counts_the_decode_batch_of_our_runner(tmp_path: Path) -> None:
    done = run_on_our_runner(
        tmp_path, "qwen3-30b-a3b-config.json", 20,
        hidden_size=64, intermediate_size=96, moe_intermediate_size=32, num_experts=16, num_experts_per_tok=4,
        num_hidden_layers=3, num_attention_heads=4, num_key_value_heads=2, head_dim=16, vocab_size=500,
    )  # fmt: skip
    assert "routers hooked: 3" in done.stdout
    result = json.loads(done.stdout.strip().splitlines()[-1])
    assert result["engine"] == "ours" and result["batch"] == 6
    assert "kernel" not in result  # ours: the router's top-k is what the experts run on
    router = result["router"]
    assert router["layer_calls"] == 3 and len(router["distinct_experts_first_calls"]) == 3
    # Six rows of four experts each hit between 4 and 16 of the 16.
    assert all(4 <= d <= 16 for d in router["distinct_experts_first_calls"])
    assert (
        4
        <= router["distinct_experts_min"]
        <= router["distinct_experts_median"]
        <= router["distinct_experts_max"]
    )
    assert result["uniform_routing_expects"] == round(expected_distinct(16, 4, 6), 1)


def test_counts_gpt_oss_on_our_runner_with_its_hybrid_kv_layout(tmp_path: Path) -> None:
    """gpt-oss names its expert count ``num_local_experts`` and keeps two KV groups (full, 128-token window):
    the prompts get a block table per group, and each layer's router is counted."""
    done = run_on_our_runner(
        tmp_path, "gpt-oss-20b-config.json", 40,
        hidden_size=64, intermediate_size=48, num_hidden_layers=4, num_attention_heads=4, num_key_value_heads=2,
        head_dim=16, vocab_size=500, num_local_experts=8, num_experts_per_tok=2, experts_per_token=2,
        layer_types=["sliding_attention", "full_attention"] * 2,
    )  # fmt: skip
    assert "routers hooked: 4" in done.stdout
    result = json.loads(done.stdout.strip().splitlines()[-1])
    router = result["router"]
    assert router["layer_calls"] == 4
    assert all(2 <= d <= 8 for d in router["distinct_experts_first_calls"])
    assert result["uniform_routing_expects"] == round(expected_distinct(8, 2, 6), 1)


def run_with_stand_in(script: str, args: list[str], tmp_path: Path) -> subprocess.CompletedProcess[str]:
    """Runs a bench script with the stand-in importable as ``vllm`` and a private TMPDIR."""
    work = tmp_path / "tmp"
    work.mkdir(exist_ok=True)
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(STAND_IN), str(REPO), str(REPO / "workers")])}
    env["TMPDIR"] = str(work)
    return subprocess.run(
        [sys.executable, str(REPO / "bench" / script), *args],
        capture_output=True, text=True, timeout=120, cwd=REPO, env=env,
    )  # fmt: skip


def small_moe_config(tmp_path: Path) -> Path:
    path = tmp_path / "config.json"
    path.write_text(json.dumps({"num_experts": 8, "num_experts_per_tok": 2}))  # the stand-in's shape
    return path


def test_counts_vllm_router_and_kernel_views_with_unit_norms(tmp_path: Path) -> None:
    config = small_moe_config(tmp_path)
    done = run_with_stand_in(
        "moe_routing.py",
        ["--engine", "vllm", "--config", str(config), "--vocab", "100", "--num-requests", "5", "--input-len", "4",
         "--output-len", "3", "--unit-norms"],
        tmp_path,
    )  # fmt: skip
    assert done.returncode == 0, done.stderr[-2000:]
    assert "vLLM dummy init unit-norms: 2 parameters set" in done.stdout
    assert "routers hooked: [2]" in done.stdout
    result = json.loads(done.stdout.strip().splitlines()[-1])
    # Three decode steps of two layers: every router call and every expert assignment was counted.
    for view in ("router", "kernel"):
        assert result[view]["layer_calls"] == 6, result
        assert all(2 <= d <= 8 for d in result[view]["distinct_experts_first_calls"])
    assert list((tmp_path / "tmp").iterdir()) == []  # the model folder and the log are gone


def test_peer_vllm_figures_and_its_model_folder(tmp_path: Path) -> None:
    config = small_moe_config(tmp_path)
    out = tmp_path / "peer.json"
    done = run_with_stand_in(
        "peer_vllm.py",
        ["--config", str(config), "--vocab", "100", "--num-requests", "3", "--input-len", "4", "--output-len", "5",
         "--unit-norms", "--json", str(out)],
        tmp_path,
    )  # fmt: skip
    assert done.returncode == 0, done.stderr[-2000:]
    figures = json.loads(out.read_text())
    assert figures["dummy_init"] == "unit-norms" and figures["model"] == "config bf16 TP1"
    assert {"init_s", "w1_cold_out_tok_s", "w1_again_out_tok_s", "batch1_tpot_ms"} <= set(figures)
    assert figures["prefix_ttft_cold_ms"] > 0 and figures["prefix_ttft_warm_ms"] > 0
    assert "shared-prefix 2048+64: TTFT cold" in done.stdout
    assert figures["w1_cold_out_tok_s"] > 0 and figures["w1_again_out_tok_s"] > 0
    assert (figures["kv_blocks"], figures["kv_block_size"]) == (7, 16)  # the stand-in's cache config
    assert "KV cache: 7 blocks of 16 tokens" in done.stdout
    assert "vLLM dummy init unit-norms: 2 parameters set" in done.stdout
    # The stand-in refuses to generate once its folder is gone, so the folder lived through the runs; now it is gone.
    assert list((tmp_path / "tmp").iterdir()) == []


def test_peer_vllm_refuses_a_max_model_len_that_cannot_hold_the_shared_prefix(tmp_path: Path) -> None:
    args = ["--config", str(small_moe_config(tmp_path)), "--num-requests", "2", "--input-len", "4", "--output-len",
            "3", "--max-model-len", "2112"]  # fmt: skip
    refused = run_with_stand_in("peer_vllm.py", args, tmp_path)
    assert refused.returncode == 2 and "does not hold the shared-prefix prompt" in refused.stderr
    done = run_with_stand_in(
        "peer_vllm.py", [*args, "--no-shared-prefix", "--no-batch1", "--no-again"], tmp_path
    )
    assert done.returncode == 0, done.stderr[-2000:]
    assert "shared-prefix" not in done.stdout


def test_peer_vllm_redraws_its_dummy_model_as_ours_and_refuses_it_with_fp8(tmp_path: Path) -> None:
    config = small_moe_config(tmp_path)
    args = ["--config", str(config), "--vocab", "100", "--num-requests", "2", "--input-len", "4", "--output-len",
            "3", "--no-again", "--no-batch1", "--ours-init"]  # fmt: skip
    done = run_with_stand_in("peer_vllm.py", args, tmp_path)
    assert done.returncode == 0, done.stderr[-2000:]
    assert "vLLM dummy init ours: 4 parameters set" in done.stdout  # two norms, two router matrices
    refused = run_with_stand_in("peer_vllm.py", [*args, "--quantization", "fp8"], tmp_path)
    assert refused.returncode != 0
    assert "with --quantization it would overwrite FP8 weights" in refused.stderr
    both = run_with_stand_in("peer_vllm.py", [*args, "--unit-norms"], tmp_path)
    assert both.returncode == 2 and "not allowed with argument" in both.stderr


def test_draw_like_ours_follows_our_dummy_loader() -> None:
    with mock.patch.dict(os.environ):  # importing peer_vllm sets vLLM's offline variables
        from bench.peer_vllm import draw_like_ours

    model = nn.Module()
    model.input_layernorm = nn.Module()
    model.input_layernorm.weight = nn.Parameter(torch.full((64,), 1e-3))
    model.proj = nn.Linear(64, 256)
    model.experts = nn.Module()
    model.experts.w13_bias = nn.Parameter(torch.zeros(8, 512))  # an experts' bias: drawn, as ours draws it
    assert draw_like_ours(model) == 4
    assert torch.equal(model.input_layernorm.weight, torch.ones(64))
    assert torch.equal(model.proj.bias, torch.zeros(256))
    for drawn in (model.proj.weight, model.experts.w13_bias):
        assert abs(drawn.std().item() - 0.02) < 0.002 and abs(drawn.mean().item()) < 0.002
    model.scale = nn.Parameter(torch.zeros(4, dtype=torch.float8_e4m3fn), requires_grad=False)
    with pytest.raises(ValueError, match="scale is torch.float8_e4m3fn"):
        draw_like_ours(model)
