"""Reference outputs from transformers, the outside oracle for the engine."""

from __future__ import annotations

import random
from dataclasses import dataclass, field

import pytest
import torch

from moemesh.tools.bench.hf_oracle import NEW_TOKENS, PROMPT_LENS, draw_prompt, generate, load


@dataclass
class Reference:
    model_dir: str
    prompts: list[list[int]]
    outputs: list[list[int]]
    logits: list[torch.Tensor]  # per prompt: [len(prompt) - 1 + NEW_TOKENS, V], each step's next-token logits
    # per prompt: [len(prompt) - 1, V], the logits that score its tokens 1.. (the V3 reference's; V4's has none)
    prompt_logits: list[torch.Tensor] = field(default_factory=list)


def _reference(model_dir: str, seed: int) -> Reference:
    rng = random.Random(seed)
    hf = load(model_dir)
    vocab = hf.config.vocab_size
    prompts, outputs, logits, prompt_logits = [], [], [], []
    with torch.no_grad():
        for n in PROMPT_LENS:
            for _ in range(MAX_DRAWS):
                p = draw_prompt(rng, n, vocab)
                out = generate(hf, p, NEW_TOKENS)
                # One causal forward over prompt + output gives every step's next-token logits.
                every = hf(torch.tensor([p + out[:-1]])).logits[0]
                full = every[len(p) - 1:]
                if _well_defined(full, out):
                    break
            prompts.append(p)
            outputs.append(out)
            logits.append(full)
            prompt_logits.append(every[: len(p) - 1])
    return Reference(model_dir, prompts, outputs, logits, prompt_logits)


MAX_DRAWS = 20
MIN_MARGIN = 1e-2


def _well_defined(logits: torch.Tensor, out: list[int]) -> bool:
    """A prompt whose greedy answer does not hang on rounding: at every step the chosen
    token leads the next by MIN_MARGIN, and transformers' cached generation and its one
    full forward agree. A random MoE model has near-ties in its router, and a float
    rounding apart, transformers' own two paths then route a token to other experts and
    pick different tokens (seen: 0.06 apart in a logit); no engine can be exact to that."""
    top = logits.topk(2, dim=-1)  # (an end token as the argmax also redraws: min_new_tokens kept it out)
    return top.indices[:, 0].tolist() == out and bool(((top.values[:, 0] - top.values[:, 1]) >= MIN_MARGIN).all())


@pytest.fixture(scope="session")
def ref_v3(tiny_model) -> Reference:
    return _reference(tiny_model, 0)


@pytest.fixture(scope="session")
def ref_v2(tiny_v2_model) -> Reference:
    return _reference(tiny_v2_model, 1)


@pytest.fixture(params=["v3", "v2"])
def ref(request) -> Reference:
    return request.getfixturevalue(f"ref_{request.param}")
