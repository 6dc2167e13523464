"""Policy factory: ``make_policy(name)`` builds a fresh policy instance by name."""

from __future__ import annotations

import random

from kvgate.scoring.api import Policy
from kvgate.scoring.baselines import (
    LeastLoadedPolicy,
    RandomPolicy,
    RoundRobinPolicy,
    SessionPolicy,
)
from kvgate.scoring.config import KvPolicyConfig
from kvgate.scoring.kv import KvPolicy

POLICY_NAMES: tuple[str, ...] = ("kv", "round_robin", "random", "least_loaded", "session")
"""Every policy ``make_policy`` knows; ``kv`` is cache-aware, the others are baselines."""


def make_policy(
    name: str,
    *,
    seed: int | None = None,
    rng: random.Random | None = None,
    kv_config: KvPolicyConfig | None = None,
    kv_capacity_blocks: int | None = None,
) -> Policy:
    """A new policy named ``name``.

    ``rng`` (else a ``random.Random(seed)``) feeds randomised choices; ``kv_config`` holds the
    ``kv`` policy's knobs and ``kv_capacity_blocks`` a configured KV capacity it prices decode
    load with (``scheduling.kv_capacity_blocks``).
    """
    if rng is None:
        rng = random.Random(seed)
    match name:
        case "kv":
            config = kv_config if kv_config is not None else KvPolicyConfig()
            return KvPolicy(config, rng, kv_capacity_blocks=kv_capacity_blocks)
        case "round_robin":
            return RoundRobinPolicy()
        case "random":
            return RandomPolicy(rng)
        case "least_loaded":
            return LeastLoadedPolicy()
        case "session":
            return SessionPolicy()
    raise ValueError(f"unknown policy {name!r}; choose one of: {', '.join(POLICY_NAMES)}")
