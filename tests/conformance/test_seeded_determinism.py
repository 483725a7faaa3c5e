"""same_seed_same_tokens judges what seeded sampling promises: the same seeded request in the same situation
(alone twice, the same batch twice) draws the same tokens. Low-precision logits depend on the batch around
a request, so alone vs in a batch may differ and must not fail the check; ignoring the seed must."""

from __future__ import annotations

import asyncio
import random
import sys
from collections.abc import Iterator
from pathlib import Path

import pytest

from ominix_runtime.backends.grpc_worker import GrpcWorkerBackend
from ominix_runtime.conformance import format_table, run_checks
from ominix_runtime.contract import DecodeStep, RequestOutput, StepResult
from ominix_runtime.testing.fake_backend import FakeStepBackend

CHECK = ["same_seed_same_tokens"]


class BatchDependentLogits(FakeStepBackend):
    """Seeded draws, but from 'logits' that depend on the batch size, as bf16 GEMMs do: a request alone and
    the same request in a batch part after a few tokens; the same batch again draws the same tokens."""

    def execute(self, step: DecodeStep) -> StepResult:
        self._batch = len(step.new_requests) + len(step.running_requests)
        return super().execute(step)

    def _compute(self, req, n: int, step_id: int) -> RequestOutput:  # type: ignore[no-untyped-def]
        out = super()._compute(req, n, step_id)
        position = len(req.token_ids) - req.num_prompt_tokens
        if out.sampled_token_id is not None and self._batch > 1 and position > 3:
            token = (out.sampled_token_id + self._batch) % self.config.vocab_size
            req.token_ids[-1] = token
            out = RequestOutput(req.request_id, sampled_token_id=token)
        return out


class IgnoresTheSeed(FakeStepBackend):
    """Draws from its own random generator, whatever seed the request carries."""

    def _compute(self, req, n: int, step_id: int) -> RequestOutput:  # type: ignore[no-untyped-def]
        out = super()._compute(req, n, step_id)
        if out.sampled_token_id is not None:
            token = random.randrange(self.config.vocab_size)
            req.token_ids[-1] = token
            out = RequestOutput(req.request_id, sampled_token_id=token)
        return out


def test_batch_dependent_logits_pass_and_the_difference_is_reported() -> None:
    (result,) = asyncio.run(run_checks(lambda: [BatchDependentLogits()], CHECK, timeout=30))
    assert result.passed, format_table([result])
    assert "identical alone twice and in a batch of 6 twice" in result.message
    assert "parted at position" in result.message


def test_a_backend_ignoring_the_seed_fails() -> None:
    (result,) = asyncio.run(run_checks(lambda: [IgnoresTheSeed()], CHECK, timeout=30))
    assert result.failed, format_table([result])
    assert "seed 4242 run alone twice: tokens differ" in result.message


def test_the_well_behaved_fakes_pass() -> None:
    (result,) = asyncio.run(run_checks(lambda: [FakeStepBackend()], CHECK, timeout=30))
    assert result.passed and "alone vs in the batch: the same tokens" in result.message


@pytest.fixture(scope="module")
def bf16_worker(tmp_path_factory: pytest.TempPathFactory) -> Iterator[str]:
    sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "e2e"))
    from e2e_procs import start_workers, stop_procs

    from ominix_worker.testing import write_tiny_hf_model

    model = write_tiny_hf_model(tmp_path_factory.mktemp("tiny") / "tiny-llama", arch="llama", vocab_size=320)
    logs = tmp_path_factory.mktemp("logs")
    procs, (address,) = start_workers(str(model), 1, logs, "4MiB", ["--dtype", "bfloat16"])
    try:
        asyncio.run(GrpcWorkerBackend(address).wait_ready(120))
        yield address
    finally:
        stop_procs(procs)


def test_passes_on_a_real_bfloat16_cpu_worker(bf16_worker: str) -> None:
    """The real worker over gRPC: the same batch sent twice is batched alike and draws alike."""
    (result,) = asyncio.run(run_checks(lambda: [GrpcWorkerBackend(bf16_worker)], CHECK, timeout=120))
    assert result.passed, format_table([result])
