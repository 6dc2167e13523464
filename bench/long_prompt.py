"""Time to first token of long fresh prompts through kvgate against the same replica directly.

    kvgate serve --sim 1 --port 8000 &          # one simulated replica on 127.0.0.1:9001
    python -m kvgate.bench.long_prompt --words 26000 --requests 8
    python -m kvgate.bench.long_prompt --words 20000 --requests 5 --grow

Each request is a streaming ``/v1/completions`` of fresh simulator words (one token each),
sent alternately to kvgate and to the replica after one uncounted warm-up request each,
each side with its own text (so that neither finds the other's prompt cached); ``--grow``
makes each side's prompt its previous prompt plus the fresh words (an agent history that
grows by a long tool output per turn). Prints the median and the largest TTFT of each side:
their difference is what kvgate adds on the way to the first token for such prompts.
Sequential, loopback only, bounded in count.
"""

from __future__ import annotations

import argparse
import asyncio
import random
import statistics
import sys
import time

import httpx

from kvgate.backends.sim.vocab import GENERATED_WORDS, generated_word


async def _ttft(client: httpx.AsyncClient, url: str, model: str, text: str) -> float:
    body = {"model": model, "prompt": text, "max_tokens": 1, "stream": True}
    started = time.perf_counter()
    async with client.stream("POST", f"{url}/v1/completions", json=body) as reply:
        reply.raise_for_status()
        async for _ in reply.aiter_bytes():
            break
    return time.perf_counter() - started


async def run(args: argparse.Namespace) -> dict[str, list[float]]:
    rng = random.Random(args.seed)
    sides = {"direct": args.direct, "kvgate": args.kvgate}
    prompts = dict.fromkeys(sides, "")
    ttfts: dict[str, list[float]] = {side: [] for side in sides}
    async with httpx.AsyncClient(timeout=args.timeout, trust_env=False) as client:
        model = (await client.get(f"{args.kvgate}/v1/models")).json()["data"][0]["id"]
        for number in range(-1, args.requests):  # one warm-up request per side (tokenizer load)
            for side, url in sides.items():
                fresh = " ".join(
                    generated_word(rng.randrange(GENERATED_WORDS)) for _ in range(args.words)
                )
                text = f"{prompts[side]} {fresh}" if args.grow and prompts[side] else fresh
                ttft = await _ttft(client, url, model, text)
                if number >= 0:
                    ttfts[side].append(ttft)
                prompts[side] = text
    return ttfts


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m kvgate.bench.long_prompt", description=__doc__)
    parser.add_argument("--kvgate", default="http://127.0.0.1:8000")
    parser.add_argument("--direct", default="http://127.0.0.1:9001")
    parser.add_argument("--words", type=int, default=26_000)
    parser.add_argument("--requests", type=int, default=8, help="per side, 1-100")
    parser.add_argument("--grow", action="store_true")
    parser.add_argument("--seed", type=int, default=1)
    parser.add_argument("--timeout", type=float, default=120.0)
    args = parser.parse_args(argv)
    if not 1 <= args.requests <= 100:
        parser.error("--requests must be within 1-100")
    ttfts = asyncio.run(run(args))
    for side, values in ttfts.items():
        print(f"{side}: TTFT median {statistics.median(values) * 1e3:.1f} ms, "
              f"max {max(values) * 1e3:.1f} ms ({len(values)} requests)")  # fmt: skip
    gap = statistics.median(ttfts["kvgate"]) - statistics.median(ttfts["direct"])
    print(f"kvgate - direct (medians): {gap * 1e3:+.1f} ms")
    return 0


if __name__ == "__main__":
    sys.exit(main())
