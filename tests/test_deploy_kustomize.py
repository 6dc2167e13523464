"""deploy/k8s is one source for both front doors: a base (the namespace, the engines and
their fence) and two overlays, serve (kvgate serve) and epp (kvgate epp behind a Gateway
API gateway), each with the options (components: a ServiceMonitor, the Grafana dashboard).
Every rendering (`kubectl kustomize`, pinned) validates against the Kubernetes schemas
offline and keeps what both front doors must have: the pod security context, the engines
fenced to the router, the keys and the admin token from Secrets."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest
import yaml
from kubernetes_validate import utils as kv_utils
from kustomize import COMPONENTS, K8S, OVERLAYS, by_name, kustomization, render

ROOT = Path(__file__).resolve().parent.parent
KUBERNETES_VERSIONS = ("1.29", "1.37")  # oldest and newest schemas we promise
CUSTOM_KINDS = {"InferencePool", "HTTPRoute", "ServiceMonitor"}  # CRDs: checked by their tests
ROUTER = {"serve": "kvgate", "epp": "kvgate-epp"}
RENDERINGS = [(o, ()) for o in OVERLAYS] + [(o, COMPONENTS) for o in OVERLAYS]


def _id(rendering: tuple[str, tuple[str, ...]]) -> str:
    overlay, components = rendering
    return overlay + ("+" + "+".join(components) if components else "")


@pytest.mark.parametrize("version", KUBERNETES_VERSIONS)
@pytest.mark.parametrize("rendering", RENDERINGS, ids=_id)
def test_every_rendering_validates_strictly_offline(
    rendering: tuple[str, tuple[str, ...]], version: str
) -> None:
    docs = render(*rendering)
    assert docs
    for doc in docs:
        if doc["kind"] not in CUSTOM_KINDS:
            assert kv_utils.validate(doc, version, strict=True), doc["metadata"]["name"]


@pytest.mark.parametrize("folder", ["base", *OVERLAYS, *(f"components/{c}" for c in COMPONENTS)])
def test_each_kustomization_lists_every_manifest_beside_it(folder: str) -> None:
    here = K8S / folder
    listed = {r for r in kustomization(here).get("resources", []) if not r.startswith("..")}
    assert listed == {p.name for p in here.glob("*.yaml") if p.name != "kustomization.yaml"}


def test_no_manifest_is_left_outside_the_base_and_overlays() -> None:
    assert sorted(p.name for p in K8S.iterdir()) == ["base", "components", "epp", "serve"]
    assert not (ROOT / "deploy" / "k8s-epp").exists()


def deployment(overlay: str) -> dict[str, Any]:
    return by_name(render(overlay))[("Deployment", ROUTER[overlay])]


@pytest.mark.parametrize("overlay", OVERLAYS)
def test_the_router_pods_keep_the_security_context(overlay: str) -> None:
    pod = deployment(overlay)["spec"]["template"]["spec"]
    assert pod["automountServiceAccountToken"] is False
    assert pod["securityContext"] == {
        "runAsNonRoot": True,
        "runAsUser": 10001,
        "runAsGroup": 10001,
        "seccompProfile": {"type": "RuntimeDefault"},
    }
    (container,) = pod["containers"]
    assert container["securityContext"] == {
        "allowPrivilegeEscalation": False,
        "readOnlyRootFilesystem": True,
        "capabilities": {"drop": ["ALL"]},
    }


@pytest.mark.parametrize("overlay", OVERLAYS)
def test_the_admin_token_comes_from_a_generated_secret(overlay: str) -> None:
    docs = by_name(render(overlay))
    (container,) = deployment(overlay)["spec"]["template"]["spec"]["containers"]
    env = {e["name"]: e for e in container["env"]}
    variables = {"KVGATE_ADMIN_TOKEN"} | ({"KVGATE_API_KEYS"} if overlay == "serve" else set())
    for variable in variables:
        ref = env[variable]["valueFrom"]["secretKeyRef"]
        assert ref.get("optional", False) is False
        secret = docs[("Secret", ref["name"])]
        assert ref["key"] in secret["data"]  # the file the operator made, nothing in git
    for generator in kustomization(K8S / overlay)["secretGenerator"]:
        for source in generator["files"]:
            file_name = source.split("=", 1)[1]
            ignored = (ROOT / ".gitignore").read_text().splitlines()
            assert f"deploy/k8s/{overlay}/{file_name}" in ignored


@pytest.mark.parametrize("overlay", OVERLAYS)
def test_the_engines_admit_the_router_and_in_epp_the_gateway_on_http_only(overlay: str) -> None:
    docs = by_name(render(overlay))
    engines = docs[("Deployment", "vllm")]["spec"]["template"]["metadata"]["labels"]
    router = deployment(overlay)["spec"]["template"]["metadata"]["labels"]
    fences = [
        d
        for (kind, _), d in docs.items()
        if kind == "NetworkPolicy"
        and d["spec"]["podSelector"]["matchLabels"].items() <= engines.items()
    ]
    ports_by_peer: dict[str, set[int]] = {}
    for policy in fences:
        for rule in policy["spec"]["ingress"]:
            for peer in rule["from"]:
                key = json.dumps(peer, sort_keys=True)
                ports_by_peer.setdefault(key, set()).update(p["port"] for p in rule["ports"])
    router_peers = [
        k
        for k in ports_by_peer
        if json.loads(k).get("podSelector", {}).get("matchLabels", {}).items() <= router.items()
    ]
    (router_peer,) = router_peers
    assert json.loads(router_peer).keys() == {"podSelector"}  # same namespace, router pods
    assert ports_by_peer[router_peer] == {8000, 5557, 5558}  # HTTP, KV events, replay
    others = {k: v for k, v in ports_by_peer.items() if k != router_peer}
    if overlay == "serve":
        assert others == {}
    else:
        (gateway,) = others.values()
        assert gateway == {8000}  # the gateway's proxies never reach the event ports


@pytest.mark.parametrize("overlay", OVERLAYS)
def test_the_service_monitor_option_scrapes_the_router(overlay: str) -> None:
    docs = by_name(render(overlay, COMPONENTS))
    monitor = docs[("ServiceMonitor", "kvgate-router")]
    assert monitor["apiVersion"] == "monitoring.coreos.com/v1"
    selector = monitor["spec"]["selector"]["matchLabels"]
    services = [
        d for (kind, _), d in docs.items()
        if kind == "Service" and selector.items() <= d["metadata"].get("labels", {}).items()
    ]  # fmt: skip
    (service,) = services
    assert service["metadata"]["name"] == ROUTER[overlay]
    (endpoint,) = monitor["spec"]["endpoints"]
    assert endpoint["path"] == "/metrics"
    assert endpoint["port"] in {p["name"] for p in service["spec"]["ports"]}
    assert service["metadata"]["namespace"] in monitor["spec"]["namespaceSelector"]["matchNames"]
    assert ("ServiceMonitor", "kvgate-router") not in by_name(render(overlay))  # an option


def test_the_dashboard_option_ships_the_repository_dashboard() -> None:
    docs = by_name(render("serve", COMPONENTS))
    config_map = docs[("ConfigMap", "kvgate-dashboard")]
    assert config_map["metadata"]["labels"]["grafana_dashboard"] == "1"
    shipped = json.loads(config_map["data"]["kvgate-dashboard.json"])
    dashboard = ROOT / "deploy" / "grafana" / "kvgate-dashboard.json"
    assert shipped == json.loads(dashboard.read_text())
    assert yaml.safe_load(json.dumps(shipped))["panels"]
