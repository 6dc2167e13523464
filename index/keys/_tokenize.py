"""Prompt → tokens → block keys, exactly as the engine tokenizes when a tokenizer is configured.

Modes, best first (the one used is returned in ``PromptKeys.mode`` and counted):

* ``token_ids``: a completion prompt given as token ids is used as is;
* ``tokenizer``: the model's ``tokenizer.json`` and chat template (``ModelTokenizer``);
* ``engine``: the engine's own ``POST /tokenize`` (vLLM) through the shared HTTP client;
* ``approx``: the rendered text hashed in fixed character chunks (no tokens).

Chat prompts are tokenized without the post-processor's special tokens (the template writes
them), completion prompts with them, as vLLM does. Long cold tokenizations run in a thread.

Texts are tokenized incrementally (``index/prefix_cache.py``): cut at safe added tokens, and
also at spaces when the tokenizer's pipeline provably never merges across one
(``space_cuts_provable``, then confirmed on probe texts at load).
"""

from __future__ import annotations

import asyncio
import dataclasses
import functools
import itertools
import json
import logging
from array import array
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from tokenizers import Encoding, Tokenizer

from kvgate.index.api import PromptInput
from kvgate.index.config import tokenizer_problem
from kvgate.index.errors import TemplateError, TokenizeError
from kvgate.index.keys._blocks import block_keys, cache_seed
from kvgate.index.keys._chat_template import ChatTemplate, load_template_source
from kvgate.index.keys._prefix_cache import Cut, Entry, Mark, Plan, PrefixTokenCache
from kvgate.index.memo import BoundedMemo
from kvgate.index.types import BlockKey

log = logging.getLogger(__name__)

_SPECIAL_NAMES = ("bos_token", "eos_token", "unk_token", "pad_token", "sep_token", "cls_token")
_TAIL_MEMO_CHARS = 256  # tails this short are remembered (tokens and cut points)
_TAIL_MEMO_ENTRIES = 1024
WINDOW_CHARS = 4 * 1024
"""Size of the first window such a text is tokenized in; each next one is twice the one
before. A window costs a thread hop and an index lookup (tens of µs); the last one is the
most tokenized past the held prefix (at most the held part again, and often one small
window: a new session's prompt that nobody holds)."""
PARTIAL_CHARS = 32 * 1024
"""A text whose part past the prefix cache (all of it, for a new text) is longer than this is
tokenized only as far as a worker's cached match reaches (about 5-8k tokens of English;
below it the whole part costs a few ms, and one window would save little)."""
MAX_BACKGROUND = 2
"""Background full tokenizations per tokenizer at once (more are skipped, not queued)."""

Reach = Callable[[Sequence[BlockKey]], int]
"""How many of these block keys (a prefix) some worker holds."""

# Space cuts (see ``space_cuts_provable``).
_CHAR_LOCAL_NORMALIZERS = frozenset({"NFD", "NFKD", "NFC", "NFKC", "Lowercase", "StripAccents"})
_WHITESPACE_FIRST = frozenset({"WhitespaceSplit", "Whitespace", "BertPreTokenizer"})
_WITHIN_PIECE = _WHITESPACE_FIRST | {
    "Punctuation",
    "Digits",
    "ByteLevel",
    "UnicodeScripts",
    "Split",
    "CharDelimiterSplit",
}
_PER_WORD_MODELS = frozenset({"BPE", "WordPiece", "WordLevel", "Unigram"})
_LLAMA3_PATTERN = (
    r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}"
    r"| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+"
)
_QWEN2_PATTERN = (
    r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}"
    r"| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+"
)
_SPACE_LEADING_PATTERNS = frozenset({_LLAMA3_PATTERN, _QWEN2_PATTERN})
"""Split regexes (besides ByteLevel's built-in GPT-2 one) in which a space never follows a
non-whitespace character inside one match, with no lookbehind and no anchors."""
_SPACE_PROBES = (
    "Hello world, it's 42! The  quick\tbrown fox.\n\nNew paragraph:  x ",
    " leading space and trailing space ",
    "ünïcödé café naïve ÉCOLE ΣΑΣ Σίσυφος straße ǅemal ﬁne ½ ² x\u00a8 y\u00b4 z",
    "mixed\u00a0nbsp\u3000ideographic\u2003em space \u0301combining e\u0301 a\u0308 x",
    "数字 12345 678,9 3.14 1e10 -7 tokens: a1b2 ++ -- ... !? ' s 're 'll x's y'S",
    "code:\n    def f(x):\n        return x  # comment\r\n\t\tend {'a': [1, 2]}",
    "emoji 😀 👍🏽 family 👨‍👩‍👧 flags 🇫🇷 zero\u200bwidth joiner a\u200db x",
    "a" * 120 + " " + "b" * 3 + "   " + "c",
)


@dataclass(frozen=True, slots=True)
class TokenizedPrompt:
    token_count: int
    keys: list[BlockKey]
    cache_hit: bool
    complete: Callable[[], None] | None = None  # ``tokenize(defer=True)``: starts the rest


class _Once:
    """A call that runs at most once (``TokenizedPrompt.complete``)."""

    __slots__ = ("_call",)

    def __init__(self, call: Callable[[], None]) -> None:
        self._call: Callable[[], None] | None = call

    def __call__(self) -> None:
        call, self._call = self._call, None
        if call is not None:
            call()


def _token_text(value: Any) -> str | None:
    if isinstance(value, str):
        return value
    if isinstance(value, Mapping) and isinstance(value.get("content"), str):
        return str(value["content"])
    return None


def _safe_added_tokens(tokenizer: Tokenizer) -> dict[str, int]:
    """Added tokens that split text into independently tokenized pieces (see prefix_cache)."""
    added = tokenizer.get_added_tokens_decoder()
    contents = [t.content for t in added.values()]
    safe: dict[str, int] = {}
    for token_id, token in added.items():
        if token.lstrip or token.rstrip or token.single_word or token.normalized:
            continue
        if not token.content or any(
            other != token.content and token.content in other for other in contents
        ):
            continue
        safe[token.content] = token_id
    return safe


def _probe_split(tokenizer: Tokenizer, safe: dict[str, int]) -> bool:
    """Check on sample texts that cutting before each safe token is exact."""
    samples = ("Hello world, it's 42!", " leading space", "ünïcödé\n\n  x", "a")
    for token in list(safe)[:8]:
        for left in samples:
            for right in samples:
                text = f"{left}{token}{right}{token}{left}"
                whole = tokenizer.encode(text, add_special_tokens=False).ids
                cut = text.index(token, len(left))
                head = tokenizer.encode(text[:cut], add_special_tokens=False).ids
                tail = tokenizer.encode(text[cut:], add_special_tokens=False).ids
                if head + tail != whole:
                    return False
    return True


def space_cuts_provable(config: Mapping[str, Any]) -> bool:
    """Whether a ``tokenizer.json`` pipeline never merges across a space that follows a
    non-whitespace character, so that cutting the text there is exact (docs/block-keys.md):

    * no truncation or padding, a deterministic per-word model (BPE without dropout,
      WordPiece, WordLevel, Unigram);
    * whitespace-first: char-local normalizers (NFD/NFKD/NFC/NFKC, Lowercase, StripAccents;
      a space is a normalization boundary and stays a space) and a pre-tokenizer that first
      splits at whitespace (WhitespaceSplit, Whitespace, BertPreTokenizer), then only splits
      its pieces further, the same way wherever they are (no Metaspace: its "first" scheme
      depends on the piece's position);
    * or space-leading regex (GPT-2, Llama 3, Qwen 2 byte-level BPE): no normalizer or NFC,
      and ByteLevel's own regex or one of the known Split regexes then ByteLevel, where a
      space after a non-whitespace character always starts a new piece.
    """
    if config.get("truncation") is not None or config.get("padding") is not None:
        return False
    model = config.get("model")
    if not isinstance(model, Mapping) or model.get("type") not in _PER_WORD_MODELS:
        return False
    if model.get("type") == "BPE" and model.get("dropout") is not None:
        return False
    normalizers = _flatten(config.get("normalizer"), "normalizers")
    pre_tokenizers = _flatten(config.get("pre_tokenizer"), "pretokenizers")
    if normalizers is None or not pre_tokenizers:
        return False
    if _whitespace_first(normalizers, pre_tokenizers):
        return True
    return model.get("type") == "BPE" and _space_leading_regex(normalizers, pre_tokenizers)


def _flatten(step: Any, key: str) -> list[Mapping[str, Any]] | None:
    """The steps of a (possibly nested) Sequence; None if malformed."""
    if step is None:
        return []
    if not isinstance(step, Mapping):
        return None
    if step.get("type") != "Sequence":
        return [step]
    flat: list[Mapping[str, Any]] = []
    for inner in step.get(key) or []:
        steps = _flatten(inner, key)
        if steps is None:
            return None
        flat.extend(steps)
    return flat


def _whitespace_first(
    normalizers: Sequence[Mapping[str, Any]], pre_tokenizers: Sequence[Mapping[str, Any]]
) -> bool:
    return (
        all(n.get("type") in _CHAR_LOCAL_NORMALIZERS for n in normalizers)
        and pre_tokenizers[0].get("type") in _WHITESPACE_FIRST
        and all(p.get("type") in _WITHIN_PIECE for p in pre_tokenizers[1:])
    )


def _space_leading_regex(
    normalizers: Sequence[Mapping[str, Any]], pre_tokenizers: Sequence[Mapping[str, Any]]
) -> bool:
    if any(n.get("type") != "NFC" for n in normalizers):
        return False
    last = pre_tokenizers[-1]
    if last.get("type") != "ByteLevel":
        return False
    if len(pre_tokenizers) == 1:
        return bool(last.get("use_regex", True))
    if len(pre_tokenizers) != 2 or last.get("use_regex", True):
        return False
    split = pre_tokenizers[0]
    pattern = split.get("pattern")
    return (
        split.get("type") == "Split"
        and isinstance(pattern, Mapping)
        and pattern.get("Regex") in _SPACE_LEADING_PATTERNS
        and split.get("behavior") == "Isolated"
        and not split.get("invert", False)
    )


def _added_tokens_allow_space_cuts(tokenizer: Tokenizer) -> bool:
    """No added token can match across a space or absorb one (no whitespace inside, no
    lstrip/rstrip)."""
    return not any(
        token.lstrip or token.rstrip or any(ch.isspace() for ch in token.content)
        for token in tokenizer.get_added_tokens_decoder().values()
    )


def _space_cut_positions(text: str) -> list[int]:
    return [c for c in range(1, len(text)) if text[c] == " " and not text[c - 1].isspace()]


def _probe_space_cuts(tokenizer: Tokenizer, safe: dict[str, int]) -> bool:
    """Check on sample texts that cutting at every space cut point is exact."""
    samples = list(_SPACE_PROBES)
    for token in list(safe)[:4]:
        samples.append(f"{token}user x {token} y{token} z {_SPACE_PROBES[0]}{token}")
    for text in samples:
        whole = tokenizer.encode(text, add_special_tokens=False).ids
        for cut in _space_cut_positions(text):
            head = tokenizer.encode(text[:cut], add_special_tokens=False).ids
            tail = tokenizer.encode(text[cut:], add_special_tokens=False).ids
            if head + tail != whole:
                return False
    return True


def _space_cuts(tokenizer: Tokenizer, safe: dict[str, int]) -> bool:
    config = json.loads(tokenizer.to_str())
    return (
        isinstance(config, dict)
        and space_cuts_provable(config)
        and _added_tokens_allow_space_cuts(tokenizer)
        and _probe_space_cuts(tokenizer, safe)
    )


def _first_token_from(encoding: Encoding, count: int, char: int) -> int:
    """Index of the first token starting at or after ``char`` (``count`` if none).

    At an exact cut ``c`` the tokens of ``text[:c]`` map into it and those of ``text[c:]``
    after it, so this is ``len(tokens(text[:c]))``.
    """
    low, high = 0, count
    while low < high:
        middle = (low + high) // 2
        span = encoding.token_to_chars(middle)
        if span is None or span[0] < char:
            low = middle + 1
        else:
            high = middle
    return low


def _load_tokenizer(directory: Path) -> Tokenizer:
    """The folder's ``tokenizer.json``; ``TokenizeError`` saying what is wrong otherwise."""
    problem = tokenizer_problem("", directory)
    if problem is not None:
        raise TokenizeError(problem)
    try:
        return Tokenizer.from_file(str(directory / "tokenizer.json"))
    except Exception as exc:  # the tokenizers library raises bare Exception on a bad file
        raise TokenizeError(f"{directory / 'tokenizer.json'} is not a tokenizer: {exc}") from exc


class ModelTokenizer:
    """One model's tokenizer, chat template and rendered-prefix tokenization cache."""

    def __init__(self, directory: Path, cache_tokens: int, inline_chars: int) -> None:
        self.directory = directory
        self.tokenizer = _load_tokenizer(directory)
        config = self._read_config(directory)
        special = {name: _token_text(config.get(name)) for name in _SPECIAL_NAMES}
        source = load_template_source(config)
        template_file = directory / "chat_template.jinja"
        if source is None and template_file.is_file():
            source = template_file.read_text()
        self.template = ChatTemplate(source, special) if source is not None else None
        safe = _safe_added_tokens(self.tokenizer)
        if safe and not _probe_split(self.tokenizer, safe):
            log.warning("%s: tokenizer splits unexpectedly; prefix cache disabled", directory)
            safe = {}
        space_cuts = _space_cuts(self.tokenizer, safe)
        self.cache = PrefixTokenCache(safe, cache_tokens, space_cuts=space_cuts)
        self._inline_chars = inline_chars
        self._affix = self._special_affix()
        self._tails: BoundedMemo[tuple[str, tuple[Mark, ...]], tuple[array[int], list[Cut]]]
        self._tails = BoundedMemo(_TAIL_MEMO_ENTRIES)
        self._background: set[asyncio.Task[TokenizedPrompt]] = set()

    @staticmethod
    def _read_config(directory: Path) -> dict[str, Any]:
        path = directory / "tokenizer_config.json"
        if not path.is_file():
            return {}
        loaded = json.loads(path.read_text())
        return loaded if isinstance(loaded, dict) else {}

    def _special_affix(self) -> tuple[list[int], list[int]] | None:
        """Tokens the post-processor puts around a text, if it only adds a fixed prefix/suffix."""
        affixes = []
        for probe in ("probe text one", "x"):
            plain = self.tokenizer.encode(probe, add_special_tokens=False).ids
            full = self.tokenizer.encode(probe, add_special_tokens=True).ids
            for start in range(len(full) - len(plain) + 1):
                if full[start : start + len(plain)] == plain:
                    affixes.append((full[:start], full[start + len(plain) :]))
                    break
            else:
                return None
        return affixes[0] if affixes[0] == affixes[1] else None

    def render(self, prompt: PromptInput) -> str:
        if self.template is None:
            raise TokenizeError(f"{self.directory}: no chat template")
        try:
            return self.template.render(
                prompt.messages or [],
                tools=prompt.tools,
                add_generation_prompt=prompt.add_generation_prompt,
                extra=prompt.chat_template_kwargs,
            )
        except TemplateError as error:
            raise TokenizeError(str(error)) from error

    def encode_full(self, text: str, add_special_tokens: bool) -> list[int]:
        """Reference tokenization (no cache)."""
        return list(self.tokenizer.encode(text, add_special_tokens=add_special_tokens).ids)

    def _encode_tail(self, text: str, marks: tuple[Mark, ...]) -> tuple[array[int], list[Cut]]:
        """Tokens of a text's uncached tail and its cut points ``marks`` (relative to the tail).

        The tail is tokenized in pieces cut at its space marks (exact, see
        index/prefix_cache.py), which also gives their token indices; an added-token mark is
        kept if the encoding has that safe token there. Short tails repeat (the generation
        prompt after a cached conversation): they are remembered.
        """
        short = len(text) <= _TAIL_MEMO_CHARS
        if short:
            found = self._tails.get((text, marks))
            if found is not None:
                return found
        bounds = [start for start, _, space in marks if space and start > 0]
        if bounds and len(text) > self._inline_chars:  # pieces, encoded in parallel
            edges = [0, *bounds, len(text)]
            pieces = [text[a:b] for a, b in itertools.pairwise(edges)]
            encodings = self.tokenizer.encode_batch(pieces, add_special_tokens=False)
        elif len(text) > self._inline_chars:  # one long piece (in a thread): encode_batch
            # releases the GIL while it works, encode holds it (the event loop would stall)
            edges = [0, len(text)]
            encodings = self.tokenizer.encode_batch([text], add_special_tokens=False)
        else:  # one piece: space cut indices from the offsets (batches cost more when short)
            edges = [0, len(text)]
            encodings = [self.tokenizer.encode(text, add_special_tokens=False)]
        ids: array[int] = array("I")
        cuts: list[Cut] = []
        pending = iter(marks)
        mark = next(pending, None)
        for (piece_start, piece_end), encoding in zip(
            itertools.pairwise(edges), encodings, strict=True
        ):
            offset = len(ids)
            piece_ids = encoding.ids
            ids.extend(piece_ids)
            while mark is not None and mark[0] < piece_end:
                start, end, space = mark
                if space and start == piece_start:  # a piece starts there
                    cuts.append((start, end, offset))
                elif space:
                    first = _first_token_from(encoding, len(piece_ids), start - piece_start)
                    cuts.append((start, end, offset + first))
                else:
                    safe_at = self._safe_token_at(
                        encoding, piece_ids, start - piece_start, end - start
                    )
                    if safe_at is not None:
                        cuts.append((start, end, offset + safe_at))
                mark = next(pending, None)
        encoded = ids, cuts
        if short:
            self._tails.put((text, marks), encoded)  # shared: callers only read them
        return encoded

    def _safe_token_at(
        self, encoding: Encoding, ids: list[int], start: int, length: int
    ) -> int | None:
        """Index of the safe added token spanning ``start`` … ``start + length``, if any."""
        index = encoding.char_to_token(start)
        if index is None or ids[index] not in self.cache.safe_ids:
            return None
        return index if encoding.token_to_chars(index) == (start, start + length) else None

    async def tokenize(
        self,
        text: str,
        *,
        add_special_tokens: bool,
        block_size: int,
        seed: int,
        reach: Reach | None = None,
        defer: bool = False,
    ) -> TokenizedPrompt:
        """Tokens of ``text`` (reusing a cached prefix) and their block keys.

        With ``reach`` (how many of some block keys, a prefix, a worker holds), a text whose
        part past the prefix cache is long (a new text, or a turn that adds a long tool
        output) is tokenized only as far as a worker's cached match can reach: window by
        window, until a window ends in a block nobody holds (no window at all when nobody
        holds the whole cached prefix). Its keys are those blocks' (exact: windows are cut at
        exact cut points), its token count an estimate (the rest at the tokenized part's
        tokens per character). The whole text is then tokenized in the background, so that
        the session's next turn finds it in the prefix cache (see ``_reachable``): at once,
        or with ``defer`` when the caller calls the result's ``complete`` (after the
        request's first token: it would compete with the request for the CPU and the GIL).
        """
        plan = self.cache.plan(text)
        if reach is not None and len(text) - plan.start > PARTIAL_CHARS:
            partial = await self._reachable(
                text,
                plan,
                add_special_tokens=add_special_tokens,
                block_size=block_size,
                seed=seed,
                reach=reach,
            )
            if partial is not None:
                rest = functools.partial(
                    self._complete_later, text, add_special_tokens, block_size, seed
                )
                if not defer:
                    rest()
                    return partial
                return dataclasses.replace(partial, complete=_Once(rest))
        tail = text[plan.start :]
        marks = plan.tail_marks()
        if len(tail) > self._inline_chars:
            tail_ids, tail_cuts = await asyncio.to_thread(self._encode_tail, tail, marks)
        else:
            tail_ids, tail_cuts = self._encode_tail(tail, marks)
        entry = self.cache.commit(text, plan, tail_ids, tail_cuts)
        before: list[int] = []
        after: list[int] = []
        if add_special_tokens:
            if self._affix is None:
                full = self.encode_full(text, True)
                return TokenizedPrompt(len(full), block_keys(full, block_size, seed), False)
            before, after = self._affix
        keys_for = (seed, block_size, tuple(before))
        reused, fresh, parent = self._reusable_keys(entry, plan, keys_for, before, after)
        if len(fresh) > self._inline_chars:  # ~ a few ms of hashing: off the event loop
            new = await asyncio.to_thread(block_keys, fresh, block_size, seed, parent)
        else:
            new = block_keys(fresh, block_size, seed, parent)
        keys = reused + new
        entry.keys = keys
        entry.keys_for = keys_for
        token_count = len(before) + len(entry.ids) + len(after)
        return TokenizedPrompt(token_count, keys, plan.entry is not None)

    async def _reachable(
        self,
        text: str,
        plan: Plan,
        *,
        add_special_tokens: bool,
        block_size: int,
        seed: int,
        reach: Reach,
    ) -> TokenizedPrompt | None:
        """The text's keys as far as some worker holds them, or None to tokenize it all.

        The keys start with the prefix cache's part (``plan.prefix``). While some worker
        holds every key so far, the rest is tokenized in windows growing from ``WINDOW_CHARS``
        cut at the plan's space marks (exact cut points; the longer ones in a thread) and
        keyed; the first window whose keys reach past every worker's match ends it. None
        when no exact cut exists, or when the held part runs past half of the uncached rest
        (cached somewhere but not in this prefix cache: tokenizing it all is then cheaper).
        """
        if add_special_tokens and self._affix is None:
            return None
        before, after = self._affix if add_special_tokens and self._affix else ([], [])
        rest = len(text) - plan.start
        tail_edges = _window_edges([start for start, _, _ in plan.tail_marks()], rest)
        if len(tail_edges) < 2:
            return None
        ids: array[int] = array("I", before) + plan.prefix
        keys = self._prefix_keys(plan, (seed, block_size, tuple(before)), ids)
        done = plan.start
        if not keys or reach(keys) == len(keys):
            for edge in tail_edges:
                ids.extend(await self._encoded_window(text[done : plan.start + edge]))
                done = plan.start + edge
                parent = keys[-1] if keys else None
                keys += block_keys(ids[len(keys) * block_size :], block_size, seed, parent)
                if reach(keys) < len(keys):
                    break
                if edge * 2 > rest:
                    return None
        if done >= len(text) or done == 0:
            return None
        tokens = len(ids) - len(before)
        estimate = round((len(text) - done) * tokens / done)
        return TokenizedPrompt(len(ids) + estimate + len(after), keys, plan.entry is not None)

    @staticmethod
    def _prefix_keys(
        plan: Plan, keys_for: tuple[int, int, tuple[int, ...]], ids: array[int]
    ) -> list[BlockKey]:
        """Keys of the whole blocks of ``ids`` (the affix before and the prefix cache's part),
        taken from the prefix cache's entry when it was keyed alike."""
        seed, block_size, _ = keys_for
        entry = plan.entry
        if entry is not None and entry.keys_for == keys_for:
            return entry.keys[: len(ids) // block_size]
        return block_keys(ids, block_size, seed)

    async def _encoded_window(self, piece: str) -> list[int]:
        """A window's tokens: on the event loop when short (a thread hop, and the wait for
        the GIL on a busy loop, cost more than the window), else in a thread."""
        if len(piece) <= self._inline_chars:
            return self._encode_window(piece)
        return await asyncio.to_thread(self._encode_window, piece)

    def _encode_window(self, piece: str) -> list[int]:
        # encode_batch releases the GIL while it works (encode would stall the event loop)
        (encoding,) = self.tokenizer.encode_batch([piece], add_special_tokens=False)
        return list(encoding.ids)

    def _complete_later(
        self, text: str, add_special_tokens: bool, block_size: int, seed: int
    ) -> None:
        """Tokenize ``text`` in full in the background (into the prefix cache); skipped when
        ``MAX_BACKGROUND`` such jobs already run (the next turn then tokenizes it itself)."""
        if len(self._background) >= MAX_BACKGROUND:
            return
        job = self.tokenize(text, add_special_tokens=add_special_tokens, block_size=block_size,
                            seed=seed)  # fmt: skip
        task = asyncio.get_running_loop().create_task(job)
        self._background.add(task)
        task.add_done_callback(self._background_done)

    def _background_done(self, task: asyncio.Task[TokenizedPrompt]) -> None:
        self._background.discard(task)
        if task.cancelled():
            return
        error = task.exception()
        if isinstance(error, TokenizeError):
            log.info("%s: background tokenization failed: %s", self.directory, error)
        elif error is not None:
            log.error("%s: background tokenization crashed", self.directory, exc_info=error)

    async def drain(self) -> None:
        """Wait for the background tokenizations (tests, benchmarks)."""
        while self._background:
            await asyncio.gather(*self._background, return_exceptions=True)

    def close(self) -> None:
        """Cancel the background tokenizations."""
        for task in list(self._background):
            task.cancel()

    @staticmethod
    def _reusable_keys(
        entry: Entry,
        plan: Plan,
        keys_for: tuple[int, int, tuple[int, ...]],
        before: list[int],
        after: list[int],
    ) -> tuple[list[BlockKey], array[int], BlockKey | None]:
        """The cached prefix's keys, the ids still to key, and the key before them.

        Keys cover ``before + ids + after`` (the post-processor's tokens around a completion
        prompt); blocks within ``before`` and the reused prefix are the same in both texts.
        """
        _, block_size, _ = keys_for
        reused: list[BlockKey] = []
        previous = plan.entry
        if previous is not None and previous.keys_for == keys_for:
            reused = previous.keys[: (len(before) + len(plan.prefix)) // block_size]
        start = len(reused) * block_size
        parent = reused[-1] if reused else None
        if not before and not after:
            return reused, entry.ids[start:], parent
        ids = array("I", before) + entry.ids + array("I", after)
        return reused, ids[start:], parent


def _window_edges(marks: Sequence[int], length: int) -> list[int]:
    """Window ends: the first mark at least ``WINDOW_CHARS`` from the start, then the first
    at least twice as far as the previous window's size past it, ..., and the text's end
    (marks are increasing char offsets of exact cut points)."""
    edges: list[int] = []
    last = 0
    size = WINDOW_CHARS
    for mark in marks:
        if mark - last >= size:
            edges.append(mark)
            size = 2 * (mark - last)
            last = mark
    if length > last:
        edges.append(length)
    return edges


def prompt_seed(prompt: PromptInput) -> int:
    return cache_seed(prompt.lora_name, prompt.cache_salt)


def plain_render(prompt: PromptInput) -> str:
    """Text of a prompt for the approximate mode (no template known)."""
    if prompt.kind == "completion":
        return prompt.prompt if isinstance(prompt.prompt, str) else ""
    parts = []
    for message in prompt.messages or []:
        content = message.get("content")
        if isinstance(content, list):
            content = "\n".join(str(p.get("text", "")) for p in content if isinstance(p, Mapping))
        parts.append(f"<|{message.get('role', '')}|>\n{content or ''}\n")
    if prompt.tools:
        parts.insert(0, json.dumps(list(prompt.tools), sort_keys=True))
    return "".join(parts)
