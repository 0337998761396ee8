"""Checkpoints made by transformers itself: a random DeepSeek model built by transformers
and written by its own `save_pretrained`, as a user who saved one has it on disk.

transformers' own initialisation (std 0.02, zero hash tables) gives near-tied logits and
routes every token of a hash layer to expert 0, so the weights are redrawn by name with
init-model's seeded scheme before saving: the model and the save path stay transformers'.
"""

from __future__ import annotations

import random
from pathlib import Path

import torch

from moemesh.shared.checkpoint import writer, writer_v4
from moemesh.shared.checkpoint.presets import TOKENIZER_VOCAB, preset_config
from moemesh.shared.checkpoint.tokenizer_builder import build_tokenizer, write_tokenizer
from moemesh.shared.model.config import ModelConfig

PRESETS = {"v2": "tiny-v2", "v3": "tiny", "v4": "v4-tiny"}


def build(arch: str, seed: int):
    """A transformers model of the arch's tiny preset, with seeded weights; and the
    tokenizer that goes with it."""
    from transformers import AutoConfig, AutoModelForCausalLM

    preset = PRESETS[arch]
    raw = preset_config(preset)
    tok = build_tokenizer(TOKENIZER_VOCAB[preset])
    raw["vocab_size"] = tok.get_vocab_size()
    config = AutoConfig.for_model(**raw)
    model = AutoModelForCausalLM.from_config(config, dtype=torch.float32).eval()
    cfg = ModelConfig.from_dict(raw)
    with torch.no_grad():
        for name, t in model.state_dict().items():  # buffers too: V4's tid2eid
            shape = tuple(t.shape)
            if arch == "v4":
                value = writer_v4._materialise(name, shape, seed, cfg)
            else:
                value = writer._materialise(name, shape, cfg, seed, torch.float32)
            t.copy_(value)
    return model, tok


def save(model, tok, out: Path, **save_kwargs) -> Path:
    """save_pretrained, plus the tokenizer a serving stack needs beside the weights."""
    model.save_pretrained(out, **save_kwargs)
    write_tokenizer(out, tok, model.config.max_position_embeddings)
    return out


MARGIN = 1e-3  # between the chosen token's logit and the next, at every step


def reference(model, seed: int, lens: list[int], new_tokens: int) -> tuple[list[list[int]], list[list[int]]]:
    """(prompts, transformers' greedy ids), one prompt per length: the first drawn whose
    answer hangs on no rounding (no near-tie in the logits; for V4 none in the indexer's
    top-k either), so that exact agreement is a fair demand. Full forwards, no cache:
    transformers' cached decode may break V4's indexer ties differently."""
    rng = random.Random(seed)
    vocab = model.config.vocab_size
    prompts, outputs = [], []
    with torch.no_grad():
        for n in lens:
            for _ in range(20):
                p = [0] + [rng.randrange(4, vocab) for _ in range(n - 1)]
                out = _greedy(model, p, new_tokens)
                if out is not None:
                    break
            else:
                raise AssertionError(f"no well-defined prompt of length {n} in 20 draws")
            prompts.append(p)
            outputs.append(out)
    return prompts, outputs


def _greedy(model, prompt: list[int], new_tokens: int) -> list[int] | None:
    ids = list(prompt)
    for _ in range(new_tokens):
        top = model(torch.tensor([ids])).logits[0, -1].topk(2)
        if float(top.values[0] - top.values[1]) < MARGIN:
            return None
        ids.append(int(top.indices[0]))
    if model.config.model_type == "deepseek_v4":
        from tests.oracle.v4_reference import MARGIN as INDEXER_MARGIN, indexer_margin

        if indexer_margin(model, ids[:-1]) <= INDEXER_MARGIN:
            return None
    return ids[len(prompt):]
