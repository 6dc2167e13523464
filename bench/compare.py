"""One comparison run: for each router, a cold simulated fleet, the router, one replay of the
same trace slice, then everything stopped; summaries, a markdown table and plots at the end."""

from __future__ import annotations

import asyncio
import json
import os
import subprocess
import sys
import time
from collections.abc import Callable, Sequence
from dataclasses import asdict, dataclass, field, replace
from pathlib import Path

import httpx

from kvgate.bench import pd, report
from kvgate.bench.dynamo_peer import DYNAMO_ROUTERS, scrape_index_counts, start_dynamo_router
from kvgate.bench.engines import start_bench_fleet
from kvgate.bench.fleet import (
    BenchFleet,
    FleetSpec,
    KvgateSpec,
    cpus_apart,
    pd_roles,
    process_cpu_seconds,
    sim_config,
    start_kvgate,
    system_cpu_times,
)
from kvgate.bench.floor import measured_floor
from kvgate.bench.oracle import oracle, pooled_lru, ttft_floor
from kvgate.bench.peers import PEERS, SMG, RouterProcess, start_peer
from kvgate.bench.replay import (
    SAMPLED_METRICS,
    MetricsSample,
    ReplayConfig,
    ReplayResult,
    metrics_texts,
    parse_prometheus,
    replay,
    select_slice,
    write_records,
)
from kvgate.bench.traces import TraceRequest
from kvgate.bench.variants import TUNINGS

KVGATE_POLICIES = ("kv", "round_robin", "random", "least_loaded", "session")
ALL_ROUTERS = (
    "kv",
    "round_robin",
    "least_loaded",
    "session",
    "sglang_cache_aware",
    "vllm_cache_aware",
    "vllm_kv_aware",
    "smg_cache_aware",
    "dynamo_kv",
)


PD_VARIANT = "kv_pd"
"""kvgate over the same fleet disaggregated (docs/pd.md), against the aggregated routers."""
PD_SGLANG_VARIANT = "kv_pd_sglang"
"""``kv_pd`` with SGLang's bootstrap protocol (the one smg's P/D mode speaks over HTTP)."""
PD_VARIANTS = (PD_VARIANT, PD_SGLANG_VARIANT)
BASELINE_TREE = "kv_baseline"
"""Router name of kvgate ``kv`` run from another checkout (``CompareConfig.baseline_tree``)."""


KVGATE_VARIANTS: dict[str, tuple[str, tuple[str, ...]]] = {
    "kv_noqueue": ("kv", ("--no-queue-enabled",)),  # kv without the router-side queue
    "kv_nofleet": ("kv", ("--scoring-fleet-prefill-weight", "0")),  # no fleet term
    # busy with 16k / 32k prompt tokens sent and not yet prefilled (64k: the default)
    "kv_busy16k": ("kv", ("--scheduling-max-pending-prefill-tokens", "16384")),
    "kv_busy32k": ("kv", ("--scheduling-max-pending-prefill-tokens", "32768")),
    "kv_qp05": ("kv", ("--scoring-queued-prefill-weight", "0.5")),  # queued prefill at half
    # built in code (bench.variants: the scheduler's parts, dispatch order or patience)
    **{name: ("kv", ()) for name in TUNINGS},
    "kv_plain": ("kv", ("--no-queue-enabled",)),  # plain overlap versus load (and no queue)
    "kv_nofp": ("kv", ("--scoring-footprint-weight", "0")),  # no footprint term
    "kv_pd": ("kv", ()),  # disaggregated: the first half of the replicas prefill, the rest decode
    "kv_pd_sglang": ("kv", ()),  # the same with SGLang's bootstrap protocol
}
"""Named kvgate configurations beyond a policy: name -> (policy, ``kvgate serve`` flags);
those in ``bench.variants.TUNINGS`` are served by ``python -m kvgate.bench.variants NAME``."""


def is_peer(name: str) -> bool:
    """Whether router ``name`` is a peer (not kvgate)."""
    return name in PEERS or name in DYNAMO_ROUTERS


def router_label(name: str) -> str:
    if name in PEERS:
        return PEERS[name].label
    if name in DYNAMO_ROUTERS:
        return DYNAMO_ROUTERS[name].label
    if name == BASELINE_TREE:
        return "kvgate kv (baseline tree)"
    if name in KVGATE_VARIANTS:
        return f"kvgate {name.replace('_', ' ')}"
    return f"kvgate {name}"


@dataclass(frozen=True, slots=True)
class RouterRun:
    """One router of a comparison: a kvgate policy (with knobs) or a peer."""

    name: str  # kvgate policy or a key of PEERS
    label: str
    knobs: tuple[tuple[str, str], ...] = ()  # kv policy knobs (sweep)


def kv_knob_args(knobs: Sequence[tuple[str, str]]) -> tuple[str, ...]:
    """kv policy knobs as ``kvgate serve`` flags (``--scoring-footprint-weight 1``)."""
    out: list[str] = []
    for name, value in knobs:
        out += [f"--scoring-{name.replace('_', '-')}", value]
    return tuple(out)


@dataclass(slots=True)
class CompareConfig:
    fleet: FleetSpec
    replay: ReplayConfig  # target is filled per router
    out_dir: Path
    title: str
    trace_block_tokens: int = 512
    kvgate_extra_args: tuple[str, ...] = ()
    baseline_tree: Path | None = None  # the checkout router "kv_baseline" runs from
    slo_s: float = 5.0  # goodput's TTFT objective (in the load window)
    log: Callable[[str], None] = field(default=lambda msg: print(msg, file=sys.stderr))


def _scrape_all(urls: Sequence[str]) -> dict[str, dict[str, float]]:
    return {
        f"{url}/metrics": parse_prometheus(text, SAMPLED_METRICS)
        for url, text in metrics_texts(urls).items()
    }


def warm_up(url: str, model: str, requests: int, timeout_s: float = 30.0) -> int:
    """A few tiny requests through the router before measuring (lazy start-up work such as
    loading a tokenizer or opening connections is not measured). Prompts shorter than one
    KV block leave nothing in any cache. Returns how many succeeded."""
    body = {"model": model, "prompt": "warm up", "max_tokens": 1, "temperature": 0.0}
    ok = 0
    with httpx.Client(timeout=timeout_s) as client:
        for _ in range(requests):
            try:
                resp = client.post(f"{url}/v1/completions", json=body)
            except httpx.HTTPError:
                continue
            ok += resp.status_code == 200
    return ok


def kvgate_spec(run: RouterRun, cfg: CompareConfig) -> KvgateSpec:
    """How ``run`` (a kvgate router) is served: its policy, flags and checkout."""
    if run.name == BASELINE_TREE:
        if cfg.baseline_tree is None:
            raise RuntimeError("router kv_baseline needs a baseline tree (--baseline-tree)")
        extra = (*kv_knob_args(run.knobs), *cfg.kvgate_extra_args)
        return KvgateSpec("kv", (), extra, cfg.baseline_tree)
    policy, variant_args = KVGATE_VARIANTS.get(run.name, (run.name, ()))
    args = (*kv_knob_args(run.knobs), *variant_args, *cfg.kvgate_extra_args)
    variant = run.name if run.name in TUNINGS else None
    roles = pd_roles(cfg.fleet.replicas) if run.name in PD_VARIANTS else ()
    bootstrap = run.name == PD_SGLANG_VARIANT
    return KvgateSpec(policy, (), args, variant=variant, roles=roles, bootstrap=bootstrap)


def fleet_for(run: RouterRun, fleet: FleetSpec) -> FleetSpec:
    """The fleet ``run`` is measured on: the comparison's, its replicas owned by ``sglang``
    for the routers speaking SGLang's P/D protocol (smg picks its protocol by the owner)."""
    sglang = run.name == PD_SGLANG_VARIANT or (
        run.name in PEERS and PEERS[run.name].disaggregated and PEERS[run.name].package is SMG
    )
    if not sglang or fleet.engine != "sim":
        return fleet
    return replace(fleet, extra_args=(*fleet.extra_args, "--owned-by", "sglang"))


def _start_router(
    run: RouterRun, fleet: BenchFleet, cfg: CompareConfig, log_dir: Path
) -> tuple[RouterProcess, str]:
    if run.name in PEERS:
        return start_peer(PEERS[run.name], fleet, log_dir, model=cfg.replay.model)
    if run.name in DYNAMO_ROUTERS:
        return start_dynamo_router(DYNAMO_ROUTERS[run.name], fleet, log_dir)
    return start_kvgate(kvgate_spec(run, cfg), fleet, log_dir)


ROUTER_METRICS = ("kvgate_queue_entered_total", "kvgate_queue_rejected_total")
"""Router-side counters read after each replay (kvgate's queue; absent for peers)."""


@dataclass(slots=True)
class RunOutput:
    summary: report.RunSummary
    result: ReplayResult
    router_metrics: dict[str, float] = field(default_factory=dict)
    pd_stats: pd.PdStats | None = None
    """What the replicas counted of prefill, transfers and skipped legs (bench/pd.py)."""


def run_one(
    run: RouterRun, requests: Sequence[TraceRequest], cfg: CompareConfig, oracle_rate: float
) -> RunOutput:
    """Cold fleet + router, replay, stop both; write records and summary under out_dir."""
    run_dir = cfg.out_dir / report.run_dir_name(run.label)
    cfg.log(f"[{run.label}] starting fleet ({cfg.fleet.replicas} replicas) and router")
    with cpus_apart(cfg.fleet.cpus):
        return _run_one(run, requests, cfg, oracle_rate, run_dir)


def _run_one(
    run: RouterRun,
    requests: Sequence[TraceRequest],
    cfg: CompareConfig,
    oracle_rate: float,
    run_dir: Path,
) -> RunOutput:
    fleet = start_bench_fleet(fleet_for(run, cfg.fleet), run_dir / "logs")
    router: RouterProcess | None = None
    try:
        router, url = _start_router(run, fleet, cfg, run_dir / "logs")
        metrics_urls = tuple(f"{u}/metrics" for u in fleet.urls)
        rcfg = ReplayConfig(**{**asdict(cfg.replay), "target": url, "metrics_urls": metrics_urls})
        warm_up(url, cfg.replay.model, 2 * cfg.fleet.replicas)
        before = _scrape_all(fleet.urls)
        pd_before = pd.scrape_series(fleet.urls, pd.FLEET_SERIES) | _skipped(run, url)
        cpu0 = _cpu_snapshot(router, fleet)
        box0 = system_cpu_times()[0]
        t0 = time.perf_counter()
        result = asyncio.run(replay(requests, rcfg))
        wall = time.perf_counter() - t0
        router_metrics = _scrape_router(url, kvgate=not is_peer(run.name))
        pd_after = pd.scrape_series(fleet.urls, pd.FLEET_SERIES) | _skipped(run, url)
        if run.name in DYNAMO_ROUTERS:
            router_metrics = scrape_index_counts(url)
        cpu1 = _cpu_snapshot(router, fleet)
        box1 = system_cpu_times()[0]
    finally:
        if router is not None:
            router.stop()
        fleet.stop()
    cpu = report.CpuUse(
        wall_s=wall,
        seconds={k: cpu1[k] - cpu0[k] for k in cpu0},
        box_busy_s=box1 - box0,
        cores=os.cpu_count() or 2,
    )
    summary = report.summarize(
        run.label,
        result.records,
        oracle_hit_rate=oracle_rate,
        wall_s=result.wall_s,
        replicas=cfg.fleet.replicas,
        cpu=cpu,
        metrics_before=before,
        metrics_after=result.final_metrics,
        samples=result.samples,
        window_s=cfg.replay.max_duration_s,
        slo_s=cfg.slo_s,
    )
    pd_stats = pd.pd_stats(result.records, pd_before, pd_after)
    pd.write_stats(run_dir / "pd.json", pd_stats)
    write_records(run_dir / "records.jsonl", result.records)
    report.write_summary(run_dir / "summary.json", summary)
    _write_samples(run_dir / "samples.jsonl", result.samples)
    if router_metrics:
        (run_dir / "router_metrics.json").write_text(json.dumps(router_metrics, indent=2) + "\n")
    cfg.log(
        f"[{run.label}] ok {summary.ok}/{summary.requests} hit {summary.hit_rate:.3f} "
        f"(÷oracle {summary.hit_vs_oracle:.2f}) ttft p50 {summary.ttft_p50_s:.3f}s "
        f"p99 {summary.ttft_p99_s:.3f}s imbalance {summary.imbalance:.2f} "
        f"fleet busy {summary.fleet_busy:.2f} late {summary.fleet_late:.0%} "
        f"box {cpu.box_utilisation:.0%}{_queued_note(router_metrics)}"
    )
    warning = report.saturation_warning([summary])
    if warning:
        cfg.log(warning)
    return RunOutput(summary, result, router_metrics, pd_stats)


def _skipped(run: RouterRun, url: str) -> dict[str, float]:
    """The prefill legs ``run``'s router has skipped so far: kvgate's counter; 0 for a peer's
    P/D mode (it sends both legs of every request); none for an aggregated peer."""
    if not is_peer(run.name):
        return pd.scrape_series([url], pd.ROUTER_SERIES)
    if run.name in PEERS and PEERS[run.name].disaggregated:
        return {"skipped": 0.0}
    return {}


def _queued_note(router_metrics: dict[str, float]) -> str:
    """`` queued N`` for kvgate (requests its queue took in the run); peers have no queue.
    For Dynamo, the stored events its index applied and rejected (parent block not found)."""
    entered = router_metrics.get("kvgate_queue_entered_total")
    rejected = router_metrics.get("dynamo_stored_parent_block_not_found")
    note = "" if entered is None else f" queued {entered:.0f}"
    if rejected is None:
        return note
    applied = router_metrics.get("dynamo_stored_ok", 0.0)
    return f"{note} index: {applied:.0f} stored events applied, {rejected:.0f} rejected (no parent)"


def _scrape_router(url: str, *, kvgate: bool) -> dict[str, float]:
    """kvgate's ``ROUTER_METRICS`` (a counter with no request counted yet is 0); {} for a
    peer or when the scrape fails."""
    if not kvgate:
        return {}
    with httpx.Client(timeout=5.0) as client:
        try:
            resp = client.get(f"{url}/metrics")
        except httpx.HTTPError:
            return {}
    if resp.status_code != 200:
        return {}
    counters = dict.fromkeys(ROUTER_METRICS, 0.0) | parse_prometheus(resp.text, ROUTER_METRICS)
    return counters | mechanism_series(resp.text)


MECHANISM_PREFIX = "kvgate_mechanism_"


def mechanism_series(text: str) -> dict[str, float]:
    """The do-no-harm guard's counters by part (``kvgate_mechanism_loss_seconds_total{part=
    "waiting"}`` -> ``mechanism_loss_seconds.waiting``), summed over workers."""
    out: dict[str, float] = {}
    for line in text.splitlines():
        if not line.startswith(MECHANISM_PREFIX) or "_total{" not in line:
            continue
        name, _, rest = line.partition("{")
        labels, _, value = rest.rpartition("} ")
        part = labels.partition('part="')[2].partition('"')[0]
        key = f"{name.removeprefix('kvgate_').removesuffix('_total')}.{part}"
        try:
            out[key] = out.get(key, 0.0) + float(value)
        except ValueError:
            continue
    return out


def _cpu_snapshot(router: RouterProcess, fleet: BenchFleet) -> dict[str, float]:
    return {
        "router": router.cpu_seconds(),
        "fleet": fleet.cpu_seconds(),
        "replayer": process_cpu_seconds(os.getpid(), include_reaped_children=False),
    }


def _write_samples(path: Path, samples: Sequence[MetricsSample]) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    with path.open("w", encoding="utf-8") as fh:
        for s in samples:
            fh.write(json.dumps(asdict(s), separators=(",", ":")) + "\n")


def compare(
    runs: Sequence[RouterRun], requests: Sequence[TraceRequest], cfg: CompareConfig
) -> list[RunOutput]:
    """Run every router on the same slice; write table.md, summary.json and PNGs."""
    chosen = select_slice(requests, cfg.replay)
    refs = references(chosen, cfg.fleet, cfg.trace_block_tokens, cfg.out_dir, cfg.replay)
    cfg.log(
        f"slice: {len(chosen)} requests, oracle hit rate {refs.oracle_hit_rate:.3f}, "
        f"pooled LRU {refs.pooled_hit_rate:.3f}, "
        f"TTFT floor p99 {report.percentile(refs.ttft_floor, 99):.3f}s"
    )
    outputs: list[RunOutput] = []
    failed: list[str] = []
    for run in runs:
        try:
            outputs.append(run_one(run, chosen, cfg, refs.oracle_hit_rate))
        except (RuntimeError, TimeoutError, OSError, subprocess.CalledProcessError) as exc:
            cfg.log(f"[{run.label}] could not run: {exc}")
            failed.append(f"{run.label}: {exc}")
    write_comparison(outputs, refs, cfg, failed)
    return outputs


def references(
    chosen: Sequence[TraceRequest],
    fleet: FleetSpec,
    block_tokens: int,
    floor_dir: Path | None = None,
    replay_cfg: ReplayConfig | None = None,
) -> report.References:
    """The oracle, the TTFT floor and the pooled LRU of ``fleet`` for the slice ``chosen``
    (``block_tokens`` tokens per trace hash id).

    On the simulator the floor is computed from its timing model. On another engine it is
    measured (bench/floor.py) on a fleet started for it, and kept in ``floor_dir`` (a run
    that resumes reads it back); the pooled LRU is given where the engine's tokens are the
    trace's words (the Dynamo mocker tokenizes with the simulator's tokenizer), not on vLLM,
    whose tokenizer splits them."""
    orc = oracle(chosen, block_tokens=block_tokens)
    if fleet.engine != "sim":
        idle = measured_floor(chosen, orc, fleet, block_tokens, floor_dir, replay_cfg)
        floor = [idle[i] for i in sorted(idle)]
        pooled_rate: float | None = None
        capacity: int | None = None
        if fleet.engine == "dynamo-mocker" and fleet.capacity_blocks is not None:
            capacity = fleet.replicas * fleet.capacity_blocks * fleet.block_size
            pooled_rate = pooled_lru(chosen, capacity, block_tokens=block_tokens).token_hit_rate
        return report.References(orc.token_hit_rate, floor, pooled_rate, capacity, "measured")
    sim = sim_config(fleet)
    engine = sim.engine
    capacity = (
        sim.replicas * (engine.capacity_blocks + engine.cpu_offload_blocks) * engine.block_size
    )
    pooled = pooled_lru(chosen, capacity, block_tokens=block_tokens)
    return report.References(
        orc.token_hit_rate, ttft_floor(orc, sim), pooled.token_hit_rate, capacity
    )


def write_comparison(
    outputs: Sequence[RunOutput],
    refs: report.References,
    cfg: CompareConfig,
    failed: Sequence[str] = (),
) -> str:
    summaries = [o.summary for o in outputs]
    table = report.markdown_table(summaries, refs)
    warning = report.saturation_warning(summaries)
    text = f"## {cfg.title}\n\n{table}"
    if warning:
        text += f"\n{warning}\n"
    for line in failed:
        text += f"\nNot measured: {line}\n"
    cfg.out_dir.mkdir(parents=True, exist_ok=True)
    (cfg.out_dir / "table.md").write_text(text)
    (cfg.out_dir / "summaries.json").write_text(
        json.dumps(
            refs.as_json() | {"runs": [asdict(s) for s in summaries]},
            indent=2,
            default=str,
        )
        + "\n"
    )
    records = {o.summary.label: o.result.records for o in outputs}
    report.plot_ttft_cdf(records, cfg.out_dir / "ttft_cdf.png", cfg.title)
    report.plot_hit_rates(summaries, refs.oracle_hit_rate, cfg.out_dir / "hit_rate.png", cfg.title)
    report.plot_replica_load(
        {o.summary.label: o.result.samples for o in outputs},
        cfg.out_dir / "replica_load.png",
        cfg.title,
    )
    print(text)
    return text
