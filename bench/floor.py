"""The TTFT floor of a slice on an engine we did not write, measured.

On the simulator the floor is computed from its timing model (``bench.oracle.ttft_floor``).
Other engines have no model we could trust, so after two warm-up requests each request of
the slice is sent alone, in arrival order, to one idle replica of a fleet started for this:
first its prefix as the oracle caches it (the whole trace blocks one infinite cache would
hold for it, one output token), then the request itself with one output token, timed as the
replay times it (the first streamed text). That is the request's best case: no queue, no
batch, its reusable prefix cached. It is measured once, on the same shared box as the runs,
so one slow sample can stand out: ``lowest`` lowers each request's value to the lowest TTFT
it had in any run of the cell (no run can beat a request's true floor, so that is still a
floor, and every router's p99 is at least the floor's). The idle values are kept in
``ttft_floor.json`` beside the cell's results (a resumed cell reads them back).
"""

from __future__ import annotations

import asyncio
import dataclasses
import json
import sys
import tempfile
import time
from collections.abc import Sequence
from pathlib import Path

import httpx

from kvgate.bench.engines import start_bench_fleet
from kvgate.bench.fleet import FleetSpec
from kvgate.bench.oracle import OracleResult
from kvgate.bench.replay import ReplayConfig, RequestRecord, send_one
from kvgate.bench.traces import TraceRequest

FLOOR_FILE = "ttft_floor.json"


def _alone(r: TraceRequest, input_length: int, hash_ids: Sequence[int]) -> TraceRequest:
    return TraceRequest(r.index, 0.0, input_length, 1, tuple(hash_ids), None)


async def _ttft(client: httpx.AsyncClient, r: TraceRequest, cfg: ReplayConfig) -> float | None:
    rec = RequestRecord(r.index, None, 0.0, r.input_length, 1)
    await send_one(client, r, rec, cfg, time.perf_counter())
    return rec.ttft_s if rec.status == "ok" else None


WARM_UP = TraceRequest(-1, 0.0, 3, 1, (0,), None)
"""Shorter than any KV block: it leaves nothing cached."""


async def measure(
    url: str,
    chosen: Sequence[TraceRequest],
    orc: OracleResult,
    block_tokens: int,
    model: str,
) -> dict[int, float]:
    """Each request's TTFT (by its index) alone on the replica at ``url`` with its oracle
    prefix cached (requests that fail are left out)."""
    cfg = ReplayConfig(target=url, model=model, block_tokens=block_tokens, send_session=False)
    ordered = sorted(chosen, key=lambda q: (q.arrival_s, q.index))
    out: dict[int, float] = {}
    async with httpx.AsyncClient(timeout=httpx.Timeout(300.0, connect=10.0)) as client:
        for _ in range(2):  # lazy start-up work (tokenizer, connections) is not a floor
            await _ttft(client, WARM_UP, cfg)
        for r, (_prompt, hit) in zip(ordered, orc.per_request, strict=True):
            blocks = min(hit // block_tokens, len(r.hash_ids))
            if blocks:
                await _ttft(client, _alone(r, blocks * block_tokens, r.hash_ids[:blocks]), cfg)
            ttft = await _ttft(client, _alone(r, r.input_length, r.hash_ids), cfg)
            if ttft is not None:
                out[r.index] = ttft
    return out


def read_floor(floor_dir: Path, requests: int) -> dict[int, float] | None:
    """The idle floor measured before for a slice of ``requests`` requests, if any."""
    path = floor_dir / FLOOR_FILE
    if not path.is_file():
        return None
    data = json.loads(path.read_text())
    values = data.get("ttft_s")
    if data.get("requests") != requests or not isinstance(values, dict):
        return None
    return {int(k): float(v) for k, v in values.items()}


def lowest(idle: dict[int, float], records: Sequence[Path]) -> list[float]:
    """Per request, the lower of its idle floor and the lowest TTFT any run gave it (the
    runs' ``records.jsonl``), in index order."""
    best = dict(idle)
    for path in records:
        with path.open(encoding="utf-8") as fh:
            for line in fh:
                rec = json.loads(line)
                ttft = rec.get("ttft_s")
                if rec.get("status") == "ok" and isinstance(ttft, float | int):
                    index = int(rec["index"])
                    best[index] = min(best.get(index, float(ttft)), float(ttft))
    return [best[i] for i in sorted(best)]


def measured_floor(
    chosen: Sequence[TraceRequest],
    orc: OracleResult,
    spec: FleetSpec,
    block_tokens: int,
    floor_dir: Path | None,
    replay_cfg: ReplayConfig | None,
) -> dict[int, float]:
    """The slice's idle floor on ``spec``'s engine: read from ``floor_dir`` if measured
    before, else measured on one replica of that engine started for it (and written there)."""
    if floor_dir is not None and (known := read_floor(floor_dir, len(chosen))) is not None:
        return known
    path = floor_dir / FLOOR_FILE if floor_dir is not None else None
    model = replay_cfg.model if replay_cfg is not None else "kvgate-sim"
    logs = (floor_dir or Path(tempfile.mkdtemp(prefix="kvgate-floor-"))) / "floor-logs"
    print(f"measuring the TTFT floor of {len(chosen)} requests on {spec.engine}", file=sys.stderr)
    fleet = start_bench_fleet(dataclasses.replace(spec, replicas=1), logs)
    try:
        floor = asyncio.run(measure(fleet.urls[0], chosen, orc, block_tokens, model))
    finally:
        fleet.stop()
    if path is not None:
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(json.dumps({"requests": len(chosen), "ttft_s": floor}) + "\n")
    return floor
