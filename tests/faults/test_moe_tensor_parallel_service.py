"""A mixture-of-experts model (Qwen2-MoE: routed experts and a gated shared expert) in a TP=2 worker group
(two gloo rank processes) behind a real `serve` engine, for both ways of splitting the experts: the group
states its mode in the capability and gives TP=1's greedy tokens through the whole service."""

from __future__ import annotations

from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import pytest
from fault_procs import stream_one
from test_tensor_parallel_service import greedy_reference, prompt
from tp_procs import request, start_tp_engine

from ominix_runtime.pb import engine_pb2

GREEDY_TOKENS = 16


@pytest.fixture(scope="module")
def tiny_moe(tmp_path_factory: pytest.TempPathFactory) -> Path:
    from ominix_worker.testing import write_tiny_hf_model

    return write_tiny_hf_model(
        tmp_path_factory.mktemp("moe-tp-model") / "tiny",
        arch="qwen2_moe",
        vocab_size=320,
        num_experts=8,
        num_experts_per_tok=3,
        moe_intermediate_size=32,
        shared_expert_intermediate_size=48,
        seed=6,
    )


@pytest.mark.parametrize("mode", ["tensor", "expert"])
def test_tp2_moe_service_states_its_split_and_gives_tp1_greedy_tokens(
    mode: str, tiny_moe: Path, tmp_path: Path
) -> None:
    prompts = [prompt(i, 20 + 3 * i) for i in range(4)]
    reference = greedy_reference(tiny_moe, prompts, GREEDY_TOKENS)
    worker_args = ("--kv-cache-memory", "8MiB", "--moe-parallel", mode)
    with start_tp_engine(str(tiny_moe), tmp_path, worker_args=worker_args) as (engine, _):
        (backend,) = engine.stub.ListBackends(engine_pb2.ListBackendsRequest(), timeout=5).backends
        assert backend.tensor_parallel_size == 2 and backend.moe_parallel == mode
        assert backend.model.num_experts == 8
        # either split gives the ranks equal shares of the weights
        weights = [r.weight_bytes for r in backend.ranks]
        assert len(weights) == 2 and weights[0] == weights[1] > 0
        with ThreadPoolExecutor(len(prompts)) as pool:
            outs = list(
                pool.map(
                    lambda i: stream_one(engine.stub, request(f"m{i}", prompts[i], GREEDY_TOKENS), 120),
                    range(len(prompts)),
                )
            )
        for i, out in enumerate(outs):
            assert out.status is None and out.done is not None, f"{out}\n{engine.logs()}"
            assert out.tokens == reference[i], f"request {i}"
