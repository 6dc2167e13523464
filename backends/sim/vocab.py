"""The simulator's word-level vocabulary: every vocabulary word is exactly one token.

Shared by the simulated engine's tokenizer, ``kvgate serve --sim`` and the trace replayer,
which expands each trace hash id into words from this vocabulary so that every router
(token- or character-matching) sees the same real text.

Token ids, in order: the special tokens, the named words (chat roles, common English and
technical words, then the byte-level pieces that let any other word be spelled as several
sub-word tokens), then the generated three-syllable words.
"""

from __future__ import annotations

from functools import cache

from kvgate.backends.sim.english import english_words

_ONSETS = "bdfgklmnprstvzhjwcxyq"  # 21 consonants
_VOWELS = "aeiou"
_SYLLABLES = tuple(c + v for c in _ONSETS for v in _VOWELS)  # 105 syllables

SPECIAL_TOKENS: tuple[str, ...] = ("<unk>", "<s>", "</s>", "<|im_start|>", "<|im_end|>")
"""Special tokens, ids 0..4 in this order."""

GENERATED_WORDS = 32_000
"""How many generated three-syllable words follow the special and named words."""

CONTINUATION_PREFIX = "##"
"""Marks a sub-word piece that continues a word (WordPiece convention)."""

_COMMON_SUFFIXES = ("s", "es", "ed", "er", "ers", "ing", "ly", "tion", "ment", "ness", "able")


def generated_word(i: int) -> str:
    """The i-th generated word (0 <= i < GENERATED_WORDS): three syllables, lowercase."""
    if not 0 <= i < GENERATED_WORDS:
        raise ValueError(f"word index {i} outside 0..{GENERATED_WORDS - 1}")
    n = len(_SYLLABLES)
    return _SYLLABLES[i // (n * n)] + _SYLLABLES[(i // n) % n] + _SYLLABLES[i % n]


@cache
def byte_level_alphabet() -> tuple[str, ...]:
    """The 256 printable characters that stand for bytes 0..255 (GPT-2 byte-level mapping).

    Printable ASCII and most of Latin-1 stand for themselves; the other bytes are shifted
    above U+0100. The tokenizer's byte-level pre-tokenizer applies the same mapping.
    """
    kept = [
        *range(ord("!"), ord("~") + 1),
        *range(ord("¡"), ord("¬") + 1),
        *range(ord("®"), ord("ÿ") + 1),
    ]
    chars: dict[int, str] = {b: chr(b) for b in kept}
    shifted = 0
    for b in range(256):
        if b not in chars:
            chars[b] = chr(256 + shifted)
            shifted += 1
    return tuple(chars[b] for b in range(256))


def _is_generated(word: str) -> bool:
    """Whether ``word`` is one of the ``GENERATED_WORDS`` (then it is already in the vocabulary)."""
    if len(word) != 6 or any(word[k : k + 2] not in _SYLLABLES for k in (0, 2, 4)):
        return False
    n = len(_SYLLABLES)
    a, b, c = (_SYLLABLES.index(word[k : k + 2]) for k in (0, 2, 4))
    return a * n * n + b * n + c < GENERATED_WORDS


@cache
def named_words() -> tuple[str, ...]:
    """Named tokens between the special tokens and the generated words, without duplicates."""
    alphabet = byte_level_alphabet()
    pieces = (
        *(w for w in english_words() if not _is_generated(w)),
        *alphabet,
        *(CONTINUATION_PREFIX + c for c in alphabet),
        *(CONTINUATION_PREFIX + s for s in _COMMON_SUFFIXES),
    )
    return tuple(dict.fromkeys(p for p in pieces if p not in SPECIAL_TOKENS))


@cache
def vocabulary() -> tuple[str, ...]:
    """All tokens in id order: special tokens, named words, then generated words."""
    return SPECIAL_TOKENS + named_words() + tuple(generated_word(i) for i in range(GENERATED_WORDS))
