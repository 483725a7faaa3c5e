"""Size and allocate the paged KV cache: from a byte budget (always on the CPU, when given on a GPU), else
from measured free memory on GPUs."""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

import torch

from ominix_worker.attention.base import AttentionBackend
from ominix_worker.config import AttentionGroup, ModelConfig


def resolve_kv_cache_dtype(name: str, run_dtype: torch.dtype, device: torch.device) -> torch.dtype:
    """--kv-cache-dtype: "auto" keeps the run dtype; "fp8_e4m3" stores e4m3 (CPU reference and CUDA kernels)."""
    key = name.lower()
    if key == "auto":
        return run_dtype
    if key in ("fp8", "fp8_e4m3", "float8_e4m3fn"):
        if device.type not in ("cpu", "cuda"):
            raise ValueError(f"--kv-cache-dtype {name} is not supported on {device.type}")
        return torch.float8_e4m3fn
    raise ValueError(f"unknown --kv-cache-dtype {name!r}: auto or fp8_e4m3")


def kv_bytes_per_block(
    config: ModelConfig, block_size: int, dtype: torch.dtype, num_kv_heads: int | None = None
) -> int:
    """K and V, all layers (and compressed rows), one block; ``num_kv_heads``: the heads one tensor-parallel
    rank keeps."""
    element = torch.tensor([], dtype=dtype).element_size()
    heads = config.num_kv_heads if num_kv_heads is None else num_kv_heads
    return 2 * config.num_kv_cache_layers * block_size * heads * config.head_dim * element


def num_blocks_for_budget(budget_bytes: int, bytes_per_block: int) -> int:
    return max(0, budget_bytes // bytes_per_block)


@dataclass(frozen=True, slots=True)
class DeviceRoom:
    """A GPU's memory as the KV sizing sees it: free and total bytes once the profile forwards' own KV is
    dropped, and the activations a step needs beside the KV (the largest eager forward's peak and the
    piecewise graphs' pool)."""

    free: int
    total: int
    activations: int

    def budget_at(self, utilization: float) -> int:
        """Bytes left for KV at ``utilization`` of the device: that share less what is in use (weights,
        context, other processes) and the activations."""
        if not 0.0 < utilization <= 1.0:
            raise ValueError(f"--gpu-memory-utilization must be in (0, 1], got {utilization}")
        return int(self.total * utilization - (self.total - self.free) - self.activations)

    def check_given(self, budget: int) -> None:
        """Raises ValueError unless a given KV budget fits beside the activations in the free memory."""
        room = self.free - self.activations
        if budget > room:
            raise ValueError(
                f"--kv-cache-memory {budget} bytes does not fit: {max(room, 0)} bytes are free beside the "
                f"weights and a step's activations ({self.activations} bytes)"
            )


def measure_device_room(
    device: torch.device,
    profile_forward: Callable[[], None],
    accel: Any = None,
    graph_forward: Callable[[], None] | None = None,
    release: Callable[[], None] | None = None,
) -> DeviceRoom:
    """Profile a GPU for KV sizing: the activation peak of ``profile_forward`` (a forward of the largest step
    the worker accepts), then that of ``graph_forward`` if given (the memory pool the piecewise graphs of
    prefill and mixed steps keep for good; eager steps cannot reuse it), then ``release`` (drops what only the
    forwards needed, the small KV they wrote into: counted as in use, that KV, one step's worth, 1 GiB for an
    8,192-token step of a Llama-8B shape, came off the budget though the sized KV replaces it), then the
    device's free memory. ``accel`` is torch.cuda (or torch.npu); tests pass a stand-in."""
    if accel is None:
        accel = torch.cuda if device.type == "cuda" else getattr(torch, device.type)
    activations = _activation_peak(accel, device, profile_forward)
    if graph_forward is not None:
        activations += _activation_peak(accel, device, graph_forward)
    if release is not None:
        release()
        accel.synchronize(device)
        accel.empty_cache()
    free, total = accel.mem_get_info(device)
    return DeviceRoom(int(free), int(total), activations)


def _activation_peak(accel: Any, device: torch.device, forward: Callable[[], None]) -> int:
    """Bytes ``forward`` allocated at its peak above what stays allocated after it."""
    accel.synchronize(device)
    accel.empty_cache()
    accel.reset_peak_memory_stats(device)
    forward()
    accel.synchronize(device)
    accel.empty_cache()  # cached activation blocks would otherwise count twice (in use and as the peak)
    return int(accel.max_memory_allocated(device) - accel.memory_allocated(device))


# Room for blocks that slid out of a window to stay cached for prefix hits: this many windows per running
# request, taking at most this share of the whole KV memory from the full-attention layers.
WINDOW_CACHE_WINDOWS = 4
WINDOW_CACHE_SHARE = 0.1


def group_block_counts(
    groups: Sequence[AttentionGroup],
    uniform_blocks: int,
    block_size: int,
    max_running_requests: int,
    max_batch_tokens: int,
) -> tuple[int, ...]:
    """Blocks of each KV group's pool from the memory of ``uniform_blocks`` blocks in every layer.

    Beside a full-attention group a sliding-window group's request never holds more than its window (plus the
    block it straddles and one being filled), so its layers need far fewer blocks; the memory they save goes
    to the full-attention group, and long requests fit many more at once than in a uniform layout. A sliding
    pool holds the smaller of: every running request's window plus one step's tokens (it then never limits
    concurrency), and the share at which both pools hold equally many requests four windows long (so a
    large running cap does not keep all the memory in the windows). It always holds one request's window and
    a full step, so it never bounds a request's length. On top, room to keep blocks cached after they slide out
    (``WINDOW_CACHE_WINDOWS`` windows per running request, at most ``WINDOW_CACHE_SHARE`` of the KV memory):
    a prefix hit needs, in a sliding group, the window before the hit point, and a pool sized for the running
    windows alone reuses a slid-out block within a few steps — a prompt sent again later found nothing cached
    there. A layout without both kinds keeps the uniform count.
    """
    if all(g.window for g in groups) or not any(g.window for g in groups):
        return (uniform_blocks,) * len(groups)
    if any(g.compress_ratio for g in groups):  # compressed layouts keep one count (see docs/SCHEDULER.md)
        return (uniform_blocks,) * len(groups)
    num_layers = sum(len(g.layers) for g in groups)
    window_blocks = {i: -(-g.window // block_size) + 2 for i, g in enumerate(groups) if g.window}
    # Balance point: the blocks a request four windows long takes in the full groups, per sliding window.
    full_layers = sum(len(g.layers) for g in groups if not g.window)
    long_request = -(-4 * max(g.window for g in groups) // block_size)
    weight = full_layers * long_request + sum(len(groups[i].layers) * b for i, b in window_blocks.items())
    balanced_requests = uniform_blocks * num_layers / weight
    step_blocks = -(-max_batch_tokens // block_size)
    counts: dict[int, int] = {}
    layer_blocks = uniform_blocks * num_layers
    for i, per_request in window_blocks.items():
        everyone = max_running_requests * per_request + step_blocks
        one = -(-(groups[i].window + max_batch_tokens) // block_size) + 2
        base = min(uniform_blocks, max(one, min(everyone, int(balanced_requests * per_request))))
        cache_room = max_running_requests * WINDOW_CACHE_WINDOWS * -(-groups[i].window // block_size)
        share = int(WINDOW_CACHE_SHARE * uniform_blocks * num_layers / len(groups[i].layers))
        counts[i] = min(uniform_blocks, base + min(cache_room, share))
        layer_blocks -= counts[i] * len(groups[i].layers)
    for i, g in enumerate(groups):
        if not g.window:
            counts[i] = layer_blocks // full_layers
    return tuple(counts[i] for i in range(len(groups)))


def allocate_kv_cache(
    backend: AttentionBackend,
    config: ModelConfig,
    num_blocks: int | Sequence[int],
    dtype: torch.dtype,
    device: torch.device,
    num_kv_heads: int | None = None,
) -> list[torch.Tensor]:
    """One KV tensor per layer, then one of compressed rows per layer of each compressed group (in
    ``kv_tensor_indices`` order); ``num_blocks``: one count for every group, or one per KV group
    (``config.attention_groups`` on this backend); ``num_kv_heads``: the heads one tensor-parallel rank keeps
    (default: all)."""
    groups = config.attention_groups(backend.supports_sliding_window)
    counts = (num_blocks,) * len(groups) if isinstance(num_blocks, int) else tuple(num_blocks)
    if len(counts) != len(groups):
        raise ValueError(f"{len(counts)} block counts for {len(groups)} KV groups")
    if min(counts) <= 0:
        raise ValueError("the KV cache budget leaves no room for a single block")
    heads = config.num_kv_heads if num_kv_heads is None else num_kv_heads
    caches: list[torch.Tensor | None] = [None] * config.num_kv_cache_layers
    for indices, count in zip(kv_tensor_indices(groups, config.num_layers), counts, strict=True):
        tensors = backend.allocate_kv_cache(len(indices), count, heads, config.head_dim, dtype, device)
        for index, tensor in zip(indices, tensors, strict=True):
            caches[index] = tensor
    return [c for c in caches if c is not None]


def kv_tensor_indices(groups: Sequence[AttentionGroup], num_layers: int) -> list[tuple[int, ...]]:
    """Per KV group, where its layers' tensors sit in the KV list: a raw group's at its layer indices, a
    compressed group's after every layer's, group after group."""
    out: list[tuple[int, ...]] = []
    extra = num_layers
    for group in groups:
        if group.compress_ratio:
            out.append(tuple(range(extra, extra + len(group.layers))))
            extra += len(group.layers)
        else:
            out.append(group.layers)
    return out
