"""The runner's side of the piecewise graphs, on the CPU: a step is padded to its bucket (token 0 at position 0,
KV slot -1) while the attention metadata and the sampled rows stay the step's own, the forward goes to the
pieces, and the tokens are those of the eager step. A stand-in replaces ``PiecewiseGraphs`` (CUDA only; its
replay is checked against the eager forward in tests/gpu/test_piecewise_graphs.py)."""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass, replace
from pathlib import Path

import pytest
import torch

from ominix_runtime.contract import SamplingParams
from ominix_worker.attention.base import AttentionMetadata
from ominix_worker.cuda_graph import padded_size
from ominix_worker.runner import ModelRunner, build_runner

from .test_logits_row_padding import _run, _steps


@dataclass
class _Replayed:
    input_ids: list[int]
    positions: list[int]
    slots: list[int]
    query_start_loc: list[int]
    logits_rows: int


class RecordingPieces:
    """Buckets of 32 tokens. Records each replayed step's padded inputs, computes its real rows with the eager
    forward and gives NaN in the padding rows, so a kept (sampled) padding row would show."""

    def __init__(self, runner: ModelRunner) -> None:
        self.runner = runner
        self.buckets = (32, 64, 96)
        self.replayed: list[_Replayed] = []

    def bucket_for(self, num_tokens: int) -> int | None:
        return padded_size(num_tokens, self.buckets)

    def run(
        self,
        input_ids: torch.Tensor,
        positions: torch.Tensor,
        metas: Sequence[AttentionMetadata],
        keep: torch.Tensor,
        between: Callable[[], None] | None = None,
    ) -> torch.Tensor:
        starts = metas[0].query_start_loc_cpu
        assert starts is not None
        rows = starts[-1]
        self.replayed.append(
            _Replayed(
                input_ids.tolist(), positions.tolist(), metas[0].slot_mapping.tolist(), list(starts), rows
            )
        )
        real = [replace(meta, slot_mapping=meta.slot_mapping[:rows]) for meta in metas]
        hidden = self.runner.model(input_ids[:rows], positions[:rows], self.runner.kv_caches, real)
        padded = torch.full((input_ids.shape[0], hidden.shape[1]), float("nan"), dtype=hidden.dtype)
        padded[:rows] = hidden
        return padded.index_select(0, keep)


@pytest.mark.parametrize("overlap", [False, True], ids=["sync", "overlapped"])
@pytest.mark.parametrize("temperature", [0.0, 0.8])
def test_steps_padded_to_their_bucket_sample_the_eager_tokens(
    tiny_model_dir: Callable[[str], Path], temperature: float, overlap: bool
) -> None:
    runner = build_runner(str(tiny_model_dir("llama")), num_blocks=16, block_size=16)
    steps = _steps(SamplingParams(temperature=temperature))
    eager, _ = _run(runner, steps, overlap=overlap)
    pieces = RecordingPieces(runner)
    runner._piecewise_graphs = pieces  # type: ignore[assignment]  # the stand-in
    padded, _ = _run(runner, steps, overlap=overlap)
    assert padded == eager and all(len(ids) == 3 for ids in padded)
    # Three 17-token prompts (51 tokens: bucket 64), then two steps of three decodes (bucket 32).
    assert [len(r.input_ids) for r in pieces.replayed] == [64, 32, 32]
    assert [r.logits_rows for r in pieces.replayed] == [51, 3, 3]
    first = pieces.replayed[0]
    assert first.query_start_loc == [0, 17, 34, 51]  # the step's own requests, no padding request
    assert first.input_ids[:17] == list(range(3, 20)) and first.input_ids[51:] == [0] * 13
    assert first.positions[51:] == [0] * 13 and first.positions[17:34] == list(range(17))
    assert first.slots[51:] == [-1] * 13 and min(first.slots[:51]) >= 0
    decode = pieces.replayed[1]
    assert decode.input_ids[3:] == [0] * 29 and decode.slots[3:] == [-1] * 29
    assert decode.positions[:3] == [17, 17, 17]


class RoutedPieces(RecordingPieces):
    """Steps padded to 64 tokens replay the 96-token bucket, as after ``PiecewiseGraphs.set_routes``."""

    def bucket_for(self, num_tokens: int) -> int | None:
        bucket = super().bucket_for(num_tokens)
        return 96 if bucket == 64 else bucket


def test_a_step_routed_to_a_larger_bucket_samples_the_eager_tokens(
    tiny_model_dir: Callable[[str], Path],
) -> None:
    runner = build_runner(str(tiny_model_dir("llama")), num_blocks=16, block_size=16)
    steps = _steps(SamplingParams(temperature=0.0))
    eager, _ = _run(runner, steps, overlap=False)
    pieces = RoutedPieces(runner)
    runner._piecewise_graphs = pieces  # type: ignore[assignment]  # the stand-in
    routed, _ = _run(runner, steps, overlap=False)
    assert routed == eager
    assert [len(r.input_ids) for r in pieces.replayed] == [96, 32, 32]
    first = pieces.replayed[0]
    assert first.logits_rows == 51 and first.input_ids[51:] == [0] * 45 and first.slots[51:] == [-1] * 45
