"""The embedded SmolLM2-135M GGUF: our greedy continuation equals transformers' token for token."""

from __future__ import annotations

import pytest
import torch
import transformers

from ominix_runtime.contract import DecodeStep, NewRequestData, RunningRequestData, SamplingParams
from ominix_runtime.models import embedded_model_path
from ominix_runtime.text.tokenizer import Tokenizer
from ominix_worker.runner import build_runner

NEW_TOKENS = 16
PROMPTS = [
    "What is the capital of France?",
    "Write a haiku about the sea.",
    "List three prime numbers.",
]


@pytest.fixture(scope="module")
def gguf_path():
    try:
        return embedded_model_path()
    except Exception as exc:  # noqa: BLE001
        pytest.skip(f"embedded model unavailable: {exc}")


@pytest.mark.slow
def test_greedy_continuations_match_transformers(gguf_path) -> None:
    # The engine's own tokenizer and chat template; both models are fed the same token ids.
    tokenizer = Tokenizer.from_gguf(gguf_path)
    prompts = [tokenizer.encode_chat([{"role": "user", "content": text}]) for text in PROMPTS]

    reference = transformers.AutoModelForCausalLM.from_pretrained(
        gguf_path.parent, gguf_file=gguf_path.name, dtype=torch.float32
    ).eval()
    expected = []
    with torch.no_grad():
        for ids in prompts:
            out = reference.generate(
                torch.tensor([ids]),
                max_new_tokens=NEW_TOKENS,
                do_sample=False,
                attention_mask=torch.ones(1, len(ids), dtype=torch.long),
            )
            expected.append(out[0, len(ids) :].tolist())
    del reference

    # All three prompts in one ragged batch, then decoded together.
    greedy = SamplingParams(temperature=0.0, max_tokens=NEW_TOKENS)
    blocks_each = -(-(max(len(ids) for ids in prompts) + NEW_TOKENS) // 16)
    blocks = [list(range(i * blocks_each, (i + 1) * blocks_each)) for i in range(len(prompts))]
    runner = build_runner(None, num_blocks=len(prompts) * blocks_each, block_size=16)
    got: list[list[int]] = [[] for _ in prompts]
    step = DecodeStep(
        1,
        new_requests=[
            NewRequestData(f"p{i}", ids, greedy, blocks[i], 0, len(ids), 0) for i, ids in enumerate(prompts)
        ],
    )
    for step_id in range(1, NEW_TOKENS + 1):
        if step_id > 1:
            step = DecodeStep(
                step_id, running_requests=[RunningRequestData(f"p{i}", [], 1) for i in range(3)]
            )
        for i, output in enumerate(runner.execute_step(step).outputs):
            got[i].append(output.sampled_token_id)
    for i, want in enumerate(expected):
        # transformers stops at end-of-sequence; compare up to there.
        assert got[i][: len(want)] == want, (
            f"prompt {i}: {tokenizer.decode(got[i])!r} != {tokenizer.decode(want)!r}"
        )
    assert any(len(want) >= 8 for want in expected)
