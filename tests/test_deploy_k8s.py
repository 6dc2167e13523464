"""deploy/k8s/serve (the base and the kvgate serve overlay), rendered by `kubectl kustomize`:
schema-valid offline, consistent with kvgate's own config and discovery, without a working
placeholder secret (the admin token and client keys must be made before anything starts),
with the engines fenced to kvgate (NetworkPolicy) and kvgate tokenizing with the engines'
own model directory. What both overlays and the options share: tests/test_deploy_kustomize.py."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest
import yaml
from kubernetes_validate import utils as kv_utils
from kustomize import K8S, by_name, kustomization, render

from kvgate.backends.discovery import parse_discovery_url
from kvgate.router.config import ConfigError, Settings, load_settings
from kvgate.router.flags import given_settings
from kvgate.router.serve import build_parser

ROOT = Path(__file__).resolve().parent.parent
SERVE = K8S / "serve"


def documents(path: Path) -> list[dict[str, Any]]:
    with path.open() as f:
        return [doc for doc in yaml.safe_load_all(f) if doc]


def resources() -> dict[tuple[str, str], dict[str, Any]]:
    """The serve overlay as `kubectl apply -k deploy/k8s/serve` would create it."""
    return by_name(render("serve"))


def container(deployment: dict[str, Any], name: str) -> dict[str, Any]:
    containers = deployment["spec"]["template"]["spec"]["containers"]
    return next(c for c in containers if c["name"] == name)


def flag_values(args: list[str], flag: str) -> list[str]:
    """Values of ``--flag=value`` and ``--flag value`` in an argument list."""
    values = [a.split("=", 1)[1] for a in args if a.startswith(f"{flag}=")]
    values += [args[i + 1] for i, a in enumerate(args[:-1]) if a == flag]
    return values


def test_validator_rejects_a_misspelt_field() -> None:
    """The schema check has teeth: an unknown field fails strict validation."""
    deployment = resources()[("Deployment", "kvgate")]
    broken = json.loads(json.dumps(deployment))
    container(broken, "kvgate")["readinessProbe"]["httpGett"] = {"path": "/ready", "port": 8000}
    with pytest.raises(kv_utils.ValidationError):
        kv_utils.validate(broken, "1.37", strict=True)


def secret_ref(variable: str) -> dict[str, Any]:
    kvgate = container(resources()[("Deployment", "kvgate")], "kvgate")
    token = next(e for e in kvgate["env"] if e["name"] == variable)
    ref: dict[str, Any] = token["valueFrom"]["secretKeyRef"]
    return ref


def admin_token_ref() -> dict[str, Any]:
    return secret_ref("KVGATE_ADMIN_TOKEN")


@pytest.mark.parametrize("variable", ["KVGATE_ADMIN_TOKEN", "KVGATE_API_KEYS"])
def test_no_working_placeholder_secret(variable: str) -> None:
    """No Secret with a value is in the repository: the admin token and the client keys are
    generated from files the operator creates (git-ignored), so `kubectl apply -k` fails
    without them and the kvgate pods cannot start without the Secrets."""
    for path in K8S.rglob("*.yaml"):  # the repository's manifests, before rendering
        for doc in documents(path):
            if doc.get("kind") == "Secret":
                assert not doc.get("data") and not doc.get("stringData"), path
    ref = secret_ref(variable)
    assert ref.get("optional", False) is False
    secret = resources()[("Secret", ref["name"])]  # the generated Secret, its hashed name
    (generator,) = (
        g
        for g in kustomization(SERVE)["secretGenerator"]
        if ref["name"].startswith(g["name"] + "-")
    )
    assert secret["metadata"]["namespace"] == generator["namespace"] == "llm"
    source = next(f for f in generator["files"] if f.startswith(ref["key"] + "="))
    key, _, file_name = source.partition("=")
    assert key == ref["key"]
    ignored = (ROOT / ".gitignore").read_text().splitlines()
    assert (SERVE / file_name).relative_to(ROOT).as_posix() in ignored
    assert f"deploy/k8s/serve/{file_name}" in (SERVE / "kustomization.yaml").read_text()
    assert "openssl rand" in (SERVE / "kustomization.yaml").read_text()
    assert f"deploy/k8s/serve/{file_name}" in (ROOT / "docs" / "deploy.md").read_text()


def test_kvgate_refuses_an_empty_admin_token(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A Secret created from an empty file still stops kvgate, with the reason."""
    monkeypatch.setenv("KVGATE_ADMIN_TOKEN", "")
    with pytest.raises(ConfigError, match="admin_token"):
        kvgate_settings(tmp_path)
    monkeypatch.setenv("KVGATE_ADMIN_TOKEN", "9f8e7d6c5b4a")
    assert kvgate_settings(tmp_path).admin_token is not None


def test_kvgate_takes_client_keys_one_a_line_and_refuses_none(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The client-keys file (``openssl rand -hex 32 > client-keys``, more lines for more
    clients) gives one key a line; an empty file stops kvgate rather than opening /v1."""
    monkeypatch.setenv("KVGATE_ADMIN_TOKEN", "9f8e7d6c5b4a")
    monkeypatch.setenv("KVGATE_API_KEYS", "")
    with pytest.raises(ConfigError, match="api_keys"):
        kvgate_settings(tmp_path)
    monkeypatch.setenv("KVGATE_API_KEYS", "a1b2c3d4e5f6\n0a9b8c7d6e5f\n")
    keys = kvgate_settings(tmp_path).api_keys
    assert [k.get_secret_value() for k in keys] == ["a1b2c3d4e5f6", "0a9b8c7d6e5f"]


def test_kvgate_deployment_shape() -> None:
    deployment = resources()[("Deployment", "kvgate")]
    spec = deployment["spec"]
    assert spec["replicas"] == 2
    kvgate = container(deployment, "kvgate")
    assert kvgate["livenessProbe"]["httpGet"]["path"] == "/health"
    assert kvgate["startupProbe"]["httpGet"]["path"] == "/health"
    assert kvgate["readinessProbe"]["httpGet"]["path"] == "/ready"
    assert {"cpu", "memory"} <= kvgate["resources"]["requests"].keys()
    assert {"cpu", "memory"} <= kvgate["resources"]["limits"].keys()
    assert admin_token_ref()["key"] == "token"
    pod = spec["template"]["spec"]
    assert pod["securityContext"]["runAsNonRoot"] is True


def kvgate_settings(tmp_path: Path) -> Settings:
    """What the kvgate container runs with: its args through kvgate's own parser, the
    ConfigMap's file where --config points, the Secret's token in the environment."""
    deployment = resources()[("Deployment", "kvgate")]
    kvgate = container(deployment, "kvgate")
    args = list(kvgate["args"])
    (config_path,) = flag_values(args, "--config")
    mount = next(m for m in kvgate["volumeMounts"] if m["name"] == "config")
    volumes = deployment["spec"]["template"]["spec"]["volumes"]
    volume = next(v for v in volumes if v["name"] == "config")
    config_map = resources()[("ConfigMap", volume["configMap"]["name"])]
    file_name = Path(config_path).relative_to(mount["mountPath"]).as_posix()
    local = tmp_path / file_name
    local.write_text(config_map["data"][file_name])
    args = [f"--config={local}" if a.startswith("--config") else a for a in args]
    namespace = build_parser().parse_args(args)  # unknown flags exit here
    return load_settings(namespace.config, given_settings(namespace, Settings))


def test_kvgate_args_and_config_map_are_valid_kvgate_settings(tmp_path: Path) -> None:
    settings = kvgate_settings(tmp_path)
    assert settings.host == "0.0.0.0"
    assert settings.policy == "kv"
    assert len(settings.discover) == 1
    engines = container(resources()[("Deployment", "vllm")], "vllm")
    (block_size,) = flag_values(engines["args"], "--block-size")
    assert settings.index.block_size == int(block_size)  # kvgate keys blocks like the engine


def test_termination_grace_covers_prestop_and_drain(tmp_path: Path) -> None:
    settings = kvgate_settings(tmp_path)
    deployment = resources()[("Deployment", "kvgate")]
    pause = container(deployment, "kvgate")["lifecycle"]["preStop"]["exec"]["command"]
    assert pause[0] == "sleep"
    grace = deployment["spec"]["template"]["spec"]["terminationGracePeriodSeconds"]
    assert grace > int(pause[1]) + settings.shutdown_timeout_s


def test_discovery_url_matches_headless_service_and_engine_ports() -> None:
    deployment = resources()[("Deployment", "kvgate")]
    (url,) = flag_values(container(deployment, "kvgate")["args"], "--discover")
    config = parse_discovery_url(url)

    service = resources()[("Service", "vllm-engines")]
    namespace = service["metadata"]["namespace"]
    assert config.host == f"{service['metadata']['name']}.{namespace}.svc.cluster.local"
    assert service["spec"]["clusterIP"] == "None"  # headless: one record per pod
    service_ports = {p["name"]: p["port"] for p in service["spec"]["ports"]}
    assert service_ports == {
        "http": config.port,
        "kv-events": config.events_port,
        "kv-replay": config.replay_port,
    }

    engines = resources()[("Deployment", "vllm")]
    assert (
        service["spec"]["selector"].items()
        <= engines["spec"]["template"]["metadata"]["labels"].items()
    )
    vllm = container(engines, "vllm")
    container_ports = {p["name"]: p["containerPort"] for p in vllm["ports"]}
    assert container_ports == service_ports
    args = vllm["args"]
    assert flag_values(args, "--port") == [str(config.port)]
    (events_json,) = flag_values(args, "--kv-events-config")
    events = json.loads(events_json)
    assert events["enable_kv_cache_events"] is True
    assert events["publisher"] == "zmq"
    assert events["endpoint"] == f"tcp://*:{config.events_port}"
    assert events["replay_endpoint"] == f"tcp://*:{config.replay_port}"
    assert "--enable-prefix-caching" in args
    assert "--enable-prompt-tokens-details" in args


def test_kvgate_service_targets_kvgate_pods() -> None:
    service = resources()[("Service", "kvgate")]
    deployment = resources()[("Deployment", "kvgate")]
    labels = deployment["spec"]["template"]["metadata"]["labels"]
    assert service["spec"]["selector"].items() <= labels.items()
    assert service["spec"].get("clusterIP") != "None"
    ports = container(deployment, "kvgate")["ports"]
    assert {p["targetPort"] for p in service["spec"]["ports"]} <= {p["name"] for p in ports}


def test_the_engines_are_reachable_from_kvgate_pods_only() -> None:
    """A NetworkPolicy selects the engine pods and admits, on their HTTP, KV-event and
    replay ports, kvgate's pods and nothing else."""
    policies = [doc for (kind, _), doc in resources().items() if kind == "NetworkPolicy"]
    engines = resources()[("Deployment", "vllm")]
    engine_labels = engines["spec"]["template"]["metadata"]["labels"]
    kvgate_labels = resources()[("Deployment", "kvgate")]["spec"]["template"]["metadata"]["labels"]
    (policy,) = [
        p
        for p in policies
        if p["spec"]["podSelector"]["matchLabels"].items() <= engine_labels.items()
    ]
    spec = policy["spec"]
    assert spec["policyTypes"] == ["Ingress"] and policy["metadata"]["namespace"] == "llm"
    assert not spec["podSelector"]["matchLabels"].items() <= kvgate_labels.items()
    ports = {p["name"]: p["containerPort"] for p in container(engines, "vllm")["ports"]}
    assert set(ports.values()) == {8000, 5557, 5558}
    (rule,) = spec["ingress"]  # one rule: every admitted peer is in it
    (peer,) = rule["from"]
    assert peer.keys() == {"podSelector"}  # no namespaceSelector, no ipBlock
    assert peer["podSelector"]["matchLabels"].items() <= kvgate_labels.items()
    assert not peer["podSelector"]["matchLabels"].items() <= engine_labels.items()
    assert {(p["port"], p["protocol"]) for p in rule["ports"]} == {
        (port, "TCP") for port in ports.values()
    }


def test_kvgate_tokenizes_with_the_engines_model_directory(tmp_path: Path) -> None:
    """``--tokenizer`` points at a read-only mount of the volume the engines load their
    ``--model`` from: kvgate never asks an engine to tokenize a prompt."""
    settings = kvgate_settings(tmp_path)
    tokenizer = settings.index.default_tokenizer
    assert tokenizer is not None

    def model_claim(deployment: dict[str, Any], name: str, path: str) -> str:
        mounts = container(deployment, name)["volumeMounts"]
        (mount,) = [m for m in mounts if Path(path).is_relative_to(m["mountPath"])]
        assert mount["readOnly"] is True
        volumes = deployment["spec"]["template"]["spec"]["volumes"]
        (volume,) = [v for v in volumes if v["name"] == mount["name"]]
        assert volume["persistentVolumeClaim"]["readOnly"] is True
        claim: str = volume["persistentVolumeClaim"]["claimName"]
        return claim

    engines = resources()[("Deployment", "vllm")]
    (model,) = flag_values(container(engines, "vllm")["args"], "--model")
    claim = model_claim(resources()[("Deployment", "kvgate")], "kvgate", str(tokenizer))
    assert claim == model_claim(engines, "vllm", model)
    assert str(tokenizer) == model  # the same directory on both sides
    pvc = resources()[("PersistentVolumeClaim", claim)]
    assert "ReadOnlyMany" in pvc["spec"]["accessModes"]
