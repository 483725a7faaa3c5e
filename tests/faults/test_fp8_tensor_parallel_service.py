"""FP8 checkpoints (e4m3 weights with 16-wide block scales, written here from tiny random models) served by a
TP=2 group through the whole service: `launch --devices cpu,cpu --tensor-parallel-size 2` states FP8 weights
and gives the greedy tokens of an in-process TP=1 runner on the same FP8 checkpoint, for a dense Llama and a
Qwen3-MoE (tensor-parallel and expert-parallel experts)."""

from __future__ import annotations

import signal
import sys
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import grpc
import pytest
from fault_procs import CLI, free_ports, start_proc_env, stop_procs, stream_one, wait_health
from test_tensor_parallel_service import greedy_reference, prompt
from tp_procs import request

from ominix_runtime.pb import engine_pb2, engine_pb2_grpc

sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "e2e"))
from test_launch import _two_consecutive_free_ports  # noqa: E402

GREEDY_TOKENS = 12
MODELS = {
    "llama": dict(arch="llama"),
    "qwen3_moe": dict(
        arch="qwen3_moe",
        num_layers=3,
        num_experts=16,
        num_experts_per_tok=4,
        moe_intermediate_size=32,
        norm_topk_prob=True,
        mlp_only_layers=[1],
        seed=4,
    ),  # fmt: skip
}


@pytest.fixture(scope="module")
def fp8_model(tmp_path_factory: pytest.TempPathFactory):  # type: ignore[no-untyped-def]
    from ominix_worker.testing import write_fp8_checkpoint, write_tiny_hf_model

    cache: dict[str, Path] = {}

    def get(name: str) -> Path:
        if name not in cache:
            root = tmp_path_factory.mktemp(f"fp8-tp-{name}")
            source = write_tiny_hf_model(root / "bf16", vocab_size=320, **MODELS[name])  # type: ignore[arg-type]
            cache[name] = write_fp8_checkpoint(source, root / "fp8", "block", block=16)
        return cache[name]

    return get


@pytest.mark.parametrize(
    ("name", "moe"), [("llama", "tensor"), ("qwen3_moe", "tensor"), ("qwen3_moe", "expert")]
)
def test_launch_tp2_serves_an_fp8_checkpoint_with_tp1_greedy_tokens(
    name: str,
    moe: str,
    fp8_model,
    tmp_path: Path,  # type: ignore[no-untyped-def]
) -> None:
    model = fp8_model(name)
    prompts = [prompt(i, 18 + 5 * i) for i in range(3)]
    reference = greedy_reference(model, prompts, GREEDY_TOKENS)
    base = _two_consecutive_free_ports()
    port, metrics_port = free_ports(2)
    argv = [*CLI, "launch", "--devices", "cpu,cpu", "--tensor-parallel-size", "2", "--model", str(model)]
    argv += ["--port", str(port), "--metrics-port", str(metrics_port), "--worker-base-port", str(base)]
    argv += ["--kv-cache-memory", "8MiB", "--moe-parallel", moe]
    argv += ["--dtype", "float32"]  # as the reference; "auto" is bfloat16 on a CPU with hardware bfloat16
    launch = start_proc_env("launch", argv, tmp_path, {})
    try:
        wait_health(f"127.0.0.1:{port}", [launch])
        with grpc.insecure_channel(f"127.0.0.1:{port}") as channel:
            stub = engine_pb2_grpc.EngineStub(channel)
            (backend,) = stub.ListBackends(engine_pb2.ListBackendsRequest(), timeout=5).backends
            assert backend.tensor_parallel_size == 2 and backend.weight_dtype == "float8_e4m3fn"
            assert backend.moe_parallel == (moe if name == "qwen3_moe" else "")
            with ThreadPoolExecutor(len(prompts)) as pool:
                outs = list(
                    pool.map(
                        lambda i: stream_one(stub, request(f"f{i}", prompts[i], GREEDY_TOKENS), 120),
                        range(len(prompts)),
                    )
                )
            for i, out in enumerate(outs):
                assert out.status is None and out.done is not None, f"{out}\n{launch.log_tail()}"
                assert out.tokens == reference[i], f"request {i}"
        launch.popen.send_signal(signal.SIGTERM)
        assert launch.popen.wait(timeout=60) == 0, launch.log_tail()
    finally:
        stop_procs([launch])
