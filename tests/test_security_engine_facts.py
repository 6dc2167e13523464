"""Engine facts by agreement (issue 44, findings 4 and 5): a model's block size is the
configured one, else what a strict majority of its workers declare; a name is an adapter only
where no worker serves it as a base model, and each worker's own relation says which cache
domain its blocks are in. One worker cannot decide for the others.

The rules (backends/facts.py) and the registry's use of them first, then end to end: a
hostile worker (a real HTTP server on 127.0.0.1) listing an honest replica's model as an
adapter, beside that replica (a simulated vLLM with real KV events over ZMQ).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import httpx
import pytest
from fakes.engine import FakeEngine
from fakes.engine import _json as send_json
from fakes.server import serve
from fakes.simgate import MODEL, chat, fleet_config, gate, indexed, long_text, sim_fleets
from starlette.types import Receive, Send

from kvgate.backends.config import WorkerConfig
from kvgate.backends.engines import EngineFacts
from kvgate.backends.facts import Declared, adapter_parents, agree_block_sizes
from kvgate.backends.registry import WorkerRegistry
from kvgate.index.types import NO_MATCH, PrefixMatch, WorkerId

pytestmark = pytest.mark.anyio


def declared(name: str, size: int | None, *models: str, events: int | None = None) -> Declared:
    return Declared(WorkerId(name), models or ("m",), size, events)


def unset(model: str) -> int | None:
    return None


# -- block size -----------------------------------------------------------------------------
def test_a_strict_majority_decides_and_the_minority_is_kept_out() -> None:
    found = agree_block_sizes(
        [declared("liar", 32), declared("a", 16), declared("b", 16), declared("quiet", None)],
        unset,
    )
    assert found.unresolved == {} and found.own == {}
    assert set(found.per_model) == {"liar"}
    assert "2 of the 3 workers" in found.per_model[WorkerId("liar")]["m"]


@pytest.mark.parametrize(
    "sizes", [(16, 32), (16, 16, 32, 32), (16, 16, 32, 64)], ids=["1-1", "2-2", "2-1-1"]
)
def test_without_a_strict_majority_the_model_is_not_ready(sizes: tuple[int, ...]) -> None:
    workers = [declared(f"w{i}", size) for i, size in enumerate(sizes)]
    found = agree_block_sizes([*workers, declared("quiet", None)], unset)
    reason = found.unresolved["m"]
    assert "no block size has a majority" in reason
    # every worker of the model is kept out of it, the one that declares nothing too
    assert {w: p["m"] for w, p in found.per_model.items()} == {
        WorkerId(n): reason for n in [*(f"w{i}" for i in range(len(sizes))), "quiet"]
    }


def test_the_configured_size_wins_and_self_contradiction_does_not_vote() -> None:
    found = agree_block_sizes(
        [declared("a", 32), declared("b", 32), declared("c", 16)], lambda m: 16
    )
    assert set(found.per_model) == {"a", "b"} and found.unresolved == {}
    found = agree_block_sizes([declared("two-faced", 32, events=16), declared("a", 16)], unset)
    assert set(found.own) == {"two-faced"}
    assert found.per_model == {} and found.unresolved == {}  # the one honest vote is a majority


def test_each_model_agrees_on_its_own() -> None:
    # an engine serving two names (served-model-name aliases) is kept out of one only
    found = agree_block_sizes(
        [declared("both", 16, "x", "y"), declared("y1", 32, "y"), declared("y2", 32, "y")],
        unset,
    )
    assert found.per_model == {WorkerId("both"): {"y": found.per_model["both"]["y"]}}


# -- adapters ---------------------------------------------------------------------------------
def test_a_name_served_as_a_base_model_is_no_adapter() -> None:
    assert adapter_parents([{"x": None}, {"x": "p", "p": None}]) == {}
    assert adapter_parents([{"sql": "base"}, {"sql": "base"}, {"sql": "other"}]) == {"sql": "base"}
    assert adapter_parents([{"sql": "b"}, {"sql": "a"}]) == {"sql": "a"}  # a tie: sort order


@dataclass
class _Fleet:
    registry: WorkerRegistry = field(default_factory=WorkerRegistry)

    def worker(self, url: str, size: int | None, cards: dict[str, str | None]) -> WorkerId:
        worker = self.registry.add(WorkerConfig(url=url))
        worker.healthy = True
        listed = {m: {"id": m, **({"parent": p} if p else {})} for m, p in cards.items()}
        self.registry.update_models(worker, listed, EngineFacts(block_size=size))
        return worker.id


def test_the_registry_routes_by_agreement_per_worker_and_model() -> None:
    fleet = _Fleet()
    liar = fleet.worker("http://10.0.0.1:8000", 32, {"m": None})
    honest = [fleet.worker(f"http://10.0.0.{i}:8000", 16, {"m": None}) for i in (2, 3)]
    # an adapter of ``m`` on an honest worker follows its base model's agreement
    fleet.worker("http://10.0.0.4:8000", 16, {"m": None, "sql": "m"})
    registry = fleet.registry
    assert {w.id for w in registry.serving("m")} == {*honest, "http://10.0.0.4:8000"}
    assert [w.id for w in registry.serving("sql")] == ["http://10.0.0.4:8000"]
    assert not registry.get(liar).ready and registry.unresolved_models() == {}
    registry.remove(honest[0])
    registry.remove("http://10.0.0.4:8000")
    assert registry.serving("m") == []  # 1 against 1: nobody
    assert "m" in registry.unresolved_models()
    registry.remove(liar)
    assert [w.id for w in registry.serving("m")] == [honest[1]]


def test_a_workers_own_relation_decides_its_cache_domain() -> None:
    fleet = _Fleet()
    honest = fleet.worker("http://10.0.0.1:8000", 16, {"m": None})
    hostile = fleet.worker("http://10.0.0.2:8000", 16, {"m": "other", "other": None})
    registry = fleet.registry
    assert registry.base_model("m") == ("m", None)  # served as a base model: no adapter
    match = PrefixMatch(gpu=3)
    matches = {honest: match, hostile: match}
    found = registry.in_domain(registry.serving("m"), "m", matches, ("m", None))
    assert found[honest] == match
    assert hostile not in found  # its blocks for "m" are keyed in another domain
    cards = {card["id"]: card for card in registry.model_cards()}
    assert "parent" not in cards["m"]  # the base model's card, not the adapter's

    # a name nobody serves as a base: the parent most workers give; a dissenter gets no match
    for i, parent in ((3, "p"), (4, "p"), (5, "q")):
        fleet.worker(f"http://10.0.0.{i}:8000", 16, {"sql": parent, parent: None})
    assert registry.base_model("sql") == ("p", "sql")
    matches = {WorkerId(f"http://10.0.0.{i}:8000"): match for i in (3, 4, 5)}
    found = registry.in_domain(registry.serving("sql"), "sql", matches, ("p", "sql"))
    held = [found.get(WorkerId(f"http://10.0.0.{i}:8000"), NO_MATCH) for i in (3, 4, 5)]
    assert [m.blocks for m in held] == [3, 3, 0]


# -- end to end: an honest replica's blocks survive a hostile worker's adapter claim --------------
@dataclass
class ClaimsAdapter(FakeEngine):
    """A fake engine listing the honest replicas' model as its adapter of another base."""

    parent: str = "some-other-base"

    async def _route(self, method: str, path: str, body: Any, receive: Receive, send: Send) -> None:
        if (method, path) == ("GET", "/v1/models"):
            cards = [
                {"id": self.parent, "object": "model"},
                {"id": MODEL, "object": "model", "parent": self.parent},
            ]
            await send_json(send, {"object": "list", "data": cards})
            return
        await super()._route(method, path, body, receive, send)


async def test_a_hostile_adapter_claim_leaves_the_honest_replicas_blocks_intact() -> None:
    async with (
        sim_fleets(fleet_config(1)) as (fleet,),
        serve(ClaimsAdapter(models=[MODEL])) as hostile,
    ):
        replica = fleet.replicas[0]
        honest = f"{replica.url},events={replica.events},replay={replica.replay}"
        async with gate([hostile.url, honest]) as gw:
            body = chat(MODEL, long_text("honest prompt"))
            async with httpx.AsyncClient(base_url=replica.url, timeout=10) as direct:
                seeded = await direct.post("/v1/chat/completions", json=body)  # its cache
                assert seeded.status_code == 200, seeded.text
            overlap = await indexed(gw, body, replica.url)
            explained = (await gw.client.post("/debug/route", json=body)).json()
            assert explained["cache_domain"] == {"base_model": MODEL, "adapter": None}
            entry = next(w for w in explained["workers"] if w["worker"] == replica.url)
            assert entry["matched_blocks"]["gpu"] == overlap // explained["block_size"] > 0
            assert explained["chosen"] == replica.url
            models = (await gw.client.get("/v1/models")).json()["data"]
            assert next(m for m in models if m["id"] == MODEL).get("parent") is None
