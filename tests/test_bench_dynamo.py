"""NVIDIA Dynamo in benchmarks (bench/dynamo_peer.py, bench/dynamo_worker.py, bench/netns.py).

The command lines, environment and model directory are checked here without Dynamo. The
tests that run Dynamo itself need its venv (``.engines/dynamo``, installed by the first
``kvgate bench compare --routers dynamo_kv``; ``make test`` does not install it) and root
for ``unshare --net``: they are skipped without either. They run inside a private network
namespace (Dynamo's event plane binds 0.0.0.0): the test re-runs itself there.
"""

from __future__ import annotations

import json
import os
import socket
import subprocess
import sys
from pathlib import Path

import httpx
import pytest
from tokenizers import Tokenizer

from kvgate.backends.process import wait_until
from kvgate.backends.sim.tokenizer import tokenizer_dir
from kvgate.bench import dynamo_peer, netns
from kvgate.bench.dynamo_peer import (
    DYNAMO,
    DYNAMO_ROUTERS,
    DynamoError,
    dynamo_env,
    frontend_argv,
    index_counts,
    model_dir,
    serving_workers,
    start_dynamo_router,
    worker_argv,
)
from kvgate.bench.fleet import FleetSpec, SimFleet, start_fleet
from kvgate.bench.peers import installed, venv_python
from kvgate.bench.traces import prompt_text

IN_NETNS = "KVGATE_TEST_IN_NETNS"


def test_frontend_and_worker_command_lines_stay_on_loopback(tmp_path: Path) -> None:
    front = frontend_argv(tmp_path, 19500, "kvbench", "kv")
    assert front[:3] == [str(tmp_path / "python"), "-m", "dynamo.frontend"]
    assert front[front.index("--http-host") + 1] == "127.0.0.1"
    assert front[front.index("--router-mode") + 1] == "kv"
    assert front[front.index("--namespace") + 1] == "kvbench"
    planes = [front[front.index(f) + 1] for f in ("--discovery-backend", "--request-plane")]
    assert planes == ["file", "tcp"] and front[front.index("--event-plane") + 1] == "zmq"
    worker = worker_argv(
        tmp_path, replica_url="http://127.0.0.1:9001", events="tcp://127.0.0.1:5557",
        topic="", model_dir=tmp_path / "m", model="kvgate-sim", block_size=16,
    )  # fmt: skip
    # -P: bench/ (the script's folder) is not put first on sys.path, where its modules
    # (index.py, report.py, ...) would shadow packages Dynamo imports
    assert worker[1:3] == ["-P", str(dynamo_peer.WORKER_SCRIPT)]
    assert "--topic=" in worker and worker[worker.index("--block-size") + 1] == "16"
    env = dynamo_env(tmp_path / "store")
    hosts = [k for k in env if k.startswith("DYN_") and k.endswith("_HOST")]
    assert len(hosts) >= 4 and {env[k] for k in hosts} == {"127.0.0.1"}
    assert env["DYN_FILE_KV"] == str(tmp_path / "store") and env["HF_HUB_OFFLINE"] == "1"


def test_the_model_directory_tokenizes_as_the_replicas_do(tmp_path: Path) -> None:
    """Dynamo's frontend loads a model directory: the simulator's tokenizer has no
    ``config.json`` and leaves the added tokens' flags out, which Dynamo's parser requires;
    the directory built for it must still produce the simulator's token ids."""
    src = tokenizer_dir()
    out = model_dir(src, tmp_path / "model")
    text = prompt_text([3, 1, 4, 1, 5], 200, 40) + " <|im_start|> déjà vu 42"
    want = Tokenizer.from_file(str(src / "tokenizer.json")).encode(text).ids
    assert Tokenizer.from_file(str(out / "tokenizer.json")).encode(text).ids == want
    config = json.loads((out / "config.json").read_text())
    vocab = Tokenizer.from_file(str(src / "tokenizer.json")).get_vocab_size()
    assert config["vocab_size"] >= vocab and config["model_type"] == "llama"
    assert config["eos_token_id"] == Tokenizer.from_file(str(src / "tokenizer.json")).token_to_id(
        "<|im_end|>"
    )
    added = json.loads((out / "tokenizer_config.json").read_text())["added_tokens_decoder"]
    assert added and all({"lstrip", "rstrip", "single_word"} <= set(t) for t in added.values())


def test_serving_workers_reads_the_frontend_health_answer() -> None:
    health = {
        "status": "healthy",
        "instances": [
            {"namespace": "kvbench", "endpoint": "generate", "instance_id": 1},
            {"namespace": "kvbench", "endpoint": "worker_kv_query_source_1", "instance_id": 1},
            {"namespace": "kvbench", "endpoint": "generate", "instance_id": 2},
            {"namespace": "mock0", "endpoint": "generate", "instance_id": 3},
            "junk",
        ],
    }
    assert serving_workers(health, "kvbench") == 2
    assert serving_workers(health, "mock0") == 1
    assert serving_workers({"instances": "nope"}, "kvbench") == 0
    assert serving_workers([], "kvbench") == 0


def test_index_counts_sum_the_frontend_event_counter_over_workers() -> None:
    applied = dynamo_peer.APPLIED
    text = "\n".join(
        [
            f"# TYPE {applied} counter",
            f'{applied}{{dynamo_namespace="kv",event_type="stored",status="ok",worker_id="a"}} 5',
            f'{applied}{{dynamo_namespace="kv",event_type="stored",status="ok",worker_id="b"}} 2',
            f'{applied}{{event_type="stored",status="parent_block_not_found",worker_id="a"}} 3',
            f'{applied}{{event_type="removed",status="ok",worker_id="a"}} 4',
            f"{applied}_other 9",
            f'{applied}{{event_type="stored",status="ok"}} junk',
        ]
    )
    counts = index_counts(text)
    assert counts == {
        "dynamo_stored_ok": 7.0,
        "dynamo_stored_parent_block_not_found": 3.0,
        "dynamo_removed_ok": 4.0,
    }


def test_dynamo_refuses_to_start_outside_a_private_namespace(tmp_path: Path) -> None:
    if netns.only_loopback():
        pytest.skip("already in a private network namespace")
    with pytest.raises(DynamoError, match="private network namespace"):
        never_started = SimFleet(FleetSpec(replicas=1), 18000, 18100, [])
        start_dynamo_router(DYNAMO_ROUTERS["dynamo_kv"], never_started, tmp_path)


def _unshare_works() -> bool:
    try:
        done = subprocess.run(
            ["unshare", "--net", "--", "true"], capture_output=True, timeout=30, check=False
        )
    except (OSError, subprocess.TimeoutExpired):
        return False
    return done.returncode == 0


needs_unshare = pytest.mark.skipif(
    not _unshare_works(), reason="unshare --net needs root (CAP_SYS_ADMIN)"
)


@needs_unshare
def test_a_private_namespace_has_only_its_loopback_and_it_is_up() -> None:
    probe = (
        "import socket; s = socket.socket(); s.bind(('0.0.0.0', 0)); s.listen(); "
        "port = s.getsockname()[1]; c = socket.create_connection(('127.0.0.1', port), 5); "
        "print(sorted(n for _, n in socket.if_nameindex()))"
    )
    argv = netns.private_argv([sys.executable, "-c", probe])
    done = subprocess.run(argv, capture_output=True, text=True, timeout=60, check=False)
    assert done.returncode == 0, done.stderr
    assert done.stdout.strip() == "['lo']"
    # and a listener on 0.0.0.0 there is not one here
    assert "lo" in [n for _, n in socket.if_nameindex()]


def _rerun_in_private_netns(test: str) -> None:
    """Run ``test`` of this file again, inside a private network namespace."""
    argv = netns.private_argv(
        [sys.executable, "-m", "pytest", f"{__file__}::{test}", "-q", "-x", "-p", "no:randomly"]
    )
    env = {**os.environ, IN_NETNS: "1"}
    done = subprocess.run(argv, capture_output=True, text=True, timeout=600, env=env, check=False)
    assert done.returncode == 0, done.stdout[-4000:] + done.stderr[-2000:]
    assert " passed" in done.stdout and "skipped" not in done.stdout.splitlines()[-1]


def _complete(client: httpx.Client, url: str, prompt: str) -> int:
    body = {
        "model": "kvgate-sim", "prompt": prompt, "max_tokens": 2, "ignore_eos": True,
        "stream": True, "stream_options": {"include_usage": True},
    }  # fmt: skip
    cached = -1
    with client.stream("POST", f"{url}/v1/completions", json=body) as resp:
        assert resp.status_code == 200
        for line in resp.iter_lines():
            if line.startswith("data:") and '"usage"' in line and "cached_tokens" in line:
                usage = json.loads(line[5:])["usage"]
                cached = usage["prompt_tokens_details"]["cached_tokens"]
    return cached


@needs_unshare
@pytest.mark.slow
@pytest.mark.skipif(not installed(DYNAMO), reason="the Dynamo peer is not installed")
def test_dynamo_routes_to_the_replica_whose_events_it_relayed(tmp_path: Path) -> None:
    """A real simulated fleet, Dynamo's frontend and one relay worker per replica: a prompt
    cached on a replica by a request sent to it directly (Dynamo saw only that replica's
    KV events, relayed by our worker through Dynamo's KvEventPublisher) is then routed by
    Dynamo to that replica, whole blocks cached, for prompts warmed on each replica."""
    if os.environ.get(IN_NETNS) != "1":
        _rerun_in_private_netns("test_dynamo_routes_to_the_replica_whose_events_it_relayed")
        return
    assert netns.only_loopback()
    fleet = start_fleet(FleetSpec(replicas=2), tmp_path / "sim")
    router = None
    try:
        router, url = start_dynamo_router(DYNAMO_ROUTERS["dynamo_kv"], fleet, tmp_path / "dyn")
        with httpx.Client(timeout=60.0, trust_env=False) as client:
            for i in range(4):
                prompt = prompt_text([1000 + 10 * i + k for k in range(6)], 6 * 40, 40)
                replica = fleet.urls[i % 2]
                before = _stored(url)
                assert _complete(client, replica, prompt) == 0  # cold: computed there
                # its stored event relayed and applied by Dynamo's index (bounded wait)
                wait_until(lambda b=before: _stored(url) > b, 30.0, "Dynamo indexing the event")
                cached = _complete(client, url, prompt)
                assert cached == (6 * 40 - 1) // 16 * 16, (i, cached)  # whole blocks
    finally:
        if router is not None:
            router.stop()
        fleet.stop()


def _stored(url: str) -> float:
    return index_counts(httpx.get(f"{url}/metrics", timeout=5.0).text).get("dynamo_stored_ok", 0)


WORKER_CHECK = """
import json, sys
sys.path.insert(0, sys.argv[1])
from tokenizers import Tokenizer
import dynamo_worker as w

req = {"token_ids": [5, 6, 7], "stop_conditions": {"max_tokens": 9, "ignore_eos": True},
       "sampling_options": {"temperature": None}}
plain = w.completion_body(req, "m")
asked = w.completion_body(req, "m", token_ids=True)
tok = Tokenizer.from_file(sys.argv[2] + "/tokenizer.json")
print(json.dumps({
    "plain": plain, "asked": asked,
    "default_max": w.completion_body({"token_ids": [1]}, "m")["max_tokens"],
    "ids": w.chunk_tokens({"token_ids": [3, 4], "text": "x"}, tok),
    "text": w.chunk_tokens({"text": "hello world"}, tok),
    "want": tok.encode("hello world", add_special_tokens=False).ids,
    "empty": w.chunk_tokens({"text": ""}, tok),
    "sse": [w.sse_payload(x) for x in (b'data: {"a": 1}\\n', b"data: [DONE]\\n", b": ping\\n",
                                        b"data: [1]\\n", b"data: {bad\\n")],
}))
"""


@pytest.mark.skipif(not installed(DYNAMO), reason="the Dynamo peer is not installed")
def test_the_relay_worker_forwards_token_ids_and_reads_streamed_chunks(tmp_path: Path) -> None:
    """The worker's request and chunk translation, run in the Dynamo venv it runs in."""
    python = venv_python(DYNAMO)
    argv = [str(python), "-P", "-c", WORKER_CHECK, str(dynamo_peer.BENCH_DIR), str(tokenizer_dir())]
    done = subprocess.run(argv, capture_output=True, text=True, timeout=120, check=False)
    assert done.returncode == 0, done.stderr[-3000:]
    got = json.loads(done.stdout.splitlines()[-1])
    plain, asked = got["plain"], got["asked"]
    assert plain["prompt"] == [5, 6, 7] and plain["max_tokens"] == 9 and plain["ignore_eos"]
    assert plain["stream"] and plain["stream_options"] == {"include_usage": True}
    assert "return_token_ids" not in plain and asked["return_token_ids"] is True
    assert got["default_max"] == 16
    assert got["ids"] == [3, 4] and got["text"] == got["want"] and got["empty"] == []
    assert got["sse"] == [{"a": 1}, None, None, None, None]
