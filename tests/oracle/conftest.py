"""Reference outputs from transformers, the outside oracle for the engine."""

from __future__ import annotations

import random
from dataclasses import dataclass

import pytest
import torch

PROMPT_LENS = [1, 2, 3, 5, 8, 13, 16, 17, 21, 31, 33, 47, 64, 65, 90, 127]
NEW_TOKENS = 16


@dataclass
class Reference:
    model_dir: str
    prompts: list[list[int]]
    outputs: list[list[int]]
    logits: list[torch.Tensor]  # per prompt: [len(prompt) - 1 + NEW_TOKENS, V], each step's next-token logits


def _reference(model_dir: str, seed: int) -> Reference:
    from transformers import AutoModelForCausalLM

    rng = random.Random(seed)
    hf = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()
    vocab = hf.config.vocab_size
    prompts = [[0] + [rng.randrange(4, vocab) for _ in range(n - 1)] for n in PROMPT_LENS]
    outputs, logits = [], []
    with torch.no_grad():
        for p in prompts:
            ids = torch.tensor([p])
            gen = hf.generate(ids, max_new_tokens=NEW_TOKENS, min_new_tokens=NEW_TOKENS, do_sample=False,
                              pad_token_id=1)
            out = gen[0, len(p):].tolist()
            outputs.append(out)
            # One causal forward over prompt + output gives every step's next-token logits.
            full = hf(torch.tensor([p + out[:-1]])).logits[0]
            logits.append(full[len(p) - 1:])
    return Reference(model_dir, prompts, outputs, logits)


@pytest.fixture(scope="session")
def ref_v3(tiny_model) -> Reference:
    return _reference(tiny_model, 0)


@pytest.fixture(scope="session")
def ref_v2(tiny_v2_model) -> Reference:
    return _reference(tiny_v2_model, 1)


@pytest.fixture(params=["v3", "v2"])
def ref(request) -> Reference:
    return request.getfixturevalue(f"ref_{request.param}")
