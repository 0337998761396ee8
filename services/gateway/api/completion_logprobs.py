"""/v1/completions' logprobs: OpenAI's legacy shape, with vLLM's extensions, the echoed
prompt's tokens (`echo` with `logprobs`) and `prompt_logprobs`. Pure: no I/O.

The legacy shape is four parallel arrays per choice:
- tokens: each token's text;
- token_logprobs: its logprob, null for the first prompt token (nothing comes before it);
- top_logprobs: text -> logprob of the token itself and the `logprobs` most likely there,
  so up to logprobs + 1 entries (OpenAI's definition); null where token_logprobs is;
- text_offset: where its text starts in the choice's text, the echoed prompt included,
  running on across a stream's chunks.

vLLM's prompt_logprobs, per prompt token: null for the first, else {token id: {logprob,
rank, decoded_token}} of the token itself and the `prompt_logprobs` most likely there.

An entry is (token id, logprob or None, [(id, logprob) of the most likely, best first]).
"""

from __future__ import annotations

from typing import Any, Callable

from moemesh.shared.protocol.messages import PromptLogprobs, TokenLogprob
from moemesh.shared.tokenizer.tokenizer import Tokenizer

Entry = tuple[int, float | None, list[tuple[int, float]]]


def token_text(tok: Tokenizer, as_ids: bool = False) -> Callable[[int], str]:
    """A token's text as a logprob names it: special tokens included, as decoded alone;
    as_ids (return_tokens_as_token_ids): "token_id:<id>" instead."""
    if as_ids:
        return lambda t: f"token_id:{int(t)}"
    return lambda t: tok.decode([int(t)], skip_special_tokens=False)


def prompt_entries(ids: list[int], scores: PromptLogprobs, num_top: int) -> list[Entry]:
    """The prompt's tokens; scores: the prefill's (protocol/messages.py), one row per token after the first."""
    if scores.num_rows != len(ids) - 1:
        raise ValueError(f"{scores.num_rows} prompt scores for a prompt of {len(ids)} tokens")
    out: list[Entry] = [(ids[0], None, [])]
    for i in range(1, len(ids)):
        top_ids, top_lps = scores.top(i - 1)
        out.append((ids[i], scores.logprobs[i - 1], list(zip(top_ids[:num_top], top_lps[:num_top]))))
    return out


def generated_entries(lps: list[TokenLogprob]) -> list[Entry]:
    return [(lp.token_id, lp.logprob, list(zip(lp.top_ids, lp.top_logprobs))) for lp in lps]


class LegacyLogprobs:
    """One choice's legacy logprobs, chunk by chunk (a whole answer is one chunk)."""

    def __init__(self, tok: Tokenizer, as_ids: bool = False):
        self.text = token_text(tok)  # what text_offset counts: the choice's text
        self.name = token_text(tok, as_ids)  # what tokens and top_logprobs say
        self.offset = 0  # the choice's text so far, in characters

    def payload(self, entries: list[Entry]) -> dict[str, Any]:
        tokens, lps, tops, offsets = [], [], [], []
        for tid, lp, top in entries:
            t = self.name(tid)
            tokens.append(t)
            lps.append(lp)
            if lp is None:
                tops.append(None)
            else:
                d = {t: lp}
                for i, v in top:
                    d.setdefault(self.name(i), v)  # two ids of one text: the first (the token's own) stays
                tops.append(d)
            offsets.append(self.offset)
            self.offset += len(self.text(tid))
        return {"tokens": tokens, "token_logprobs": lps, "top_logprobs": tops, "text_offset": offsets}


def vllm_prompt_logprobs(ids: list[int], scores: PromptLogprobs, num_top: int, tok: Tokenizer,
                         as_ids: bool = False) -> list:
    text = token_text(tok, as_ids)
    out: list = [None]
    for i, (tid, _, top) in enumerate(prompt_entries(ids, scores, num_top)[1:]):
        d = {str(tid): {"logprob": scores.logprobs[i], "rank": scores.ranks[i], "decoded_token": text(tid)}}
        for rank, (t, v) in enumerate(top, 1):
            d.setdefault(str(t), {"logprob": v, "rank": rank, "decoded_token": text(t)})
        out.append(d)
    return out
