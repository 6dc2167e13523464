"""Build the tiny model: run by the vLLM venv's python (torch + transformers), not by kvgate.

Standalone on purpose (no kvgate imports): ``python tiny_model_script.py --out DIR --seed 0``.
Writes a 2-layer random-weight Llama (safetensors + config.json) and a byte-level BPE tokenizer
trained on a generated corpus (tokenizer.json + tokenizer_config.json with a chatml-style
chat template). Deterministic for a given seed; no downloads.
"""

from __future__ import annotations

import argparse
import json
import random
from pathlib import Path

import torch  # type: ignore[import-not-found]
from tokenizers import Tokenizer, decoders, models, pre_tokenizers, processors, trainers
from transformers import LlamaConfig, LlamaForCausalLM  # type: ignore[import-not-found]

SPECIAL_TOKENS = ("<unk>", "<s>", "</s>", "<|im_start|>", "<|im_end|>")
BOS, EOS, PAD = "<s>", "<|im_end|>", "</s>"
VOCAB_SIZE = 4096
MAX_POSITIONS = 4096

CHAT_TEMPLATE = (
    "{{ bos_token }}"
    "{% for message in messages %}"
    "{% if message['role'] not in ['system', 'user', 'assistant', 'tool'] %}"
    "{{ raise_exception('unknown role: ' + message['role']) }}"
    "{% endif %}"
    "<|im_start|>{{ message['role'] }}\n{{ message['content'] }}<|im_end|>\n"
    "{% endfor %}"
    "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
)

_ONSETS = "bdfgklmnprstvzhjwcxyq"
_VOWELS = "aeiou"
_ENGLISH_TEXT = (
    "the of and to in is you that it he was for on are as with his they at be this have "
    "from or one had by word but not what all were we when your can said there use an each "
    "which she do how their if will up other about out many then them these so some her "
    "would make like him into time has look two more write go see number no way could people "
    "my than first water been call who oil its now find long down day did get come made may "
    "part session agent tool call result file code test user assistant system prompt cache"
)


def _corpus(seed: int, lines: int = 6000) -> list[str]:
    """Deterministic text: English words, syllable words, numbers, code-ish punctuation."""
    rng = random.Random(seed)
    syllables = [c + v for c in _ONSETS for v in _VOWELS]
    english = _ENGLISH_TEXT.split()
    out: list[str] = []
    for _ in range(lines):
        words: list[str] = []
        for _ in range(rng.randint(4, 24)):
            pick = rng.random()
            if pick < 0.55:
                words.append(rng.choice(english))
            elif pick < 0.85:
                words.append("".join(rng.choice(syllables) for _ in range(rng.randint(1, 3))))
            elif pick < 0.93:
                words.append(str(rng.randint(0, 9999)))
            else:
                words.append(rng.choice(["{", "}", "(", ")", ":", ";", "=", "->", "#", '"']))
        sentence = " ".join(words)
        out.append(sentence.capitalize() + rng.choice([".", "?", "!", ",", ""]))
    return out


def _special_id(tokenizer: Tokenizer, token: str) -> int:
    token_id = tokenizer.token_to_id(token)
    if token_id is None:
        raise RuntimeError(f"special token {token} missing from the trained vocabulary")
    return token_id


def build_tokenizer(out: Path, seed: int) -> dict[str, int]:
    tokenizer = Tokenizer(models.BPE())
    tokenizer.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tokenizer.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=VOCAB_SIZE,
        special_tokens=list(SPECIAL_TOKENS),
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tokenizer.train_from_iterator(_corpus(seed), trainer=trainer)
    ids = {token: _special_id(tokenizer, token) for token in SPECIAL_TOKENS}
    tokenizer.post_processor = processors.TemplateProcessing(
        single=f"{BOS} $A", pair=f"{BOS} $A {BOS} $B", special_tokens=[(BOS, ids[BOS])]
    )
    tokenizer.save(str(out / "tokenizer.json"))
    config = {
        "tokenizer_class": "PreTrainedTokenizerFast",
        "bos_token": BOS,
        "eos_token": EOS,
        "pad_token": PAD,
        "unk_token": "<unk>",
        "model_max_length": MAX_POSITIONS,
        "clean_up_tokenization_spaces": False,
        "chat_template": CHAT_TEMPLATE,
    }
    (out / "tokenizer_config.json").write_text(json.dumps(config, indent=2) + "\n")
    return {"vocab_size": tokenizer.get_vocab_size(), **{f"id:{k}": v for k, v in ids.items()}}


def build_model(out: Path, seed: int, info: dict[str, int]) -> None:
    torch.manual_seed(seed)
    config = LlamaConfig(
        vocab_size=info["vocab_size"],
        hidden_size=128,
        intermediate_size=256,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=MAX_POSITIONS,
        bos_token_id=info[f"id:{BOS}"],
        eos_token_id=info[f"id:{EOS}"],
        pad_token_id=info[f"id:{PAD}"],
        tie_word_embeddings=False,
        torch_dtype="bfloat16",
    )
    model = LlamaForCausalLM(config).to(torch.bfloat16)
    model.save_pretrained(str(out), safe_serialization=True)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--out", type=Path, required=True)
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args()
    out: Path = args.out
    out.mkdir(parents=True, exist_ok=True)
    info = build_tokenizer(out, args.seed)
    build_model(out, args.seed, info)
    print(json.dumps(info))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
