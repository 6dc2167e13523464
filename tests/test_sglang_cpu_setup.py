"""``kvgate engines --engine sglang`` set-up code that needs no SGLang: plans, commands,
stamps, the one-command dispatch, a failed start (the stand-in kernel ops are checked in the
SGLang venv: tests/integration/test_sglang_kernel_standin.py)."""

from __future__ import annotations

import json
import sys
from pathlib import Path

import pytest

from kvgate.backends import engines_cli
from kvgate.backends.process import PortAllocator
from kvgate.backends.sglang_cpu.install import (
    CONSTRAINTS_FILE,
    RUNTIME_REQUIREMENTS,
    SGLANG_VERSION,
    _wanted_stamp,
    is_installed,
)
from kvgate.backends.sglang_cpu.launch import (
    SglangFleet,
    SglangOptions,
    SglangReplicaSpec,
    SglangStartError,
    engine_command,
    engine_env,
    plan_replicas,
)
from kvgate.backends.sglang_cpu.layout import SglangLayout


def test_replica_plan_and_worker_flags() -> None:
    specs = plan_replicas(2, port=8201, events_port=5701)
    assert [s.ports for s in specs] == [(8201, 5701, 5702, 5703), (8202, 5704, 5705, 5706)]
    assert specs[1].worker_flag() == (
        "http://127.0.0.1:8202,engine=sglang,events=tcp://127.0.0.1:5704,"
        "replay=tcp://127.0.0.1:5705"
    )


def test_engine_command_and_environment(tmp_path: Path) -> None:
    options = SglangOptions(python=Path("/venv/bin/python"), model_dir=tmp_path, logs=tmp_path)
    spec = plan_replicas(2, 8201, 5701)[1]
    command = engine_command(options, spec)
    assert command[:3] == ["/venv/bin/python", "-m", "sglang.launch_server"]
    for flag in ("--enable-cache-report", "--enable-metrics", "--sleep-on-idle"):
        assert flag in command
    values = dict(zip(command[3::2], command[4::2], strict=False))
    assert values["--host"] == "127.0.0.1"
    assert (values["--port"], values["--nccl-port"]) == ("8202", "5706")
    assert (values["--device"], values["--attention-backend"]) == ("cpu", "torch_native")
    assert values["--page-size"] == "32"
    events = json.loads(command[command.index("--kv-events-config") + 1])
    assert events == {
        "publisher": "zmq",
        "endpoint": "tcp://127.0.0.1:5704",
        "bind": True,  # else SGLang connects its PUB socket to a concrete address
        "topic": "kv-events",
        "replay_endpoint": "tcp://127.0.0.1:5705",
    }
    env = engine_env(options, spec)
    assert env["SGLANG_USE_CPU_ENGINE"] == "1"
    assert env["SGLANG_CPU_OMP_THREADS_BIND"].isdigit()
    assert env["HF_HUB_OFFLINE"] == "1"


def test_install_stamp_decides_reuse(tmp_path: Path) -> None:
    layout = SglangLayout(tmp_path)
    assert layout.venv == tmp_path / "sglang-venv"
    assert not is_installed(layout)
    layout.python.parent.mkdir(parents=True)
    layout.python.write_text("")
    layout.install_stamp.write_text(json.dumps(_wanted_stamp(CONSTRAINTS_FILE)))
    assert is_installed(layout)
    layout.install_stamp.write_text(json.dumps({"sglang": "0.0.1"}))
    assert not is_installed(layout)


def test_constraints_pin_every_package() -> None:
    pins = [line for line in CONSTRAINTS_FILE.read_text().splitlines() if not line.startswith("#")]
    assert pins and all("==" in line for line in pins)
    versions = dict(line.split("==") for line in pins)
    assert versions["sglang"] == SGLANG_VERSION
    assert (versions["torch"], versions["torchvision"]) == ("2.14.1", "0.29.1")
    names = {name.lower().replace("_", "-") for name in versions}
    wanted = {r.split("=")[0].split(">")[0].lower() for r in RUNTIME_REQUIREMENTS}
    assert wanted <= names
    assert "sgl-kernel" not in names and "sglang-kernel" not in names  # CUDA-only: our stand-in


def test_one_command_picks_the_engine(capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit):
        engines_cli.main(["--engine", "sglang", "up", "--help"])
    assert "kvgate engines --engine sglang up" in capsys.readouterr().out
    with pytest.raises(SystemExit):
        engines_cli.main(["install", "--help"])  # no --engine: vLLM's
    assert "vllm" in capsys.readouterr().out


def test_a_replica_that_cannot_start_fails_fast_with_its_log(tmp_path: Path) -> None:
    # this venv has no SGLang: the server process exits at once
    options = SglangOptions(python=Path(sys.executable), model_dir=tmp_path, logs=tmp_path)
    ports = PortAllocator().take(4)
    fleet = SglangFleet(options, [SglangReplicaSpec(0, *ports)])
    with pytest.raises(SglangStartError, match="exited with code") as failure:
        fleet.start(ready_timeout=60.0)
    assert "No module named 'sglang'" in str(failure.value)
    assert fleet.process_groups() == []
