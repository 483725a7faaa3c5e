"""/metrics answers while `serve` still waits for its workers (they load for minutes): Prometheus then scrapes
a starting engine, and deploy/prometheus's OminixEngineDown (a failed scrape for a minute) means down, not
starting. The gRPC health says NOT_SERVING meanwhile; a SIGTERM still stops the daemon promptly."""

from __future__ import annotations

import signal
import subprocess
import sys
import time
import urllib.request

import grpc
from grpc_health.v1 import health_pb2, health_pb2_grpc

from ominix_runtime.bind_probe import free_ports


def test_metrics_are_scraped_while_the_workers_are_not_ready() -> None:
    port, metrics_port, worker_port = free_ports(3)  # nothing listens on the worker's port
    argv = [sys.executable, "-m", "ominix_runtime", "serve", "--worker", f"127.0.0.1:{worker_port}"]
    argv += ["--port", str(port), "--metrics-port", str(metrics_port), "--worker-ready-timeout", "120"]
    proc = subprocess.Popen(argv, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)
    try:
        deadline = time.monotonic() + 60
        body = ""
        while not body:
            assert proc.poll() is None, proc.communicate()[1][-2000:]
            assert time.monotonic() < deadline, "no /metrics while the worker was not ready"
            try:
                with urllib.request.urlopen(f"http://127.0.0.1:{metrics_port}/metrics", timeout=5) as r:
                    body = r.read().decode()
            except OSError:
                time.sleep(0.2)
        assert "ominix_" in body
        with grpc.insecure_channel(f"127.0.0.1:{port}") as channel:
            health = health_pb2_grpc.HealthStub(channel).Check(health_pb2.HealthCheckRequest(), timeout=10)
        assert health.status == health_pb2.HealthCheckResponse.NOT_SERVING
        proc.send_signal(signal.SIGTERM)
        assert proc.wait(timeout=30) is not None
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
