"""The Gateway API Inference Extension's conformance expectations that run without a cluster,
through a real Envoy in front of ``kvgate epp`` and simulated replicas: the test header that
forces the pick (``test-epp-endpoint-selection``) and the echo of the endpoint that served
(``x-conformance-test-served-endpoint``, read from Envoy's
``x-gateway-destination-endpoint-served``), and the data plane's subset hint."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator
from contextlib import AsyncExitStack, asynccontextmanager
from pathlib import Path
from typing import Any

import httpx
import pytest
from fakes.epp import Stack, envoy_stack, epp_server
from fakes.simgate import MODEL, fleet_config, sim_fleets, worker_specs

from kvgate.backends.process import free_port
from kvgate.bench.envoy import Envoy, bootstrap
from kvgate.router.epp.wire import endpoint_of

pytestmark = pytest.mark.anyio

SELECT = "test-epp-endpoint-selection"
SERVED = "x-conformance-test-served-endpoint"


def body(text: str) -> dict[str, Any]:
    return {"model": MODEL, "prompt": f"Write as if you were a critic: {text}", "max_tokens": 2}


@asynccontextmanager
async def conformance(tmp_path: Path, replicas: int = 3) -> AsyncIterator[Stack]:
    async with (
        sim_fleets(fleet_config(replicas)) as (fleet,),
        envoy_stack(fleet, tmp_path, conformance_headers=True) as stack,
    ):
        yield stack


async def test_the_test_header_forces_the_pick_and_the_served_endpoint_is_echoed(
    tmp_path: Path,
) -> None:
    async with conformance(tmp_path) as stack:
        for url in stack.urls:
            endpoint = endpoint_of(url)
            for number in range(3):
                reply = await stack.client.post(
                    "/v1/completions",
                    json=body(f"San Francisco {number}"),
                    headers={SELECT: endpoint},
                )
                assert reply.status_code == 200, reply.text
                assert reply.headers[SERVED] == endpoint
                assert reply.headers["x-kvgate-worker"] == url


async def test_traffic_stays_within_the_designated_endpoints(tmp_path: Path) -> None:
    async with conformance(tmp_path, replicas=3) as stack:
        designated = [endpoint_of(stack.urls[0]), endpoint_of(stack.urls[2])]
        served = set()
        for number in range(12):
            reply = await stack.client.post(
                "/v1/completions",
                json=body(f"city {number} " * (number + 1)),
                headers={SELECT: ",".join(designated)},
            )
            assert reply.status_code == 200, reply.text
            served.add(reply.headers[SERVED])
        assert served <= set(designated)


async def test_without_conformance_headers_a_client_cannot_choose(tmp_path: Path) -> None:
    async with sim_fleets(fleet_config(2)) as (fleet,), envoy_stack(fleet, tmp_path) as stack:
        reply = await stack.client.post(
            "/v1/completions", json=body("steer me"), headers={SELECT: "10.1.1.1:3000"}
        )
        assert reply.status_code == 200  # the header is ignored, not a 503 for its endpoint
        assert SERVED not in reply.headers
        assert reply.headers["x-kvgate-worker"] in stack.urls


def with_subset_hint(config: dict[str, Any], allowed: list[str]) -> dict[str, Any]:
    """The bootstrap with a filter before ext_proc that sets the data plane's subset hint
    (as a gateway implementation does from its own view of the pool)."""
    listener = config["static_resources"]["listeners"][0]
    manager = listener["filter_chains"][0]["filters"][0]["typed_config"]
    hint = {
        "name": "envoy.filters.http.set_metadata",
        "typed_config": {
            "@type": "type.googleapis.com/envoy.extensions.filters.http.set_metadata.v3.Config",
            "metadata": [
                {
                    "metadata_namespace": "envoy.lb.subset_hint",
                    "value": {"x-gateway-destination-endpoint-subset": allowed},
                }
            ],
        },
    }
    manager["http_filters"].insert(0, hint)
    return config


async def test_the_data_planes_subset_hint_is_honoured(tmp_path: Path) -> None:
    async with AsyncExitStack() as stack:
        (fleet,) = await stack.enter_async_context(sim_fleets(fleet_config(3)))
        epp = await stack.enter_async_context(epp_server(worker_specs(fleet)))
        urls = [r.url for r in fleet.replicas]
        allowed = [endpoint_of(urls[1])]
        config = bootstrap(
            listen_port=free_port(),
            admin_port=free_port(),
            epp=[f"127.0.0.1:{epp.grpc_port}"],
            pool=[endpoint_of(u) for u in urls],
        )
        envoy = Envoy(with_subset_hint(config, allowed), tmp_path, name="envoy-hint")
        stack.callback(envoy.stop)
        await asyncio.to_thread(envoy.start)
        async with httpx.AsyncClient(base_url=envoy.url, timeout=30.0) as client:
            for number in range(6):
                reply = await client.post("/v1/completions", json=body(f"hinted {number}"))
                assert reply.status_code == 200, reply.text
                assert reply.headers["x-kvgate-worker"] == urls[1]
