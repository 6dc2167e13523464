"""How long one engine step takes (see ``TimingConfig`` and docs/simulator.md)."""

from __future__ import annotations

from dataclasses import dataclass

from kvgate.backends.sim.config import TimingConfig


@dataclass(slots=True)
class StepWork:
    """The work one engine step does, as the timing model sees it."""

    tokens: int = 0
    """Tokens through the model: prefill chunks plus one per decoding sequence."""
    prefill_tokens: int = 0
    """Of ``tokens``, those of prefill chunks (what a prefill slowdown multiplies)."""
    prefill_pairs: int = 0
    """Sum over prefill tokens of the tokens before them in their sequence."""
    decode_context: int = 0
    """Sum over decoding sequences of their cached context length."""
    cpu_loaded_tokens: int = 0
    """Tokens brought back from the CPU tier this step."""


def step_seconds(
    work: StepWork, timing: TimingConfig, slowdown: float = 1.0, prefill_slowdown: float = 1.0
) -> float:
    """Wall seconds of one step: the modelled time times ``slowdown``, over ``speedup``.

    ``prefill_slowdown`` multiplies the prefill share only (its tokens' compute and its
    attention pairs): a replica slow at prefill and normal at decode.
    """
    tokens = work.tokens + work.prefill_tokens * (prefill_slowdown - 1.0)
    compute_us = max(timing.step_floor_ms * 1000.0, tokens * timing.token_us)
    attention_us = (
        work.prefill_pairs * timing.prefill_attn_ns * prefill_slowdown
        + work.decode_context * timing.decode_kv_ns
    ) / 1000.0
    load_us = work.cpu_loaded_tokens * timing.cpu_load_us_per_token
    return (compute_us + attention_us + load_us) * 1e-6 * slowdown / timing.speedup


def prefill_pairs(start: int, n: int) -> int:
    """Sum of ``start .. start + n - 1``: attention pairs of a chunk of ``n`` tokens."""
    return n * start + n * (n - 1) // 2
