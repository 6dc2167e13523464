"""Prompt → tokens → block keys.

A prompt becomes tokens exactly as the engine makes them when the model's tokenizer is
configured (``ModelTokenizer``: tokenizer.json, the chat template, a rendered-prefix cache),
and tokens become kvgate's chained block keys (``block_keys``, docs/block-keys.md).
``PromptKeyer`` picks the best way for each model (its tokenizer, the engine's ``/tokenize``,
approximate chunks) and counts it.
"""

from kvgate.index.keys._blocks import (
    block_keys,
    cache_seed,
    pack_tokens,
    shared_prefix_blocks,
    text_block_keys,
)
from kvgate.index.keys._chat_template import ChatTemplate, load_template_source
from kvgate.index.keys._prefix_cache import PrefixTokenCache
from kvgate.index.keys._prompt import PromptKeyer
from kvgate.index.keys._tokenize import (
    PARTIAL_CHARS,
    WINDOW_CHARS,
    ModelTokenizer,
    Reach,
    TokenizedPrompt,
    plain_render,
    prompt_seed,
    space_cuts_provable,
)

__all__ = [
    "PARTIAL_CHARS",
    "WINDOW_CHARS",
    "ChatTemplate",
    "ModelTokenizer",
    "PrefixTokenCache",
    "PromptKeyer",
    "Reach",
    "TokenizedPrompt",
    "block_keys",
    "cache_seed",
    "load_template_source",
    "pack_tokens",
    "plain_render",
    "prompt_seed",
    "shared_prefix_blocks",
    "space_cuts_provable",
    "text_block_keys",
]
