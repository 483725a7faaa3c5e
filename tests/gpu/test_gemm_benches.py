"""The GEMM diagnostics of bench/ on a real device, at small sizes: ``gemm_rows.py`` times the four linear
shapes of a layer per row count, ``gemm_algos.py`` times cuBLASLt's candidate algorithms for them against
torch's own product, ``gemm_first_call.py`` times a GEMM's first and second call idle or behind
queued work. Their argument checks and the exit without CUDA are tested on the CPU (tests/bench/test_bench_tools.py)."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device"),
]


@pytest.mark.parametrize(
    ("orientation", "library"),
    [("x_wt", "cublas"), ("w_xt", "cublas"), ("x_w", "cublas"), ("x_wt", "cublaslt")],
)
def test_gemm_rows_reports_every_row_count_with_its_shapes(
    tmp_path: Path, orientation: str, library: str
) -> None:
    from bench import gemm_rows

    out = tmp_path / "rows.json"
    before = torch.backends.cuda.preferred_blas_library()
    args = ["--rows", "64,200", "--reps", "3", "--orientation", orientation, "--blas-library", library]
    assert gemm_rows.main([*args, "--json", str(out)]) == 0
    assert torch.backends.cuda.preferred_blas_library() == before  # the process-wide choice is put back
    report = json.loads(out.read_text())
    assert report["orientation"] == orientation and report["blas_library"] == library
    assert [r["rows"] for r in report["rows"]] == [64, 200]
    for row in report["rows"]:
        assert row["ms"] > 0 and row["tflops"] > 0
        assert set(row["by_shape_ms"]) == {"qkv", "o", "gate_up", "down"}
        assert all(v > 0 for v in row["by_shape_ms"].values())


def test_gemm_algos_checks_and_times_every_candidate_against_torch(tmp_path: Path) -> None:
    from bench import gemm_algos

    out = tmp_path / "algos.json"
    args = ["--rows", "64,200", "--candidates", "4", "--reps", "3", "--trials", "3", "--json", str(out)]
    assert gemm_algos.main(args) == 0
    results = json.loads(out.read_text())["results"]
    assert [(r["rows"], r["shape"]) for r in results] == [
        (m, name) for m in (64, 200) for name in ("qkv", "o", "gate_up", "down")
    ]
    for r in results:
        # Every candidate computed the product torch did (the descriptors' layouts and transposes are right)
        # and none failed to run.
        assert r["candidates"] >= 1 and r["wrong"] == 0 and r["failed"] == 0
        assert r["torch_us"] > 0 and r["best_us"] > 0 and r["first_us"] > 0
        assert r["best_workspace"] <= gemm_algos.WORKSPACE_BYTES


@pytest.mark.parametrize("mode", ["idle", "queued"])
def test_gemm_first_call_times_first_and_second_calls(tmp_path: Path, mode: str) -> None:
    from bench import gemm_first_call

    out = tmp_path / "first.json"
    args = ["--mode", mode, "--rows", "3:12:4", "--n", "4096", "--k", "512", "--queue-ms", "5"]
    assert gemm_first_call.main([*args, "--json", str(out)]) == 0
    report = json.loads(out.read_text())
    assert report["mode"] == mode
    assert [r["rows"] for r in report["calls"]] == [3, 7, 11]
    assert all(r["first_ms"] > 0 and r["second_ms"] > 0 for r in report["calls"])
    assert (report["queued_matmuls"] >= 1) == (mode == "queued")
