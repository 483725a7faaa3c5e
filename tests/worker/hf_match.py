"""Our runner against transformers on one tiny model folder, for tests of checkpoint variants (how a folder
is laid out, not how the model computes): a batched prefill of two prompts of different lengths, then decode
steps, every sampled row's logits compared with transformers' float32 forward (``test_model_vs_hf``'s
``REL_TOL``)."""

from __future__ import annotations

from pathlib import Path

from ominix_runtime.contract import DecodeStep, NewRequestData, RunningRequestData
from ominix_worker.runner import ModelRunner, build_runner

from .test_model_vs_hf import GREEDY, LogitsRecorder, Reference, assert_close, prompt, tokens_by_id

BLOCK_SIZE = 16


def assert_matches_transformers(
    folder: Path, reference: Path | None = None, decode_steps: int = 3, **overrides: object
) -> ModelRunner:
    """Run ``folder`` on the CPU and check every row against transformers' model of ``reference`` (default
    ``folder``; e.g. the ``dequantized`` copy of an FP8 checkpoint); ``overrides`` go to ``from_pretrained``.
    Returns the runner, for checks of what it loaded."""
    runner = build_runner(str(folder), num_blocks=32, block_size=BLOCK_SIZE)
    rec = LogitsRecorder(runner)
    groups = len(runner.attention_groups)
    seqs = {"a": prompt(1, 9), "b": prompt(2, 37)}  # one block and three (the last partial)
    first = {"a": 3, "b": 12}  # each request's blocks, per group: first + 4 · group + i
    lengths = {rid: len(tokens) for rid, tokens in seqs.items()}
    new = [
        NewRequestData(
            rid,
            list(tokens),
            GREEDY,
            [first[rid] + i for i in range(-(-len(tokens) // BLOCK_SIZE))],
            0,
            len(tokens),
            seed,
            group_kv_block_ids=[
                [first[rid] + 4 * g + i for i in range(-(-len(tokens) // BLOCK_SIZE))]
                for g in range(1, groups)
            ],
        )
        for seed, (rid, tokens) in enumerate(seqs.items())
    ]
    result, logits = rec.step(DecodeStep(1, new_requests=new))
    rows = {rid: [logits[rid]] for rid in seqs}
    for step_id in range(2, decode_steps + 2):  # the sequences stay inside their blocks
        for rid, token in tokens_by_id(result).items():
            seqs[rid].append(token)
        running = [RunningRequestData(rid, [], 1, [[] for _ in range(1, groups)]) for rid in seqs]
        result, logits = rec.step(DecodeStep(step_id, running_requests=running))
        for rid in seqs:
            rows[rid].append(logits[rid])
    ref = Reference(reference or folder, **overrides)
    for rid, tokens in seqs.items():
        expected = ref.logits(tokens)
        for i, row in enumerate(rows[rid]):
            assert_close(row, expected[lengths[rid] - 1 + i])
    return runner
