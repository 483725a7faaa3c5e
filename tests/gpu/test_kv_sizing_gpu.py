"""How a CUDA worker sizes its KV cache at start: from a given byte count (``--kv-cache-memory``), or from
its share of the device (``--gpu-memory-utilization``) without counting the profile forwards' own KV."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from test_decode_graphs import _CONFIG

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device"),
]


def _load(tmp_path: Path, *flags: str) -> tuple[int, int]:
    """(KV blocks, bytes of one block) of a worker loaded with ``flags``."""
    from ominix_runtime.cli.commands import command
    from ominix_runtime.cli.settings import resolve
    from ominix_worker.kv_cache import kv_bytes_per_block
    from ominix_worker.server import load_worker

    config = tmp_path / "config.json"
    config.write_text(json.dumps(_CONFIG))
    argv = ["--model", f"dummy:{config}", "--device", "cuda", "--max-batch-tokens", "512", *flags]
    settings, _ = resolve(command("worker"), argv, env={"OMINIX_CUDA_GRAPHS": "0"})
    runner, _cap = load_worker(settings, "kv-sizing")
    block = kv_bytes_per_block(runner.config, runner.block_size, torch.bfloat16)
    blocks = runner.num_blocks
    del runner
    torch.cuda.empty_cache()
    return blocks, block


def test_a_given_kv_budget_is_the_cache_on_a_gpu(tmp_path: Path) -> None:
    blocks, block = _load(tmp_path, "--kv-cache-memory", "64MiB", "--dtype", "bfloat16")
    assert blocks == 64 * 2**20 // block


def test_what_the_release_frees_goes_to_the_budget() -> None:
    """On the device itself: memory the release drops (the profile forwards' KV, here 256 MiB) is back in
    the device's free memory when it is read, so the budget grows by that much."""
    from ominix_worker.kv_cache import measure_gpu_kv_budget

    device = torch.device("cuda", torch.cuda.current_device())
    held = [torch.empty(256 * 2**20, dtype=torch.uint8, device=device)]

    def forward() -> None:
        torch.empty(64 * 2**20, dtype=torch.uint8, device=device).fill_(1)  # an activation, freed on return

    kept = measure_gpu_kv_budget(device, 0.9, forward)
    released = measure_gpu_kv_budget(device, 0.9, forward, release=held.clear)
    assert abs((released - kept) - 256 * 2**20) < 8 * 2**20, (released - kept) / 2**20
