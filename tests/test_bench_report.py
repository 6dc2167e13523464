"""Summary metrics, plots, and the process/CPU accounting used by benchmarks."""

from __future__ import annotations

import math
import os
import shutil
import sys
import time
from dataclasses import replace
from pathlib import Path

import httpx
import pytest

from kvgate.bench.args import compare_parser, fleet_spec
from kvgate.bench.fleet import (
    FleetSpec,
    ManagedProcess,
    cpus_apart,
    pinned,
    process_cpu_seconds,
    start_fleet,
    system_cpu_times,
    tree_cpu_seconds,
)
from kvgate.bench.overload import PointResult, ramp_table, window_goodput
from kvgate.bench.replay import MetricsSample, RequestRecord
from kvgate.bench.report import (
    LATE_METRIC,
    CpuUse,
    busy_from_metrics,
    busy_from_records,
    counter_growth,
    imbalance,
    percentile,
    plot_hit_rates,
    plot_replica_load,
    plot_sweep,
    plot_ttft_cdf,
    saturation_warning,
    summarize,
)


def _rec(i: int, worker: str, sent: float, e2e: float, cached: int = 0) -> RequestRecord:
    return RequestRecord(
        index=i, session_id=None, scheduled_s=sent, expected_prompt_tokens=100, max_tokens=4,
        sent_s=sent, ttft_s=e2e / 2, e2e_s=e2e, prompt_tokens=100, cached_tokens=cached,
        output_tokens=4, worker=worker, status="ok",
    )  # fmt: skip


def test_percentile_and_imbalance() -> None:
    assert percentile([1.0, 2.0, 3.0, 4.0], 50) == pytest.approx(2.5)
    assert percentile([5.0], 99) == 5.0
    assert math.isnan(percentile([], 50))
    assert imbalance({"a": 2.0, "b": 2.0}, 2) == pytest.approx(1.0)
    assert imbalance({"a": 3.0}, 3) == pytest.approx(3.0)  # idle replicas count


def test_busy_time_is_union_of_in_flight_spans() -> None:
    recs = [_rec(0, "a", 0.0, 2.0), _rec(1, "a", 1.0, 2.0), _rec(2, "a", 5.0, 1.0),
            _rec(3, "b", 0.0, 1.0)]  # fmt: skip
    assert busy_from_records(recs) == pytest.approx({"a": 4.0, "b": 1.0})
    before = {"u1": {"kvgate_sim_busy_seconds_total": 1.0}}
    after = {"u1": {"kvgate_sim_busy_seconds_total": 4.0}}
    assert busy_from_metrics(before, after) == {"u1": 3.0}
    assert busy_from_metrics({}, {"u1": {}}) is None
    late = {"u1": {"kvgate_sim_late_seconds_total": 2.5}}
    assert counter_growth({}, late, "kvgate_sim_late_seconds_total") == {"u1": 2.5}


def test_summary_counts_and_rates() -> None:
    recs = [_rec(0, "a", 0.0, 1.0, cached=50), _rec(1, "b", 0.0, 1.0)]
    recs.append(RequestRecord(2, None, 0.0, 100, 4, status="cancelled"))
    cpu = CpuUse(
        wall_s=10.0,
        seconds={"router": 2.0, "fleet": 5.0, "replayer": 1.0},
        box_busy_s=19.0,
        cores=2,
    )
    s = summarize("x", recs, oracle_hit_rate=0.5, wall_s=10.0, replicas=2, cpu=cpu)
    assert (s.requests, s.ok, s.cancelled, s.failed) == (3, 2, 1, 0)
    assert s.hit_rate == pytest.approx(0.25)
    assert s.hit_vs_oracle == pytest.approx(0.5)
    assert s.cpu["fleet"] == pytest.approx(0.5)
    assert s.imbalance == pytest.approx(1.0)
    warning = saturation_warning([s])
    assert warning is not None and "speedup" in warning
    assert math.isnan(s.fleet_late)  # the fleet exported no lateness
    late = [{"u1": {LATE_METRIC: t}, "u2": {LATE_METRIC: 2 * t}} for t in (1.0, 2.0)]
    s = summarize("x", recs, oracle_hit_rate=0.5, wall_s=10.0, replicas=2, metrics_before=late[0],
                  metrics_after=late[1])  # fmt: skip
    assert s.fleet_late == pytest.approx((1.0 + 2.0) / 2 / 10.0)


def test_plots_are_written(tmp_path: Path) -> None:
    recs = [_rec(i, "a", float(i), 0.5 + i / 10) for i in range(20)]
    s = summarize("kv", recs, oracle_hit_rate=0.8, wall_s=20.0, replicas=2)
    plot_ttft_cdf({"kv": recs}, tmp_path / "cdf.png", "t")
    plot_hit_rates([s], 0.8, tmp_path / "hit.png", "t")
    samples = [MetricsSample(float(t), f"r{k}", {"vllm:num_requests_running": float(t % 3)})
               for t in range(5) for k in range(2)]  # fmt: skip
    plot_replica_load({"kv": samples}, tmp_path / "load.png", "t")
    plot_sweep([(0.5, 0.0, 0.7, 1.0), (1.0, 0.0, 0.8, 2.0)], tmp_path / "sweep.png", "t")
    for name in ("cdf.png", "hit.png", "load.png", "sweep.png"):
        data = (tmp_path / name).read_bytes()
        assert data[:8] == b"\x89PNG\r\n\x1a\n"


def test_cpu_accounting_of_a_child_process(tmp_path: Path) -> None:
    spin = "import time\nt = time.process_time()\nwhile time.process_time() - t < 0.3: pass\n"
    spin += "time.sleep(30)\n"
    proc = ManagedProcess("spin", [sys.executable, "-c", spin], tmp_path / "spin.log").start()
    try:
        for _ in range(200):  # bounded wait until the child has burned its 0.3 s
            if proc.cpu_seconds() >= 0.3:
                break
            time.sleep(0.05)
        assert proc.cpu_seconds() >= 0.3
        assert tree_cpu_seconds(proc.pid) >= 0.3 and process_cpu_seconds(proc.pid) >= 0.3
    finally:
        proc.stop(timeout_s=5)
    assert not proc.alive()
    busy, total = system_cpu_times()
    assert 0 < busy <= total


def test_readiness_counts_only_the_process_under_test(tmp_path: Path) -> None:
    """A port another process holds (picked as free, taken before the benchmark's process
    bound it) must not pass for the process under test being ready."""
    import socket  # noqa: PLC0415

    from kvgate.bench.fleet import owns_listener, wait_own_http  # noqa: PLC0415

    serve = (
        "import http.server, sys\n"
        "class H(http.server.BaseHTTPRequestHandler):\n"
        "    def do_GET(self):\n"
        "        self.send_response(200); self.end_headers()\n"
        "    def log_message(self, *a): pass\n"
        "http.server.HTTPServer(('127.0.0.1', int(sys.argv[1])), H).serve_forever()\n"
    )
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    owner = ManagedProcess("owner", [sys.executable, "-c", serve, str(port)], tmp_path / "o.log")
    other = ManagedProcess("other", [sys.executable, "-c", serve, str(port)], tmp_path / "x.log")
    owner.start()
    try:
        wait_own_http(f"http://127.0.0.1:{port}/", 30, owner)
        assert owns_listener(owner.pid, port)
        other.start()  # cannot bind: the port is the owner's
        with pytest.raises((RuntimeError, TimeoutError)):
            wait_own_http(f"http://127.0.0.1:{port}/", 5, other)
        assert not owns_listener(other.pid, port)
    finally:
        owner.stop()
        other.stop()


def test_bench_ports_are_free_and_offset_per_process() -> None:
    """Benchmarks side by side start their port search at different places (by pid)."""
    from kvgate.backends.process import port_free  # noqa: PLC0415
    from kvgate.bench.fleet import bench_port_range  # noqa: PLC0415

    first = bench_port_range(4, start=21000)
    assert 21000 <= first < 60000
    assert all(port_free(first + i) for i in range(4))
    offset = (os.getpid() % 64) * 16 * 4
    assert first >= 21000 + offset  # the search began at this process's offset


def _point(repeat: int, ttfts: list[float], lost: int = 0, rejected: int = 0) -> PointResult:
    return PointResult(
        factor=1.5,
        session_rate=0.2,
        repeat=repeat,
        router="r",
        sent=len(ttfts) + lost + rejected,
        ok=len(ttfts),
        rejected_429=rejected,
        rejected_503=0,
        other_failed=lost,
        ttft_p50_s=percentile(ttfts, 50),
        ttft_p99_s=percentile(ttfts, 99),
        goodput_rps=1.0,
        hit_rate=0.5,
        wall_s=60.0,
        queued=0,
        served_ttft_s=tuple(ttfts),
    )


def test_ramp_table_pools_the_repeats_served_requests() -> None:
    """Per-run p99s are medianed; the pooled p99 and mean are over every served request of
    every repeat (here one run's slow tail, diluted by the other's)."""
    runs = [_point(1, [0.1] * 99 + [9.0]), _point(2, [0.2] * 100)]
    row = ramp_table(runs, slo_s=5.0).splitlines()[2].split(" | ")
    assert row[7].startswith(f"{(percentile([0.1] * 99 + [9.0], 99) + 0.2) / 2:.2f} (")
    pooled = [0.1] * 99 + [9.0] + [0.2] * 100
    assert row[8] == f"{percentile(pooled, 99):.2f}"
    assert row[9] == f"{sum(pooled) / len(pooled):.3f}"


def _sent(sent_s: float, ttft_s: float | None, status: str = "ok") -> RequestRecord:
    return RequestRecord(0, "s", 0.0, 10, 1, sent_s=sent_s, ttft_s=ttft_s, status=status)


def test_the_load_windows_goodput_counts_good_first_tokens_before_its_end() -> None:
    """Within the SLO and before the window ends: counted. A first token after the window
    (sent inside it or not), one over the SLO, and a failed request are not."""
    records = [
        _sent(1.0, 0.5),
        _sent(8.0, 1.9),  # first token at 9.9 s
        _sent(9.0, 1.5),  # first token at 10.5 s: after the window
        _sent(2.0, 6.0),  # over the SLO
        _sent(3.0, None, status="http_503"),
        _sent(12.0, 0.1),
    ]
    assert window_goodput(records, slo_s=5.0, window_s=10.0) == pytest.approx(2 / 10)


def test_ramp_table_gives_the_load_windows_goodput_beside_the_replays() -> None:
    runs = [replace(_point(1, [0.1] * 10), window_goodput_rps=w) for w in (0.4, 0.2, 0.3)]
    header, _, row = ramp_table(runs, slo_s=5.0).splitlines()[:3]
    assert "in the load window" in header.split(" | ")[11]
    assert row.split(" | ")[11] == "0.30 (0.20–0.40)"
    without = ramp_table([_point(1, [0.1])], slo_s=5.0).splitlines()[2]
    assert without.split(" | ")[11] == "–"


def test_ramp_table_counts_requests_over_every_repeat() -> None:
    """One run of three that lost requests (cancelled at the drain) or had some rejected
    shows in the row: the counts are summed, not the median run's."""
    runs = [_point(1, [0.1] * 10), _point(2, [0.1] * 7, lost=3), _point(3, [0.1] * 9, rejected=1)]
    row = ramp_table(runs, slo_s=5.0).splitlines()[2].split(" | ")
    assert row[3:6] == ["26/30", "1", "0"]


@pytest.mark.skipif(
    not hasattr(os, "sched_getaffinity")
    or len(os.sched_getaffinity(0)) < 2
    or shutil.which("taskset") is None,
    reason="needs two CPUs and taskset",
)
def test_the_fleet_gets_its_cpu_and_the_benchmark_the_others(tmp_path: Path) -> None:
    """``--fleet-cpu``: the simulated fleet runs on its CPU only; the load generator (this
    thread) and the router it starts run on the others, and this thread gets its CPUs back."""
    cpus = os.sched_getaffinity(0)
    fleet_cpu = max(cpus)
    args = compare_parser().parse_args(["--trace", "t.jsonl", "--fleet-cpu", str(fleet_cpu)])
    spec = replace(fleet_spec(args), replicas=1, speedup=100.0)
    assert spec.cpus == (fleet_cpu,)
    fleet = start_fleet(spec, tmp_path)
    try:
        assert [os.sched_getaffinity(p.pid) for p in fleet.processes] == [{fleet_cpu}]
        with cpus_apart(spec.cpus):
            assert os.sched_getaffinity(0) == cpus - {fleet_cpu}
            sleep = [sys.executable, "-c", "import time; time.sleep(30)"]
            router = ManagedProcess("router", sleep, tmp_path / "router.log").start()
            try:
                assert os.sched_getaffinity(router.pid) == cpus - {fleet_cpu}
            finally:
                router.stop(timeout_s=5)
        assert os.sched_getaffinity(0) == cpus
    finally:
        fleet.stop()


def test_an_unpinned_fleet_runs_as_is() -> None:
    argv = [sys.executable, "-m", "kvgate.router.cli", "sim"]
    assert pinned(argv, ()) == argv
    assert fleet_spec(compare_parser().parse_args(["--trace", "t.jsonl"])).cpus == ()


def test_fleet_shares_split_replicas_contiguously() -> None:
    assert FleetSpec(replicas=4).shares() == [range(4)]
    assert FleetSpec(replicas=4, processes=4).shares() == [range(i, i + 1) for i in range(4)]
    assert FleetSpec(replicas=4, processes=3).shares() == [range(0, 1), range(1, 2), range(2, 4)]
    assert FleetSpec(replicas=2, processes=8).shares() == [range(0, 1), range(1, 2)]


@pytest.mark.parametrize("count", ["0", "-2", "x"])
def test_a_fleet_of_no_processes_is_refused(count: str, capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit):
        compare_parser().parse_args(["--trace", "t.jsonl", "--fleet-processes", count])
    assert "--fleet-processes" in capsys.readouterr().err


def test_a_fleet_split_over_processes_serves_each_replica_on_its_port(tmp_path: Path) -> None:
    """``--fleet-processes 2``: two ``kvgate sim`` processes; replica i answers on the
    fleet's port i as replica i, and stopping the fleet stops both."""
    args = compare_parser().parse_args(["--trace", "t.jsonl", "--fleet-processes", "2"])
    spec = replace(fleet_spec(args), replicas=2, speedup=100.0)
    fleet = start_fleet(spec, tmp_path)
    try:
        assert len(fleet.processes) == 2
        states = [httpx.get(f"{url}/sim/state", timeout=10).json() for url in fleet.urls]
        assert [s["replica"] for s in states] == [0, 1]
        assert fleet.cpu_seconds() > 0
    finally:
        fleet.stop()
    assert all(p.exit_code() is not None for p in fleet.processes)
