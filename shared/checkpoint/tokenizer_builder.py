"""Train a byte-level BPE tokenizer locally and write it in Hugging Face layout.

The corpus is generated from a fixed word list with a seeded RNG, so the same vocab
size always yields the same tokenizer on every machine, with no download.
"""

from __future__ import annotations

import json
import random
from pathlib import Path

BOS = "<｜begin▁of▁sentence｜>"
EOS = "<｜end▁of▁sentence｜>"
USER = "<｜User｜>"
ASSISTANT = "<｜Assistant｜>"
SPECIAL_TOKENS = [BOS, EOS, USER, ASSISTANT]  # ids 0..3

CHAT_TEMPLATE = (
    "{{ bos_token }}"
    "{% for message in messages %}"
    "{% if message['role'] == 'system' %}{{ message['content'] }}"
    "{% elif message['role'] == 'user' %}{{ '<｜User｜>' + message['content'] }}"
    "{% elif message['role'] == 'assistant' %}{{ '<｜Assistant｜>' + message['content'] + '<｜end▁of▁sentence｜>' }}"
    "{% elif message['role'] == 'tool' %}{{ '<｜User｜>[tool] ' + message['content'] }}"
    "{% endif %}"
    "{% endfor %}"
    "{% if add_generation_prompt %}{{ '<｜Assistant｜>' }}{% endif %}"
)

_WORDS = (
    "the of and to in is that for it as was with be by on not he this are or his from at which but have an "
    "they you were her she there one all we their would been has when who will more no if out so said what up "
    "its about into than them can only other new some could time these two may then do first any my now such "
    "like our over man me even most made after also did many before must through back years where much your way "
    "well down should because each just those people how too little state good very make world still own see men "
    "work long get here between both life being under never day same another know while last might us great old "
    "year off come since against go came right used take three model expert token decode prefill cache layer "
    "batch request stream rank balance router weight latency throughput kernel memory server client message "
    "queue block page attention mixture serving mesh transfer gateway worker load skew moves replica slot"
).split()
_EXTRA = [
    "def", "return", "import", "class", "self", "None", "True", "False", "print(", "):", "{", "}", "[", "]",
    "0", "1", "2", "3", "42", "100", "3.14", "café", "naïve", "日本語", "中文", "emoji 🙂", "→", "—", "über",
]


def corpus(num_sentences: int = 6000, seed: int = 0) -> list[str]:
    rng = random.Random(seed)
    lines = []
    for _ in range(num_sentences):
        n = rng.randint(4, 18)
        words = [rng.choice(_WORDS) if rng.random() > 0.08 else rng.choice(_EXTRA) for _ in range(n)]
        s = " ".join(words)
        s = s[0].upper() + s[1:] + rng.choice([".", ".", ".", "?", "!", ",", ":\n", "\n"])
        lines.append(s)
    return lines


def build_tokenizer(vocab_size: int):
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, processors, trainers

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size,
        special_tokens=SPECIAL_TOKENS,
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tok.train_from_iterator(corpus(), trainer)
    tok.post_processor = processors.TemplateProcessing(
        single=f"{BOS} $A", pair=f"{BOS} $A {BOS} $B", special_tokens=[(BOS, 0)]
    )
    return tok


def write_tokenizer(out_dir: Path, tok, max_length: int) -> None:
    """tok: a trained tokenizer from build_tokenizer()."""
    tok.save(str(out_dir / "tokenizer.json"))
    cfg = {
        "tokenizer_class": "PreTrainedTokenizerFast",
        "bos_token": BOS,
        "eos_token": EOS,
        "pad_token": EOS,
        "add_bos_token": True,
        "add_eos_token": False,
        "clean_up_tokenization_spaces": False,
        "model_max_length": max_length,
        "chat_template": CHAT_TEMPLATE,
    }
    (out_dir / "tokenizer_config.json").write_text(json.dumps(cfg, indent=2, ensure_ascii=False) + "\n")
    special = {"bos_token": BOS, "eos_token": EOS, "pad_token": EOS}
    (out_dir / "special_tokens_map.json").write_text(json.dumps(special, indent=2, ensure_ascii=False) + "\n")
