"""The simulator's word-level vocabulary: every word is exactly one token.

Shared by the simulated engine's tokenizer, ``kvgate serve --sim`` and the trace replayer,
which expands each trace hash id into words from this vocabulary so that every router
(token- or character-matching) sees the same real text.
"""

from __future__ import annotations

from functools import cache

_ONSETS = "bdfgklmnprstvzhjwcxyq"  # 21 consonants
_VOWELS = "aeiou"
_SYLLABLES = tuple(c + v for c in _ONSETS for v in _VOWELS)  # 105 syllables

SPECIAL_TOKENS: tuple[str, ...] = ("<unk>", "<s>", "</s>", "<|im_start|>", "<|im_end|>")
"""Special tokens, ids 0..4 in this order."""

GENERATED_WORDS = 32_000
"""How many generated three-syllable words follow the special and named words."""


def generated_word(i: int) -> str:
    """The i-th generated word (0 <= i < GENERATED_WORDS): three syllables, lowercase."""
    if not 0 <= i < GENERATED_WORDS:
        raise ValueError(f"word index {i} outside 0..{GENERATED_WORDS - 1}")
    n = len(_SYLLABLES)
    return _SYLLABLES[i // (n * n)] + _SYLLABLES[(i // n) % n] + _SYLLABLES[i % n]


@cache
def vocabulary() -> tuple[str, ...]:
    """All tokens in id order: special tokens, then generated words."""
    return SPECIAL_TOKENS + tuple(generated_word(i) for i in range(GENERATED_WORDS))
