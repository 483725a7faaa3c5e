"""One rank of a mixture-of-experts tensor-parallel logits check (``tp_logits.py`` with ``--moe-parallel``).

``python moe_tp_logits.py --model DIR --rank R --size N --addr HOST:PORT --moe-parallel expert --out FILE``
joins the group on the CPU (gloo), loads rank R's share of the experts as ``--moe-parallel`` says, runs the
batch of ``tp_logits.batch_logits`` and, on rank 0, saves the logits to FILE.
"""

from __future__ import annotations

import argparse
import sys
from dataclasses import replace
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "workers"))  # a bare checkout
sys.path.insert(0, str(Path(__file__).resolve().parent))

from tp_logits import batch_logits, load_runner  # noqa: E402

from ominix_worker.parallel import MoeParallel  # noqa: E402


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--model", required=True)
    parser.add_argument("--rank", type=int, required=True)
    parser.add_argument("--size", type=int, required=True)
    parser.add_argument("--addr", required=True)
    parser.add_argument("--moe-parallel", choices=[m.value for m in MoeParallel], required=True)
    parser.add_argument("--out", required=True)
    args = parser.parse_args()
    from ominix_worker.parallel.distributed import init_rank_group

    torch.set_num_threads(1)
    group = init_rank_group(args.rank, args.size, args.addr, torch.device("cpu"), timeout_s=60)
    tp = replace(group.tp, moe=MoeParallel(args.moe_parallel))
    logits = batch_logits(load_runner(args.model, "cpu", torch.float32, tp))
    if args.rank == 0:
        torch.save(logits, args.out)
    torch.distributed.destroy_process_group()


if __name__ == "__main__":
    main()
