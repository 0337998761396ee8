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
# DeepSeek-V3's tool-call markers, as its tokenizer has them (one special token each).
TOOL_CALLS_BEGIN = "<｜tool▁calls▁begin｜>"
TOOL_CALLS_END = "<｜tool▁calls▁end｜>"
TOOL_CALL_BEGIN = "<｜tool▁call▁begin｜>"
TOOL_CALL_END = "<｜tool▁call▁end｜>"
TOOL_SEP = "<｜tool▁sep｜>"
TOOL_OUTPUTS_BEGIN = "<｜tool▁outputs▁begin｜>"
TOOL_OUTPUTS_END = "<｜tool▁outputs▁end｜>"
TOOL_OUTPUT_BEGIN = "<｜tool▁output▁begin｜>"
TOOL_OUTPUT_END = "<｜tool▁output▁end｜>"
TOOL_TOKENS = [TOOL_CALLS_BEGIN, TOOL_CALLS_END, TOOL_CALL_BEGIN, TOOL_CALL_END, TOOL_SEP, TOOL_OUTPUTS_BEGIN,
               TOOL_OUTPUTS_END, TOOL_OUTPUT_BEGIN, TOOL_OUTPUT_END]
# ids 0..3, then the tool markers at 4..12: the first four keep the ids they always had.
SPECIAL_TOKENS = [BOS, EOS, USER, ASSISTANT, *TOOL_TOKENS]

# DeepSeek-V3.1's conventions: tools are described in the system prompt with the exact call
# format; an assistant turn's calls are `<｜tool▁call▁begin｜>NAME<｜tool▁sep｜>ARGUMENTS-JSON
# <｜tool▁call▁end｜>`, all of them between the calls markers; consecutive tool results are
# wrapped in the outputs markers and followed by the next assistant turn.
CHAT_TEMPLATE = (
    "{{ bos_token }}"
    "{% set ns = namespace(in_outputs=false) %}"
    "{% for message in messages %}{% if message['role'] == 'system' %}{{ message['content'] }}{% endif %}{% endfor %}"
    "{% if tools %}"
    "{{ '\\n\\n## Tools\\nYou have access to the following tools:\\n' }}"
    "{% for tool in tools %}"
    "{{ '\\n### ' + tool['function']['name'] + '\\nDescription: ' + (tool['function']['description'] or '')"
    " + '\\n\\nParameters: ' }}{{ (tool['function']['parameters'] or {}) | tojson }}{{ '\\n' }}"
    "{% endfor %}"
    "{{ '\\nIMPORTANT: ALWAYS adhere to this exact format for tool use:\\n'"
    " + '<｜tool▁calls▁begin｜><｜tool▁call▁begin｜>tool_call_name<｜tool▁sep｜>tool_call_arguments'"
    " + '<｜tool▁call▁end｜>{{additional_tool_calls}}<｜tool▁calls▁end｜>\\n' }}"
    "{% endif %}"
    "{% for message in messages %}"
    "{% if message['role'] != 'tool' and ns.in_outputs %}{{ '<｜tool▁outputs▁end｜>' }}"
    "{% set ns.in_outputs = false %}{% endif %}"
    "{% if message['role'] == 'user' %}{{ '<｜User｜>' + message['content'] }}"
    "{% elif message['role'] == 'assistant' %}{{ '<｜Assistant｜>' + (message['content'] or '') }}"
    "{% if message['tool_calls'] %}{{ '<｜tool▁calls▁begin｜>' }}"
    "{% for call in message['tool_calls'] %}"
    "{{ '<｜tool▁call▁begin｜>' + call['function']['name'] + '<｜tool▁sep｜>' + call['function']['arguments']"
    " + '<｜tool▁call▁end｜>' }}"
    "{% endfor %}{{ '<｜tool▁calls▁end｜>' }}{% endif %}"
    "{{ '<｜end▁of▁sentence｜>' }}"
    "{% elif message['role'] == 'tool' %}"
    "{% if not ns.in_outputs %}{{ '<｜tool▁outputs▁begin｜>' }}{% set ns.in_outputs = true %}{% endif %}"
    "{{ '<｜tool▁output▁begin｜>' + message['content'] + '<｜tool▁output▁end｜>' }}"
    "{% endif %}"
    "{% endfor %}"
    "{% if ns.in_outputs %}{{ '<｜tool▁outputs▁end｜>' }}{% endif %}"
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


def build_tokenizer(vocab_size: int, texts: list[str] | None = None):
    """texts: what to learn the merges from (a trained model's corpus); by default the
    seeded word-list corpus above."""
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
    tok.train_from_iterator(texts if texts is not None else corpus(), trainer)
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
