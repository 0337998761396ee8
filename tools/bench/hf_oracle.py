"""transformers as the outside oracle: its greedy answers to token-id prompts.

The engine's tests hold it to these answers (tests/oracle), and the GPU check measures
transformers' own bf16 against its fp32 with them (engine_gpu.py). A V3 (or V2) model
answers through transformers' cached `generate`; a V4 model through one full forward
per token, since its cached decode can break the indexer's ties differently from its
full forward.
"""

from __future__ import annotations

import random

import torch

# One token, a partial block, whole blocks and a block and one (block size 16), up to 127.
PROMPT_LENS = [1, 2, 3, 5, 8, 13, 16, 17, 21, 31, 33, 47, 64, 65, 90, 127]
NEW_TOKENS = 16


def draw_prompt(rng: random.Random, n: int, vocab: int) -> list[int]:
    """n ids: token 0 (a beginning of sequence), then ids clear of the special ones."""
    return [0] + [rng.randrange(4, vocab) for _ in range(n - 1)]


def load(model_dir: str, dtype: torch.dtype = torch.float32, device: str = "cpu"):
    """transformers' model of a checkpoint, in eval mode (needs transformers)."""
    from transformers import AutoModelForCausalLM

    from moemesh.tools.train.trainer import quiet_load

    with quiet_load():
        hf = AutoModelForCausalLM.from_pretrained(model_dir, dtype=dtype)
    return hf.to(device).eval()


def generate(hf, prompt: list[int], new_tokens: int) -> list[int]:
    """transformers' cached greedy generation: exactly new_tokens ids (min_new_tokens keeps
    an end token out, so that every answer has the same length)."""
    ids = torch.tensor([prompt], device=hf.device)
    gen = hf.generate(ids, max_new_tokens=new_tokens, min_new_tokens=new_tokens, do_sample=False, pad_token_id=1)
    return gen[0, len(prompt):].tolist()


def generate_full(hf, prompt: list[int], new_tokens: int) -> list[int]:
    """Greedy ids from one full forward (no cache) per token."""
    toks = list(prompt)
    for _ in range(new_tokens):
        toks.append(int(hf(torch.tensor([toks], device=hf.device)).logits[0, -1].argmax()))
    return toks[len(prompt):]


def greedy(hf, prompts: list[list[int]], new_tokens: int) -> list[list[int]]:
    """Each prompt's greedy answer, the way the oracle takes it for the model's kind."""
    step = generate_full if hf.config.model_type == "deepseek_v4" else generate
    with torch.no_grad():
        return [step(hf, p, new_tokens) for p in prompts]


def top2_gap(hf, prompt: list[int], answer: list[int], step: int) -> float:
    """How far transformers' best next token leads the second at answer[step]: near zero,
    the choice is a near-tie that rounding decides."""
    with torch.no_grad():
        logits = hf(torch.tensor([prompt + answer[:step]], device=hf.device)).logits[0, -1].float()
    top = logits.topk(2).values
    return float(top[0] - top[1])
