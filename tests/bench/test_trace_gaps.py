"""bench/trace_gaps.py on synthetic profiler traces: the device span, the busy time with overlapping events
counted once, the idle gaps longest first with the event that ended each, the host's lead before the first device
event, gzip input, and a trace without device events refused with a message."""

from __future__ import annotations

import gzip
import json
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(REPO))  # bench/ as a namespace package: its modules must not shadow installed ones

from bench.trace_gaps import load_events, main, timeline  # noqa: E402


def _event(cat: str, name: str, ts: float, dur: float) -> dict[str, object]:
    return {"ph": "X", "cat": cat, "name": name, "ts": ts, "dur": dur}


EVENTS = [
    _event("cpu_op", "aten::copy_", 0.0, 5.0),  # the host starts 1,000 us before the device
    _event("gpu_memcpy", "Memcpy HtoD", 1_000.0, 10.0),
    _event("kernel", "gemm", 1_510.0, 1_000.0),  # 500 us idle before it
    _event("kernel", "attention", 2_000.0, 600.0),  # on a second stream: overlaps the gemm by 510 us
    _event("kernel", "norm", 2_610.0, 5.0),  # 10 us idle: under the listing minimum
    _event("gpu_memset", "Memset", 2_700.0, 100.0),  # 85 us idle
    {"ph": "i", "cat": "kernel", "name": "instant", "ts": 9_999.0},  # not a complete event: ignored
]


def test_span_busy_idle_and_gaps() -> None:
    line = timeline(load_events_from(EVENTS), min_gap_us=20.0)
    assert line.device_events == 5
    assert line.span_ms == pytest.approx(1.8)  # 1,000 .. 2,800 us
    assert line.busy_ms == pytest.approx((10 + 1_090 + 5 + 100) / 1e3)  # gemm and attention as one interval
    assert line.idle_ms == pytest.approx(line.span_ms - line.busy_ms)
    assert [(g.before, round(g.us)) for g in line.gaps] == [("gemm", 500), ("Memset", 85)]
    assert line.gaps[0].at_ms == pytest.approx(0.51)
    assert line.host_lead_ms == pytest.approx(1.0)


def load_events_from(events: list[dict[str, object]]) -> list[dict[str, object]]:
    return [e for e in events if e.get("ph") == "X"]


def test_reads_gzip_and_writes_json(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    trace = tmp_path / "trace.json.gz"
    with gzip.open(trace, "wt") as f:
        json.dump({"traceEvents": EVENTS}, f)
    assert len(load_events(trace)) == 6
    out = tmp_path / "gaps.json"
    assert main([str(trace), "--json", str(out)]) == 0
    figures = json.loads(out.read_text())
    assert figures["device_events"] == 5 and [g["before"] for g in figures["gaps"]] == ["gemm", "Memset"]
    assert "span 1.80 ms" in capsys.readouterr().out


def test_a_trace_without_device_events_is_refused(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    trace = tmp_path / "host_only.json"
    trace.write_text(json.dumps([_event("cpu_op", "aten::mm", 0.0, 5.0)]))
    assert main([str(trace)]) == 1
    assert "no device events" in capsys.readouterr().err
