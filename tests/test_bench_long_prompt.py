"""bench/long_prompt.py against a real kvgate and a simulated replica on 127.0.0.1."""

from __future__ import annotations

import argparse

import pytest
from fakes.gateway import kvgate
from test_sim_support import sim_config, sim_fleet

from kvgate.backends.sim.tokenizer import tokenizer_dir
from kvgate.bench import long_prompt

pytestmark = pytest.mark.anyio
MODEL = "kvgate-sim"


async def test_both_sides_are_timed_after_a_warm_up() -> None:
    async with sim_fleet(sim_config(replicas=1, speedup=1000.0)) as fleet:
        url = fleet.replicas[0].url
        async with kvgate(
            [f"{url},models={MODEL}"], policy="kv", tokenizers=[f"{MODEL}={tokenizer_dir()}"]
        ) as gw:
            args = argparse.Namespace(
                kvgate=gw.url, direct=url, words=300, requests=2, grow=True, seed=1, timeout=30.0
            )
            ttfts = await long_prompt.run(args)
    assert set(ttfts) == {"direct", "kvgate"}
    assert all(len(values) == 2 and min(values) > 0 for values in ttfts.values())
