"""A request as the engine sees it.

Lifecycle: WAITING -> RUNNING -> FINISHED. A running sequence that is preempted goes
back to WAITING with its blocks freed and is recomputed from its tokens. In the
prefill-only role a sequence whose prompt is done becomes HELD: its blocks stay
allocated until the decode side has pulled them, then it is released.
"""

from __future__ import annotations

import enum
import itertools
import zlib
from dataclasses import dataclass, field

import torch

from moemesh.shared.protocol.messages import PromptLogprobs, SamplingParams, TokenLogprob

_arrival = itertools.count()
# Stands for a token that a step in flight is sampling; the step's landing overwrites it.
PLACEHOLDER = -1


class SeqStatus(enum.Enum):
    WAITING = "waiting"
    RUNNING = "running"
    HELD = "held"
    FINISHED = "finished"


class FinishReason(str, enum.Enum):
    STOP = "stop"
    LENGTH = "length"
    ABORT = "abort"
    ERROR = "error"


@dataclass(frozen=True, slots=True)
class StopRule:
    """Why a request ends on a token; one rule for every kind of step."""

    eos_ids: frozenset[int]
    max_model_len: int

    def __call__(self, p: SamplingParams, token: int, n_out: int, n_tokens: int) -> FinishReason | None:
        """The reason a request ends on `token`, its n_out-th output with n_tokens tokens
        in all then; None: it goes on. p: its SamplingParams."""
        if n_out >= p.min_tokens and ((token in self.eos_ids and not p.ignore_eos) or token in p.stop_token_ids):
            return FinishReason.STOP
        if n_out >= p.max_tokens or n_tokens >= self.max_model_len:
            return FinishReason.LENGTH
        return None


@dataclass(eq=False)  # a sequence is itself, not its fields: `seq in running` compares identity
class Sequence:
    request_id: str
    token_ids: list[int]
    params: SamplingParams
    num_prompt_tokens: int = -1
    num_computed: int = 0  # positions whose KV is in the cache
    block_ids: list[int] = field(default_factory=list)
    ring: int = -1  # DeepSeek-V4: the ring of recent positions, held with the blocks
    table_row: int = -1  # its row in the engine's BlockTables (block_table.py), -1: none yet
    key: int = field(init=False, default=0)  # crc32 of the request id (set in __post_init__)
    # DeepSeek-V4 prefix reuse (engine/snapshots.py): the pinned snapshot to copy into the
    # ring before the first step, the boundaries to snapshot during prefill, and the hash of
    # the newest boundary snapshot taken during decode.
    restore_ring: int = -1
    restore_hash: bytes = b""
    snap_targets: list[int] = field(default_factory=list)
    latest_snap: bytes = b""
    status: SeqStatus = SeqStatus.WAITING
    finish_reason: FinishReason | None = None
    draft_ids: list[int] = field(default_factory=list)
    logprobs: list[TokenLogprob] = field(default_factory=list)
    # Its prompt's scores when it asked for them (engine/prompt_scores.py), filled chunk by chunk.
    prompt_logprobs: PromptLogprobs | None = None
    generator: torch.Generator | None = None
    arrival: int = field(default_factory=lambda: next(_arrival))
    num_preemptions: int = 0
    num_drafted: int = 0
    num_accepted: int = 0
    block_hashes: list[bytes] = field(default_factory=list)  # content hashes of full blocks, a chain
    num_registered: int = 0  # leading blocks whose hashes are in the prefix cache
    num_cached_tokens: int = 0  # prompt tokens found in the prefix cache at admission
    # The step in flight that samples the placeholder at the end of token_ids, and its row there.
    sample_step: int = -1
    sample_row: int = -1
    last_slot: int = 1 << 62  # index in token_ids of its last token by length (set by the engine)
    hold_step: int = -1  # an MTP step in flight whose outcome its next step depends on (spec_overlap.py)
    # Parallel sampling (engine/fork.py). A parent: its children's (request id, params); it
    # computes the prompt but its last position, then forks into them; on V4, also the rings
    # children 1.. take at the fork, held from its admission. A child: its index, and until
    # its first step, the block it copies its prompt's partial last block from.
    forks: list = field(default_factory=list)
    fork_rings: list[int] = field(default_factory=list)
    fork_index: int = 0
    cow_src: int = -1
    matcher: object = None  # structured output: its grammar state (engine/grammar.py), None when free

    def __post_init__(self):
        # A stable number per request (not Python's salted hash): what a model that asks for
        # row keys (the mock's draft head) is given, the same on every run.
        self.key = zlib.crc32(self.request_id.encode())
        if self.num_prompt_tokens < 0:
            self.num_prompt_tokens = len(self.token_ids)
        if self.params.seed is not None and self.generator is None:
            self.generator = torch.Generator().manual_seed(self.params.seed)

    @property
    def num_tokens(self) -> int:
        return len(self.token_ids)

    @property
    def output_ids(self) -> list[int]:
        return self.token_ids[self.num_prompt_tokens :]

    @property
    def num_output_tokens(self) -> int:
        return len(self.token_ids) - self.num_prompt_tokens

    @property
    def is_finished(self) -> bool:
        return self.status == SeqStatus.FINISHED

    @property
    def in_decode(self) -> bool:
        """All tokens but the newest are cached: the next step computes one token."""
        n = len(self.token_ids)  # not the properties: this runs for every row of every step
        return self.num_computed == n - 1 and n > self.num_prompt_tokens

    def generator_at(self, slot: int) -> torch.Generator | None:
        """A seeded request's generator for the token at index `slot` of token_ids; None
        unseeded. Keyed by output position, so a seeded request draws the same numbers
        whether it is sampled here or on another worker, and however it was batched."""
        if self.params.seed is None:
            return None
        return torch.Generator().manual_seed((self.params.seed * 1_000_003 + slot - self.num_prompt_tokens)
                                             & (2**63 - 1))
