"""The generalization matrix's plan, table and resume logic (no fleet is started here: the
whole pipeline runs in the slow quick-mode test of tests/test_bench_quick.py)."""

from __future__ import annotations

import dataclasses
import math
from pathlib import Path

import pytest

from kvgate.bench import matrix, report
from kvgate.bench.args import compare_parser, fleet_spec, load_requests
from kvgate.bench.cli import build_parser
from kvgate.bench.fleet import sim_config


def _summary(
    label: str, p99: float, hit: float, ok: int = 10, goodput: float = math.nan
) -> report.RunSummary:
    return report.RunSummary(
        label=label, requests=10, ok=ok, failed=10 - ok, cancelled=0, prompt_tokens=100,
        cached_tokens=int(100 * hit), hit_rate=hit, hit_vs_oracle=hit, ttft_p50_s=p99 / 4,
        ttft_p99_s=p99, e2e_p50_s=1.0, throughput_rps=1.0, throughput_tok_s=1.0, busy_s={},
        busy_source="-", imbalance=1.0, fleet_busy=0.5, per_worker_requests={}, wall_s=10.0,
        cpu={}, box_utilisation=0.3, window_s=10.0, answered_in_window=ok - 1,
        window_goodput_rps=goodput, slo_s=5.0,
    )  # fmt: skip


def _result(kv: list[float], peer: list[float], floor: float) -> matrix.CellResult:
    cell = matrix.Cell("c", "test", ())
    refs = report.References(0.9, [floor] * 5, 0.8, 1000)
    return matrix.CellResult(
        cell,
        10,
        refs,
        [
            matrix.RouterCell("kv", "kvgate kv", [_summary("kv", p, 0.80) for p in kv]),
            matrix.RouterCell("vllm_kv_aware", "peer", [_summary("peer", p, 0.805) for p in peer]),
            matrix.RouterCell("sglang_cache_aware", "other", [_summary("o", 9.0, 0.85)]),
        ],
    )


def test_cells_are_one_factor_variations_of_the_base() -> None:
    cells = matrix.all_cells()
    names = [c.name for c in cells]
    assert names[0] == "base" and len(set(names)) == len(names)
    base = compare_parser().parse_args(list(cells[0].argv))
    base_sim = sim_config(fleet_spec(base))
    for cell in cells[1:]:
        args = compare_parser().parse_args(list(cell.argv))
        sim = sim_config(fleet_spec(args))
        engine_changes = {
            f.name
            for f in dataclasses.fields(sim.engine)
            if getattr(sim.engine, f.name) != getattr(base_sim.engine, f.name)
        }
        fault_changes = sim.faults != base_sim.faults
        traffic = args.trace != base.trace or args.session_rate != base.session_rate
        fleet = sim.replicas != base_sim.replicas
        changed = len(engine_changes) + fault_changes + (traffic and not fleet) + fleet
        assert changed == 1, (cell.name, engine_changes, fault_changes, traffic, fleet)


def test_every_cell_loads_its_slice() -> None:
    for cell in matrix.all_cells():
        args = compare_parser().parse_args([*cell.argv, "--duration", "5"])
        if args.trace != "synthetic" and not Path(args.trace).is_file():
            pytest.skip("../shared/traces is not beside the repo")
        reqs, block = load_requests(args)
        assert reqs and block == 256, cell.name


def test_aims_read_medians_against_the_best_peer_and_the_floor() -> None:
    # kv median 1.0 vs the best peer's 1.5 (0.67x), hit 0.80 vs best peer 0.85 (-0.05),
    # floor 0.9 -> 1.11x
    met, missed = matrix._aims(_result([0.9, 1.0, 3.0], [1.5, 1.4, 2.0], 0.9))
    assert met == ["p99 0.67x best peer", "p99 1.11x floor"]
    assert missed == ["hit -0.050 vs best peer"]
    met, missed = matrix._aims(_result([2.0], [1.5], 1.0))
    assert "p99 1.33x best peer" in missed and "p99 2.00x floor" in missed


def test_a_peer_aim_below_the_floor_is_called_unattainable() -> None:
    """Every router's p99 is at least the floor's (each request's lowest possible TTFT): a
    best peer within 1.25x of the floor leaves no room for 0.8x of it."""
    met, missed = matrix._aims(_result([1.3], [1.2], 1.0))
    assert "p99 1.08x best peer (0.8x unattainable: best peer 1.20x floor)" in missed
    assert "p99 1.30x floor" in met
    _, missed = matrix._aims(_result([2.0], [1.5], 1.0))
    assert "p99 1.33x best peer" in missed  # 0.8 x 1.5 = 1.2 >= floor: attainable


def test_table_plot_and_resume(tmp_path: Path) -> None:
    results = [_result([0.9, 1.0, 3.0], [1.5, 1.4, 2.0], 0.9)]
    cfg = matrix.MatrixConfig(out=tmp_path, cells=[results[0].cell])
    table = matrix.write_matrix(results, cfg)
    lines = table.splitlines()
    assert len({line.count("|") for line in lines}) == 1  # header, rule and rows line up
    # p99 [range] / p50 / hit / goodput in the load window / answered in it
    assert "1.00 [0.90–3.00] / 0.25 / 0.800 / – / 9 (n=3)" in table
    assert "floor p50 / p99 s" in table and "| 0.90 / 0.90 |" in table
    assert (tmp_path / "matrix.png").stat().st_size > 0
    assert (tmp_path / "matrix.json").stat().st_size > 0
    # a run already on disk is read back, not run again
    run_dir = tmp_path / "r0" / "vllm-router_kv_aware"
    report.write_summary(run_dir / "summary.json", _summary("vllm-router kv_aware", 1.2, 0.7))
    compare = dataclasses.replace(_compare_config(tmp_path), out_dir=tmp_path / "r0")
    reused = matrix._run_or_reuse("vllm_kv_aware", [], compare, 0.9)
    assert reused is not None and reused.ttft_p99_s == 1.2


def _compare_config(out: Path) -> object:
    from kvgate.bench.args import compare_config  # noqa: PLC0415

    args = compare_parser().parse_args(["--trace", "synthetic"])
    return compare_config(args, 256, out, "t")


def test_quick_and_subset_options() -> None:
    args = build_parser().parse_args(["matrix", "--quick"])
    cfg = matrix.config_from_args(args, Path("/tmp/x"))
    assert [c.name for c in cfg.cells] == list(matrix.QUICK_CELLS)
    assert (cfg.repeats, cfg.duration_s) == (1, 12.0)
    args = build_parser().parse_args(["matrix", "--cells", "serial,base", "--repeats", "5"])
    cfg = matrix.config_from_args(args, Path("/tmp/x"))
    assert [c.name for c in cfg.cells] == ["serial", "base"] and cfg.repeats == 5
    assert cfg.duration_s == 40.0 and list(cfg.routers) == list(matrix.ROUTERS)
    with pytest.raises(SystemExit):
        matrix.config_from_args(build_parser().parse_args(["matrix", "--cells", "nope"]), Path())


def test_missing_runs_are_not_medians() -> None:
    rc = matrix.RouterCell("kv", "kv", [])
    assert math.isnan(rc.median("ttft_p99_s")) and not rc.complete


def test_the_baseline_router_needs_a_tree_and_is_labelled_apart(tmp_path: Path) -> None:
    """``kv_baseline`` (kvgate from another checkout, side by side) refuses to start without
    ``--baseline-tree`` instead of silently running this tree's kvgate under its name."""
    from kvgate.bench import compare  # noqa: PLC0415
    from kvgate.bench.args import compare_config  # noqa: PLC0415

    assert compare.router_label(compare.BASELINE_TREE) == "kvgate kv (baseline tree)"
    args = compare_parser().parse_args(["--trace", "synthetic", "--out", str(tmp_path)])
    config = compare_config(args, 16, tmp_path, "t")
    assert config.baseline_tree is None
    run = compare.RouterRun(compare.BASELINE_TREE, "kvgate kv (baseline tree)")
    with pytest.raises(RuntimeError, match="--baseline-tree"):
        compare._start_router(run, None, config, tmp_path)  # type: ignore[arg-type]


def test_a_variant_built_in_code_serves_kv_with_its_tuning(tmp_path: Path) -> None:
    """A variant of ``bench.variants`` (its scheduler built in code, not a user flag) runs
    ``python -m kvgate.bench.variants NAME`` with kvgate serve's flags, labelled apart from ``kv``;
    a flag variant runs ``kvgate serve`` with its flags."""
    from kvgate.bench import compare, variants  # noqa: PLC0415
    from kvgate.bench.args import compare_config  # noqa: PLC0415
    from kvgate.bench.fleet import FleetSpec, SimFleet, kvgate_serve_argv  # noqa: PLC0415
    from kvgate.router import serve  # noqa: PLC0415
    from kvgate.router.config import Settings, load_settings  # noqa: PLC0415
    from kvgate.router.flags import given_settings  # noqa: PLC0415

    assert compare.router_label("kv_nokvroom") == "kvgate kv nokvroom"
    assert not variants.TUNINGS["kv_nokvroom"].parts.room_wait
    args = compare_parser().parse_args(["--trace", "synthetic", "--out", str(tmp_path)])
    config = compare_config(args, 16, tmp_path, "t")
    fleet = SimFleet(FleetSpec(replicas=1), 9001, 5557, [])
    spec = compare.kvgate_spec(compare.RouterRun("kv_nokvroom", "x"), config)
    assert (spec.policy, spec.variant) == ("kv", "kv_nokvroom")
    argv = kvgate_serve_argv(spec, fleet, 8000)
    assert argv[1:4] == ["-m", "kvgate.bench.variants", "kv_nokvroom"]
    serve.build_parser().parse_args(argv[4:])  # the rest are kvgate serve's own flags
    busy = compare.kvgate_spec(compare.RouterRun("kv_busy16k", "y"), config)
    assert busy.variant is None
    flags = serve.build_parser().parse_args(list(busy.extra_args))
    chosen = load_settings(None, given_settings(flags, Settings))
    assert chosen.scheduling.max_pending_prefill_tokens == 16384


def test_engine_cells_name_their_engine_and_form_a_set() -> None:
    """The cells on engines we did not write: each parses as a compare slice, names its
    engine, and ``--cells engines`` picks them all; the default run stays the simulator's."""
    cells = matrix.engine_cells()
    assert matrix.cell_engines(cells) == ["vllm", "dynamo-mocker", "sglang"]
    assert matrix.cell_engines(matrix.all_cells()) == ["sim"] * len(matrix.all_cells())
    vllm = compare_parser().parse_args(list(cells[0].argv))
    spec = fleet_spec(vllm)
    assert (spec.engine, spec.replicas, spec.block_size % 32) == ("vllm", 2, 0)
    assert spec.capacity_blocks is not None and vllm.max_output_tokens == 128
    args = build_parser().parse_args(["matrix", "--cells", "engines,base", "--slo", "2"])
    cfg = matrix.config_from_args(args, Path("/tmp/x"))
    assert [c.name for c in cfg.cells] == ["vllm-cpu", "dynamo-mocker", "sglang-cpu", "base"]
    assert cfg.slo_s == 2.0
    default = matrix.config_from_args(build_parser().parse_args(["matrix"]), Path("/tmp/x"))
    assert {c.name for c in default.cells}.isdisjoint(matrix.CELL_SETS["engines"])
    assert {"smg_cache_aware", "dynamo_kv"} <= set(default.routers)


def test_goodput_aim_reads_the_load_window() -> None:
    result = _result([1.0], [1.5], 0.5)
    result.routers[0].runs = [_summary("kv", 1.0, 0.80, goodput=2.0)]
    result.routers[1].runs = [_summary("peer", 1.5, 0.805, goodput=2.5)]
    _met, missed = matrix._aims(result)
    assert "goodput 0.80x best peer" in missed


def test_measured_floor_is_marked_in_the_table(tmp_path: Path) -> None:
    result = _result([1.0], [1.5], 0.5)
    result.refs = report.References(0.9, [0.2, 0.4], None, None, "measured")
    table = matrix.cell_table([result])
    assert "0.30 / 0.40 (measured)" in table
