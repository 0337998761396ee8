"""Token sampling: greedy, temperature, top-k, top-p, per-request seeds, logprobs.

N = rows to sample, V = vocabulary. Rows come from different requests, each with its
own parameters; the common transforms are vectorised and only the draw itself is per
row when a request carries its own seeded generator.
"""

from __future__ import annotations

import torch

from moemesh.shared.engine.host_copy import to_device
from moemesh.shared.protocol.messages import SamplingParams, TokenLogprob


def processed_probs(logits: torch.Tensor, params: list[SamplingParams]) -> torch.Tensor:
    """Apply temperature, top-k and top-p. logits [N, V] fp32 -> probs [N, V].
    Greedy rows come back one-hot on their argmax."""
    probs = _tempered_probs(logits, params)
    greedy = [p.greedy for p in params]
    if any(greedy):
        onehot = torch.zeros_like(probs).scatter_(1, logits.argmax(dim=-1, keepdim=True), 1.0)
        probs = torch.where(to_device(greedy, torch.bool, probs.device)[:, None], onehot, probs)
    return probs


def _tempered_probs(logits: torch.Tensor, params: list[SamplingParams]) -> torch.Tensor:
    N, V = logits.shape
    dev = logits.device
    temps = [max(p.temperature, 1e-5) for p in params]
    x = logits.float() / to_device(temps, torch.float32, dev)[:, None] if any(t != 1.0 for t in temps) \
        else logits.float()
    if any(0 < p.top_k < V or p.top_p < 1 for p in params):
        top_k = to_device([p.top_k if 0 < p.top_k < V else V for p in params], torch.long, dev)
        top_p = to_device([p.top_p for p in params], x.dtype, dev)
        sorted_x, idx = x.sort(dim=-1, descending=True)
        ranks = torch.arange(V, device=dev)[None, :]
        drop = ranks >= top_k[:, None]
        probs_sorted = sorted_x.softmax(dim=-1)
        # keep the smallest prefix whose mass reaches top_p. The first token always stays,
        # also when top_p is below what float32 holds (5e-324 rounds to 0, and dropping
        # every token would sample from NaNs: a token the grammar forbids, say).
        drop |= (probs_sorted.cumsum(dim=-1) - probs_sorted) >= top_p[:, None]
        drop[:, 0] = False
        sorted_x = sorted_x.masked_fill(drop, float("-inf"))
        x = torch.full_like(x, float("-inf")).scatter(1, idx, sorted_x)
    return x.softmax(dim=-1)


def uniforms(generators: list[torch.Generator | None]) -> torch.Tensor:
    """draw()'s numbers, one a row (float64, on the host): a seeded row's from its own
    generator, the others' from the global one, drawn for every row first."""
    u = torch.rand(len(generators), dtype=torch.float64)
    for i, g in enumerate(generators):
        if g is not None:
            u[i] = torch.rand(1, generator=g, dtype=torch.float64)
    return u


def draw(probs: torch.Tensor, generators: list[torch.Generator | None]) -> torch.Tensor:
    """One token per row, by inverse-CDF sampling: one uniform number per row, so a
    seeded row draws from its own generator and its result does not depend on what it was
    batched with. (A draw per vocabulary entry, as multinomial and the Gumbel trick make,
    costs milliseconds at batch 256 on a CPU; this costs a cumulative sum, done in place
    so that no second [N, V] buffer is made: probs is overwritten.)"""
    return draw_with(probs, uniforms(generators))


def draw_with(probs: torch.Tensor, u: torch.Tensor) -> torch.Tensor:
    """draw() with its numbers given (u: [N] float64, on any device): probs is overwritten."""
    cdf = torch.cumsum(probs, dim=-1, out=probs) if probs.dtype == torch.float32 else probs.float().cumsum(-1)
    # The last entry is the row's total (1 up to rounding): scaling u by it never runs off the end.
    target = (u.to(cdf.device, non_blocking=True) * cdf[:, -1].double()).float()[:, None]
    idx = torch.searchsorted(cdf, target, right=True).squeeze(1)
    return idx.clamp_(max=probs.shape[1] - 1)


def sample(
    logits: torch.Tensor, params: list[SamplingParams], generators: list[torch.Generator | None]
) -> torch.Tensor:
    greedy = [p.greedy for p in params]
    if all(greedy):
        return logits.argmax(dim=-1)
    tokens = draw(_tempered_probs(logits, params), generators)
    if any(greedy):
        tokens = torch.where(to_device(greedy, torch.bool, logits.device), logits.argmax(dim=-1), tokens)
    return tokens


LOGPROB_FLOOR = -9999.0


def logprobs_of(logits: torch.Tensor, tokens: torch.Tensor, num_top: list[int | None]) -> list[TokenLogprob | None]:
    """Logprobs under the model's raw distribution, as OpenAI reports them."""
    if all(n is None for n in num_top):
        return [None] * len(num_top)
    # A grammar's mask leaves -inf, which JSON cannot carry: such a token is reported at
    # -9999, as vLLM does.
    lp = torch.log_softmax(logits.float(), dim=-1).clamp_(min=LOGPROB_FLOOR)
    k = max(n or 0 for n in num_top)
    top_v, top_i = lp.topk(k, dim=-1) if k else (None, None)
    out: list[TokenLogprob | None] = []
    for r, n in enumerate(num_top):
        if n is None:
            out.append(None)
            continue
        t = int(tokens[r])
        out.append(TokenLogprob(t, float(lp[r, t]), top_i[r, :n].tolist() if n else [],
                                top_v[r, :n].tolist() if n else []))
    return out
