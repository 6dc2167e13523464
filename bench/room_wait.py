"""Which requests waited for KV room where they were sent, and what else was possible.

``kvgate bench room-wait RUN_DIR...`` reads the client's records of finished runs
(``records.jsonl``, as ``bench replay``, ``compare`` and ``overload`` write them) and
rebuilds, from the client's side alone, how many tokens each replica held over time:

* a request holds its prompt from the moment it was sent (queued in the engine or running,
  as kvgate's own prediction counts it) to its end, plus its output tokens, decoded at an
  even pace from its first token to its end. A request that waited in kvgate's queue was
  sent to its replica only when dispatched: where the run holds kvgate's access log (JSON
  format, as in ``bench tail``), its ``queued_ms`` is added to the client's send time;
* a request sent at ``t`` *lacks room* on a replica when the tokens held there by requests
  sent before it, plus its own prompt, exceed the capacity (``--capacity-blocks`` x
  ``--block-size``); its *room wait* there is the time until enough of them ended.

For every request that lacked room where it went, it reports its room wait on that replica,
on the replica that freed room first (hindsight: no router can know it when sending), and on
the replica a *residual-life* estimate picks: each running request's remaining decode is the
mean of (D - e) over the decode durations D > e of the requests that ended before, with e its
decode so far (requests not started yet release nothing). That estimate is the best a router
can do from what it observes; the report shows how far it gets between the router's choice
and hindsight. Cached blocks and the engines' own accounting are not modelled: the figures
compare choices, they do not replay an engine.
"""

from __future__ import annotations

import argparse
import json
import math
import statistics
from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from kvgate.bench.replay import request_id
from kvgate.bench.tail import queued_ms_of, read_access, read_records

NEVER = math.inf


@dataclass(frozen=True, slots=True)
class Served:
    """One answered request, in seconds of the run."""

    sent: float  # to its replica: the client's send, plus its wait in kvgate's queue
    first: float  # first token
    end: float
    prompt_tokens: int
    output_tokens: int
    worker: str

    def held(self, t: float) -> float:
        """Tokens it holds at time ``t`` (0 before it was sent and from its end on)."""
        if t < self.sent or t >= self.end:
            return 0.0
        if t < self.first:
            return float(self.prompt_tokens)
        return self.prompt_tokens + self.output_tokens * (t - self.first) / (self.end - self.first)


@dataclass(frozen=True, slots=True)
class RoomWait:
    """One request that lacked room where it was sent: its room waits, seconds."""

    prompt_tokens: int
    where_sent: float
    residual_life: float
    hindsight: float
    fits_nowhere: bool


def read_served(run_dir: Path) -> list[Served]:
    """The answered requests of one run directory's ``records.jsonl`` whose replica is known
    (kvgate names it in a response header; routers that do not leave nothing to read), each
    sent when it left kvgate's queue where the run's access log says it waited there."""
    access = read_access(run_dir)
    served = []
    for r in read_records(run_dir):
        times = (r.get("sent_s"), r.get("ttft_s"), r.get("e2e_s"))
        if r.get("status") != "ok" or None in times or not r.get("worker"):
            continue  # not answered, or no replica named (a router that does not say)
        sent = float(r["sent_s"])
        end = sent + max(float(r["e2e_s"]), float(r["ttft_s"]))
        served.append(
            Served(
                sent=sent + _queued_s(access.get(request_id(int(r["index"])))),
                first=sent + float(r["ttft_s"]),
                end=end,
                prompt_tokens=int(r["prompt_tokens"]),
                output_tokens=int(r["output_tokens"]),
                worker=str(r["worker"]),
            )
        )
    return sorted(served, key=lambda s: s.sent)


def _queued_s(line: dict[str, Any] | None) -> float:
    """Seconds the access-log ``line`` says the request waited in kvgate's queue (0: none)."""
    return max(queued_ms_of(line) or 0.0, 0.0) / 1000.0


def room_wait(holders: Sequence[Served], t0: float, need: int, capacity: int) -> float:
    """Seconds from ``t0`` until ``need`` tokens fit beside ``holders`` (by their real ends)."""
    for t in (t0, *sorted(h.end for h in holders)):
        if t >= t0 and sum(h.held(t) for h in holders) + need <= capacity:
            return t - t0
    return NEVER


def residual_life(decodes: Sequence[float], elapsed: float) -> float:
    """Mean remaining decode of a request that has decoded ``elapsed`` seconds, from the
    decode durations seen so far (``elapsed`` itself when none lasted longer)."""
    longer = [d for d in decodes if d > elapsed]
    return sum(longer) / len(longer) - elapsed if longer else elapsed


def estimated_wait(
    holders: Sequence[Served], t0: float, need: int, capacity: int, decodes: Sequence[float]
) -> float:
    """The room wait the residual-life estimate expects (requests not started: never end)."""
    releases = sorted(
        (residual_life(decodes, t0 - h.first) if h.first <= t0 else NEVER, h.held(t0))
        for h in holders
    )
    held = sum(tokens for _, tokens in releases)
    if held + need <= capacity:
        return 0.0
    for wait, tokens in releases:
        held -= tokens
        if held + need <= capacity:
            return wait
    return NEVER


def room_waits(served: Sequence[Served], capacity: int) -> list[RoomWait]:
    """Every request of one run that lacked room where it was sent."""
    workers = sorted({s.worker for s in served})
    out = []
    for i, x in enumerate(served):
        earlier = served[:i]
        holders = {w: [h for h in earlier if h.worker == w and h.end > x.sent] for w in workers}
        actual = {w: room_wait(hs, x.sent, x.prompt_tokens, capacity) for w, hs in holders.items()}
        if actual[x.worker] <= 0.0:
            continue
        decodes = [h.end - h.first for h in earlier if h.end <= x.sent]
        estimate = {
            w: estimated_wait(hs, x.sent, x.prompt_tokens, capacity, decodes)
            for w, hs in holders.items()
        }
        pick = min(workers, key=lambda w: (estimate[w], w != x.worker))
        out.append(
            RoomWait(
                prompt_tokens=x.prompt_tokens,
                where_sent=actual[x.worker],
                residual_life=actual[pick],
                hindsight=min(actual.values()),
                fits_nowhere=min(actual.values()) > 0.0,
            )
        )
    return out


def _summary(values: Iterable[float]) -> dict[str, float]:
    v = sorted(values)
    if not v:
        return {}
    summary = {
        "median": statistics.median(v),
        "mean": statistics.fmean(v),
        "p90": v[min(len(v) - 1, math.ceil(0.9 * len(v)) - 1)],
        "max": v[-1],
    }
    return {name: round(value, 3) for name, value in summary.items()}


def report(waits: Sequence[RoomWait], runs: int) -> dict[str, object]:
    """Counts and the three room waits' summaries (seconds)."""
    return {
        "runs": runs,
        "lacked_room_where_sent": len(waits),
        "fitting_nowhere": sum(w.fits_nowhere for w in waits),
        "where_sent": _summary(w.where_sent for w in waits),
        "residual_life_pick": _summary(w.residual_life for w in waits),
        "hindsight": _summary(w.hindsight for w in waits),
    }


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("runs", nargs="+", type=Path, help="directories holding records.jsonl")
    p.add_argument("--capacity-blocks", type=int, default=8000, help="one replica's KV blocks")
    p.add_argument("--block-size", type=int, default=16, help="tokens per KV block")


def main(args: argparse.Namespace) -> int:
    capacity = args.capacity_blocks * args.block_size
    waits = [w for run in args.runs for w in room_waits(read_served(run), capacity)]
    print(json.dumps(report(waits, len(args.runs)), indent=2))
    return 0
