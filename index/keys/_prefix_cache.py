"""Exact incremental tokenization of growing texts (agent histories).

Hugging Face tokenizers split the text on added tokens *before* normalizing and
pre-tokenizing, so the pieces between added tokens are tokenized independently. Cutting a text
right before an added token that cannot merge with its surroundings (no lstrip/rstrip/
single_word, matched on raw text, not contained in another added token) therefore gives
``tokens(text) == tokens(text[:c]) + tokens(text[c:])``. The piece starting at ``c`` starts
with that added token, so no piece changes its offset-0 status (Metaspace "first" schemes).

The cache remembers tokenized texts with their safe cut points (char offset, token index),
indexed by a hash of the text up to and including each cut's added token. A new text looks up
its own cut points from the last one back; on a hit, the cached tokens up to the cut are reused
(after checking the text really is equal up there) and only the rest is tokenized.
Block keys of the reused prefix are reused the same way.

Plain text (completion prompts, trace replays) has no added tokens. For tokenizers whose
pipeline provably never merges across a space (``index/tokenize.py``: ``space_cuts_provable``), a
space that follows a non-whitespace character is a cut point too: ``tokens(text) ==
tokens(text[:c]) + tokens(text[c:])`` where ``text[c] == " "`` and ``text[c - 1]`` is not
whitespace (the piece starting at ``c`` starts with that space, so prefix-space / offset-0
rules do not change it). Such a cut is hashed up to and including its space.

Cut points are selected by stepping through the text (``str.find``, ``re.search``), added
tokens at least ``MIN_GAP_CHARS`` apart, spaces ``SPACE_GAP_CHARS`` after any cut point:
O(len / gap) Python steps and one streaming hash pass per text.
"""

from __future__ import annotations

import re
from array import array
from bisect import bisect_left
from collections import OrderedDict
from collections.abc import Iterable
from dataclasses import dataclass, field

import xxhash

from kvgate.index.types import BlockKey

MIN_GAP_CHARS = 512
"""Cut points closer than this to the previous one are not indexed (fewer hashes per text;
at most this many more characters are tokenized on a hit)."""
SPACE_GAP_CHARS = 2048
"""Space cut points closer than this to the previous cut point are not indexed. Spaces come
every few characters: each indexed cut costs about 3 µs (selecting, hashing, indexing), each
character re-tokenized on a hit about 0.3 µs (the simulator's tokenizer), so a 400 kB text is
cheapest at a few kB between cuts."""

Cut = tuple[int, int, int]
"""(char offset of the separator, char offset after it, index of the first token from there).

The separator is a safe added token (its own token) or a space (the first token of the text
after the cut, whatever it is)."""

Mark = tuple[int, int, bool]
"""A selected cut point of a text: (start, end, is a space) of its separator."""


def _cut_start(cut: Cut) -> int:
    return cut[0]


@dataclass(slots=True)
class Entry:
    text: str
    ids: array[int]
    cuts: list[Cut]
    refs: int = 0
    digests: list[int] = field(default_factory=list)
    keys: list[BlockKey] = field(default_factory=list)
    keys_for: tuple[int, int, tuple[int, ...]] | None = None
    """(seed, block_size, tokens before the text) of ``keys``."""


@dataclass(frozen=True, slots=True)
class Plan:
    """What to tokenize for a text: ``text[start:]``, after ``prefix`` ids (from ``entry``)."""

    start: int
    prefix: array[int]
    entry: Entry | None
    digests: dict[int, int]
    marks: list[Mark] = field(default_factory=list)

    def tail_marks(self) -> tuple[Mark, ...]:
        """The selected cut points of ``text[start:]``, relative to ``start``."""
        start = self.start
        return tuple((s - start, e - start, space) for s, e, space in self.marks if s >= start)


class PrefixTokenCache:
    """Bounded LRU of tokenized texts, keyed by their safe cut points."""

    def __init__(
        self, safe_tokens: dict[str, int], budget_tokens: int, *, space_cuts: bool = False
    ) -> None:
        """``space_cuts``: spaces after a non-whitespace character are exact cut points too
        (only for a tokenizer checked by ``index.tokenize.space_cuts_provable``)."""
        self.safe_ids = frozenset(safe_tokens.values())
        ordered = sorted(safe_tokens, key=len, reverse=True)
        self._pattern = re.compile("|".join(re.escape(t) for t in ordered)) if ordered else None
        self.space_cuts = space_cuts
        self._budget = budget_tokens
        self._entries: OrderedDict[int, Entry] = OrderedDict()
        self._by_digest: dict[int, tuple[Entry, int]] = {}
        self._tokens = 0
        self.hits = 0
        self.misses = 0

    @property
    def enabled(self) -> bool:
        return (self._pattern is not None or self.space_cuts) and self._budget > 0

    def _select(self, text: str) -> list[Mark]:
        """Cut points of ``text``: safe added tokens at least ``MIN_GAP_CHARS`` after the
        previous added-token cut point, and spaces at least ``SPACE_GAP_CHARS`` after the
        previous cut point of either kind (a rule that only depends on the text up to the
        cut's end: texts sharing a prefix select the same cut points in it). Space cuts never
        hide an added token: chat prompts keep their cut points at message boundaries."""
        search = self._pattern.search if self._pattern is not None else None
        token = search(text) if search is not None else None
        token_start = token.start() if token is not None else -1
        space = _next_space_cut(text, 1) if self.space_cuts else -1
        marks: list[Mark] = []
        while token_start >= 0 or space >= 0:
            if token_start >= 0 and (space < 0 or token_start < space):
                end = token.end() if token is not None else 0
                marks.append((token_start, end, False))
                token = search(text, end + MIN_GAP_CHARS) if search is not None else None
                token_start = token.start() if token is not None else -1
            else:
                end = space + 1
                marks.append((space, end, True))
            if 0 <= space < end + SPACE_GAP_CHARS:
                space = _next_space_cut(text, end + SPACE_GAP_CHARS)
        return marks

    @staticmethod
    def _digests(text: str, marks: list[Mark]) -> dict[int, int]:
        """Hash of ``text[:end]`` at the end of each selected cut point (one streaming pass)."""
        hasher = xxhash.xxh3_64()
        digests: dict[int, int] = {}
        pos = 0
        ascii_bytes = memoryview(text.encode()) if text.isascii() else None
        for _, end, _ in marks:
            if ascii_bytes is not None:
                hasher.update(ascii_bytes[pos:end])
            else:
                hasher.update(text[pos:end].encode())
            pos = end
            digests[end] = hasher.intdigest()
        return digests

    def plan(self, text: str) -> Plan:
        if not self.enabled:
            return Plan(0, array("I"), None, {})
        marks = self._select(text)
        digests = self._digests(text, marks)
        for end in reversed(digests):
            found = self._by_digest.get(digests[end])
            if found is None:
                continue
            entry, cut_index = found
            start, cut_end, token_index = entry.cuts[cut_index]
            cached = entry.text if len(entry.text) == end else entry.text[:end]
            if cut_end == end and text.startswith(cached):
                self.hits += 1
                self._entries.move_to_end(id(entry))
                return Plan(start, entry.ids[:token_index], entry, digests, marks)
        self.misses += 1
        return Plan(0, array("I"), None, digests, marks)

    def commit(
        self,
        text: str,
        plan: Plan,
        tail_ids: Iterable[int],
        tail_cuts: Iterable[Cut],
    ) -> Entry:
        """Remember ``text``: ``plan.prefix`` + ``tail_ids`` (``tail_cuts`` relative to start)."""
        ids = array("I", plan.prefix)
        token_offset = len(ids)
        ids.extend(array("I", tail_ids) if not isinstance(tail_ids, array) else tail_ids)
        cuts: list[Cut] = []
        if plan.entry is not None:  # its cuts before ``plan.start`` (they are in text order)
            cuts = plan.entry.cuts[: bisect_left(plan.entry.cuts, plan.start, key=_cut_start)]
        cuts.extend((plan.start + s, plan.start + e, token_offset + k) for s, e, k in tail_cuts)
        entry = Entry(text, ids, cuts)
        if self.enabled:
            self._insert(entry, plan.digests)
        return entry

    def _insert(self, entry: Entry, digests: dict[int, int]) -> None:
        by_digest = self._by_digest
        released: dict[int, tuple[Entry, int]] = {}
        own = entry.digests
        for index, (_, end, _) in enumerate(entry.cuts):
            digest = digests.get(end)
            if digest is None:
                continue
            previous = by_digest.get(digest)
            by_digest[digest] = (entry, index)
            own.append(digest)
            if previous is not None:
                owner = previous[0]
                count = released.get(id(owner), (owner, 0))[1]
                released[id(owner)] = (owner, count + 1)
        entry.refs += len(own)
        for owner, count in released.values():
            self._release(owner, count)
        if entry.refs == 0:
            return
        self._entries[id(entry)] = entry
        self._tokens += len(entry.ids)
        while self._tokens > self._budget and self._entries:
            _, oldest = self._entries.popitem(last=False)
            self._forget(oldest)

    def _release(self, entry: Entry, count: int) -> None:
        entry.refs -= count
        if entry.refs <= 0 and self._entries.pop(id(entry), None) is not None:
            self._tokens -= len(entry.ids)

    def _forget(self, entry: Entry) -> None:
        self._tokens -= len(entry.ids)
        for digest in entry.digests:
            found = self._by_digest.get(digest)
            if found is not None and found[0] is entry:
                del self._by_digest[digest]

    def __len__(self) -> int:
        return len(self._entries)


def _next_space_cut(text: str, at: int) -> int:
    """The first space at or after ``at`` (> 0) that follows a non-whitespace character."""
    find = text.find
    space = find(" ", at)
    while space > 0 and text[space - 1].isspace():
        space = find(" ", space + 1)
    return space
