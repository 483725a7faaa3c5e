"""Two real worker ranks of a TP=2 group started to be refused: what each says on stderr."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

from ominix_runtime.bind_probe import free_ports

RANK_TIMEOUT_S = 120


def refusal_lines(model: Path, extra_argv: dict[int, list[str]], before_loading: bool = False) -> list[str]:
    """Start ranks 1 and 0 of a gloo group on ``model`` (each with its ``extra_argv``), wait for both to exit,
    and return each one's single non-JSON stderr line (rank 1 first); both must exit non-zero with one line
    (and, ``before_loading``, before reading any weight)."""
    rendezvous, leader_port = free_ports(2)  # two distinct ports
    addr = f"127.0.0.1:{rendezvous}"
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONUNBUFFERED": "1"}
    procs = []
    for rank in (1, 0):
        argv = [sys.executable, "-m", "ominix_worker", "--model", str(model), "--port", str(leader_port)]
        argv += ["--tp-size", "2", "--tp-rank", str(rank), "--dist-init-addr", addr, "--dist-timeout", "30"]
        argv += ["--kv-cache-memory", "8MiB", "--num-threads", "1", *extra_argv.get(rank, [])]
        procs.append(
            subprocess.Popen(argv, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
        )
    try:
        results = [p.communicate(timeout=RANK_TIMEOUT_S) for p in procs]
    finally:
        for p in procs:
            if p.poll() is None:
                p.kill()
                p.wait()
    said = []
    for p, (_, err) in zip(procs, results, strict=True):
        assert p.returncode != 0, err
        lines = [line for line in err.strip().splitlines() if line and not line.startswith("{")]
        assert len(lines) == 1, err
        assert not before_loading or "loading" not in err, err
        said.append(lines[0])
    return said
