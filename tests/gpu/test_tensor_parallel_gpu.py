"""Tensor parallelism over NCCL: TP=2 and TP=4 logits against TP=1 in bf16, decode graphs and the eager steps'
piecewise graphs with their collectives captured (pipelined graph decode gives the eager tokens), and kill -9 of a rank mid-stream behind a real engine.

One command on a 2- or 4-GPU machine: ``NCCL_NVLS_ENABLE=0 python -m pytest -q tests/gpu/test_tensor_parallel_gpu.py``
(the TP=4 cases skip with fewer than four GPUs).
"""

from __future__ import annotations

import os
import sys
from pathlib import Path

import pytest
import torch

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device"),
]

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE.parent / "worker"))
sys.path.insert(0, str(HERE.parent / "faults"))
os.environ.setdefault("NCCL_NVLS_ENABLE", "0")


def _needs(num_gpus: int) -> None:
    if torch.cuda.device_count() < num_gpus:
        pytest.skip(f"needs {num_gpus} GPUs, found {torch.cuda.device_count()}")


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """8 query heads over 2 KV heads (split at TP=2, replicated at TP=4), an odd vocabulary (padded rows)."""
    from ominix_worker.testing import write_tiny_hf_model

    folder = tmp_path_factory.mktemp("tp-gpu") / "llama"
    return write_tiny_hf_model(
        folder,
        arch="llama",
        vocab_size=1001,
        hidden_size=256,
        num_layers=2,
        heads=8,
        kv_heads=2,
        with_tokenizer=False,
    )


@pytest.mark.parametrize("size", [2, 4])
def test_tp_logits_match_tp1_in_bf16(size: int, model_dir: Path, tmp_path: Path) -> None:
    _needs(size)
    from test_tensor_parallel import run_group
    from tp_logits import batch_logits, load_runner

    torch.backends.cuda.matmul.allow_tf32 = False
    exact = batch_logits(load_runner(str(model_dir), "cuda:0", torch.float32))
    single = batch_logits(load_runner(str(model_dir), "cuda:0", torch.bfloat16))
    sharded = run_group(model_dir, size, tmp_path / "logits.pt", device="cuda", dtype="bfloat16")
    assert sharded.shape == single.shape == exact.shape
    # Sharding reorders bf16 sums (partial products, then the all-reduce): it may add rounding, not more
    # than bf16 itself makes against float32.
    single_error = float((single - exact).abs().max())
    sharded_error = float((sharded - exact).abs().max())
    assert sharded_error <= 2 * single_error + 1e-2, (sharded_error, single_error)
    agree = float((sharded.argmax(-1) == single.argmax(-1)).float().mean())
    assert agree >= 0.9, agree


@pytest.mark.parametrize("size", [2, 4])
def test_tp_decode_graphs_capture_the_collectives(size: int, model_dir: Path, tmp_path: Path) -> None:
    _needs(size)
    from test_tensor_parallel import run_group

    result = run_group(
        model_dir, size, tmp_path / "graphs.pt", device="cuda", dtype="float32", check="graphs"
    )
    assert result["num_graphs"] == 3
    # The prompts' step (46 tokens) from the pieces captured at 32 and 64 tokens, all-reduces inside them.
    assert result["piecewise_graph_buckets"] == 2 and result["piece_bucket"] == 64
    assert result["piece_logit_diff"] < 1e-3, result["piece_logit_diff"]
    assert result["max_logit_diff"] < 1e-3, result["max_logit_diff"]
    assert result["pipelined"] == result["eager"]
    assert all(len(tokens) == 12 for tokens in result["pipelined"].values())


def test_a_tp1_worker_on_the_second_gpu_serves(tmp_path: Path) -> None:
    """Data parallelism's second group: a worker without TP flags on cuda:1 must make it the current device,
    or Triton launches (and graph captures) go to cuda:0 and its warm-up fails."""
    _needs(2)
    from fault_procs import stream_one
    from tp_procs import seeded, start_tp_engine

    from ominix_worker.testing import write_tiny_hf_model

    model = write_tiny_hf_model(tmp_path / "tiny", arch="llama", vocab_size=320, heads=4, kv_heads=4)
    worker_args = ("--gpu-memory-utilization", "0.3", "--max-model-len", "1024")
    with start_tp_engine(str(model), tmp_path, devices=["cuda:1"], worker_args=worker_args) as (engine, _):
        outs = [stream_one(engine.stub, seeded(i, 24), 120) for i in range(3)]
    for out in outs:
        assert out.status is None and out.num_terminal == 1, f"{out}\n{engine.logs()}"
        assert out.done is not None and len(out.tokens) == 24, out


def test_kill_9_of_a_rank_mid_stream_ends_the_group(tmp_path: Path) -> None:
    _needs(2)
    from tp_procs import STEP_TIMEOUT_S, kill_a_rank_mid_stream, seeded, start_tp_engine

    from ominix_runtime.contract import RuntimeErrorKind
    from ominix_worker.testing import write_tiny_hf_model

    size = 4 if torch.cuda.device_count() >= 4 else 2
    model = write_tiny_hf_model(tmp_path / "tiny", arch="llama", vocab_size=320, heads=4, kv_heads=4)
    devices = [f"cuda:{i}" for i in range(size)]
    worker_args = ("--gpu-memory-utilization", "0.3", "--max-model-len", "1024")
    with start_tp_engine(str(model), tmp_path, devices=devices, worker_args=worker_args) as (engine, ranks):
        results, seconds = kill_a_rank_mid_stream(engine, ranks, 1, [seeded(i, 400) for i in range(8)])
        for out in results:
            assert out.status is None and out.num_terminal == 1, f"{out}\n{engine.logs()}"
            assert out.error is not None and out.error.code == int(RuntimeErrorKind.BACKEND_UNAVAILABLE), out
        assert seconds < STEP_TIMEOUT_S + 15


def test_sigterm_ends_a_leader_whose_decode_graphs_hold_the_nccl_communicator(tmp_path: Path) -> None:
    """Tearing an NCCL group down under captured graphs blocks forever: the leader of a serving TP=2 group
    (graphs captured, a request served) leaves on SIGTERM at once with 0, without that teardown; its follower
    notices and leaves too."""
    _needs(2)
    import signal
    import time

    from fault_procs import stream_one
    from tp_procs import DIST_TIMEOUT_S, GROUP_FAILURE_EXIT_CODE, request, start_tp_engine

    from ominix_runtime.pb import engine_pb2
    from ominix_worker.testing import write_tiny_hf_model

    model = write_tiny_hf_model(tmp_path / "tiny", arch="llama", vocab_size=320, heads=4, kv_heads=4)
    worker_args = ("--gpu-memory-utilization", "0.3", "--max-model-len", "1024")
    devices = ("cuda:0", "cuda:1")
    with start_tp_engine(str(model), tmp_path, devices=devices, worker_args=worker_args) as (engine, ranks):
        (backend,) = engine.stub.ListBackends(engine_pb2.ListBackendsRequest(), timeout=5).backends
        assert backend.supports_graph_capture
        assert stream_one(engine.stub, request("a", [5, 6, 7], 16), 60).done is not None
        signalled = time.monotonic()
        ranks[0].popen.send_signal(signal.SIGTERM)
        assert ranks[0].popen.wait(timeout=30) == 0, ranks[0].log_tail()
        assert time.monotonic() - signalled < 8.0
        # the control group's broken connection ends it (code 3), or NCCL's watchdog first (abort)
        code = ranks[1].popen.wait(timeout=DIST_TIMEOUT_S + 15)
        assert code in (GROUP_FAILURE_EXIT_CODE, -signal.SIGABRT), (code, ranks[1].log_tail())
