"""Does cuBLASLt have a faster kernel than the one torch runs, at the Llama-3.1-8B linear shapes?

For each row count M and each of the four linear shapes (qkv, o, gate_up, down: Y = X @ W^T, bf16, fp32
accumulation), asks cuBLASLt's heuristic for up to ``--candidates`` algorithms (``cublasLtMatmulAlgoGetHeuristic``
through ctypes on the libcublasLt torch loaded, within the 32 MiB workspace cuBLAS recommends on Hopper), runs
each into its own output and checks it against torch's product (a candidate off by more than ``--tolerance`` of
the output's largest magnitude, or whose call fails, is counted and not timed), then times each the same way as
torch's own ``F.linear``: ``--reps`` calls captured in one CUDA graph, cycling through copies of the weight that
together exceed the L2 cache (as 32 layers' distinct weights would), the median of ``--trials`` replays. The
fastest candidate and torch are then timed again in alternation (``--retimes`` each), so one noisy reading in the
search cannot make a winner. Reports per shape torch's time, the heuristic's first pick and the fastest
candidate, and per row count the four shapes' sum: what picking the fastest algorithm per shape at start would
take off a layer.

    python bench/gemm_algos.py [--rows 256,1032,4096] [--candidates 32] [--json out.json]
"""

from __future__ import annotations

import argparse
import ctypes
import itertools
import json
import statistics
import sys
from collections.abc import Callable
from dataclasses import asdict, dataclass
from pathlib import Path

if __package__ in (None, ""):
    sys.path[0] = str(Path(__file__).resolve().parent.parent)  # bench.* from the repository root

import torch
import torch.nn.functional as F

from bench.common import counts_option
from bench.gemm_rows import SHAPES, median_replay_ms, product_off

# cublasLt.h / library_types.h values.
CUDA_R_32F = 0
CUDA_R_16BF = 14
CUBLAS_COMPUTE_32F = 68
CUBLAS_OP_N = 0
CUBLAS_OP_T = 1
CUBLASLT_MATMUL_DESC_TRANSA = 3
CUBLASLT_MATMUL_DESC_TRANSB = 4
CUBLASLT_MATMUL_PREF_MAX_WORKSPACE_BYTES = 1
# The workspace cuBLAS's documentation recommends on Hopper: a candidate needing more is not offered, as one
# that only runs with a larger workspace than a worker gives its GEMMs could not replace torch's pick.
WORKSPACE_BYTES = 32 << 20
# The weight copies a graph cycles through exceed this (the H100 / H200 L2 is 50 MiB).
L2_BYTES = 64 << 20


class HeuristicResult(ctypes.Structure):
    """cublasLtMatmulHeuristicResult_t: the opaque algorithm (64 bytes) and what it needs."""

    _fields_ = [
        ("algo", ctypes.c_uint64 * 8),
        ("workspace_size", ctypes.c_size_t),
        ("state", ctypes.c_int),
        ("waves_count", ctypes.c_float),
        ("reserved", ctypes.c_int * 4),
    ]


def load_cublaslt() -> ctypes.CDLL:
    """The libcublasLt this process's torch loaded (found in /proc/self/maps after a CUDA matmul), so the
    candidates are that library's."""
    a = torch.ones(8, 8, device="cuda", dtype=torch.bfloat16)
    torch.nn.functional.linear(a, a)  # torch's matmul loads cuBLAS and cuBLASLt
    torch.cuda.synchronize()
    with open("/proc/self/maps") as maps:
        for line in maps:
            path = line.split()[-1]
            if "libcublasLt.so" in path:
                return ctypes.CDLL(path)
    for name in ("libcublasLt.so.13", "libcublasLt.so.12", "libcublasLt.so"):  # not mapped: the search path
        try:
            return ctypes.CDLL(name)
        except OSError:
            continue
    raise RuntimeError("no libcublasLt found (not mapped by torch, none on the loader's path)")


class CublasLt:
    """The few cuBLASLt calls the search needs, each status checked."""

    def __init__(self, lib: ctypes.CDLL) -> None:
        self.lib = lib
        self.handle = ctypes.c_void_p()
        self._check(lib.cublasLtCreate(ctypes.byref(self.handle)), "cublasLtCreate")

    def close(self) -> None:
        self.lib.cublasLtDestroy(self.handle)

    @staticmethod
    def _check(status: int, what: str) -> None:
        if status != 0:
            raise RuntimeError(f"{what} returned cuBLAS status {status}")

    def _set(
        self,
        setter: Callable[..., int],
        obj: ctypes.c_void_p,
        attr: int,
        value: ctypes.c_int32 | ctypes.c_uint64,
    ) -> None:
        status = setter(obj, ctypes.c_int(attr), ctypes.byref(value), ctypes.c_size_t(ctypes.sizeof(value)))
        self._check(status, "SetAttribute")

    def plan(self, m: int, n: int, k: int, candidates: int) -> tuple[Plan, list[HeuristicResult]]:
        """Descriptors for Y (m, n) = X (m, k) @ W (n, k)^T in row-major torch terms (column-major: Y^T = W X^T,
        i.e. A = W stored (k, n) with op T, B = X^T stored (k, m) with op N) and the heuristic's usable
        candidates, its best guess first."""
        lib = self.lib
        desc = ctypes.c_void_p()
        status = lib.cublasLtMatmulDescCreate(
            ctypes.byref(desc), ctypes.c_int(CUBLAS_COMPUTE_32F), ctypes.c_int(CUDA_R_32F)
        )
        self._check(status, "DescCreate")
        plan = Plan(self, desc)
        pref = ctypes.c_void_p()
        try:
            self._set(
                lib.cublasLtMatmulDescSetAttribute,
                desc,
                CUBLASLT_MATMUL_DESC_TRANSA,
                ctypes.c_int32(CUBLAS_OP_T),
            )
            self._set(
                lib.cublasLtMatmulDescSetAttribute,
                desc,
                CUBLASLT_MATMUL_DESC_TRANSB,
                ctypes.c_int32(CUBLAS_OP_N),
            )
            for rows, cols in ((k, n), (k, m), (n, m)):  # A = W^T (k, n); B = X^T (k, m); C = D = Y^T (n, m)
                layout = ctypes.c_void_p()
                status = lib.cublasLtMatrixLayoutCreate(
                    ctypes.byref(layout),
                    ctypes.c_int(CUDA_R_16BF),
                    ctypes.c_uint64(rows),
                    ctypes.c_uint64(cols),
                    ctypes.c_int64(rows),
                )
                self._check(status, "MatrixLayoutCreate")
                plan.layouts.append(layout)
            self._check(lib.cublasLtMatmulPreferenceCreate(ctypes.byref(pref)), "PreferenceCreate")
            self._set(
                lib.cublasLtMatmulPreferenceSetAttribute,
                pref,
                CUBLASLT_MATMUL_PREF_MAX_WORKSPACE_BYTES,
                ctypes.c_uint64(WORKSPACE_BYTES),
            )
            results = (HeuristicResult * candidates)()
            found = ctypes.c_int(0)
            a, b, c = plan.layouts
            status = lib.cublasLtMatmulAlgoGetHeuristic(
                self.handle, desc, a, b, c, c, pref, ctypes.c_int(candidates), results, ctypes.byref(found)
            )
            self._check(status, "AlgoGetHeuristic")
        except BaseException:
            plan.close()
            raise
        finally:
            if pref.value:
                lib.cublasLtMatmulPreferenceDestroy(pref)
        return plan, [results[i] for i in range(found.value) if results[i].state == 0]


class Plan:
    """One problem's descriptors; ``run`` launches one candidate on the current stream."""

    def __init__(self, lt: CublasLt, desc: ctypes.c_void_p) -> None:
        self.lt, self.desc = lt, desc
        self.layouts: list[ctypes.c_void_p] = []  # A, B, C (= D)
        self.alpha = ctypes.c_float(1.0)
        self.beta = ctypes.c_float(0.0)

    def run(
        self, algo: HeuristicResult, x: torch.Tensor, w: torch.Tensor, y: torch.Tensor, ws: torch.Tensor
    ) -> None:
        a, b, c = self.layouts
        status = self.lt.lib.cublasLtMatmul(
            self.lt.handle,
            self.desc,
            ctypes.byref(self.alpha),
            ctypes.c_void_p(w.data_ptr()),
            a,
            ctypes.c_void_p(x.data_ptr()),
            b,
            ctypes.byref(self.beta),
            ctypes.c_void_p(y.data_ptr()),
            c,
            ctypes.c_void_p(y.data_ptr()),
            c,
            ctypes.byref(algo.algo),
            ctypes.c_void_p(ws.data_ptr()),
            ctypes.c_size_t(ws.numel()),
            ctypes.c_void_p(torch.cuda.current_stream().cuda_stream),
        )
        self.lt._check(status, "cublasLtMatmul")

    def close(self) -> None:
        lib = self.lt.lib
        for layout in self.layouts:
            lib.cublasLtMatrixLayoutDestroy(layout)
        lib.cublasLtMatmulDescDestroy(self.desc)


def graph_us(fn: Callable[[], object], reps: int, trials: int) -> float:
    """Device µs of one ``fn`` call: ``reps`` calls in one CUDA graph, the median of ``trials`` replays."""
    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):
        fn()  # outside the capture: a first call may load its kernel
    torch.cuda.current_stream().wait_stream(stream)
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        for _ in range(reps):
            fn()
    return median_replay_ms(graph, trials) * 1e3 / reps


@dataclass
class ShapeResult:
    rows: int
    shape: str
    torch_us: float  # F.linear, median of the alternating re-times
    first_us: float  # the heuristic's first pick, in the search (NaN if it was off or failed)
    best_us: float  # the fastest candidate of the search, median of the alternating re-times
    best_index: int  # its place among the heuristic's usable candidates
    best_workspace: int  # bytes it needs
    candidates: int
    wrong: int  # candidates whose product was off (not timed)
    failed: int  # candidates whose call returned an error (not timed)


def _cycling(weights: list[torch.Tensor], call: Callable[[torch.Tensor], object]) -> Callable[[], object]:
    """``call`` with the next weight copy each time, as each layer reads its own."""
    turn = itertools.count()
    return lambda: call(weights[next(turn) % len(weights)])


def search(
    lt: CublasLt, m: int, name: str, n: int, k: int, args: argparse.Namespace, ws: torch.Tensor
) -> ShapeResult:
    x = torch.randn(m, k, device="cuda", dtype=torch.bfloat16)
    w = torch.randn(n, k, device="cuda", dtype=torch.bfloat16) / k**0.5
    copies = max(1, -(-L2_BYTES // (w.numel() * w.element_size())))
    weights = [w] + [w.clone() for _ in range(copies - 1)]
    expected = F.linear(x, w)
    out = torch.empty_like(expected)
    plan, algos = lt.plan(m, n, k, args.candidates)
    times: list[tuple[float, int]] = []
    wrong = failed = 0
    try:
        for index, algo in enumerate(algos):
            out.zero_()
            try:
                plan.run(algo, x, w, out, ws)
                torch.cuda.synchronize()
                if product_off(out, expected, args.tolerance):
                    wrong += 1
                    continue
                run = _cycling(weights, lambda weight, a=algo: plan.run(a, x, weight, out, ws))
                times.append((graph_us(run, args.reps, args.trials), index))
            except RuntimeError:  # this candidate's call failed (a cuBLAS status): count it, try the next
                failed += 1
        if not times:
            raise RuntimeError(
                f"{name} at {m} rows: no cuBLASLt candidate ran correctly ({len(algos)} offered, {wrong} off, "
                f"{failed} failed)"
            )
        _, best_index = min(times)
        first_us = next((t for t, i in times if i == 0), float("nan"))
        torch_times: list[float] = []
        best_times: list[float] = []
        for _ in range(args.retimes):
            best = _cycling(weights, lambda weight: plan.run(algos[best_index], x, weight, out, ws))
            torch_times.append(
                graph_us(_cycling(weights, lambda weight: F.linear(x, weight)), args.reps, args.trials)
            )
            best_times.append(graph_us(best, args.reps, args.trials))
    finally:
        plan.close()
    return ShapeResult(
        rows=m,
        shape=name,
        torch_us=statistics.median(torch_times),
        first_us=first_us,
        best_us=statistics.median(best_times),
        best_index=best_index,
        best_workspace=int(algos[best_index].workspace_size),
        candidates=len(algos),
        wrong=wrong,
        failed=failed,
    )


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--rows", default="256,1032,4096,8192", help="row counts, START:STOP:STEP or a list")
    p.add_argument("--candidates", type=int, default=32, help="algorithms to ask the heuristic for")
    p.add_argument("--reps", type=int, default=20, help="calls per captured graph")
    p.add_argument("--trials", type=int, default=7, help="graph replays; the median is kept")
    p.add_argument("--retimes", type=int, default=3, help="alternating re-times of torch and the fastest")
    p.add_argument(
        "--tolerance",
        type=float,
        default=0.02,
        help="largest error, as a share of the output's largest value",
    )
    p.add_argument("--json", default=None)
    args = p.parse_args(argv)
    counts = counts_option(p, "--rows", args.rows)
    if min(args.candidates, args.reps, args.trials, args.retimes) < 1:
        p.error("--candidates, --reps, --trials and --retimes must each be at least 1")
    if not torch.cuda.is_available():
        print("needs a CUDA device", file=sys.stderr)
        return 2
    lt = CublasLt(load_cublaslt())
    ws = torch.empty(WORKSPACE_BYTES, device="cuda", dtype=torch.uint8)
    results = []
    try:
        rows_by_count = [[search(lt, m, name, n, k, args, ws) for name, n, k in SHAPES] for m in counts]
    finally:
        lt.close()
    for m, row in zip(counts, rows_by_count, strict=True):
        results.extend(row)
        shapes = "; ".join(
            f"{r.shape} {r.torch_us:.1f} / {r.first_us:.1f} / {r.best_us:.1f} (#{r.best_index} of {r.candidates}"
            + (f", {r.wrong} off" if r.wrong else "")
            + (f", {r.failed} failed" if r.failed else "")
            + ")"
            for r in row
        )
        torch_sum = sum(r.torch_us for r in row)
        best_sum = sum(r.best_us for r in row)
        print(
            f"M={m:6d}  torch {torch_sum:8.1f} us  fastest {best_sum:8.1f} us ({best_sum / torch_sum:.3f}x)  "
            f"[torch / first / fastest: {shapes}]",
            flush=True,
        )
    if args.json:
        with open(args.json, "w") as f:
            json.dump(
                {"device": torch.cuda.get_device_name(), "results": [asdict(r) for r in results]}, f, indent=1
            )
    return 0


if __name__ == "__main__":
    sys.exit(main())
