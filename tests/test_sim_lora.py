"""LoRA adapters served the vLLM way: listed in /v1/models, loaded and unloaded at run time,
requests served with them cached apart from the base model, and their blocks published
with ``lora_id``/``lora_name``/``extra_keys`` so that kvgate keys them in the adapter's
domain (real HTTP, real ZMQ, kvgate's own decoder and event feed)."""

from __future__ import annotations

from collections.abc import AsyncIterator
from dataclasses import replace
from typing import Any

import httpx
import pytest
from fakes.wait import wait_until
from prometheus_client import CollectorRegistry
from test_sim_support import EventLog, expected, sim_config, sim_fleet

from kvgate.backends.sim.config import LoraModule
from kvgate.backends.sim.fleet import SimFleet
from kvgate.index.config import IndexConfig
from kvgate.index.events import BlockStored, EventFeed, decode_event_batch
from kvgate.index.keys import block_keys, cache_seed
from kvgate.index.metrics import IndexMetrics
from kvgate.index.table import EventIndex
from kvgate.index.types import PrefixMatch, WorkerId, WorkerKey

pytestmark = pytest.mark.anyio
BASE = "kvgate-sim"
PROMPT = list(range(500, 540))  # 40 tokens: 9 reusable blocks of 4


@pytest.fixture
async def fleet() -> AsyncIterator[SimFleet]:
    config = sim_config(block_size=4)
    engine = replace(config.engine, lora_modules=(LoraModule("sql", "/adapters/sql"),))
    async with sim_fleet(replace(config, engine=engine)) as f:
        yield f


@pytest.fixture
async def client(fleet: SimFleet) -> AsyncIterator[httpx.AsyncClient]:
    async with httpx.AsyncClient(base_url=fleet.replicas[0].url, timeout=30) as c:
        yield c


async def _complete(c: httpx.AsyncClient, model: str, **extra: Any) -> httpx.Response:
    body = {"model": model, "prompt": PROMPT, "max_tokens": 2, **extra}
    return await c.post("/v1/completions", json=body)


def _cached(reply: httpx.Response) -> int:
    assert reply.status_code == 200, reply.text
    cached: int = reply.json()["usage"]["prompt_tokens_details"]["cached_tokens"]
    return cached


async def _load(c: httpx.AsyncClient, name: str, path: str, **extra: Any) -> httpx.Response:
    body = {"lora_name": name, "lora_path": path, **extra}
    return await c.post("/v1/load_lora_adapter", json=body)


def _error(reply: httpx.Response, status: int, kind: str) -> str:
    assert reply.status_code == status, reply.text
    error = reply.json()["error"]
    assert error["type"] == kind and error["code"] == status
    message: str = error["message"]
    return message


async def test_models_list_adapters_as_vllm_does(client: httpx.AsyncClient) -> None:
    data = (await client.get("/v1/models")).json()["data"]
    assert [m["id"] for m in data] == [BASE, "sql"]
    assert data[0]["parent"] is None and data[0]["root"] == BASE
    sql = data[1]
    assert (sql["object"], sql["owned_by"], sql["root"], sql["parent"]) == (
        "model", "vllm", "/adapters/sql", BASE
    )  # fmt: skip


async def test_load_and_unload_adapters_at_run_time(client: httpx.AsyncClient) -> None:
    loaded = await _load(client, "chat", "/adapters/chat-v1")
    assert loaded.status_code == 200
    assert loaded.text == "Success: LoRA adapter 'chat' added successfully."
    models = (await client.get("/v1/models")).json()["data"]
    assert {"id": "chat", "root": "/adapters/chat-v1", "parent": BASE}.items() <= models[2].items()
    again = await _load(client, "chat", "/adapters/chat-v1")
    assert "has already been loaded" in _error(again, 400, "InvalidUserInput")
    in_place = await _load(client, "chat", "/adapters/chat-v2", load_inplace=True)
    assert in_place.status_code == 200
    state = (await client.get("/sim/state")).json()
    assert state["lora_adapters"] == [
        {"name": "sql", "lora_id": 1, "path": "/adapters/sql"},
        {"name": "chat", "lora_id": 2, "path": "/adapters/chat-v2"},  # same id in place
    ]
    assert _cached(await _complete(client, "chat")) == 0
    unloaded = await client.post("/v1/unload_lora_adapter", json={"lora_name": "chat"})
    assert unloaded.text == "Success: LoRA adapter 'chat' removed successfully."
    gone = await client.post("/v1/unload_lora_adapter", json={"lora_name": "chat"})
    assert _error(gone, 404, "NotFoundError") == "The lora adapter 'chat' cannot be found."
    missing = await _complete(client, "chat")
    assert _error(missing, 404, "NotFoundError") == "The model `chat` does not exist."
    assert (await _load(client, "chat", "/adapters/chat-v3")).status_code == 200
    ids = [a["lora_id"] for a in (await client.get("/sim/state")).json()["lora_adapters"]]
    assert ids == [1, 3]  # a new load takes the next id


@pytest.mark.parametrize(
    ("body", "kind"),
    [
        ({"lora_name": "x"}, "BadRequestError"),
        ({"lora_name": "", "lora_path": ""}, "InvalidUserInput"),
        ({"lora_name": "x", "lora_path": "/p", "load_inplace": "yes"}, "BadRequestError"),
    ],
)
async def test_malformed_loads_are_400(
    client: httpx.AsyncClient, body: dict[str, Any], kind: str
) -> None:
    _error(await client.post("/v1/load_lora_adapter", json=body), 400, kind)


async def test_adapter_requests_are_cached_apart_from_the_base_model(
    client: httpx.AsyncClient,
) -> None:
    assert (await _load(client, "chat", "/adapters/chat")).status_code == 200
    first = await _complete(client, "sql")
    assert first.json()["model"] == "sql"  # vLLM answers with the adapter's name
    assert _cached(first) == 0
    assert _cached(await _complete(client, "sql")) == 36
    assert _cached(await _complete(client, BASE)) == 0  # never credit for adapter blocks
    assert _cached(await _complete(client, BASE)) == 36
    assert _cached(await _complete(client, "chat")) == 0  # nor another adapter's
    chat = {"model": "sql", "messages": [{"role": "user", "content": "hi " * 30}],
            "max_tokens": 1}  # fmt: skip
    tokenized = await client.post("/tokenize", json={"model": "sql", "prompt": "hi"})
    assert tokenized.status_code == 200
    reply = await client.post("/v1/chat/completions", json=chat)
    assert reply.json()["model"] == "sql"


async def test_adapter_blocks_are_published_as_vllm_does_and_keyed_apart_by_kvgate(
    fleet: SimFleet, client: httpx.AsyncClient
) -> None:
    replica = fleet.replica(0)
    _, events, replay_endpoint = fleet.replicas[0]
    async with EventLog(events, replay_endpoint) as log:
        assert _cached(await _complete(client, "sql", cache_salt="tenant-a")) == 0
        assert _cached(await _complete(client, BASE)) == 0
        await wait_until(replica.idle)
        await log.complete(replica.publisher.next_seq)
        payloads = [log.batches[s] for s in sorted(log.batches)]
        assert log.rebuild() == expected(replica.snapshot())
    stored = [
        e
        for p in payloads
        for e in decode_event_batch(p).events
        if isinstance(e, BlockStored) and e.parent_block_hash is None
    ]
    adapter, base = stored  # each request's chain starts with one root BlockStored
    assert (adapter.lora_id, adapter.lora_name) == (1, "sql")
    assert adapter.extra_keys is not None
    assert adapter.extra_keys[0] == ["sql", "tenant-a"]  # the name first, then the salt
    assert all(keys == ["sql"] for keys in adapter.extra_keys[1:])
    assert (base.lora_id, base.lora_name, base.extra_keys) == (None, None, None)

    index = EventIndex()
    feed = EventFeed(
        WorkerId(replica.url), 0, index, IndexConfig(block_size=4), block_size=4,
        metrics=IndexMetrics(CollectorRegistry()),
    )  # fmt: skip
    for payload in payloads:
        feed.apply_payload(payload)
    worker = WorkerKey(WorkerId(replica.url), 0)
    for lora, salt in ((None, None), ("sql", "tenant-a")):
        keys = block_keys(PROMPT, 4, cache_seed(lora, salt))
        assert index.find_matches(keys[:9]) == {worker: PrefixMatch(gpu=9)}
    for lora, salt in (("sql", None), (None, "tenant-a")):
        assert index.find_matches(block_keys(PROMPT, 4, cache_seed(lora, salt))) == {}
