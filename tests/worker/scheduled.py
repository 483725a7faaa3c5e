"""The engine's scheduler driving a CPU runner in one process, for the worker-vs-reference tests.

The capability is what the worker would state for its layout; each step can go through protobuf as over the
wire; integrity is checked after every step and quiescence once the work is done.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Sequence

import torch

from ominix_runtime import wire
from ominix_runtime.contract import (
    BackendCapability,
    BackendKind,
    DecodeStep,
    GenerateRequest,
    KVGroup,
    ModelInfo,
    SamplingParams,
    Token,
    stated_profile,
)
from ominix_runtime.engine.scheduler import Scheduler
from ominix_runtime.pb import worker_pb2
from ominix_worker.kv_cache import kv_bytes_per_block
from ominix_worker.runner import ModelRunner
from ominix_worker.server import stated_kv_groups


def worker_groups(runner: ModelRunner) -> tuple[KVGroup, ...]:
    """The KV groups the worker states for ``runner`` (float32 cache)."""
    return tuple(
        stated_kv_groups(runner, kv_bytes_per_block(runner.config, runner.block_size, torch.float32))
    )


def capability(
    runner: ModelRunner,
    name: str,
    groups: Sequence[KVGroup],
    max_batch_tokens: int,
    num_blocks: int | None = None,
    max_model_len: int | None = None,
) -> BackendCapability:
    """A CPU worker's capability with ``groups`` (``num_blocks`` defaults to the first group's)."""
    config = runner.config
    cap = stated_profile(
        BackendKind.CPU,
        worker_id="cpu-test",
        model=ModelInfo(
            name, config.vocab_size, max_model_len or runner.max_model_len, (2,), num_layers=config.num_layers
        ),
        kv_block_size=runner.block_size,
        kv_num_blocks=num_blocks if num_blocks is not None else groups[0].num_blocks,
        kv_bytes_per_block=kv_bytes_per_block(config, runner.block_size, torch.float32),
        max_batch_tokens=max_batch_tokens,
        kv_groups=tuple(groups),
    )
    assert cap.problems() == []
    return cap


def serve_greedy(
    scheduler: Scheduler,
    runner: ModelRunner,
    prompts: dict[str, list[int]],
    max_tokens: int,
    produced: dict[str, list[int]],
    each_step: Callable[[DecodeStep], None] | None = None,
    via_wire: bool = True,
) -> None:
    """Adds ``prompts`` (greedy, exactly ``max_tokens`` out) and runs the scheduler until it has no work,
    appending each request's tokens to ``produced``; ``each_step`` sees every step after its update."""
    for rid, tokens in prompts.items():
        sampling = SamplingParams(max_tokens=max_tokens, temperature=0.0, ignore_eos=True)
        scheduler.add_request(GenerateRequest(rid, tokens, sampling))
    while scheduler.has_work():
        step = scheduler.schedule()
        assert not scheduler.take_events(), "the scheduler ended a request it could not compute"
        assert step is not None
        sent = step
        if via_wire:
            sent = wire.step_from_pb(
                worker_pb2.DecodeStep.FromString(wire.step_to_pb(step).SerializeToString())
            )
        result = runner.execute_step(sent)
        assert result is not None
        for event in scheduler.update(step, result):
            if isinstance(event, Token):
                produced.setdefault(event.request_id, []).extend(event.token_ids)
        scheduler.check_integrity()
        if each_step is not None:
            each_step(step)
    scheduler.registry.check_quiescent()


@torch.no_grad()
def hf_greedy(
    model: torch.nn.Module, prompts: Iterable[tuple[str, list[int]]], n: int
) -> dict[str, list[int]]:
    """HF ``generate``'s greedy continuation of exactly ``n`` tokens for each prompt."""
    return {
        rid: model.generate(  # type: ignore[operator]
            torch.tensor([tokens]), max_new_tokens=n, do_sample=False, min_new_tokens=n
        )[0, len(tokens) :].tolist()
        for rid, tokens in prompts
    }
