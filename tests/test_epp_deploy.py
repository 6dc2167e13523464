"""deploy/envoy and deploy/k8s/epp, checked offline: the Envoy bootstrap validates with the
real Envoy and keeps the Endpoint Picker Protocol's names; the epp overlay, rendered by
`kubectl kustomize` (built-in kinds validated in tests/test_deploy_kustomize.py), has the
InferencePool and HTTPRoute fields of their v1 APIs and is consistent with itself, with the
engines of the base and with kvgate epp's own command line and settings loader."""

from __future__ import annotations

import subprocess
from pathlib import Path
from typing import Any

import yaml
from kustomize import by_name, render
from test_deploy_k8s import flag_values

from kvgate.backends.discovery import parse_discovery_url
from kvgate.bench.envoy import BOOTSTRAP, bootstrap, envoy_binary
from kvgate.router.config import load_settings
from kvgate.router.epp import messages as pb
from kvgate.router.epp.cli import build_parser
from kvgate.router.epp.config import EppSettings
from kvgate.router.epp.server import EXT_PROC_SERVICE, LIVENESS, READINESS
from kvgate.router.epp.wire import (
    DESTINATION,
    LB_NAMESPACE,
    SERVED,
    SUBSET_NAMESPACE,
    can_skip_answer,
)
from kvgate.router.flags import given_settings


def resources() -> dict[tuple[str, str], dict[str, Any]]:
    """The epp overlay as `kubectl apply -k deploy/k8s/epp` would create it."""
    return by_name(render("epp"))


def engines_deployment() -> dict[str, Any]:
    return resources()[("Deployment", "vllm")]


def container(deployment: dict[str, Any]) -> dict[str, Any]:
    (found,) = deployment["spec"]["template"]["spec"]["containers"]
    return found


# -- Envoy --------------------------------------------------------------------------------


def test_the_envoy_bootstrap_validates_with_the_real_envoy(tmp_path: Path) -> None:
    ports = {"listen_port": 1, "admin_port": 2, "epp": ["127.0.0.1:3"], "pool": ["127.0.0.1:4"]}
    for config in (BOOTSTRAP, _written(tmp_path, bootstrap(**ports))):
        checked = subprocess.run(
            [envoy_binary(), "--mode", "validate", "-c", str(config), "--disable-hot-restart"],
            capture_output=True,
            text=True,
            timeout=120,
            check=False,
        )
        assert checked.returncode == 0, checked.stdout + checked.stderr


def _written(tmp_path: Path, config: dict[str, Any]) -> Path:
    path = tmp_path / "rewritten.yaml"
    path.write_text(yaml.safe_dump(config))
    return path


def test_the_bootstrap_speaks_the_endpoint_picker_protocol() -> None:
    config = yaml.safe_load(BOOTSTRAP.read_text())
    manager = config["static_resources"]["listeners"][0]["filter_chains"][0]["filters"][0]
    filters = manager["typed_config"]["http_filters"]
    ext_proc = filters[0]["typed_config"]
    assert filters[0]["name"] == "envoy.filters.http.ext_proc"
    assert filters[-1]["name"] == "envoy.filters.http.router"
    modes = ext_proc["processing_mode"]
    # kvgate reads the whole body, then tells Envoy to skip most answers' bodies: Envoy
    # ignores mode overrides when either body mode is FULL_DUPLEX_STREAMED
    assert (modes["request_body_mode"], modes["response_body_mode"]) == ("BUFFERED", "STREAMED")
    assert modes["response_trailer_mode"] == "SEND"  # the stream lasts to the request's end
    assert ext_proc["allow_mode_override"] is True
    assert can_skip_answer((pb.BUFFERED, pb.STREAMED))
    assert not can_skip_answer((pb.FULL_DUPLEX_STREAMED, pb.FULL_DUPLEX_STREAMED))
    listener = config["static_resources"]["listeners"][0]  # a buffered body fits
    assert listener["per_connection_buffer_limit_bytes"] >= EppSettings().max_body_bytes
    assert ext_proc["failure_mode_allow"] is False
    metadata = ext_proc["metadata_options"]
    assert set(metadata["forwarding_namespaces"]["untyped"]) == {LB_NAMESPACE, SUBSET_NAMESPACE}
    assert metadata["receiving_namespaces"]["untyped"] == [LB_NAMESPACE]
    clusters = {c["name"]: c for c in config["static_resources"]["clusters"]}
    epp = clusters["kvgate-epp"]
    assert epp["health_checks"][0]["grpc_health_check"]["service_name"] == EXT_PROC_SERVICE
    (policy,) = clusters["pool"]["load_balancing_policy"]["policies"]
    override = policy["typed_extension_config"]["typed_config"]
    sources = override["override_host_sources"]
    assert sources[0]["metadata"] == {"key": LB_NAMESPACE, "path": [{"key": DESTINATION}]}
    assert sources[1]["header"] == DESTINATION
    assert override["selected_host_key"] == {"key": LB_NAMESPACE, "path": [{"key": SERVED}]}
    route = manager["typed_config"]["route_config"]["virtual_hosts"][0]["routes"][0]["route"]
    # Envoy tries every endpoint kvgate lists: 1 + upstream.max_failover
    assert route["retry_policy"]["num_retries"] == EppSettings().upstream.max_failover


def test_the_bootstrap_is_rewritten_in_its_addresses_only() -> None:
    original = yaml.safe_load(BOOTSTRAP.read_text())
    rewritten = bootstrap(
        listen_port=18080, admin_port=19901, epp=["127.0.0.1:19002"], pool=["127.0.0.1:19101"]
    )
    listener = rewritten["static_resources"]["listeners"][0]
    assert listener["address"]["socket_address"]["port_value"] == 18080
    for config in (original, rewritten):  # the parts that are not addresses are the same
        config["admin"].pop("address")
        config["static_resources"]["listeners"][0].pop("address")
        for cluster in config["static_resources"]["clusters"]:
            cluster.pop("load_assignment")
    assert rewritten == original


# -- Kubernetes ---------------------------------------------------------------------------


def _only_keys(node: dict[str, Any], allowed: set[str], where: str) -> None:
    unknown = set(node) - allowed
    assert not unknown, f"{where}: fields not in the API: {unknown}"


def test_the_inference_pool_has_the_v1_api_shape() -> None:
    pool = resources()[("InferencePool", "vllm-pool")]
    assert pool["apiVersion"] == "inference.networking.k8s.io/v1"
    spec = pool["spec"]
    _only_keys(spec, {"selector", "targetPorts", "endpointPickerRef", "appProtocol"}, "spec")
    _only_keys(spec["selector"], {"matchLabels"}, "spec.selector")
    assert 1 <= len(spec["selector"]["matchLabels"]) <= 64
    assert 1 <= len(spec["targetPorts"]) <= 8
    for port in spec["targetPorts"]:
        _only_keys(port, {"number"}, "spec.targetPorts[]")
        assert 1 <= port["number"] <= 65535
    ref = spec["endpointPickerRef"]
    _only_keys(ref, {"group", "kind", "name", "port", "failureMode"}, "spec.endpointPickerRef")
    assert ref.get("kind", "Service") == "Service" and ref.get("group", "") == ""
    assert "port" in ref and set(ref["port"]) == {"number"}  # required for a Service
    assert ref.get("failureMode", "FailClose") in {"FailOpen", "FailClose"}


def test_the_http_route_sends_the_openai_api_to_the_pool() -> None:
    route = resources()[("HTTPRoute", "llm-openai")]
    assert route["apiVersion"] == "gateway.networking.k8s.io/v1"
    _only_keys(route["spec"], {"parentRefs", "hostnames", "rules"}, "spec")
    (rule,) = route["spec"]["rules"]
    _only_keys(rule, {"matches", "backendRefs", "filters", "timeouts", "name"}, "rules[]")
    (backend,) = rule["backendRefs"]
    assert backend == {
        "group": "inference.networking.k8s.io",
        "kind": "InferencePool",
        "name": "vllm-pool",
    }
    assert rule["matches"] == [{"path": {"type": "PathPrefix", "value": "/v1"}}]


def test_the_pool_selects_the_engines_and_names_the_epp_service() -> None:
    pool = resources()[("InferencePool", "vllm-pool")]["spec"]
    engines = engines_deployment()
    pod_labels = engines["spec"]["template"]["metadata"]["labels"]
    assert pool["selector"]["matchLabels"].items() <= pod_labels.items()
    vllm = container(engines)
    http = next(p["containerPort"] for p in vllm["ports"] if p["name"] == "http")
    assert [p["number"] for p in pool["targetPorts"]] == [http]
    service = resources()[("Service", pool["endpointPickerRef"]["name"])]
    port = next(
        p
        for p in service["spec"]["ports"]
        if p["port"] == pool["endpointPickerRef"]["port"]["number"]
    )
    assert port["appProtocol"] == "kubernetes.io/h2c"  # gRPC, cleartext HTTP/2
    deployment = resources()[("Deployment", "kvgate-epp")]
    labels = deployment["spec"]["template"]["metadata"]["labels"]
    assert service["spec"]["selector"].items() <= labels.items()
    epp = container(deployment)
    grpc = next(p for p in epp["ports"] if p["name"] == port["targetPort"])
    assert flag_values(epp["args"], "--grpc-port") == [str(grpc["containerPort"])]


def epp_settings_of(tmp_path: Path, deployment: dict[str, Any]) -> EppSettings:
    """What the kvgate-epp container runs with: its args through kvgate epp's own parser,
    the ConfigMap's file where --config points."""
    epp = container(deployment)
    assert epp["command"] == ["kvgate", "epp"]
    args = list(epp["args"])
    config_arg = next(a for a in args if a.startswith("--config="))
    mount = next(m for m in epp["volumeMounts"] if m["name"] == "config")
    config_map = resources()[("ConfigMap", "kvgate-epp-config")]
    file_name = Path(config_arg.split("=", 1)[1]).relative_to(mount["mountPath"]).as_posix()
    local = tmp_path / file_name
    local.write_text(config_map["data"][file_name])
    args = [f"--config={local}" if a.startswith("--config") else a for a in args]
    namespace = build_parser().parse_args(args)  # unknown flags exit here
    return load_settings(
        namespace.config, given_settings(namespace, EppSettings), model=EppSettings
    )


def test_the_epp_deployment_runs_valid_kvgate_epp_settings(tmp_path: Path) -> None:
    deployment = resources()[("Deployment", "kvgate-epp")]
    settings = epp_settings_of(tmp_path, deployment)
    assert settings.host == "0.0.0.0" and settings.policy == "kv"
    (url,) = settings.discover
    headless = resources()[("Service", "vllm-engines")]
    config = parse_discovery_url(url)
    assert config.host == f"{headless['metadata']['name']}.llm.svc.cluster.local"
    engines = engines_deployment()
    (block_size,) = flag_values(container(engines)["args"], "--block-size")
    assert settings.index.block_size == int(block_size)  # keyed like the engines
    epp = container(deployment)
    assert epp["livenessProbe"]["grpc"] == {"port": settings.grpc_port, "service": LIVENESS}
    assert epp["readinessProbe"]["grpc"] == {"port": settings.grpc_port, "service": READINESS}
    pod = deployment["spec"]["template"]["spec"]
    assert pod["automountServiceAccountToken"] is False  # no API watch, so no RBAC
    assert not any(kind in {"Role", "ClusterRole", "RoleBinding"} for kind, _ in resources())
    pause = int(epp["lifecycle"]["preStop"]["exec"]["command"][1])
    assert pod["terminationGracePeriodSeconds"] > pause + settings.shutdown_timeout_s


def test_the_engines_admit_the_gateway_on_the_pools_port() -> None:
    """The base fences the engines to the router's pods (kvgate-epp here, on HTTP and the
    KV-event ports: tests/test_deploy_kustomize.py); this policy opens the pool's port to
    the gateway's proxies named by the HTTPRoute."""
    policy = resources()[("NetworkPolicy", "vllm-from-gateway")]
    labels = engines_deployment()["spec"]["template"]["metadata"]["labels"]
    assert policy["spec"]["podSelector"]["matchLabels"].items() <= labels.items()
    (gateway_rule,) = policy["spec"]["ingress"]
    (gateway_from,) = gateway_rule["from"]
    route = resources()[("HTTPRoute", "llm-openai")]
    (parent,) = route["spec"]["parentRefs"]
    gateway_label = "gateway.networking.k8s.io/gateway-name"
    assert gateway_from["podSelector"]["matchLabels"] == {gateway_label: parent["name"]}
    pool = resources()[("InferencePool", "vllm-pool")]
    assert [p["port"] for p in gateway_rule["ports"]] == [
        t["number"] for t in pool["spec"]["targetPorts"]
    ]
    settings = EppSettings(discover=[_discover_url()])
    events = parse_discovery_url(settings.discover[0])
    assert events.port == pool["spec"]["targetPorts"][0]["number"]


def _discover_url() -> str:
    epp = container(resources()[("Deployment", "kvgate-epp")])
    (url,) = flag_values(epp["args"], "--discover")
    return url
