"""Fault benchmark: requests lost, phantom hits and recovery through crashes, restarts and
lossy event wires (issue 14).

    python -m kvgate.bench.faults [--scenarios all] [--runs 3] [--seconds 50] [--fault-at 20]
                           [--json PATH] [--markdown PATH] [--out DIR]
    kvgate bench faults ...        (the same)

Each scenario run starts a fresh simulated fleet (``kvgate sim``, 4 replicas, streams opened
at accept as vLLM does, small KV caches so that blocks are evicted) and a fresh ``kvgate
serve`` (``kv`` policy, KV events and replay wired; two of them for the active-active
scenario), all on 127.0.0.1. Closed-loop agent sessions (``bench/agents.py``) run for
``--seconds``; at ``--fault-at`` the scenario's faults are applied through the simulator's
``POST /sim/fault`` (or kvgate is restarted: SIGTERM, drained, started again on the same port).

Per scenario (medians and ranges of the runs): requests sent, answered, failed before any
token, cut after tokens; the phantom share (predicted cached tokens the engine did not report
cached, over all predicted); the engine-reported hit rate, the reuse rate (cached over
reusable tokens) before the fault and the time until it is back within 5% of the same
round's fault-free run (``baseline``); client-side TTFT p50/p99; kvgate's retries (its
metrics) and the client's (connection refused by a gateway that is down); for a kvgate
restart, how long it was down and when its index was rebuilt. Bounded: every run ends after
``--seconds`` plus a drain of at most ``--drain`` seconds. docs/benchmarks.md, "Overload,
faults and the event storm".
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import statistics
import sys
import tempfile
import time
from collections.abc import Callable, Mapping, Sequence
from dataclasses import asdict, dataclass, field, replace
from pathlib import Path
from typing import Any, TypeVar

import httpx

from kvgate.backends.errors import ProcessExited
from kvgate.backends.process import LOOPBACK, free_port_range, wait_http
from kvgate.bench.agents import AgentLoad, AgentRun, Gateways, Record, Tally
from kvgate.bench.fleet import (
    FleetSpec,
    KvgateSpec,
    ManagedProcess,
    SimFleet,
    kvgate_serve_argv,
    start_fleet,
)
from kvgate.bench.report import percentile

T = TypeVar("T")

COUNTED = (
    "kvgate_upstream_retries_total",
    "kvgate_stream_errors_total",
    "kvgate_index_resyncs_total",
    "kvgate_index_resets_total",
    "kvgate_index_replays_total",
)
"""kvgate counters reported per scenario (summed over workers, split by their reason label)."""


# ------------------------------------------------------------------ scenarios
@dataclass(frozen=True, slots=True)
class Step:
    """One action at ``at_s`` seconds after the fault time: a simulator fault (``fault``,
    its ``replica`` included) or a restart of gateway ``restart``."""

    at_s: float
    fault: Mapping[str, Any] | None = None
    restart: int | None = None


@dataclass(frozen=True, slots=True)
class Scenario:
    name: str
    title: str
    steps: tuple[Step, ...] = ()
    gateways: int = 1


def _fault(at_s: float, replica: int, kind: str, **body: Any) -> Step:
    return Step(at_s, {"kind": kind, "replica": replica, **body})


def _everywhere(replicas: int, kind: str, **body: Any) -> tuple[Step, ...]:
    return tuple(_fault(0.0, i, kind, **body) for i in range(replicas))


def scenarios(replicas: int) -> dict[str, Scenario]:
    """Every scenario, by name (faults on replicas 0..3 of a fleet of ``replicas``)."""
    r = [i % replicas for i in range(4)]
    items = [
        Scenario("baseline", "no fault"),
        Scenario(
            "crash",
            "replica crash with requests queued (1.5 s paused), cold restart 5 s later; "
            "a second replica crashes 12 s later",
            (
                _fault(0.0, r[0], "pause", duration_s=1.5),
                _fault(1.5, r[0], "crash", downtime_s=5),
                _fault(12.0, r[1], "crash", downtime_s=5),
            ),
        ),
        Scenario(
            "refuse",
            "one replica refuses connections for 5 s",
            (_fault(0.0, r[1], "refuse", duration_s=5),),
        ),
        Scenario(
            "http_5xx",
            "one replica answers 503 to everything for 5 s",
            (_fault(0.0, r[2], "fail", status=503, duration_s=5),),
        ),
        Scenario(
            "abort",
            "for 10 s, half the requests of one replica fail before their first token "
            "(error event), 30% of another's are reset",
            (
                _fault(0.0, r[0], "abort", rate=0.5, duration_s=10),
                _fault(0.0, r[1], "abort", rate=0.3, drop=True, duration_s=10),
            ),
        ),
        Scenario(
            "slow",
            "one replica 8x slower for 15 s",
            (_fault(0.0, r[3], "slow", factor=8, duration_s=15),),
        ),
        Scenario(
            "drop_events",
            "5% of every replica's event batches dropped for 20 s (replayable)",
            _everywhere(replicas, "drop_events", rate=0.05, duration_s=20),
        ),
        Scenario(
            "lose_events",
            "2% of every replica's event batches lost for 20 s (not replayable)",
            _everywhere(replicas, "drop_events", rate=0.02, replayable=False, duration_s=20),
        ),
        Scenario(
            "delay_events",
            "every replica's event batches 1 s late for 20 s",
            _everywhere(replicas, "delay_events", delay_s=1.0, duration_s=20),
        ),
        Scenario(
            "stop_events",
            "one replica's event stream stops for 20 s, HTTP up",
            (_fault(0.0, r[0], "stop_events", duration_s=20),),
        ),
        Scenario(
            "kvgate_restart",
            "kvgate restarted (SIGTERM, drained, started again)",
            (Step(0.0, restart=0),),
        ),
        Scenario(
            "kvgate_restart_aa",
            "one of two active-active kvgates restarted (load spread over both)",
            (Step(0.0, restart=0),),
            gateways=2,
        ),
    ]
    return {s.name: s for s in items}


# ------------------------------------------------------------------ configuration
@dataclass(frozen=True, slots=True)
class BenchConfig:
    replicas: int = 4
    capacity_blocks: int = 600  # per replica: small enough that blocks are evicted
    block_size: int = 16
    seconds: float = 50.0
    fault_at: float = 20.0
    drain_s: float = 30.0
    load: AgentLoad = field(default_factory=AgentLoad)
    serve_args: tuple[str, ...] = ()
    sim_args: tuple[str, ...] = ()


# ------------------------------------------------------------------ gateways
@dataclass
class Gateway:
    """One ``kvgate serve`` on a fixed port; its counters are kept across restarts."""

    index: int
    port: int
    argv: list[str]
    log_dir: Path
    process: ManagedProcess | None = None
    counters: dict[str, float] = field(default_factory=dict)
    restarts: list[dict[str, float | None]] = field(default_factory=list)

    @property
    def url(self) -> str:
        return f"http://{LOOPBACK}:{self.port}"

    def start(self) -> None:
        n = len(self.restarts)
        log = self.log_dir / f"kvgate-{self.index}-{n}.log"
        self.process = ManagedProcess(f"kvgate-{self.index}", self.argv, log).start()
        wait_http(f"{self.url}/ready", 60, self.process)

    async def collect(self) -> None:
        """Add the running process's counters to the total (before it stops)."""
        for key, value in (await scrape_counters(self.url)).items():
            self.counters[key] = self.counters.get(key, 0.0) + value

    async def restart(self, t0: float) -> None:
        """SIGTERM (in-flight requests drain), then the same command on the same port."""
        await self.collect()
        began = time.perf_counter()
        assert self.process is not None
        await asyncio.to_thread(self.process.stop, 30.0)
        stopped = time.perf_counter()
        await asyncio.to_thread(self.start)
        ready = time.perf_counter()
        indexed = await index_rebuilt(self.url)
        self.restarts.append(
            {
                "at_s": began - t0,
                "drain_s": stopped - began,
                "start_s": ready - stopped,
                "index_s": None if indexed is None else indexed - began,
            }
        )

    def stop(self) -> None:
        if self.process is not None:
            self.process.stop()


async def index_rebuilt(url: str, timeout_s: float = 30.0) -> float | None:
    """When (``perf_counter``) every worker's event subscriber of a started kvgate is
    connected and has applied a batch (the replay of the engine's ring comes first): its
    index rebuilt. None when that did not happen within ``timeout_s``."""
    deadline = time.perf_counter() + timeout_s
    async with httpx.AsyncClient(timeout=5.0) as client:
        while time.perf_counter() < deadline:
            try:
                workers = (await client.get(f"{url}/debug/index")).json()["workers"]
            except (httpx.HTTPError, ValueError, KeyError):
                workers = {}
            subscribers = [s for w in workers.values() for s in w.get("subscribers", [])]
            if (
                workers
                and all(
                    s.get("connected") and s.get("applied_seq") is not None for s in subscribers
                )
                and len(subscribers) >= len(workers)
            ):
                return time.perf_counter()
            await asyncio.sleep(0.05)
    return None


async def scrape_counters(url: str) -> dict[str, float]:
    """The ``COUNTED`` metrics, summed over workers, keyed ``name{reason|outcome}``."""
    try:
        async with httpx.AsyncClient(timeout=5.0) as client:
            text = (await client.get(f"{url}/metrics")).text
    except httpx.HTTPError:
        return {}
    out: dict[str, float] = {}
    for line in text.splitlines():
        name = line.split("{", 1)[0]
        if name not in COUNTED:
            continue
        labels = dict(
            part.split("=", 1) for part in line[line.find("{") + 1 : line.rfind("}")].split(",")
        )
        kind = labels.get("reason") or labels.get("outcome") or ""
        key = f"{name}{{{kind.strip(chr(34))}}}"
        out[key] = out.get(key, 0.0) + float(line.rsplit(" ", 1)[1])
    return out


# ------------------------------------------------------------------ one run
async def apply_fault(fleet: SimFleet, body: Mapping[str, Any]) -> str:
    """``POST /sim/fault`` through any replica that answers (the target may be down)."""
    async with httpx.AsyncClient(timeout=5.0) as client:
        for url in fleet.urls:
            try:
                reply = await client.post(f"{url}/sim/fault", json=dict(body))
            except httpx.HTTPError:
                continue
            if reply.status_code == 200:
                return "ok"
            return f"refused: {reply.status_code} {reply.text[:200]}"
    return "no replica answered"


async def drive(
    scenario: Scenario, fleet: SimFleet, gateways: list[Gateway], run: AgentRun, fault_at: float
) -> list[dict[str, Any]]:
    """Apply the scenario's steps at their times; what was done, when."""
    done: list[dict[str, Any]] = []
    await run.started.wait()
    for step in sorted(scenario.steps, key=lambda s: s.at_s):
        if fault_at + step.at_s >= run.duration_s:
            done.append({"at_s": fault_at + step.at_s, "skipped": "after the load ended"})
            continue
        await asyncio.sleep(max(0.0, fault_at + step.at_s - run.now()))
        at = run.now()
        if step.restart is not None:
            await gateways[step.restart].restart(run.t0)
            done.append({"at_s": at, "restart": step.restart})
        elif step.fault is not None:
            done.append(
                {
                    "at_s": at,
                    "fault": dict(step.fault),
                    "result": await apply_fault(fleet, step.fault),
                }
            )
    return done


def _fleet_spec(cfg: BenchConfig) -> FleetSpec:
    extra = ("--stream-open", "at_accept", "--seed", str(cfg.load.seed), *cfg.sim_args)
    return FleetSpec(
        replicas=cfg.replicas,
        capacity_blocks=cfg.capacity_blocks,
        block_size=cfg.block_size,
        topic="kv-events",
        extra_args=extra,
    )


async def run_scenario(
    scenario: Scenario, cfg: BenchConfig, run_index: int, out_dir: Path
) -> dict[str, Any]:
    log_dir = out_dir / f"{scenario.name}-{run_index}"
    load_before = os.getloadavg()
    fleet = await _on_free_ports(lambda: start_fleet(_fleet_spec(cfg), log_dir))
    gateways: list[Gateway] = []
    try:
        gateways = await _on_free_ports(lambda: start_gateways(scenario, cfg, fleet, log_dir))
        run = AgentRun(Gateways([g.url for g in gateways]), cfg.load, cfg.seconds)
        driver = asyncio.create_task(drive(scenario, fleet, gateways, run, cfg.fault_at))
        try:
            async with asyncio.timeout(cfg.seconds + cfg.drain_s + 60):
                await run.run(drain_s=cfg.drain_s)
            steps = await driver
        finally:
            driver.cancel()
        for gateway in gateways:
            await gateway.collect()
    finally:
        for gateway in gateways:
            await asyncio.to_thread(gateway.stop)
        await asyncio.to_thread(fleet.stop)
    return summarize(scenario, run_index, run.records, gateways, steps, cfg) | {
        "load_avg": [round(load_before[0], 2), round(os.getloadavg()[0], 2)],
    }


def start_gateways(
    scenario: Scenario, cfg: BenchConfig, fleet: SimFleet, log_dir: Path
) -> list[Gateway]:
    """The scenario's kvgates on consecutive free ports, started (all or none)."""
    ports = free_port_range(scenario.gateways, start=18500)
    gateways: list[Gateway] = []
    try:
        for i in range(scenario.gateways):
            argv = kvgate_serve_argv(KvgateSpec("kv", extra_args=cfg.serve_args), fleet, ports + i)
            gateways.append(Gateway(i, ports + i, argv, log_dir))
            gateways[-1].start()
    except BaseException:
        for gateway in gateways:
            gateway.stop()
        raise
    return gateways


async def _on_free_ports(start: Callable[[], T], attempts: int = 3) -> T:
    """``start()`` in a thread, again (on new ports) when a process it started exited at
    once: another job on the box took a port between the check and the bind."""
    for attempt in range(attempts):
        try:
            return await asyncio.to_thread(start)
        except ProcessExited:
            if attempt == attempts - 1:
                raise
            await asyncio.sleep(0.5 + attempt)
    raise AssertionError("unreachable")


# ------------------------------------------------------------------ measures
WINDOW_S = 5.0  # the reuse rate's windows (by send time)
STEP_S = 0.25  # between window starts


def reuse_windows(records: Sequence[Record]) -> list[tuple[float, float | None, int]]:
    """``(start, reuse rate, answered)`` of every ``WINDOW_S`` window of send time, one per
    ``STEP_S`` (``Tally.reuse_rate``: cached over reusable prompt tokens, the hit rate
    without the swings of the session mix)."""
    ordered = sorted(records, key=lambda r: r.sent_s)
    end = ordered[-1].sent_s if ordered else 0.0
    out: list[tuple[float, float | None, int]] = []
    for n in range(int(max(0.0, end - WINDOW_S) / STEP_S) + 1):
        t = n * STEP_S
        window = Tally.of([r for r in ordered if t <= r.sent_s < t + WINDOW_S])
        out.append((t, window.reuse_rate, window.ok))
    return out


def reuse_before(records: Sequence[Record], fault_at: float, span_s: float = 10.0) -> float | None:
    """The reuse rate of the requests sent in the ``span_s`` before the fault."""
    return Tally.of([r for r in records if fault_at - span_s <= r.sent_s < fault_at]).reuse_rate


def recovery_s(
    windows: Sequence[tuple[float, float | None, int]],
    fault_at: float,
    level: float | None,
    reference: Sequence[tuple[float, float | None, int]] | None = None,
    *,
    tolerance: float = 0.05,
    min_requests: int = 20,
) -> float | None:
    """The time from the fault until the reuse rate is back within ``tolerance`` of its
    expected level: the end of the first window (starting at or after the fault) back at it,
    after the first one below it (0: it never fell below; None: not back within the run).

    The expected level is the fault-free run's window at the same time (``reference``: the
    baseline scenario's run of the same round, same seed, so the same sessions at about the
    same times: the workload's own drift, caches filling and sessions growing, cancels out),
    else ``level`` (the rate before the fault). Windows with fewer than ``min_requests``
    answered requests are not judged."""
    expected = {round(t / STEP_S): rate for t, rate, ok in reference or () if ok >= min_requests}
    fell = False
    for t, rate, ok in windows:
        if t < fault_at or rate is None or ok < min_requests:
            continue
        base = expected.get(round(t / STEP_S)) if reference is not None else level
        if base is None:
            continue
        if rate < base * (1 - tolerance):
            fell = True
        elif fell:
            return t + WINDOW_S - fault_at
    return 0.0 if not fell else None


def timeline(records: Sequence[Record], bucket_s: float = 5.0) -> list[dict[str, Any]]:
    """Per ``bucket_s`` of send time: requests, hit rate, phantom tokens, failures."""
    buckets: dict[int, list[Record]] = {}
    for rec in records:
        buckets.setdefault(int(rec.sent_s // bucket_s), []).append(rec)
    out = []
    for key in sorted(buckets):
        tally = Tally.of(buckets[key])
        rate = tally.hit_rate
        reuse = tally.reuse_rate
        out.append(
            {
                "from_s": key * bucket_s,
                "sent": tally.sent,
                "hit_rate": None if rate is None else round(rate, 4),
                "reuse_rate": None if reuse is None else round(reuse, 4),
                "phantom": tally.phantom,
                "failed": tally.failed,
                "cut": tally.cut,
            }
        )
    return out


def summarize(
    scenario: Scenario,
    run_index: int,
    records: Sequence[Record],
    gateways: Sequence[Gateway],
    steps: list[dict[str, Any]],
    cfg: BenchConfig,
) -> dict[str, Any]:
    tally = Tally.of(records)
    level = reuse_before(records, cfg.fault_at)
    windows = reuse_windows(records)
    counters: dict[str, float] = {}
    for gateway in gateways:
        for key, value in gateway.counters.items():
            counters[key] = counters.get(key, 0.0) + value
    return {
        "scenario": scenario.name,
        "run": run_index,
        "sent": tally.sent,
        "ok": tally.ok,
        "failed_before_token": tally.failed,
        "cut_after_tokens": tally.cut,
        "cancelled": tally.cancelled,
        "client_retries": tally.client_retries,
        "predicted_tokens": tally.predicted,
        "phantom_tokens": tally.phantom,
        "phantom_share": tally.phantom_share,
        "hit_rate": tally.hit_rate,
        "reuse_rate": tally.reuse_rate,
        "reuse_before": level,
        "recovery_s": recovery_s(windows, cfg.fault_at, level),  # set again by run_all
        "reuse_windows": windows,
        "ttft_p50_s": percentile(tally.ttfts, 50),
        "ttft_p99_s": percentile(tally.ttfts, 99),
        "kvgate_retries": sum(
            v for k, v in counters.items() if k.startswith("kvgate_upstream_retries_total")
        ),
        "counters": counters,
        "steps": steps,
        "restarts": [r for g in gateways for r in g.restarts],
        "index_rebuilt_s": _first_restart(gateways, "index_s"),
        "kvgate_down_s": _first_restart(gateways, "drain_s", "start_s"),
        "timeline": timeline(records),
        "failures": [asdict(r) for r in records if r.status != "ok"][:20],
    }


def _first_restart(gateways: Sequence[Gateway], *keys: str) -> float | None:
    """The sum of ``keys`` of the run's first kvgate restart (None: no restart, or unknown)."""
    for gateway in gateways:
        for restart in gateway.restarts:
            values = [restart.get(k) for k in keys]
            return None if any(v is None for v in values) else sum(v or 0.0 for v in values)
    return None


# ------------------------------------------------------------------ table
def _fmt(value: float | None, spec: str, scale: float = 1.0) -> str:
    return "-" if value is None else format(value * scale, spec)


def _cell(values: Sequence[float | None], spec: str, scale: float = 1.0) -> str:
    """The median, and the range when the runs differ: ``m (lo-hi)``."""
    known = [v for v in values if v is not None]
    if not known:
        return "-"
    low, high = min(known), max(known)
    cell = _fmt(statistics.median(known), spec, scale)
    if _fmt(low, spec, scale) != _fmt(high, spec, scale):
        cell += f" ({_fmt(low, spec, scale)}-{_fmt(high, spec, scale)})"
    return cell


def _recovery_cell(values: Sequence[float | None]) -> str:
    missed = sum(v is None for v in values)
    if missed == len(values):
        return "not back"
    cell = _cell(values, ".1f")
    return cell + (f", {missed} of {len(values)} not back" if missed else "")


_COLUMNS = (
    "| scenario | sent | ok | failed before any token | cut after tokens | phantom share "
    "| hit rate / reuse before | back within 5% (s) | TTFT p50 / p99 (ms) | kvgate retries "
    "| client retries | kvgate down / index rebuilt (s) |"
)


def markdown_table(results: Sequence[dict[str, Any]], titles: Mapping[str, str]) -> str:
    """One row per scenario: medians over its runs, and their ranges."""
    by_scenario: dict[str, list[dict[str, Any]]] = {}
    for result in results:
        by_scenario.setdefault(result["scenario"], []).append(result)
    lines = [_COLUMNS, "|---" * _COLUMNS.count("| ") + "|"]
    for name, runs in by_scenario.items():

        def col(key: str, spec: str, scale: float = 1.0, runs: list[dict[str, Any]] = runs) -> str:
            return _cell([r.get(key) for r in runs], spec, scale)

        recovery = (
            "reference" if name == "baseline" else _recovery_cell([r["recovery_s"] for r in runs])
        )
        lines.append(
            f"| {name}: {titles.get(name, '')} | {col('sent', '.0f')} | {col('ok', '.0f')} "
            f"| {col('failed_before_token', '.0f')} | {col('cut_after_tokens', '.0f')} "
            f"| {col('phantom_share', '.2f', 100)}% "
            f"| {col('hit_rate', '.3f')} / {col('reuse_before', '.3f')} "
            f"| {recovery} "
            f"| {col('ttft_p50_s', '.0f', 1000)} / {col('ttft_p99_s', '.0f', 1000)} "
            f"| {col('kvgate_retries', '.0f')} | {col('client_retries', '.0f')} "
            f"| {col('kvgate_down_s', '.1f')} / {col('index_rebuilt_s', '.1f')} |"
        )
    return "\n".join(lines) + "\n"


# ------------------------------------------------------------------ command line
def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="kvgate bench faults",
        description=__doc__,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    parser.add_argument("--scenarios", default="all", help="comma list of scenarios, or 'all'")
    parser.add_argument("--runs", type=int, default=3, help="runs of each scenario")
    parser.add_argument("--seconds", type=float, default=50.0, help="load duration per run")
    parser.add_argument("--fault-at", type=float, default=20.0, help="faults start here")
    parser.add_argument("--drain", type=float, default=30.0, help="wait for answers, at most")
    parser.add_argument("--replicas", type=int, default=4)
    parser.add_argument("--capacity-blocks", type=int, default=600, help="KV blocks a replica")
    parser.add_argument("--slots", type=int, default=24, help="agent sessions at once")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--serve-arg", action="append", default=[], help="for kvgate serve")
    parser.add_argument("--sim-arg", action="append", default=[], help="for kvgate sim")
    parser.add_argument("--json", type=Path, help="write every run's result here")
    parser.add_argument("--markdown", type=Path, help="write the table here")
    parser.add_argument("--out", type=Path, help="logs (default: a temporary directory)")
    return parser


def config_from(args: argparse.Namespace) -> BenchConfig:
    return BenchConfig(
        replicas=args.replicas,
        capacity_blocks=args.capacity_blocks,
        seconds=args.seconds,
        fault_at=args.fault_at,
        drain_s=args.drain,
        load=replace(AgentLoad(), slots=args.slots, seed=args.seed),
        serve_args=tuple(args.serve_arg),
        sim_args=tuple(args.sim_arg),
    )


async def run_all(
    chosen: Sequence[Scenario], cfg: BenchConfig, runs: int, out_dir: Path
) -> list[dict[str, Any]]:
    """Every scenario once per round, rounds one after the other (so that a change in the
    box's load spreads over all scenarios instead of hitting one), the baseline first in
    each: the other scenarios' recovery is judged against the same round's baseline."""
    ordered = sorted(chosen, key=lambda s: s.name != "baseline")
    results = []
    for run_index in range(runs):
        reference = None
        for scenario in ordered:
            result = await run_scenario(scenario, cfg, run_index, out_dir)
            if scenario.name == "baseline":
                reference = result["reuse_windows"]
            else:
                result["recovery_s"] = recovery_s(
                    result["reuse_windows"], cfg.fault_at, result["reuse_before"], reference
                )
            result["recovery_against"] = "pre-fault level" if reference is None else "baseline"
            results.append(result)
            _progress(result)
    return results


def _progress(result: dict[str, Any]) -> None:
    print(json.dumps({k: result[k] for k in (
        "scenario", "run", "sent", "ok", "failed_before_token", "cut_after_tokens",
        "phantom_share", "reuse_before", "recovery_s", "ttft_p50_s", "ttft_p99_s",
        "kvgate_retries", "client_retries", "load_avg", "restarts",
    )}), file=sys.stderr, flush=True)  # fmt: skip


def main(argv: Sequence[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    cfg = config_from(args)
    known = scenarios(cfg.replicas)
    names = list(known) if args.scenarios == "all" else args.scenarios.split(",")
    unknown = [n for n in names if n not in known]
    if unknown:
        print(f"unknown scenarios {unknown}; choose from {sorted(known)}", file=sys.stderr)
        return 2
    with tempfile.TemporaryDirectory(prefix="kvgate-faults-") as tmp:
        out_dir = args.out or Path(tmp)
        results = asyncio.run(run_all([known[n] for n in names], cfg, args.runs, out_dir))
    table = markdown_table(results, {n: s.title for n, s in known.items()})
    print(table)
    if args.json is not None:
        args.json.write_text(json.dumps(results, indent=1, default=str) + "\n")
    if args.markdown is not None:
        args.markdown.write_text(table)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
