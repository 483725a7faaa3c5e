"""A step-level worker without a model, for replay: it keeps each request's known and computed token counts
from the DecodeSteps it is sent, samples a token exactly when a step computes a request's last known token,
and checks what a real worker would rely on (block ids in range, no block written by two live requests,
tokens scheduled only when known). Its sampled token depends only on the request id and output position.
"""

from __future__ import annotations

import zlib
from dataclasses import dataclass, field

from ominix_runtime.contract import DecodeStep, RequestOutput, StepResult


class WorkerContractViolation(AssertionError):
    """The scheduler sent a step a real worker could not run."""


@dataclass(slots=True)
class _WorkerRequest:
    num_known: int  # prompt + outputs
    num_computed: int
    blocks: list[int] = field(default_factory=list)
    seed: int = 0


class SimulatedWorker:
    def __init__(
        self,
        num_blocks: int,
        block_size: int,
        vocab_size: int,
        avoid_ids: frozenset[int],
        takes_whole_prompt_hits: bool = False,
    ) -> None:
        self.num_blocks = num_blocks
        self.block_size = block_size
        self.vocab_size = vocab_size
        self.avoid_ids = avoid_ids
        # As the replayed capability states (supports_whole_prompt_hits): a hit of another shape is a violation.
        self.takes_whole_prompt_hits = takes_whole_prompt_hits
        self.requests: dict[str, _WorkerRequest] = {}
        self._block_owner: dict[int, str] = {}

    def execute(self, step: DecodeStep) -> StepResult:
        for rid in step.finished_request_ids:
            self._drop(rid)
        outputs: list[RequestOutput] = []
        for new in step.new_requests:
            if new.request_id in self.requests:
                raise WorkerContractViolation(f"step {step.step_id}: {new.request_id} sent as new twice")
            fresh = _WorkerRequest(
                num_known=len(new.prompt_token_ids) + len(new.output_token_ids),
                num_computed=new.num_computed_tokens,
                seed=zlib.crc32(new.request_id.encode("utf-8")),
            )
            self.requests[new.request_id] = fresh
            problem = new.cached_kv_problem(self.takes_whole_prompt_hits)
            if problem:
                raise WorkerContractViolation(f"step {step.step_id}: {new.request_id}: {problem}")
            self._take_blocks(new.request_id, fresh, new.kv_block_ids, shared=new.kv_cached_until)
            outputs.append(self._run(step.step_id, new.request_id, fresh, new.num_scheduled_tokens))
        for running in step.running_requests:
            req = self.requests.get(running.request_id)
            if req is None:
                raise WorkerContractViolation(f"step {step.step_id}: unknown request {running.request_id}")
            self._take_blocks(running.request_id, req, running.new_kv_block_ids, shared=0)
            outputs.append(self._run(step.step_id, running.request_id, req, running.num_scheduled_tokens))
        return StepResult(step.step_id, outputs, num_tokens=step.num_scheduled_tokens)

    def _take_blocks(self, rid: str, req: _WorkerRequest, block_ids: list[int], shared: int) -> None:
        num_shared_blocks = shared // self.block_size  # prefix-hit blocks: read, not written
        for i, block in enumerate(block_ids):
            if not 0 <= block < self.num_blocks:
                raise WorkerContractViolation(f"{rid} got block {block} outside [0, {self.num_blocks})")
            owner = self._block_owner.get(block)
            if i >= num_shared_blocks:
                if owner is not None and owner != rid:
                    raise WorkerContractViolation(f"{rid} got block {block} that {owner} still writes")
                self._block_owner[block] = rid
            req.blocks.append(block)

    def _run(self, step_id: int, rid: str, req: _WorkerRequest, num_tokens: int) -> RequestOutput:
        if req.num_computed + num_tokens > req.num_known:
            raise WorkerContractViolation(
                f"step {step_id}: {rid} scheduled {num_tokens} tokens, only "
                f"{req.num_known - req.num_computed} are known"
            )
        if (req.num_computed + num_tokens + self.block_size - 1) // self.block_size > len(req.blocks):
            raise WorkerContractViolation(f"step {step_id}: {rid} computes beyond its KV blocks")
        req.num_computed += num_tokens
        if req.num_computed < req.num_known:
            return RequestOutput(rid)  # chunked prefill continues
        token = self._sample(req.seed, req.num_known)
        req.num_known += 1
        return RequestOutput(rid, sampled_token_id=token)

    def _sample(self, seed: int, position: int) -> int:
        token = (seed * 2654435761 + position * 40503) % self.vocab_size
        while token in self.avoid_ids:
            token = (token + 1) % self.vocab_size
        return token

    def _drop(self, rid: str) -> None:
        req = self.requests.pop(rid, None)
        if req is None:
            return
        for block in req.blocks:
            if self._block_owner.get(block) == rid:
                del self._block_owner[block]
