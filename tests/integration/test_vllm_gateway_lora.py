"""LoRA adapters and the Responses API against a real vLLM CPU replica (issue 17): a tiny PEFT
adapter made here for the tiny model, served with ``--enable-lora``; kvgate's predicted cached
tokens equal the engine's for repeated adapter requests, and base-model requests never get
credit for the adapter's blocks (nor the reverse).

One replica of its own (LoRA flags), started once for the module."""

from __future__ import annotations

import json
import random
import struct
import time
from array import array
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest
from conftest import READY_TIMEOUT_S, plan_free_replicas
from kvgate_server import KvgateServer
from vllm_helpers import MODEL, ChatSession, usage_of

from kvgate.backends.process import PortAllocator
from kvgate.backends.vllm_cpu.launch import EngineOptions, EngineStartError, Fleet, socket_dir
from kvgate.backends.vllm_cpu.layout import EngineLayout

pytestmark = pytest.mark.vllm

ADAPTER = "tiny-sql"
RANK = 8
HIDDEN, HEAD_DIM, KV_HEADS, LAYERS = 128, 32, 2, 2  # backends/vllm_cpu/tiny_model_script.py


def _safetensors(tensors: dict[str, tuple[list[int], array[float]]]) -> bytes:
    """The safetensors format: a little-endian u64 header length, a JSON header, raw data."""
    header: dict[str, Any] = {}
    offset = 0
    for name, (shape, values) in tensors.items():
        size = len(values) * 4
        header[name] = {"dtype": "F32", "shape": shape, "data_offsets": [offset, offset + size]}
        offset += size
    text = json.dumps(header).encode()
    text += b" " * (-len(text) % 8)
    return struct.pack("<Q", len(text)) + text + b"".join(v.tobytes() for _, v in tensors.values())


def write_adapter(directory: Path, seed: int = 7) -> Path:
    """A PEFT LoRA adapter (q_proj, v_proj; rank 8) for the tiny 2-layer Llama."""
    rng = random.Random(seed)
    outputs = {"q_proj": HIDDEN, "v_proj": KV_HEADS * HEAD_DIM}
    tensors: dict[str, tuple[list[int], array[float]]] = {}
    for layer in range(LAYERS):
        for module, out in outputs.items():
            prefix = f"base_model.model.model.layers.{layer}.self_attn.{module}"
            a = array("f", (rng.gauss(0, 0.02) for _ in range(RANK * HIDDEN)))
            b = array("f", (rng.gauss(0, 0.02) for _ in range(out * RANK)))
            tensors[f"{prefix}.lora_A.weight"] = ([RANK, HIDDEN], a)
            tensors[f"{prefix}.lora_B.weight"] = ([out, RANK], b)
    directory.mkdir(parents=True, exist_ok=True)
    (directory / "adapter_model.safetensors").write_bytes(_safetensors(tensors))
    config = {
        "peft_type": "LORA",
        "task_type": "CAUSAL_LM",
        "base_model_name_or_path": MODEL,
        "r": RANK,
        "lora_alpha": 16,
        "lora_dropout": 0.0,
        "target_modules": list(outputs),
        "bias": "none",
        "fan_in_fan_out": False,
        "modules_to_save": None,
        "use_rslora": False,
        "use_dora": False,
    }
    (directory / "adapter_config.json").write_text(json.dumps(config, indent=2))
    return directory


@pytest.fixture(scope="module")
def lora_fleet(
    engine_layout: EngineLayout, tiny_model_dir: Path, ports: PortAllocator
) -> Iterator[Fleet]:
    adapter = write_adapter(engine_layout.root / "tiny-lora")
    options = EngineOptions(
        python=engine_layout.python,
        model_dir=tiny_model_dir,
        logs=engine_layout.logs / "pytest-lora",
        extra_args=(
            "--enable-lora",
            "--lora-modules",
            f"{ADAPTER}={adapter}",
            "--max-lora-rank",
            str(RANK),
            "--max-loras",
            "1",
        ),
    )
    fleet = Fleet(options, plan_free_replicas(1, socket_dir(engine_layout.root), ports))
    try:
        fleet.start(ready_timeout=READY_TIMEOUT_S)
    except EngineStartError as exc:
        pytest.fail(f"vLLM with --enable-lora did not start: {exc}", pytrace=False)
    try:
        yield fleet
    finally:
        fleet.stop()


@pytest.fixture(scope="module")
def gateway(
    lora_fleet: Fleet, tiny_model_dir: Path, engine_layout: EngineLayout, ports: PortAllocator
) -> Iterator[httpx.Client]:
    """kvgate without --index-block-size: it adopts the replica's (32, on its /metrics)."""
    log_path = engine_layout.logs / "pytest-lora" / "kvgate.log"
    flags = lora_fleet.worker_flags()
    with (
        KvgateServer(flags, tiny_model_dir, log_path, ports.one(), block_size=None) as server,
        httpx.Client(base_url=server.url, timeout=120.0) as client,
    ):
        yield client


def test_the_block_size_is_adopted_from_vllm(gateway: httpx.Client) -> None:
    stats = gateway.get("/debug/index").json()
    assert stats["block_sizes"]["declared_by_engines"] == {MODEL: 32}
    assert stats["config_mismatch"] == {}
    assert gateway.get("/ready").json()["ready_workers"] == 1


def _send(client: httpx.Client, path: str, body: dict[str, Any]) -> tuple[int, int]:
    """(kvgate's predicted cached tokens, the engine's) of one request."""
    reply = client.post(path, json=body)
    assert reply.status_code == 200, reply.text
    usage = reply.json()["usage"]
    if "input_tokens" in usage:  # the Responses API
        cached = int((usage.get("input_tokens_details") or {}).get("cached_tokens") or 0)
    else:
        cached = usage_of(reply.json())[1]
    return int(reply.headers["x-kvgate-predicted-cached-tokens"]), cached


def _settled(client: httpx.Client, body: dict[str, Any], path: str = "/debug/route") -> None:
    """Until kvgate's index holds the prompt's blocks (bounded)."""
    deadline = time.monotonic() + 30
    while time.monotonic() < deadline:
        explained = client.post(path, json=body).json()
        if any(w.get("overlap_tokens", 0) > 0 for w in explained["workers"]):
            return
        time.sleep(0.05)
    raise AssertionError(f"the prompt was never indexed: {explained}")


def test_adapter_blocks_are_predicted_exactly_and_never_shared(gateway: httpx.Client) -> None:
    models = {m["id"]: m for m in gateway.get("/v1/models").json()["data"]}
    assert models[ADAPTER]["parent"] == MODEL

    session = ChatSession.start("lora", seed=17)
    base = {"model": MODEL, "messages": session.ask(60), "max_tokens": 1}
    assert _send(gateway, "/v1/chat/completions", base)[1] == 0
    _settled(gateway, base)

    adapter = {**base, "model": ADAPTER}
    explained = gateway.post("/debug/route", json=adapter).json()
    assert explained["cache_domain"] == {"base_model": MODEL, "adapter": ADAPTER}
    assert _send(gateway, "/v1/chat/completions", adapter) == (0, 0)  # no credit for the base
    _settled(gateway, adapter)
    predicted, cached = _send(gateway, "/v1/chat/completions", adapter)
    assert predicted == cached > 0

    fresh = {"model": ADAPTER, "messages": ChatSession.start("only", 23).ask(60), "max_tokens": 1}
    _send(gateway, "/v1/chat/completions", fresh)
    _settled(gateway, fresh)
    assert _send(gateway, "/v1/chat/completions", {**fresh, "model": MODEL}) == (0, 0)
    predicted, cached = _send(gateway, "/v1/chat/completions", base)
    assert predicted == cached > 0


def test_responses_are_predicted_as_the_engine_caches_them(gateway: httpx.Client) -> None:
    session = ChatSession.start("responses", seed=29)
    body = {"model": MODEL, "input": session.ask(60)[-1]["content"], "max_output_tokens": 1}
    body["instructions"] = session.messages[0]["content"]
    first = gateway.post("/v1/responses", json=body)
    if first.status_code != 200:
        pytest.fail(f"vLLM's CPU build did not serve /v1/responses: {first.text}")
    _settled(gateway, body)
    predicted, cached = _send(gateway, "/v1/responses", body)
    assert predicted == cached > 0
