"""Each worker's time to first token, learned online from what kvgate observes (pure: no
clock, no I/O; every time is passed in). It decides nothing: it shows each worker's
predicted TTFT in ``/debug/route`` and tracks its error (``kvgate_worker_ttft_*``).

The model (docs/scoring.md, "Predicted TTFT") is linear in what is known at dispatch::

    ttft = base                                  # network, engine front end, one step
         + prefill_s   * uncached / 1e3          # this request's own prefill: tokens
         + attention_s * own_pairs / 1e8         #   and attention (token x earlier token)
         + queued_s    * queued / 1e3            # prefill queued ahead of it: tokens
         + queued_attention_s * queued_pairs / 1e8   #   and attention
         + interference_s * (uncached + queued) / 1e3 * context / 1e5
                                                 # decode steps sharing the prefill's steps

``uncached`` is the request's uncached prompt tokens there and ``own_pairs`` the attention
pairs of their prefill (each new token attends to every token before it, cached or not);
``queued`` and ``queued_pairs`` are the same sums over the requests sent there that have no
first token yet; ``context`` is the tokens held by the worker's running requests (each decode
step reads them; a prefill spread over more steps reads them more often). A prefill's cost
is linear in its tokens plus quadratic in its context on every transformer engine; how much
of each, how fast, and how much queued work delays a newcomer (``queued_*`` against the own
coefficients: about equal when prefill is first come first served, less when an engine
schedules around a queue) are learned per worker, so a fast GPU, a slow CPU replica, a
chunked or a serial prefill each get their own.

Learning is recursive least squares with exponential forgetting (``window`` observations),
one small state per worker (6 coefficients, a 6 x 6 covariance), with

* a fleet-pooled model fed by every worker's observations: a new worker starts from it, and
  every worker's prediction is shrunk towards it while its own evidence is thin (and the
  fleet's towards the configured prior while the fleet's is);
* robustness: observations that are not finite, negative or implausibly large are refused;
  after a short warm-up an observation whose residual exceeds ``clip`` times the running
  median |residual| is down-weighted (Huber), so stalled requests cannot drag a rate;
  exported coefficients are projected into physical bounds and the covariance is capped at
  its prior (no wind-up on a feature that never varies, such as ``queued`` on an idle fleet).
"""

from __future__ import annotations

import math
from collections.abc import Iterator
from dataclasses import dataclass

from kvgate.index.types import WorkerId
from kvgate.scheduling.capacity import held_blocks
from kvgate.scoring.api import WorkerLoad
from kvgate.scoring.cost import queued_prefill_tokens

TOKENS_UNIT = 1000.0  # uncached and queued tokens enter the model in thousands
PAIRS_UNIT = 1e8  # attention pairs in hundreds of millions (a fresh 14k-token prompt: 1)
CONTEXT_UNIT = 100_000.0  # decode context enters the model in hundreds of thousands
MAX_TTFT_S = 3600.0  # an observation above this is refused, never learned from
MAX_TOKENS = 100_000_000  # token features above this are refused
MAX_PAIRS = 1e16  # pair features above this are refused
PRIOR_PREFILL_TOKENS_PER_S = 20_000.0
"""The prefill rate assumed for a fleet nothing was learned about yet (only the first few
requests use it: a worker joining a fleet starts from the fleet's learned model)."""
PRIOR_BASE_S = 0.02
"""The TTFT of an empty prompt on an idle worker, before anything is learned."""
PRIOR_WEIGHT = 10.0
"""Pseudo-observations of the fleet's pooled model in each worker's prediction."""
_N = 6  # base, prefill, attention, queued, queued attention, interference

# Physical bounds of the exported coefficients (seconds; per 1,000 tokens; per 1e8 pairs;
# per 1,000 tokens x 100k tokens of context): a prefill rate between 1 and 10 million
# tokens/s; queued tokens delay a newcomer by at most twice its own.
_MIN_PREFILL_S = 1e-4
_MAX_PREFILL_S = 1e3
_MAX_BASE_S = 60.0
_MAX_ATTENTION_S = 1e3
_MAX_INTERFERENCE_S = 10.0


def attention_pairs(uncached_tokens: float, prompt_tokens: float) -> float:
    """Attention pairs of prefilling the last ``uncached_tokens`` of a prompt: each attends
    to every token before it (``u * (p - u) + u * (u - 1) / 2``)."""
    u = max(min(uncached_tokens, prompt_tokens), 0.0)
    return u * (prompt_tokens - u) + u * (u - 1.0) / 2.0 if u >= 1.0 else 0.0


@dataclass(frozen=True, slots=True)
class TtftFeatures:
    """What is known about one request on one worker at dispatch."""

    uncached_tokens: float  # the request's prompt tokens not cached there
    own_pairs: float = 0.0  # their attention pairs (see attention_pairs)
    queued_tokens: float = 0.0  # uncached tokens of requests sent there, not yet started
    queued_pairs: float = 0.0  # and their attention pairs
    context_tokens: float = 0.0  # tokens held by the worker's running requests

    def valid(self) -> bool:
        tokens = (self.uncached_tokens, self.queued_tokens, self.context_tokens)
        pairs = (self.own_pairs, self.queued_pairs)
        return all(math.isfinite(v) and 0.0 <= v <= MAX_TOKENS for v in tokens) and all(
            math.isfinite(v) and 0.0 <= v <= MAX_PAIRS for v in pairs
        )

    def vector(self) -> tuple[float, ...]:
        work = (self.uncached_tokens + self.queued_tokens) / TOKENS_UNIT
        return (
            1.0,
            self.uncached_tokens / TOKENS_UNIT,
            self.own_pairs / PAIRS_UNIT,
            self.queued_tokens / TOKENS_UNIT,
            self.queued_pairs / PAIRS_UNIT,
            work * self.context_tokens / CONTEXT_UNIT,
        )


@dataclass(frozen=True, slots=True)
class TtftEstimate:
    """A predicted TTFT on one worker, in its parts (seconds)."""

    base_s: float
    queue_s: float  # waiting for the prefill queued ahead
    prefill_s: float  # the request's own uncached prefill (tokens and attention)
    interference_s: float  # decode steps of running requests sharing the prefill's steps

    @property
    def wait_s(self) -> float:
        """Predicted queue wait plus own prefill: what a router-side queue weighs."""
        return self.queue_s + self.prefill_s

    @property
    def total_s(self) -> float:
        return self.base_s + self.queue_s + self.prefill_s + self.interference_s


@dataclass(frozen=True, slots=True)
class TtftParams:
    """A worker's TTFT model coefficients (an immutable snapshot; see the module doc)."""

    base_s: float
    prefill_s: float  # per 1,000 uncached tokens
    queued_s: float  # per 1,000 queued tokens
    interference_s: float  # per 1,000 tokens of work x 100,000 tokens of context
    attention_s: float = 0.0  # per 1e8 attention pairs of the uncached tokens
    queued_attention_s: float = 0.0  # per 1e8 attention pairs of the queued tokens
    observations: float = 0.0  # effective (decayed) number of observations behind them

    @classmethod
    def prior(cls, prefill_tokens_per_s: float, base_s: float) -> TtftParams:
        """Before any observation: first-come-first-served prefill at the given rate
        (queued work delays a newcomer fully), attention and interference not yet known."""
        per_unit = TOKENS_UNIT / prefill_tokens_per_s
        return cls(base_s, per_unit, per_unit, 0.0)

    @property
    def prefill_tokens_per_s(self) -> float:
        """The linear part of the prefill rate (short contexts)."""
        return TOKENS_UNIT / self.prefill_s

    @property
    def queued_weight(self) -> float:
        """How much a queued token delays a newcomer, relative to one of its own."""
        return self.queued_s / self.prefill_s

    def coefficients(self) -> tuple[float, ...]:
        """In the order of ``TtftFeatures.vector``."""
        return (
            self.base_s,
            self.prefill_s,
            self.attention_s,
            self.queued_s,
            self.queued_attention_s,
            self.interference_s,
        )

    @classmethod
    def of(cls, values: tuple[float, ...], observations: float) -> TtftParams:
        base, prefill, attention, queued, queued_attention, interference = values
        return cls(base, prefill, queued, interference, attention, queued_attention, observations)

    def predict(self, features: TtftFeatures) -> TtftEstimate:
        f = features
        work = (f.uncached_tokens + f.queued_tokens) / TOKENS_UNIT
        return TtftEstimate(
            base_s=self.base_s,
            queue_s=self.queued_s * f.queued_tokens / TOKENS_UNIT
            + self.queued_attention_s * f.queued_pairs / PAIRS_UNIT,
            prefill_s=self.prefill_s * f.uncached_tokens / TOKENS_UNIT
            + self.attention_s * f.own_pairs / PAIRS_UNIT,
            interference_s=self.interference_s * work * f.context_tokens / CONTEXT_UNIT,
        )

    def blend(self, other: TtftParams, weight: float) -> TtftParams:
        """``weight`` of ``other`` and the rest of this one (0 <= weight <= 1)."""
        mine = 1.0 - weight
        a, b = self.coefficients(), other.coefficients()
        mixed = tuple(mine * x + weight * y for x, y in zip(a, b, strict=True))
        return TtftParams.of(mixed, self.observations)


def _project(theta: list[float]) -> tuple[float, ...]:
    """The coefficients clipped into their physical bounds."""
    prefill = min(max(theta[1], _MIN_PREFILL_S), _MAX_PREFILL_S)
    return (
        min(max(theta[0], 0.0), _MAX_BASE_S),
        prefill,
        min(max(theta[2], 0.0), _MAX_ATTENTION_S),
        min(max(theta[3], 0.0), 2.0 * prefill),
        min(max(theta[4], 0.0), _MAX_ATTENTION_S),
        min(max(theta[5], 0.0), _MAX_INTERFERENCE_S),
    )


_STATE_BOUND = 1e4
"""The learning state itself is the unconstrained least-squares estimate (projecting it
would bias the other coefficients whenever one sits on a bound, such as a queued weight of
0); only what it exports is projected. It is kept within +-_STATE_BOUND to stay finite."""


@dataclass(frozen=True, slots=True)
class LearningConfig:
    window: float = 200.0  # observations: forgetting factor 1 - 1/window
    warmup: int = 8  # first observations learned unclipped (the prior may be far off)
    clip: float = 2.0  # Huber limit in median |residual|s (about 1.35 sd for normal noise)
    # prior standard deviations of the coefficients (their units): weak enough that a
    # replica 200 times slower than the prior is learned within a few requests (early
    # swings are what the calibrator's shrinkage towards the prior is for)
    prior_sd: tuple[float, ...] = (5.0, 10.0, 10.0, 10.0, 10.0, 1.0)


class OnlineTtftModel:
    """Recursive least squares with forgetting, Huber clipping and bounded state."""

    __slots__ = ("_config", "_p", "_p_cap", "_scale", "n", "observations", "theta")

    def __init__(self, start: TtftParams, config: LearningConfig | None = None) -> None:
        self._config = config or LearningConfig()
        self.theta = list(start.coefficients())
        self._p_cap = [sd * sd for sd in self._config.prior_sd]
        self._p = [[self._p_cap[i] if i == j else 0.0 for j in range(_N)] for i in range(_N)]
        self._scale = 0.0  # running median |residual| (seconds)
        self.n = 0  # observations learned from
        self.observations = 0.0  # decayed count (at most ``window``)

    def params(self) -> TtftParams:
        return TtftParams.of(_project(self.theta), self.observations)

    def observe(self, features: TtftFeatures, ttft_s: float) -> bool:
        """Learn from one measured TTFT; False (state unchanged) when the input is refused."""
        if not (math.isfinite(ttft_s) and 0.0 < ttft_s <= MAX_TTFT_S and features.valid()):
            return False
        x = features.vector()
        p = self._p
        px = [sum(p[i][j] * x[j] for j in range(_N)) for i in range(_N)]
        spread = sum(x[i] * px[i] for i in range(_N))  # x'Px: how new this direction is
        predicted = sum(t * v for t, v in zip(self.theta, x, strict=True))
        residual = ttft_s - predicted
        weight = self._weight(residual, predicted)
        self._update(x, px, spread, residual, weight)
        return True

    def _weight(self, residual: float, predicted: float) -> float:
        """The observation's Huber weight: 1 within ``clip`` times the running median of
        |residual| (and during the warm-up), ``limit / |residual|`` beyond. A weight, not a
        clipped residual: the covariance shrinks only as much as the weight says, and in a
        direction the model knows little about (the first queue an idle fleet ever sees) a
        down-weighted observation still moves it nearly all the way, as news should.

        The median is tracked multiplicatively (5% up when above it, 5% down when below), so
        outliers, up to nearly half of the observations, barely move it, while a real change
        (a replica that slowed down) doubles it within ~15 requests."""
        cfg = self._config
        size = abs(residual)
        if self.n < cfg.warmup:
            self._scale += (size - self._scale) / (self.n + 1)
            return 1.0
        limit = cfg.clip * max(self._scale, 1e-3 + 0.002 * abs(predicted))
        self._scale = max(self._scale * (1.05 if size > self._scale else 0.95), 1e-6)
        return 1.0 if size <= limit else limit / size

    def _update(
        self, x: tuple[float, ...], px: list[float], spread: float, residual: float, weight: float
    ) -> None:
        """Weighted recursive least squares with forgetting factor ``1 - 1/window``."""
        lam = 1.0 - 1.0 / self._config.window
        p = self._p
        denom = lam + weight * spread
        gain = [weight * v / denom for v in px]
        for i in range(_N):
            value = self.theta[i] + gain[i] * residual
            self.theta[i] = min(max(value, -_STATE_BOUND), _STATE_BOUND)
        for i in range(_N):
            for j in range(_N):
                p[i][j] = (p[i][j] - gain[i] * px[j]) / lam
        self._cap_covariance()
        self.n += 1
        self.observations = lam * self.observations + 1.0

    def _cap_covariance(self) -> None:
        """Scale rows and columns whose variance grew past the prior (a congruence with a
        diagonal matrix: the covariance stays symmetric positive semi-definite)."""
        p = self._p
        for i in range(_N):
            p[i][i] = max(p[i][i], 0.0)
            if p[i][i] > self._p_cap[i]:
                f = math.sqrt(self._p_cap[i] / p[i][i])
                for j in range(_N):
                    p[i][j] *= f
                    p[j][i] *= f
        for i in range(_N):
            for j in range(i + 1, _N):
                mean = 0.5 * (p[i][j] + p[j][i])
                p[i][j] = p[j][i] = mean


@dataclass(slots=True)
class CalibrationError:
    """Running prediction error of one worker (seconds; exponentially weighted)."""

    count: int = 0
    mean_abs_s: float = 0.0
    bias_s: float = 0.0  # measured - predicted: > 0 when the model is optimistic

    def add(self, predicted_s: float, measured_s: float, alpha: float = 0.05) -> None:
        error = measured_s - predicted_s
        self.count += 1
        rate = max(alpha, 1.0 / self.count)
        self.mean_abs_s += rate * (abs(error) - self.mean_abs_s)
        self.bias_s += rate * (error - self.bias_s)


class TtftCalibrator:
    """Per-worker TTFT models plus a fleet-pooled one (bounded: ``max_workers`` states)."""

    def __init__(
        self,
        prior: TtftParams,
        *,
        prior_weight: float = 10.0,
        max_workers: int = 4096,
        learning: LearningConfig | None = None,
    ) -> None:
        self._learning = learning or LearningConfig()
        self._prior = prior
        self._prior_weight = prior_weight
        self._max_workers = max_workers
        self.fleet = OnlineTtftModel(prior, self._learning)
        self._models: dict[WorkerId, OnlineTtftModel] = {}
        self._errors: dict[WorkerId, CalibrationError] = {}
        self._params: dict[WorkerId, TtftParams] = {}

    def params(self, worker: WorkerId) -> TtftParams:
        """The worker's coefficients, shrunk towards the fleet's while its evidence is thin:
        ``n / (n + prior_weight)`` of its own and the rest of the fleet's (``n``: its decayed
        observation count)."""
        cached = self._params.get(worker)
        if cached is not None:
            return cached
        fleet = self._fleet_params()
        model = self._models.get(worker)
        if model is None:
            return fleet
        own = model.params()
        params = own.blend(fleet, self._prior_weight / (own.observations + self._prior_weight))
        self._params[worker] = params
        return params

    def _fleet_params(self) -> TtftParams:
        """The pooled model, itself shrunk towards the configured prior while the whole
        fleet's evidence is thin (a cold fleet's first few requests)."""
        fleet = self.fleet.params()
        weight = self._prior_weight / (fleet.observations + self._prior_weight)
        return fleet.blend(self._prior, weight) if weight > 0.0 else fleet

    def observe(self, worker: WorkerId, features: TtftFeatures, ttft_s: float) -> bool:
        """One measured TTFT of a request sent to ``worker``; False if refused."""
        model = self._models.get(worker)
        if model is None:
            if len(self._models) >= self._max_workers:
                return False
            model = self._models[worker] = OnlineTtftModel(self._fleet_params(), self._learning)
        if not model.observe(features, ttft_s):
            return False
        self.fleet.observe(features, ttft_s)
        self._params.clear()  # the fleet moved: every shrunk snapshot is stale
        return True

    def record_error(self, worker: WorkerId, predicted_s: float, measured_s: float) -> None:
        if not (math.isfinite(predicted_s) and math.isfinite(measured_s)):
            return
        error = self._errors.get(worker)
        if error is None:
            if len(self._errors) >= self._max_workers:
                return
            error = self._errors[worker] = CalibrationError()
        error.add(predicted_s, measured_s)

    def error(self, worker: WorkerId) -> CalibrationError | None:
        return self._errors.get(worker)

    def forget(self, worker: WorkerId) -> None:
        """A removed worker's state goes (the fleet model keeps what it learned)."""
        self._models.pop(worker, None)
        self._errors.pop(worker, None)
        self._params.pop(worker, None)

    def workers(self) -> Iterator[WorkerId]:
        return iter(list(self._models))


class BusyShare:
    """The exponentially weighted share of time a condition held (``half_life_s``): a
    worker's prefill utilisation, from the moments its first waiting request was sent and
    its last one started. Times are passed in (monotonic seconds)."""

    __slots__ = ("_busy", "_decay", "_share", "_since")

    def __init__(self, half_life_s: float, now: float) -> None:
        self._decay = math.log(2.0) / half_life_s
        self._share = 0.0
        self._since = now
        self._busy = False

    def at(self, now: float) -> float:
        """The share at ``now`` (0..1)."""
        target = 1.0 if self._busy else 0.0
        elapsed = max(now - self._since, 0.0)
        return target + (self._share - target) * math.exp(-self._decay * elapsed)

    def set(self, now: float, busy: bool) -> None:
        """The condition holds (or not) from ``now`` on."""
        self._share = self.at(now)
        self._since = max(now, self._since)
        self._busy = busy


DEFAULT_TTFT = TtftParams.prior(PRIOR_PREFILL_TOKENS_PER_S, PRIOR_BASE_S)
"""The TTFT model of a worker nothing was learned about yet."""


def ttft_features(
    load: WorkerLoad,
    uncached_tokens: float,
    prompt_tokens: float,
    block_size: int,
    capacity: int | None,
) -> TtftFeatures:
    """The TTFT model's inputs for a request of ``prompt_tokens`` with ``uncached_tokens`` to
    prefill on a worker with ``load`` (``capacity``: its KV blocks, if known): the one
    definition shared by the ledger (at dispatch) and ``/debug/route``."""
    predicted, scraped = queued_prefill_tokens(load.pending_prefill_tokens, load.scraped_waiting)
    queued = predicted if scraped is None else max(predicted, scraped)
    held, held_scraped = held_blocks(load, capacity)
    context = (held if held_scraped is None else max(held, held_scraped)) * block_size
    uncached = max(uncached_tokens, 0.0)
    return TtftFeatures(
        uncached,
        attention_pairs(uncached, max(prompt_tokens, uncached)),
        queued,
        _queued_pairs(load, queued, predicted),
        context,
    )


def _queued_pairs(load: WorkerLoad, queued: float, predicted: float) -> float:
    """Attention pairs of the queued prefill: kvgate's own, scaled up when the scrape sees
    more queued tokens than kvgate sent (other traffic, assumed alike)."""
    pairs = max(load.pending_prefill_pairs, 0.0)
    if predicted > 0.0 and queued > predicted:
        return pairs * queued / predicted
    return pairs


def ttft_terms(ttft: TtftEstimate, params: TtftParams) -> dict[str, float]:
    """The predicted TTFT, its parts and the model behind it, as named terms."""
    return {
        "ttft_s": ttft.total_s,
        "ttft_base_s": ttft.base_s,
        "ttft_queue_s": ttft.queue_s,
        "ttft_prefill_s": ttft.prefill_s,
        "ttft_interference_s": ttft.interference_s,
        "prefill_tokens_per_s": params.prefill_tokens_per_s,
        "queued_weight": params.queued_weight,
        "model_observations": params.observations,
    }
