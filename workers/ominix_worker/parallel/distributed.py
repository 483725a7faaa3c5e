"""Joining a tensor-parallel group: torch.distributed over TCP rendezvous, with timeouts on every collective.

Two process groups per rank: the compute group the sharded layers reduce over (NCCL on CUDA, gloo on CPU)
and a gloo control group for host-side traffic (the leader's step hand-off, liveness ticks, small exchanges
such as the KV block count). Keeping host traffic off the compute group keeps it off the GPU streams and out
of captured graphs, and lets it run on its own thread.
"""

from __future__ import annotations

import os
from dataclasses import dataclass
from datetime import timedelta

import torch
import torch.distributed as dist

from ominix_runtime.config import DEFAULT_DIST_TIMEOUT_S  # the one definition, in the config tree
from ominix_worker.parallel.tensor_parallel import TensorParallel


class GroupInitError(RuntimeError):
    """The group could not form (bad address, a rank that never arrived, a backend that is missing)."""


@dataclass(frozen=True, slots=True)
class RankGroup:
    tp: TensorParallel
    control: dist.ProcessGroup
    backend: str  # of the compute group: "nccl" or "gloo"
    timeout_s: float

    @property
    def rank(self) -> int:
        return self.tp.rank

    @property
    def size(self) -> int:
        return self.tp.size

    @property
    def is_leader(self) -> bool:
        return self.tp.rank == 0

    def min_over_ranks(self, value: int) -> int:
        t = torch.tensor([value], dtype=torch.int64)
        dist.all_reduce(t, op=dist.ReduceOp.MIN, group=self.control)
        return int(t.item())

    def gather_to_all(self, item: object) -> list[object]:
        """Every rank's ``item`` (picklable), in rank order, on every rank."""
        out: list[object] = [None] * self.size
        dist.all_gather_object(out, item, group=self.control)
        return out


def parse_init_addr(text: str) -> tuple[str, int]:
    host, sep, port = text.rpartition(":")
    if not sep or not host or not port.isdigit() or not 0 < int(port) < 65536:
        raise ValueError(f"--dist-init-addr must be HOST:PORT, got {text!r}")
    return host.strip("[]"), int(port)


def init_rank_group(
    rank: int, size: int, init_addr: str, device: torch.device, timeout_s: float = DEFAULT_DIST_TIMEOUT_S
) -> RankGroup:
    """Join group ``init_addr`` (rank 0 listens there) as ``rank`` of ``size``; blocks until all arrived.

    Every collective of both groups fails after ``timeout_s`` instead of waiting forever (on NCCL the
    watchdog ends the process; gloo raises).
    """
    host, port = parse_init_addr(init_addr)
    backend = "nccl" if device.type == "cuda" else "gloo"
    if device.type not in ("cuda", "cpu"):
        raise GroupInitError(f"tensor parallelism runs on cuda or cpu devices, not {device.type}")
    if backend == "nccl":
        # NVLink SHARP multicast buffers fail on some lent machines; plain NVLink rings are as fast here.
        os.environ.setdefault("NCCL_NVLS_ENABLE", "0")
        torch.cuda.set_device(device)
    timeout = timedelta(seconds=timeout_s)
    try:
        options: dict[str, object] = {}
        if backend == "nccl":
            options["device_id"] = device  # eager NCCL communicator init, bound to this rank's GPU
        dist.init_process_group(
            backend,
            init_method=f"tcp://{host}:{port}",
            rank=rank,
            world_size=size,
            timeout=timeout,
            **options,  # type: ignore[arg-type]  # device_id is typed as a device only
        )
        control = dist.new_group(backend="gloo", timeout=timeout)
    except (RuntimeError, ValueError, OSError) as exc:
        raise GroupInitError(f"cannot join the tensor-parallel group at {init_addr}: {exc}") from None
    return RankGroup(TensorParallel(rank, size, dist.group.WORLD), control, backend, timeout_s)
