"""kvgate variants a benchmark compares with the defaults: code that builds the scheduler
with other internal constants (``scheduling.config.Tuning``: its parts, the queue's dispatch
order and patience), never a flag every user inherits.

    python -m kvgate.bench.variants NAME [kvgate serve flags...]

runs ``kvgate serve`` with variant NAME's tuning (``bench compare --routers kv_nokvroom``
starts it this way).
"""

from __future__ import annotations

import sys
from collections.abc import Mapping
from dataclasses import replace
from types import MappingProxyType

from kvgate.router import serve
from kvgate.scheduling.capacity import KV_FIT
from kvgate.scheduling.config import Tuning
from kvgate.scheduling.dispatch_order import OrderConfig
from kvgate.scheduling.guard import GuardConfig

TUNINGS: Mapping[str, Tuning] = MappingProxyType(
    {
        # the KV room rule and answers' blocks on (the defaults before issue 46)
        "kv_fit": Tuning(parts=KV_FIT),
        # with them: the queue does not wait for KV room where none has it
        "kv_nokvroom": Tuning(parts=replace(KV_FIT, room_wait=False)),
        # with them: a request waiting for KV room does not hold the worker it waits for
        "kv_noroomhold": Tuning(parts=replace(KV_FIT, room_hold=False)),
        # plain overlap versus load (with --no-queue-enabled): the default parts, no queue
        "kv_plain": Tuning(),
        # the queue first come first served (aging so fast that work never counts)
        "kv_fifo": Tuning(order=OrderConfig(aging_tokens_per_s=1e9)),
        # the dispatch order's aging at 4,096 and 16,384 tokens/s (65,536: the default)
        "kv_age4k": Tuning(order=OrderConfig(aging_tokens_per_s=4096.0)),
        "kv_age16k": Tuning(order=OrderConfig(aging_tokens_per_s=16384.0)),
        # the wait for KV room at half and at a thirtieth of the wait limit (a tenth: default)
        "kv_kvroom_p50": Tuning(room_patience=0.5),
        "kv_kvroom_p03": Tuning(room_patience=0.033),
        # the do-no-harm guard off: every mechanism stays on whatever its moves cost
        "kv_noguard": Tuning(guard=GuardConfig(enabled=False)),
    }
)
"""Variant name -> the scheduler's tuning."""


def main(argv: list[str] | None = None) -> int:
    args = list(sys.argv[1:] if argv is None else argv)
    if not args or args[0] not in TUNINGS:
        print(f"usage: python -m kvgate.bench.variants {{{','.join(TUNINGS)}}} [serve flags]")
        return 2
    return serve.main(args[1:], tuning=TUNINGS[args[0]])


if __name__ == "__main__":
    raise SystemExit(main())
