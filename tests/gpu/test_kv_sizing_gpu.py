"""How a CUDA worker sizes its KV cache at start: from a given byte count (``--kv-cache-memory``), or from
its share of the device (``--gpu-memory-utilization``) without counting the profile forwards' own KV."""

from __future__ import annotations

import json
import sys
from pathlib import Path

import pytest
import torch
from test_decode_graphs import _CONFIG

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device"),
]


def _load(tmp_path: Path, monkeypatch: pytest.MonkeyPatch, *flags: str) -> tuple[int, int]:
    """(KV blocks, bytes of one block) of a worker loaded with ``flags``; the process-wide settings a serving
    worker takes at start (its frozen heap, the GIL's switch interval) are left as they were."""
    from ominix_runtime import memory
    from ominix_runtime.cli.commands import command
    from ominix_runtime.cli.settings import resolve
    from ominix_worker.kv_cache import kv_bytes_per_block
    from ominix_worker.server import load_worker

    monkeypatch.setattr(memory, "freeze_startup_heap", lambda: None)
    monkeypatch.setattr(sys, "setswitchinterval", lambda interval: None)
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


def test_a_given_kv_budget_is_the_cache_on_a_gpu(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    blocks, block = _load(tmp_path, monkeypatch, "--kv-cache-memory", "64MiB", "--dtype", "bfloat16")
    assert blocks == 64 * 2**20 // block


def test_a_given_kv_budget_past_the_free_memory_stops_the_start(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    from ominix_worker.server import StartupError

    with pytest.raises(StartupError, match="does not fit"):
        _load(tmp_path, monkeypatch, "--kv-cache-memory", str(2 * torch.cuda.mem_get_info()[1]))


def test_what_the_release_frees_goes_to_the_budget() -> None:
    """On the device itself: memory the release drops (the profile forwards' KV, here 256 MiB) is back in
    the device's free memory when it is read, so the budget grows by that much."""
    from ominix_worker.kv_cache import measure_device_room

    device = torch.device("cuda", torch.cuda.current_device())
    torch.cuda.synchronize(device)
    torch.cuda.empty_cache()  # `held` gets a segment of its own, not part of one cached by earlier tests
    held = [torch.empty(256 * 2**20, dtype=torch.uint8, device=device)]

    def forward() -> None:
        torch.empty(64 * 2**20, dtype=torch.uint8, device=device).fill_(1)  # an activation, freed on return

    kept = measure_device_room(device, forward).budget_at(0.9)
    released = measure_device_room(device, forward, release=held.clear).budget_at(0.9)
    assert abs((released - kept) - 256 * 2**20) < 8 * 2**20, (released - kept) / 2**20
