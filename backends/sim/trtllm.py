"""What a simulated replica shows as trtllm-serve (TensorRT-LLM's OpenAI server).

Its Prometheus page is ``/prometheus/metrics`` (``trtllm_`` gauges, labelled ``model_name``
and ``engine_type``), its ``/metrics`` a JSON list of recent iteration stats, and it states
its KV block size and capacity as gauge values. Its KV events are vLLM's wire format (the
replica's own publisher), one endpoint per rank.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from kvgate.backends.sim.replica import SimReplica

PROMETHEUS_PATH = "/prometheus/metrics"


def prometheus_page(replica: SimReplica) -> bytes:
    """The ``trtllm_`` gauges kvgate reads, from the replica's live state."""
    ranks = replica.ranks
    config = replica.config.engine
    labels = f'{{model_name="{config.model}",engine_type="trtllm"}}'
    values = {
        "trtllm_num_requests_running": sum(len(r.engine.running) for r in ranks),
        "trtllm_num_requests_waiting": sum(len(r.engine.waiting) for r in ranks),
        "trtllm_kv_cache_utilization": sum(r.engine.cache.usage for r in ranks) / len(ranks),
        "trtllm_kv_cache_max_blocks": config.capacity_blocks,
        "trtllm_kv_cache_tokens_per_block": config.block_size,
    }
    lines = []
    for name, value in values.items():
        lines += [f"# HELP {name} {name}", f"# TYPE {name} gauge", f"{name}{labels} {value}"]
    return ("\n".join(lines) + "\n").encode()


def iteration_stats(replica: SimReplica) -> list[dict[str, Any]]:
    """``GET /metrics``: the last iteration's stats, as trtllm-serve lists them."""
    engine = replica.engine
    cache = engine.cache
    return [
        {
            "iter": engine.steps,
            "numActiveRequests": len(engine.running),
            "numQueuedRequests": len(engine.waiting),
            "kvCacheStats": {
                "maxNumBlocks": cache.num_blocks,
                "freeNumBlocks": cache.free_blocks,
                "usedNumBlocks": cache.num_blocks - cache.free_blocks,
                "tokensPerBlock": replica.config.engine.block_size,
            },
        }
    ]
