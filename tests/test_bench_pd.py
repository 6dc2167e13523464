"""The P/D comparison (bench/pd.py): the peers' P/D flags, kvgate's two protocols on the
same split of the fleet, the counters read from the replicas and the medians table."""

from __future__ import annotations

import json
import math
from dataclasses import asdict
from pathlib import Path

import pytest

from kvgate.bench import pd, report
from kvgate.bench.compare import CompareConfig, RouterRun, fleet_for, kvgate_spec
from kvgate.bench.fleet import FleetSpec, ManagedProcess, SimFleet, kvgate_serve_argv, pd_roles
from kvgate.bench.peers import PEERS, peer_argv
from kvgate.bench.replay import ReplayConfig, RequestRecord
from kvgate.bench.report import RunSummary


def _fleet(tmp_path: Path, replicas: int = 4) -> SimFleet:
    process = ManagedProcess("sim", ["true"], tmp_path / "sim.log")  # never started
    spec = FleetSpec(replicas=replicas)
    return SimFleet(spec, http_port=18000, events_port=18100, processes=[process])


def _after(argv: list[str], flag: str) -> list[list[str]]:
    """The values after each ``flag`` up to the next flag."""
    out: list[list[str]] = []
    for i, arg in enumerate(argv):
        if arg == flag:
            values = []
            for value in argv[i + 1 :]:
                if value.startswith("--"):
                    break
                values.append(value)
            out.append(values)
    return out


def test_smg_pd_names_each_prefill_worker_with_its_bootstrap_port(tmp_path: Path) -> None:
    fleet = _fleet(tmp_path)
    argv = peer_argv(PEERS["smg_pd"], tmp_path, fleet, 19000, 19001, "m")
    assert "--pd-disaggregation" in argv and "--worker-urls" not in argv
    p0, p1, d0, d1 = fleet.urls
    assert _after(argv, "--prefill") == [[p0, "18000"], [p1, "18001"]]
    assert _after(argv, "--decode") == [[d0], [d1]]
    assert argv[argv.index("--policy") + 1] == "cache_aware"


def test_vllm_router_pd_speaks_vllm_s_transfer_protocol(tmp_path: Path) -> None:
    fleet = _fleet(tmp_path)
    argv = peer_argv(PEERS["vllm_router_pd"], tmp_path, fleet, 19000, 19001, "m")
    assert "--vllm-pd-disaggregation" in argv and "--worker-urls" not in argv
    assert argv[argv.index("--kv-connector") + 1] == "nixl"  # kv_transfer_params' flow
    assert _after(argv, "--prefill") == [[u] for u in fleet.urls[:2]]
    assert _after(argv, "--decode") == [[u] for u in fleet.urls[2:]]


def test_kvgate_splits_the_fleet_as_the_peers_do_in_either_protocol(tmp_path: Path) -> None:
    cfg = CompareConfig(FleetSpec(replicas=4), ReplayConfig(target=""), tmp_path, "t")
    fleet = _fleet(tmp_path)
    for name in ("kv_pd", "kv_pd_sglang"):
        spec = kvgate_spec(RouterRun(name, name), cfg)
        assert spec.roles == pd_roles(4)
        argv = kvgate_serve_argv(spec, fleet, 18500)
        workers = [argv[i + 1] for i, a in enumerate(argv) if a == "--worker"]
        ports = ["bootstrap_port=18000" in workers[0], "bootstrap_port=18001" in workers[1]]
        assert ports == [name == "kv_pd_sglang"] * 2
        assert all("role=decode" in w and "bootstrap" not in w for w in workers[2:])


def test_only_sglang_protocol_runs_get_replicas_owned_by_sglang() -> None:
    fleet = FleetSpec(replicas=4, extra_args=("--seed", "3"))
    for name in ("smg_pd", "kv_pd_sglang"):
        assert fleet_for(RouterRun(name, name), fleet).extra_args == (
            "--seed", "3", "--owned-by", "sglang",
        )  # fmt: skip
    for name in ("kv", "kv_pd", "vllm_router_pd", "smg_cache_aware"):
        assert fleet_for(RouterRun(name, name), fleet) == fleet


METRICS = """\
# HELP vllm:prompt_tokens_by_source_total Prompt tokens by source.
vllm:prompt_tokens_total{engine="0",model_name="m"} 1000.0
vllm:prompt_tokens_cached_total{engine="0",model_name="m"} 700.0
kvgate_sim_prefill_leg_prompt_tokens_total 200.0
vllm:prompt_tokens_by_source_total{engine="0",model_name="m",source="local_compute"} 300.0
vllm:prompt_tokens_by_source_total{engine="0",model_name="m",source="local_cache_hit"} 700.0
kvgate_sim_kv_transfers_total{outcome="used"} 4.0
kvgate_sim_kv_transfers_total{outcome="redundant"} 1.0
kvgate_sim_kv_transfers_created{outcome="used"} 1.7e9
kvgate_sim_kv_transfer_tokens_total 640.0
kvgate_sim_kv_transfer_tokens_created 1.7e9
kvgate_pd_legs_total{leg="prefill",outcome="skipped"} 2.0
kvgate_pd_legs_total{leg="prefill",outcome="ok"} 5.0
"""


def test_series_are_read_by_name_and_label() -> None:
    fleet = pd.parse_series(METRICS, pd.FLEET_SERIES)
    assert fleet == {
        "admitted_tokens": 1000.0,  # not vllm:prompt_tokens_cached_total nor _by_source
        "prefill_leg_tokens": 200.0,
        "computed_tokens": 300.0,
        "transferred_tokens": 640.0,  # not the _created sample beside it
        "transfers_used": 4.0,
        "transfers_redundant": 1.0,
    }
    assert pd.parse_series(METRICS, pd.ROUTER_SERIES) == {"skipped": 2.0}
    assert pd.parse_series("", pd.ROUTER_SERIES) == {"skipped": 0.0}


def _record(
    i: int, prompt: int, ttft: float, e2e: float, out: int, status: str = "ok"
) -> RequestRecord:
    return RequestRecord(
        index=i, session_id=None, scheduled_s=0.0, expected_prompt_tokens=prompt, max_tokens=out,
        sent_s=0.0, ttft_s=ttft, e2e_s=e2e, prompt_tokens=prompt, output_tokens=out,
        status=status,
    )  # fmt: skip


def test_a_run_s_figures_come_from_the_counters_deltas_and_the_records() -> None:
    records = [
        _record(0, 600, 0.1, 1.1, 11),  # 0.1 s between tokens
        _record(1, 400, 0.2, 0.6, 5),  # 0.1 s
        _record(2, 500, 0.3, 0.3, 1),  # one token: no inter-token time
        _record(3, 900, 0.0, 0.0, 0, status="http_500"),  # not answered: no inter-token time
    ]
    before = {"computed_tokens": 100.0, "transfers_used": 1.0, "skipped": 3.0}
    before |= {"admitted_tokens": 500.0, "prefill_leg_tokens": 100.0}
    after = {"computed_tokens": 850.0, "transfers_used": 4.0, "transfers_redundant": 1.0}
    after |= {"transferred_tokens": 512.0, "skipped": 5.0}
    after |= {"admitted_tokens": 2500.0, "prefill_leg_tokens": 600.0}  # prompts: 1,500
    stats = pd.pd_stats(records, before, after)
    assert stats.prompt_tokens == 1500 and stats.computed_tokens == 750.0
    assert stats.engine_hit_rate == pytest.approx(0.5)
    assert (stats.transfers, stats.redundant_transfers, stats.skipped) == (4.0, 1.0, 2.0)
    assert stats.transferred_tokens == 512.0
    assert stats.itl_p50_s == pytest.approx(0.1) and stats.itl_p99_s == pytest.approx(0.1)
    assert stats.counters["admitted_tokens"] == 2000.0
    aggregated = pd.pd_stats(records, {}, {"computed_tokens": 750.0, "admitted_tokens": 1500.0})
    assert aggregated.skipped is None and aggregated.transfers == 0.0
    assert aggregated.engine_hit_rate == pytest.approx(0.5)
    assert math.isnan(pd.pd_stats([], {}, {}).engine_hit_rate)


def _summary(label: str, p99: float) -> RunSummary:
    return RunSummary(
        label=label, requests=10, ok=10, failed=0, cancelled=0, prompt_tokens=0,
        cached_tokens=0, hit_rate=0.0, hit_vs_oracle=0.0, ttft_p50_s=p99 / 4, ttft_p99_s=p99,
        e2e_p50_s=0.0, throughput_rps=0.0, throughput_tok_s=0.0, busy_s={}, busy_source="",
        imbalance=0.0, fleet_busy=0.0, per_worker_requests={}, wall_s=0.0, cpu={},
        box_utilisation=0.0,
    )  # fmt: skip


def _stats(hit: float, skipped: float | None) -> pd.PdStats:
    return pd.PdStats(
        prompt_tokens=1000, computed_tokens=1000 * (1 - hit), engine_hit_rate=hit,
        transfers=6.0, transferred_tokens=4096.0, redundant_transfers=0.0, skipped=skipped,
        itl_p50_s=0.002, itl_p99_s=0.004,
    )  # fmt: skip


def test_the_table_shows_each_router_s_medians_in_first_seen_order() -> None:
    rows = [
        pd.PdRow("kvgate kv pd", _summary("kvgate kv pd", p99), _stats(hit, 4.0))
        for p99, hit in ((1.0, 0.5), (3.0, 0.7), (2.0, 0.6))
    ]
    rows.append(pd.PdRow("smg cache_aware", _summary("smg", 5.0), _stats(0.4, None)))
    lines = pd.median_table(rows).splitlines()
    assert lines[0].startswith("| router | answered | TTFT p50 s | TTFT p99 s [range] |")
    kv, smg = lines[2], lines[3]
    assert kv.startswith(
        "| kvgate kv pd (3 runs) | 10/10 | 0.500 | 2.00 [1.00–3.00] | 2.0 | 4.0 | 0.600 | 4 |"
    )
    assert smg.startswith("| smg cache_aware (1 runs) | 10/10 | 1.250 | 5.00 |")
    assert "| — |" in smg


def test_a_finished_run_s_table_is_read_back_from_its_folder(tmp_path: Path) -> None:
    for repeat, p99 in ((1, 1.0), (2, 3.0)):
        run = tmp_path / f"run{repeat}"
        summary = _summary("kvgate kv pd", p99)
        report.write_summary(run / "kvgate_kv_pd" / "summary.json", summary)
        pd.write_stats(run / "kvgate_kv_pd" / "pd.json", _stats(0.5, 2.0))
        (run / "summaries.json").write_text(json.dumps({"runs": [asdict(summary)]}))
    rows = pd.rows_from(tmp_path)
    assert [(r.label, r.summary.ttft_p99_s) for r in rows] == [
        ("kvgate kv pd", 1.0),
        ("kvgate kv pd", 3.0),
    ]
    assert rows[0].stats == _stats(0.5, 2.0)
    assert "| kvgate kv pd (2 runs) |" in pd.median_table(rows)
