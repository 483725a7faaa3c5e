"""Prefix-cache blocks are found by a collision-resistant digest chain, not a 64-bit hash.

The two 4-token blocks below differ but have the same CPython tuple hash (found offline by a ~2**32-step
cycle search): anyone who can send prompts can make such pairs. Were blocks chained by ``hash``, a block
cached after the second would be a hit after the first, serving one prompt the KV computed over another.
"""

from __future__ import annotations

import pytest

from ominix_runtime.contract import GenerateRequest, SamplingParams
from ominix_runtime.contract.step import NewRequestData
from ominix_runtime.engine.config import SchedulerConfig
from ominix_runtime.engine.scheduler import Scheduler
from ominix_runtime.testing.fake_backend import FakeConfig, FakeStepBackend

VICTIM_BLOCK = [5715, 42564, 18230, 30452]
COLLIDING_BLOCK = [64827, 32943, 58986, 26832]
NEXT_BLOCK = [11, 12, 13, 14]


def _serve(s: Scheduler, backend: FakeStepBackend, rid: str, prompt: list[int]) -> NewRequestData:
    """Run one request to its end; the NewRequestData it was first sent with."""
    s.add_request(GenerateRequest(rid, prompt, SamplingParams(max_tokens=1, seed=1, ignore_eos=True)))
    sent: list[NewRequestData] = []
    while s.requests:
        step = s.schedule()
        assert step is not None
        sent += [n for n in step.new_requests if n.request_id == rid]
        s.update(step, backend.execute(step))
    return sent[0]


def test_blocks_whose_hashes_collide_share_no_kv_across_prefixes() -> None:
    if hash(tuple(VICTIM_BLOCK)) != hash(tuple(COLLIDING_BLOCK)):
        pytest.skip("this Python's tuple hash differs from CPython 3.8+'s: the pair does not collide")
    backend = FakeStepBackend(FakeConfig(vocab_size=70_000, kv_block_size=4, kv_num_blocks=64))
    s = Scheduler(backend.capability(), SchedulerConfig(), seed=1)
    _serve(s, backend, "victim-1", [*VICTIM_BLOCK, 7])  # caches the victim's block
    _serve(s, backend, "other", [*COLLIDING_BLOCK, *NEXT_BLOCK, 7])  # caches NEXT_BLOCK after the collider
    victim = _serve(s, backend, "victim-2", [*VICTIM_BLOCK, *NEXT_BLOCK, 9])
    assert victim.num_computed_tokens == 4  # its own first block only: NEXT_BLOCK was computed over another
    assert not backend.violations, backend.violations
