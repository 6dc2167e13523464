"""A prompt's block keys, by the best way available for its model (``PromptKeys.mode``):

* ``token_ids``: a completion prompt given as token ids is used as is;
* ``tokenizer``: the model's configured tokenizer and chat template (``ModelTokenizer``,
  loaded once per model, off the event loop);
* ``engine``: the engine's renderer or ``POST /tokenize`` (index/keys/_engine.py), remembered
  per rendered request (index/keys/_render.py); also the first choice for a model whose local
  template disagreed with an engine's at the self-check (``check_template``);
* ``approx``: the rendered text hashed in fixed character chunks (no tokens).

Each keying is counted by model and mode, and timed.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Callable, Iterable, Sequence
from dataclasses import replace

import httpx
from prometheus_client import Counter, Histogram

from kvgate.index.api import EngineWorker, PromptInput, PromptKeys, TokenizeMode, TokenizeOn
from kvgate.index.config import IndexConfig
from kvgate.index.errors import TokenizeError
from kvgate.index.keys._blocks import block_keys, text_block_keys
from kvgate.index.keys._engine import (
    RenderState,
    engine_tokens,
    render_body,
    tokenizing_engines,
)
from kvgate.index.keys._render import PROBES, RenderedPrompts, first_difference, render_digest
from kvgate.index.keys._tokenize import ModelTokenizer, Reach, plain_render, prompt_seed
from kvgate.index.memo import BoundedMemo
from kvgate.index.metrics import IndexMetrics
from kvgate.index.types import BlockKey

log = logging.getLogger(__name__)

_TEXT_OR_NONE = (str, type(None))
_MAX_CACHED_LABELS = 4096  # labelled metric children kept at hand (models x modes)
_MAX_CACHED_SEEDS = 4096  # (LoRA name, cache salt) -> chain seed
_MAX_CHECKED_MODELS = 4096  # models whose template was checked against an engine


class PromptKeyer:
    """Prompt → block keys for every model (``keys_for``), with its tokenizers."""

    def __init__(
        self,
        config: IndexConfig,
        metrics: IndexMetrics,
        http: httpx.AsyncClient,
        workers: Callable[[], Iterable[EngineWorker]],
        *,
        block_size_for: Callable[[str], int] | None = None,
        reach: Reach | None = None,
    ) -> None:
        """``workers``: the fleet now, asked for the engine ``/tokenize`` fallback;
        ``block_size_for``: a model's block size (default: the configured one); ``reach``:
        how far some worker's cache holds a prefix of keys (a long new prompt is tokenized
        only that far, ``ModelTokenizer.tokenize``)."""
        self._config = config
        self._block_size_for = block_size_for or config.block_size_for
        self._reach = reach
        self._metrics = metrics
        self._http = http
        self._workers = workers
        self.tokenizers: dict[str, ModelTokenizer | None] = {}
        self._tokenizer_locks: dict[str, asyncio.Lock] = {}
        self._counters = BoundedMemo[tuple[str, str], tuple[Counter, Histogram]](_MAX_CACHED_LABELS)
        self._cache_counters = BoundedMemo[tuple[str, bool], Counter](_MAX_CACHED_LABELS)
        self._seeds = BoundedMemo[tuple[str | None, str | None], int](_MAX_CACHED_SEEDS)
        self.render = RenderState()
        self.rendered = RenderedPrompts()
        # per model checked: True when its local template disagrees with the engine's
        self.mismatched = BoundedMemo[str, bool](_MAX_CHECKED_MODELS)
        self._checks: set[asyncio.Task[None]] = set()

    async def keys_for(
        self, model: str, prompt: PromptInput, *, tokenize_on: TokenizeOn | None = None
    ) -> PromptKeys:
        """``tokenize_on``: the workers whose ``/tokenize`` may see the prompt, the likeliest
        destination first (None: any worker serving the model)."""
        started = time.perf_counter()
        keys = await self._keys_for(model, prompt, tokenize_on)
        counters = self._counters.get((model, keys.mode))
        if counters is None:
            counters = self._counters.put(
                (model, keys.mode),
                (
                    self._metrics.tokenize.labels(model, keys.mode),
                    self._metrics.tokenize_seconds.labels(keys.mode),
                ),
            )
        counters[0].inc()
        counters[1].observe(time.perf_counter() - started)
        return keys

    async def _keys_for(
        self, model: str, prompt: PromptInput, tokenize_on: TokenizeOn | None
    ) -> PromptKeys:
        block_size = self._block_size_for(model)
        seed = self._seed(prompt)
        completion = prompt.kind == "completion"
        if completion and not isinstance(prompt.prompt, _TEXT_OR_NONE):
            given = prompt.prompt
            ids = given if isinstance(given, list) else list(given)
            return _keys(block_keys(ids, block_size, seed), block_size, len(ids), "token_ids")
        tokenizer = self.tokenizers.get(model)
        if tokenizer is None and model not in self.tokenizers:
            tokenizer = await self._tokenizer(model)
        engine_first = self._config.engine_tokenize and self.mismatched.get(model) is True
        if engine_first:  # the engines render it otherwise than the local template
            keyed = await self._engine_keys(model, prompt, tokenize_on, block_size, seed)
            if keyed is not None:
                return keyed
        if tokenizer is not None and (completion or tokenizer.template):
            try:
                text = (prompt.prompt or "") if completion else tokenizer.render(prompt)
                special = (
                    completion if prompt.add_special_tokens is None else prompt.add_special_tokens
                )
                result = await tokenizer.tokenize(
                    str(text),
                    add_special_tokens=special,
                    block_size=block_size,
                    seed=seed,
                    reach=self._reach,
                    defer=True,
                )
            except TokenizeError as error:
                log.info("%s: tokenizer failed (%s): approximate keys", model, error)
            else:
                self._count_cache(model, result.cache_hit)
                found = _keys(result.keys, block_size, result.token_count, "tokenizer")
                return replace(found, finish=result.complete) if result.complete else found
        if self._config.engine_tokenize and not engine_first:
            keyed = await self._engine_keys(model, prompt, tokenize_on, block_size, seed)
            if keyed is not None:
                return keyed
        text = plain_render(prompt)
        keys = text_block_keys(text, self._config.approx_chars_per_block, seed)
        return _keys(keys, block_size, len(text) // 4, "approx")

    async def _engine_keys(
        self,
        model: str,
        prompt: PromptInput,
        tokenize_on: TokenizeOn | None,
        block_size: int,
        seed: int,
    ) -> PromptKeys | None:
        """The prompt keyed by the engines' ``/tokenize``: by each engine kind among the
        workers that may serve it (at once), the likeliest worker's kind first; None when
        none answered."""
        workers = self._tokenizers_of(tokenize_on)
        kinds = tokenizing_engines(workers, model)
        answers = await asyncio.gather(
            *(
                self._engine_tokens(kind, [w for w in workers if w.engine == kind], model, prompt)
                for kind in kinds
            )
        )
        found = [(kind, ids) for kind, ids in zip(kinds, answers, strict=True) if ids is not None]
        if not found:
            return None
        engine, ids = found[0]
        others = {
            kind: block_keys(other, block_size, seed) if other is not None else ()
            for kind, other in zip(kinds, answers, strict=True)
            if kind != engine and other != ids
        }
        keys = block_keys(ids, block_size, seed)
        return PromptKeys(keys, block_size, len(ids), "engine", engine=engine, other_engines=others)

    async def _engine_tokens(
        self, kind: str, workers: list[EngineWorker], model: str, prompt: PromptInput
    ) -> list[int] | None:
        """The engines' tokens of a prompt, by kind: as rendered before, else asked."""
        digest = render_digest(kind, model, render_body(model, prompt))
        ids = self.rendered.get(digest)
        if ids is not None:
            return ids
        timeout_s = self._config.engine_tokenize_timeout_s
        ids = await engine_tokens(
            self._http, workers, model, prompt, timeout_s=timeout_s, render=self.render
        )
        if ids is not None:
            self.rendered.put(digest, ids)
        return ids

    def check_template(self, model: str, worker: EngineWorker) -> None:
        """Once per model with a local tokenizer and template (and engine tokenization on): in
        the background, render the probe prompts locally and by ``worker`` (one serving
        ``model``) and compare; the verdict goes to ``kvgate_tokenizer_mismatch{model}`` and,
        on a difference, the log."""
        config = self._config
        if not config.engine_tokenize or config.tokenizer_dir(model) is None:
            return  # nothing sent to engines to be tokenized; no local template
        if self.mismatched.get(model) is not None:
            return
        try:
            loop = asyncio.get_running_loop()
        except RuntimeError:  # told before the event loop runs: checked when it is told again
            return
        self.mismatched.put(model, False)  # checked (or being checked) once
        task = loop.create_task(self._check_template(model, worker))
        self._checks.add(task)
        task.add_done_callback(self._check_done)

    def _check_done(self, task: asyncio.Task[None]) -> None:
        self._checks.discard(task)
        if not task.cancelled() and task.exception() is not None:
            log.error("tokenizer self-check failed", exc_info=task.exception())

    async def _check_template(self, model: str, worker: EngineWorker) -> None:
        tokenizer = await self._tokenizer(model)
        if tokenizer is None or tokenizer.template is None:
            return
        timeout_s = self._config.engine_tokenize_timeout_s
        for probe in PROBES:
            engine = await engine_tokens(
                self._http, [worker], model, probe, timeout_s=timeout_s, render=self.render
            )
            if engine is None:
                log.info("%s: no engine rendering to check the local template against", model)
                return
            try:
                text = tokenizer.render(probe)
                local = await asyncio.to_thread(tokenizer.encode_full, text, False)
            except TokenizeError as error:
                log.warning("%s: the local template cannot render a probe: %s", model, error)
                local = []
            at = first_difference(local, engine)
            if at is not None:
                log.warning(
                    "model %s: the local tokenizer/chat template renders a probe prompt "
                    "otherwise than the engine at %s (token %d of %d/%d): its prompts are "
                    "keyed by the engine's renderer",
                    model, worker.id, at, len(local), len(engine),
                )  # fmt: skip
                self.mismatched.put(model, True)
                self._metrics.tokenizer_mismatch.labels(model).set(1)
                return
        self._metrics.tokenizer_mismatch.labels(model).set(0)

    def _tokenizers_of(self, tokenize_on: TokenizeOn | None) -> list[EngineWorker]:
        """The workers that may tokenize a prompt, in order: those of ``tokenize_on``
        (none given: the fleet as it is)."""
        workers = list(self._workers())
        if tokenize_on is None:
            return workers
        by_id = {worker.id: worker for worker in workers}
        return [by_id[worker] for worker in tokenize_on() if worker in by_id]

    async def _tokenizer(self, model: str) -> ModelTokenizer | None:
        if model in self.tokenizers:
            return self.tokenizers[model]
        directory = self._config.tokenizer_dir(model)
        if directory is None:
            self.tokenizers[model] = None
            return None
        lock = self._tokenizer_locks.setdefault(model, asyncio.Lock())
        async with lock:
            if model not in self.tokenizers:
                try:
                    loaded: ModelTokenizer | None = await asyncio.to_thread(
                        ModelTokenizer,
                        directory,
                        self._config.tokenize_cache_tokens,
                        self._config.tokenize_inline_chars,
                    )
                except (OSError, ValueError, TokenizeError) as error:
                    log.error("%s: cannot load tokenizer from %s: %s", model, directory, error)
                    loaded = None
                self.tokenizers[model] = loaded
        return self.tokenizers[model]

    def close(self) -> None:
        """Cancel the tokenizers' background work and the template checks."""
        for task in self._checks:
            task.cancel()
        for tokenizer in self.tokenizers.values():
            if tokenizer is not None:
                tokenizer.close()

    def _seed(self, prompt: PromptInput) -> int:
        """``prompt_seed(prompt)``, remembered per (LoRA name, cache salt)."""
        domain = (prompt.lora_name, prompt.cache_salt)
        seed = self._seeds.get(domain)
        return self._seeds.put(domain, prompt_seed(prompt)) if seed is None else seed

    def _count_cache(self, model: str, hit: bool) -> None:
        counter = self._cache_counters.get((model, hit))
        if counter is None:
            counter = self._cache_counters.put(
                (model, hit), self._metrics.tokenize_cache.labels(model, "hit" if hit else "miss")
            )
        counter.inc()


def _keys(keys: Sequence[BlockKey], block_size: int, tokens: int, mode: TokenizeMode) -> PromptKeys:
    return PromptKeys(keys, block_size, tokens, mode)
