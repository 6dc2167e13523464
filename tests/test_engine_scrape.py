"""What kvgate reads from an engine's /metrics page (the engine adapters' parse_load)."""

from __future__ import annotations

from backends.engines import SGLANG, VLLM

VLLM_PAGE = """\
# HELP vllm:cache_config_info Information of the LLMEngine CacheConfig
# TYPE vllm:cache_config_info gauge
vllm:cache_config_info{block_size="16",num_gpu_blocks="8000",num_cpu_blocks="None"} 1.0
vllm:cache_config_info{block_size="16",num_gpu_blocks="7000",num_cpu_blocks="None"} 1.0
# TYPE vllm:num_requests_running gauge
vllm:num_requests_running{engine="0",model_name="m"} 2.0
vllm:num_requests_running{engine="1",model_name="m"} 1.0
vllm:num_requests_waiting{engine="0",model_name="m"} 4.0
vllm:kv_cache_usage_perc{engine="0",model_name="m"} 0.25
vllm:kv_cache_usage_perc{engine="1",model_name="m"} 0.75
vllm:prompt_tokens_total{model_name="m"} 123.0
"""


def test_vllm_load_sums_ranks_and_takes_the_smallest_capacity() -> None:
    load = VLLM.parse_load(VLLM_PAGE)
    assert (load.running, load.waiting, load.kv_usage) == (3, 4, 0.5)
    assert load.kv_capacity_blocks == 7000


def test_a_capacity_label_that_is_not_a_positive_int_is_ignored() -> None:
    page = 'vllm:cache_config_info{num_gpu_blocks="None"} 1.0\nvllm:num_requests_running 1.0\n'
    assert VLLM.parse_load(page).kv_capacity_blocks is None
    page = 'vllm:cache_config_info{num_gpu_blocks="0"} 1.0\n'
    assert VLLM.parse_load(page).kv_capacity_blocks is None
    assert VLLM.parse_load("vllm:num_requests_running 1.0\n").kv_capacity_blocks is None


def test_sglang_has_no_capacity_metric() -> None:
    page = "sglang:num_running_reqs 2.0\nsglang:num_queue_reqs 1.0\nsglang:token_usage 0.5\n"
    load = SGLANG.parse_load(page)
    assert (load.running, load.waiting, load.kv_usage, load.kv_capacity_blocks) == (2, 1, 0.5, None)
