"""What a step gives back: per-request outputs (offline use, tests, the speculative step),
the same by column (the serving path), and the step's timings."""

from __future__ import annotations

from dataclasses import dataclass, field

from moemesh.shared.engine.sequence import FinishReason
from moemesh.shared.protocol.messages import PromptLogprobs, TokenLogprob


@dataclass
class Finished:
    """A row whose request ends, or that carries more than its token ids."""
    row: int
    finish_reason: FinishReason | None = None
    logprobs: list[TokenLogprob] | None = None
    prefill_done: bool = False
    block_hashes: list[bytes] | None = None
    num_prompt_tokens: int = 0
    num_cached_tokens: int = 0  # with num_prompt_tokens: those of them found in the prefix cache
    prompt_logprobs: PromptLogprobs | None = None  # with the first token of a request that asked


@dataclass
class StepOutputs:
    """One step's new tokens, by column: row i of request_ids got the ids
    token_ids[offsets[i]:offsets[i + 1]] (one each when counts is None). `extras` holds
    the few rows that finish or carry logprobs, in row order."""
    request_ids: list[str] = field(default_factory=list)
    token_ids: list[int] = field(default_factory=list)
    counts: list[int] | None = None
    extras: list[Finished] = field(default_factory=list)
    # each row's place in its request's output (the index of its first id): the receiver
    # of a stream sees a gap or a repeat by it
    positions: list[int] = field(default_factory=list)

    def __len__(self) -> int:
        return len(self.request_ids)

    def tokens_of(self, row: int) -> list[int]:
        if self.counts is None:
            return self.token_ids[row : row + 1]
        start = sum(self.counts[:row])
        return self.token_ids[start : start + self.counts[row]]


@dataclass
class RequestOutput:
    request_id: str
    new_token_ids: list[int]
    finished: bool = False
    finish_reason: FinishReason | None = None
    logprobs: list[TokenLogprob] | None = None
    prefill_done: bool = False  # prefill role: the request is HELD, its KV ready to export
    num_prompt_tokens: int = 0
    num_cached_tokens: int = 0  # of num_prompt_tokens, found in the prefix cache (first token only)
    block_hashes: list[bytes] | None = None  # on finish: hashes of its full computed blocks
    position: int = 0  # index in the request's output of new_token_ids[0]
    prompt_logprobs: PromptLogprobs | None = None  # with the first token of a request that asked


@dataclass
class StepStats:
    num_seqs: int = 0
    num_tokens: int = 0
    num_decode: int = 0
    schedule_s: float = 0.0
    prepare_s: float = 0.0
    forward_s: float = 0.0
    sample_s: float = 0.0
    draft_s: float = 0.0
    logits_s: float = 0.0
    land_s: float = 0.0  # planned steps: writing the sampled ids back, stop checks, outputs
    total_s: float = 0.0
    # Overlapped steps (set by the serving loop): the host work of the loop round that
    # landed the step, and the part of it the device waited for.
    loop_host_s: float | None = None
    host_exposed_s: float | None = None
    num_drafted: int = 0
    num_accepted: int = 0
    # Prompts this step completed: their tokens, and those of them found in the prefix
    # cache (a parent's children count their prompt once).
    num_prompt_tokens: int = 0
    num_cached_tokens: int = 0
    preempted: list[str] = field(default_factory=list)
    scheduled: list[str] = field(default_factory=list)  # request ids computed in this step

    @property
    def host_s(self) -> float:
        return self.total_s - self.forward_s - self.draft_s


def request_outputs(out: StepOutputs) -> list[RequestOutput]:
    """The per-request view of a step's columns (offline use and tests)."""
    extras = {e.row: e for e in out.extras}
    res = []
    for i, rid in enumerate(out.request_ids):
        o = RequestOutput(rid, out.tokens_of(i), position=out.positions[i] if out.positions else 0)
        e = extras.get(i)
        if e is not None:
            o.finished, o.finish_reason = e.finish_reason is not None, e.finish_reason
            o.logprobs, o.prefill_done, o.block_hashes = e.logprobs, e.prefill_done, e.block_hashes
            o.num_prompt_tokens, o.num_cached_tokens = e.num_prompt_tokens, e.num_cached_tokens
            o.prompt_logprobs = e.prompt_logprobs
        res.append(o)
    return res


def step_outputs(outs: list[RequestOutput]) -> StepOutputs:
    """The column view of per-request outputs (the speculative step's)."""
    res = StepOutputs(counts=[])
    for i, o in enumerate(outs):
        res.request_ids.append(o.request_id)
        res.token_ids += o.new_token_ids
        res.counts.append(len(o.new_token_ids))
        res.positions.append(o.position)
        if (o.finished or o.logprobs or o.prefill_done or o.block_hashes or o.num_cached_tokens
                or o.prompt_logprobs is not None):
            res.extras.append(Finished(i, o.finish_reason if o.finished else None, o.logprobs, o.prefill_done,
                                       o.block_hashes, o.num_prompt_tokens, o.num_cached_tokens, o.prompt_logprobs))
    return res
