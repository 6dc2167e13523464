"""deploy/compose.yaml: parses, and agrees with kvgate's CLI and docs/quickstart-vllm.md.

Docker does not run on this machine, so the file is held to the code instead: kvgate's
command goes through kvgate's own flag parser and settings loader, its workers point at the
engine services' HTTP and KV-event ports, block sizes agree, and the engines get the flags
that docs/quickstart-vllm.md documents.
"""

from __future__ import annotations

import json
import re
import shlex
from pathlib import Path
from typing import Any
from urllib.parse import urlsplit

import pytest
import yaml

from kvgate.router.config import Settings, load_settings
from kvgate.router.flags import given_settings
from kvgate.router.serve import build_parser

ROOT = Path(__file__).resolve().parent.parent
COMPOSE = ROOT / "deploy" / "compose.yaml"
QUICKSTART = ROOT / "docs" / "quickstart-vllm.md"
ENGINE_FLAGS = (
    "--enable-prefix-caching",
    "--enable-prompt-tokens-details",
    "--block-size",
    "--kv-events-config",
)


def compose() -> dict[str, Any]:
    data: dict[str, Any] = yaml.safe_load(COMPOSE.read_text())
    return data


def engines() -> dict[str, dict[str, Any]]:
    return {name: s for name, s in compose()["services"].items() if name.startswith("vllm")}


def flag_value(args: list[str], flag: str) -> str | None:
    for i, arg in enumerate(args):
        if arg.startswith(f"{flag}="):
            return arg.split("=", 1)[1]
        if arg == flag and i + 1 < len(args) and not args[i + 1].startswith("--"):
            return args[i + 1]
    return None


def kvgate_settings(args: list[str]) -> Settings:
    """What ``kvgate serve ARGS`` would run with (kvgate's own parser and loader)."""
    namespace = build_parser().parse_args(args)
    return load_settings(namespace.config, given_settings(namespace, Settings))


def events_config(args: list[str]) -> dict[str, Any]:
    raw = flag_value(args, "--kv-events-config")
    assert raw is not None
    config: dict[str, Any] = json.loads(raw)
    return config


def mount_target(volume: str) -> str:
    """``SOURCE:TARGET[:ro]`` → TARGET (SOURCE may hold ``${VAR:?message}``)."""
    match = re.search(r":(/[^:]*)(?::ro|:rw)?$", volume)
    assert match is not None, volume
    return match.group(1)


def port_of(endpoint: str) -> int:
    port = urlsplit(endpoint).port
    assert port is not None, endpoint
    return port


def test_compose_parses_with_two_engines_and_kvgate() -> None:
    services = compose()["services"]
    assert "kvgate" in services
    assert len(engines()) == 2
    for engine in engines().values():
        assert engine["entrypoint"][-1] == "vllm.entrypoints.openai.api_server"


def test_engines_run_with_prefix_caching_and_kv_events() -> None:
    for name, engine in engines().items():
        args = engine["command"]
        for flag in ENGINE_FLAGS:
            assert any(a == flag or a.startswith(f"{flag}=") for a in args), (name, flag)
        events = events_config(args)
        assert events["enable_kv_cache_events"] is True
        assert events["publisher"] == "zmq"
        assert events["endpoint"] == "tcp://*:5557"
        assert events["replay_endpoint"] == "tcp://*:5558"
        exposed = {int(p) for p in engine["expose"]}
        assert {int(flag_value(args, "--port") or 0), 5557, 5558} <= exposed


def test_kvgate_command_is_valid_for_kvgate_and_matches_the_engines() -> None:
    kvgate = compose()["services"]["kvgate"]
    settings = kvgate_settings(kvgate["command"])
    assert settings.host == "0.0.0.0"
    assert len(settings.workers) == len(engines())
    for worker in settings.workers:
        host = urlsplit(worker.url).hostname
        assert host in engines(), host
        args = engines()[host]["command"]
        events = events_config(args)
        assert urlsplit(worker.url).port == int(flag_value(args, "--port") or 0)
        assert worker.events == f"tcp://{host}:{port_of(events['endpoint'])}"
        assert worker.replay == f"tcp://{host}:{port_of(events['replay_endpoint'])}"
        assert settings.index.block_size == int(flag_value(args, "--block-size") or 0)
    mounts = {mount_target(volume) for volume in kvgate["volumes"]}
    assert str(settings.index.default_tokenizer) in mounts  # the engines' own tokenizer


def test_kvgate_publishes_on_loopback_and_drains_on_stop() -> None:
    kvgate = compose()["services"]["kvgate"]
    settings = kvgate_settings(kvgate["command"])
    (published,) = kvgate["ports"]
    host_ip, _, container_port = published.rpartition(":")
    assert host_ip.startswith("127.0.0.1:")
    assert int(container_port) == settings.port
    grace = re.fullmatch(r"(\d+)s", kvgate["stop_grace_period"])
    assert grace is not None
    assert int(grace.group(1)) > settings.shutdown_timeout_s
    assert kvgate["build"]["dockerfile"] == "deploy/Dockerfile"
    assert (COMPOSE.parent / kvgate["build"]["context"] / kvgate["build"]["dockerfile"]).is_file()


# --- docs/quickstart-vllm.md ------------------------------------------------------------


def quickstart_engine_commands() -> list[list[str]]:
    """Every vLLM launch command in the quickstart's shell blocks, as argument lists."""
    text = QUICKSTART.read_text()
    commands = []
    for block in re.findall(r"```(?:bash|sh|shell|console)?\n(.*?)```", text, flags=re.S):
        pending = ""
        for line in re.sub(r"\\\n", " ", block).splitlines():
            pending += line + "\n"
            try:
                args = shlex.split(pending, comments=True)
            except ValueError:  # a quoted argument (e.g. JSON) continues on the next line
                continue
            pending = ""
            if "vllm.entrypoints.openai.api_server" in args or args[:2] == ["vllm", "serve"]:
                commands.append(args)
    return commands


@pytest.mark.skipif(not QUICKSTART.exists(), reason="docs/quickstart-vllm.md not written yet")
def test_compose_uses_the_quickstart_engine_flags_and_ports() -> None:
    commands = quickstart_engine_commands()
    assert commands, "no vLLM command found in docs/quickstart-vllm.md"
    documented = {flag for args in commands for flag in ENGINE_FLAGS if flag_value(args, flag)}
    documented |= {f for args in commands for f in ENGINE_FLAGS if f in args}
    assert set(ENGINE_FLAGS) <= documented
    doc_events = [
        events_config(args) for args in commands if flag_value(args, "--kv-events-config")
    ]
    doc_ports = {(port_of(e["endpoint"]), port_of(e["replay_endpoint"])) for e in doc_events}
    doc_blocks = {flag_value(args, "--block-size") for args in commands} - {None}
    for engine in engines().values():
        args = engine["command"]
        events = events_config(args)
        assert (port_of(events["endpoint"]), port_of(events["replay_endpoint"])) in doc_ports
        assert flag_value(args, "--block-size") in doc_blocks
        for doc in doc_events:
            assert events["publisher"] == doc["publisher"]
            assert events["enable_kv_cache_events"] == doc["enable_kv_cache_events"]


def test_compose_carries_no_secret_value() -> None:
    """The admin token is passed through from the operator's shell, never written here;
    without it kvgate (listening beyond loopback) keeps /admin and /debug disabled."""
    kvgate = compose()["services"]["kvgate"]
    environment = kvgate.get("environment", [])
    assert "KVGATE_ADMIN_TOKEN" in environment  # the bare name: no value in the file
    assert not any(str(item).startswith("KVGATE_ADMIN_TOKEN=") for item in environment)
    text = COMPOSE.read_text()
    assert "api_key=" not in text and "--admin-token" not in text
