"""Prefill/decode disaggregation, the pure parts: the skip rule (``scheduling.pd``), the legs'
bodies (``router.pd``), the role option in every form a worker is written, ``--sim NpMd``."""

from __future__ import annotations

from dataclasses import replace
from typing import Any

import msgspec
import pytest

from kvgate.backends.config import WorkerConfig, parse_worker_spec
from kvgate.backends.discovery import parse_discovery_url, worker_for_address
from kvgate.backends.errors import DiscoveryUrlError
from kvgate.index.types import BlockKey, PrefixMatch, WorkerId
from kvgate.router.config import load_settings, sim_roles
from kvgate.router.pd import (
    REMOTE_DECODE,
    prefill_body,
    strip_transfer_params,
    with_transfer_params,
)
from kvgate.scheduling.capacity import Refusal
from kvgate.scheduling.pd import TRANSFER_BLOCK_COST, TRANSFER_SETUP_TOKENS, plan_legs
from kvgate.scheduling.routing import Routed
from kvgate.scoring.api import Candidate, Decision, RouteRequest, WorkerLoad
from kvgate.scoring.config import KvPolicyConfig

BS = 16
CONFIG = KvPolicyConfig()


def routed(blocks: int, **candidates: tuple[int, WorkerLoad]) -> Routed:
    """A ranking of ``candidates`` (name: (matched GPU blocks, load)) in the order given."""
    keys = [BlockKey(100 + i) for i in range(blocks)]
    request = RouteRequest("m", keys, BS, blocks * BS + 1)  # a partial last block
    found = {
        WorkerId(name): Candidate(WorkerId(name), f"http://{name}", load, PrefixMatch(gpu=gpu))
        for name, (gpu, load) in candidates.items()
    }
    order = list(found)
    return Routed(request, None, found, Decision(order), order, {}, "kv")


IDLE = WorkerLoad()


def test_an_idle_decode_worker_prefills_a_cold_prompt_itself() -> None:
    decode = routed(20, d=(0, IDLE))
    plan = plan_legs(decode, WorkerId("d"), routed(20, p=(0, IDLE)), CONFIG)
    assert plan.skipped and plan.prefill is None and plan.transfer_blocks == 0
    setup = TRANSFER_SETUP_TOKENS / BS
    assert plan.local_cost == pytest.approx(CONFIG.overlap_credit * 20)  # not the partial block
    assert plan.remote_cost == pytest.approx(
        CONFIG.overlap_credit * 21 + TRANSFER_BLOCK_COST * 20 + setup
    )
    assert plan.decode_cached_tokens == 0


def test_a_busy_decode_worker_receives_the_prompt() -> None:
    """Each request decoding there would stall behind the local prefill."""
    decode = routed(20, d=(0, WorkerLoad(in_flight=3, active_decode_blocks=60)))
    plan = plan_legs(decode, WorkerId("d"), routed(20, p=(0, IDLE)), CONFIG)
    assert not plan.skipped and plan.prefill == "p" and plan.transfer_blocks == 20
    assert plan.decode_cached_tokens == 20 * BS  # every whole block before the last token
    assert plan.local_cost > plan.remote_cost  # type: ignore[operator]


def test_a_long_prompt_held_by_a_prefill_worker_is_sent_to_an_idle_decode_worker() -> None:
    plan = plan_legs(routed(80, d=(0, IDLE)), WorkerId("d"), routed(80, p=(80, IDLE)), CONFIG)
    assert not plan.skipped and plan.prefill_cached_tokens == 80 * BS
    short = plan_legs(routed(8, d=(0, IDLE)), WorkerId("d"), routed(8, p=(8, IDLE)), CONFIG)
    assert short.skipped  # a short prompt costs less than the leg itself


def test_a_decode_worker_holding_the_prefix_skips_the_transfer() -> None:
    """Only the uncached remainder is prefilled there: cheaper than any transfer."""
    decode = routed(20, d=(18, WorkerLoad(in_flight=2)))
    plan = plan_legs(decode, WorkerId("d"), routed(20, p=(20, IDLE)), CONFIG)
    assert plan.skipped and plan.decode_cached_tokens == 18 * BS
    assert "local prefill" in plan.reason


def test_a_prefill_tier_at_its_limits_is_not_waited_for() -> None:
    decode = routed(80, d=(0, WorkerLoad(in_flight=3)))
    prefill = routed(80, p=(80, IDLE))
    busy = replace(prefill, refused={WorkerId("p"): Refusal("in_flight", 8, 8)})
    assert not plan_legs(decode, WorkerId("d"), prefill, CONFIG).skipped
    plan = plan_legs(decode, WorkerId("d"), busy, CONFIG)
    assert plan.skipped and plan.reason == "no prefill worker admits it (in flight 8 >= 8)"


def test_without_a_prefill_worker_the_decode_worker_prefills() -> None:
    plan = plan_legs(routed(4, d=(0, WorkerLoad(in_flight=9))), WorkerId("d"), None, CONFIG)
    assert plan.skipped and plan.remote_cost is None
    assert plan.reason == "no prefill worker ready"
    assert plan.describe()["skipped"] is True


def test_prefill_leg_body() -> None:
    data: dict[str, Any] = {
        "model": "m",
        "messages": [{"role": "user", "content": "hi"}],
        "max_tokens": 50,
        "max_completion_tokens": 50,
        "stream": True,
        "stream_options": {"include_usage": True},
        "kv_transfer_params": {"do_remote_prefill": True, "remote_host": "evil"},
    }
    body = msgspec.json.decode(prefill_body(data))
    assert body["max_tokens"] == body["max_completion_tokens"] == 1
    assert body["stream"] is False and "stream_options" not in body
    assert body["kv_transfer_params"] == REMOTE_DECODE
    assert body["messages"] == data["messages"]


def test_a_clients_transfer_params_are_stripped_and_the_prefills_added() -> None:
    raw = b'{"model":"m","kv_transfer_params":{"do_remote_prefill":true},"prompt":"x"}'
    stripped = strip_transfer_params(raw, msgspec.json.decode(raw))
    assert msgspec.json.decode(stripped) == {"model": "m", "prompt": "x"}
    sglang = b'{"model":"m","bootstrap_host":"evil","bootstrap_port":1,"bootstrap_room":2}'
    data = msgspec.json.decode(sglang)
    assert msgspec.json.decode(strip_transfer_params(sglang, data)) == {"model": "m"} == data
    plain = b'{"model":"m","prompt":"kv_transfer_params"}'  # the word, not the member
    assert strip_transfer_params(plain, msgspec.json.decode(plain)) is plain
    params = {"remote_engine_id": "e", "remote_block_ids": [[1, 2]]}
    sent = with_transfer_params(stripped, params)
    assert msgspec.json.decode(sent) == {"model": "m", "prompt": "x", "kv_transfer_params": params}
    assert msgspec.json.decode(with_transfer_params(b" { } ", params)) == {
        "kv_transfer_params": params
    }


def test_role_in_every_worker_form() -> None:
    assert parse_worker_spec("http://h:1,role=prefill")["role"] == "prefill"
    assert WorkerConfig.model_validate("http://h:1,role=decode").role == "decode"
    assert WorkerConfig.model_validate({"url": "http://h:1"}).role == "both"
    with pytest.raises(ValueError, match="role"):
        WorkerConfig.model_validate("http://h:1,role=both-ways")
    config = parse_discovery_url("dns://p.ns.svc:8000?role=prefill")
    assert worker_for_address(config, "10.0.0.1").worker_fields()["role"] == "prefill"
    assert parse_discovery_url("dns://d.ns.svc:8000").role == "both"
    with pytest.raises(DiscoveryUrlError, match="role"):
        parse_discovery_url("dns://p.ns.svc:8000?role=leader")


def test_sim_takes_a_count_or_prefill_and_decode_replicas() -> None:
    assert load_settings(overrides={"sim": "3"}).sim_roles == ["both"] * 3
    assert load_settings(overrides={"sim": "2p1d"}).sim_roles == ["prefill", "prefill", "decode"]
    assert sim_roles(0) == []
    for bad in ("2p", "0p2d", "x"):
        with pytest.raises(Exception, match="NpMd"):
            load_settings(overrides={"sim": bad})


def test_bench_serves_the_kv_pd_router_on_a_disaggregated_fleet(tmp_path: Any) -> None:
    from kvgate.bench.compare import CompareConfig, RouterRun, kvgate_spec, pd_roles  # noqa: PLC0415
    from kvgate.bench.fleet import FleetSpec  # noqa: PLC0415
    from kvgate.bench.replay import ReplayConfig  # noqa: PLC0415

    assert pd_roles(4) == ("prefill", "prefill", "decode", "decode")
    assert pd_roles(1) == ("prefill",)
    cfg = CompareConfig(FleetSpec(replicas=4), ReplayConfig(target=""), tmp_path, "t")
    assert kvgate_spec(RouterRun("kv_pd", "kv pd"), cfg).roles == pd_roles(4)
    assert kvgate_spec(RouterRun("kv", "kv"), cfg).roles == ()
