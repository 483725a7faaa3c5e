"""bench/engine_overhead.py end to end on a small batch: three real processes over loopback gRPC.

What is checked is that the bench measures what it says: every client stream ends with one Done and exactly
the asked tokens, the steady steps are found and split into phases, and the stand-in device's view is
computed. Performance is never asserted.
"""

from __future__ import annotations

import json
import pstats
import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]


@pytest.mark.parametrize(
    ("step_ms", "groups", "client_procs", "client"),
    [(0.0, 1, 1, "lean"), (5.0, 1, 1, "w1"), (0.0, 2, 2, "w1")],
)
def test_engine_overhead_bench_reports_every_phase(
    tmp_path: Path, step_ms: float, groups: int, client_procs: int, client: str
) -> None:
    out = tmp_path / "overhead.json"
    done = subprocess.run(
        [sys.executable, str(REPO / "bench" / "engine_overhead.py"), "--concurrency", "8", "--prompt-len", "8",
         "--output-len", "64", "--step-ms", str(step_ms), "--groups", str(groups), "--client-procs",
         str(client_procs), "--client", client, "--work-dir", str(tmp_path), "--json", str(out)],
        capture_output=True, text=True, timeout=240,
    )  # fmt: skip
    assert done.returncode == 0, done.stderr[-3000:]
    result = json.loads(out.read_text())
    clients, engine, window = result["clients"], result["engine"], result["window"]
    assert clients["requests"] == 8 * groups and clients["processes"] == client_procs
    assert clients["all_done_once"] and clients["tokens_per_request"] == [64]
    assert result["max_inflight_steps"] == 3 and result["light_load_below_running"] == 128  # the defaults
    # 64 tokens a request, all 8 of each group decoding together after their prefill. Some of the steps fall
    # in the window the clients' tokens set (10% to 90% received): how many depends on how far the engine,
    # sending the tokens of results it applied together as one message, runs ahead of its clients.
    assert engine["steady_steps"] >= 3 * groups
    assert window["out_tok_s"] > 0.0 and window["window_tokens"] > 0.0
    for role in ("engine", "clients", "workers"):
        assert window[f"{role}_cpu_us_per_token"] >= 0.0, role
    assert "out tok/s" in done.stdout
    for phase in ("schedule", "to_pb", "send", "from_pb", "update", "deliver", "turnaround"):
        assert engine[f"{phase}_p50_ms"] >= 0.0, phase
    assert engine["cpu_per_step_ms"] > 0.0 and engine["wall_per_step_ms"] > 0.0
    assert "steady decode steps at batch 8" in done.stdout
    if step_ms:
        worker = result["worker"]
        assert worker["steps"] >= 5 and 0.0 < worker["busy_share"] <= 1.0 + 1e-9
        assert "next_ready p50" in done.stdout


@pytest.mark.parametrize("profiled", ["", "intake", "ending"], ids=["cold", "again-intake", "again-ending"])
def test_intake_of_a_batch_submitted_burst(tmp_path: Path, profiled: str) -> None:
    """With ``--batch-submit`` (one GenerateBatch a client process) and no held first result, the bench reports
    how the engine took the burst in: every request reached a step once, after the first step. With
    ``--again`` the timed burst is the second (its prompts cached): the first burst's steps are not counted, and
    ``--profile-intake`` profiles the engine from its release to the step that holds its last request,
    ``--profile-ending`` from its first finished request to the clients' end."""
    again = bool(profiled)
    out = tmp_path / "intake.json"
    profile = tmp_path / f"{profiled}.prof"
    done = subprocess.run(
        [sys.executable, str(REPO / "bench" / "engine_overhead.py"), "--concurrency", "24", "--prompt-len", "64",
         "--output-len", "8", "--step-ms", "2", "--client-procs", "2", "--batch-submit", "--hold-s", "0",
         *(["--again", f"--profile-{profiled}", str(profile)] if again else []), "--work-dir", str(tmp_path),
         "--json", str(out)],
        capture_output=True, text=True, timeout=240,
    )  # fmt: skip
    assert done.returncode == 0, done.stderr[-3000:]
    result = json.loads(out.read_text())
    assert result["clients"]["all_done_once"] and result["clients"]["tokens_per_request"] == [8]
    intake = result["intake"]
    assert sum(intake["new_per_step"]) == 24 and intake["steps"] == len(intake["new_per_step"])
    assert 0.0 < intake["first_step_ms"] <= intake["all_in_ms"]
    # The timed burst of --again finds every prompt cached whole (64 tokens: 4 blocks of 16, only the last token
    # computed again for its logits); a cold burst finds none.
    assert intake["cached_tokens"] == (24 * 63 if again else 0)
    assert "every request in a step after" in done.stdout
    # The clients end after the stand-in device's last answer with tokens, within the run.
    ending = result["ending"]["after_last_result_ms"]
    assert 0.0 < ending < result["clients"]["wall_s"] * 1e3
    assert "ending: the clients' last event" in done.stdout
    # The decode steps the stand-in device saw are the timed burst's only (8 tokens a request).
    assert result["worker"].get("steps", 0.0) <= 8
    if not again:
        return
    calls = {name: n for (_file, _line, name), (_prim, n, *_rest) in pstats.Stats(str(profile)).stats.items()}  # type: ignore[attr-defined]
    if profiled == "intake":  # the burst's admissions and its first schedule()
        assert {"add_request", "schedule", "find_prefix"} <= calls.keys()
    else:  # the timed burst's 24 finished requests (one run report each), not the untimed burst's
        assert calls.get("_report_finished") == 24


def test_intake_view_counts_new_requests_up_to_the_last() -> None:
    sys.path.insert(0, str(REPO))
    from bench.engine_overhead import intake_view

    # (arrival, start, end, steady, new requests, their cached tokens): an earlier burst's step, a step that only
    # finishes requests, then 3, 0 and 5 new; the clients started at 9.990 s
    stats = {
        "steps": [
            [9.5, 9.5, 9.51, False, 8, 0],
            [9.995, 9.995, 9.995, False, 0, 0],
            [10.0, 10.0, 10.01, False, 3, 96],
            [10.01, 10.01, 10.02, False, 0, 0],
            [10.02, 0, 0, False, 5, 160],
        ]
    }
    view = intake_view(stats, 9.990, 8)
    assert view["steps"] == 3 and view["new_per_step"] == [3, 0, 5] and view["cached_tokens"] == 256
    assert abs(view["first_step_ms"] - 10.0) < 1e-6 and abs(view["all_in_ms"] - 30.0) < 1e-6
    assert intake_view(stats, 9.990, 9) == {"first_step_ms": view["first_step_ms"], "incomplete": 8}
    assert intake_view(stats, 10.5, 8) == {"incomplete": 0}


def test_ending_view_starts_at_the_last_step_that_ran_tokens() -> None:
    sys.path.insert(0, str(REPO))
    from bench.engine_overhead import ending_view

    # (arrival, start, end, ...): an earlier burst's step, two steps that ran tokens (due at 10.02 and 10.04),
    # then one that only carried finished ids (no device time: end == start)
    stats = {
        "steps": [
            [9.5, 9.5, 9.51, False, 8, 0],
            [10.0, 10.01, 10.02, True, 0, 0],
            [10.02, 10.03, 10.04, True, 0, 0],
            [10.045, 10.045, 10.045, False, 0, 0],
        ]
    }
    assert abs(ending_view(stats, 9.99, 10.05)["after_last_result_ms"] - 10.0) < 1e-6
    assert ending_view(stats, 10.5, 10.6) == {}  # no step of the timed burst ran tokens
