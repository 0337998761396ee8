"""Message types of the mesh's control plane (see subjects.py for who sends what).

A request's first message (PrefillJob) carries everything about it; KVReady hands
the same to the decode worker once. After that, TokenBatch carries only what changed:
new token ids per request, once per engine step per gateway.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from shared.engine.sampling_params import SamplingParams


@dataclass
class WireSampling:
    max_tokens: int = 16
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = 0
    seed: int | None = None
    stop_token_ids: list[int] = field(default_factory=list)
    ignore_eos: bool = False
    logprobs: int | None = None
    min_tokens: int = 0

    def to_params(self) -> SamplingParams:
        # Stop strings never reach workers: the gateway detokenizes and applies them.
        return SamplingParams(
            max_tokens=self.max_tokens, temperature=self.temperature, top_p=self.top_p, top_k=self.top_k,
            seed=self.seed, stop_token_ids=tuple(self.stop_token_ids), ignore_eos=self.ignore_eos,
            logprobs=self.logprobs, min_tokens=self.min_tokens,
        )

    @classmethod
    def from_params(cls, p: SamplingParams) -> "WireSampling":
        return cls(p.max_tokens, p.temperature, p.top_p, p.top_k, p.seed, list(p.stop_token_ids), p.ignore_eos,
                   p.logprobs, p.min_tokens)


@dataclass
class PrefillJob:
    request_id: str
    prompt_ids: list[int]
    sampling: WireSampling
    gateway_id: str
    decode_id: str  # the decode worker the gateway chose
    arrival_time: float = 0.0


@dataclass
class KVLayout:
    """What both sides must agree on for a KV buffer to be meaningful."""

    num_layers: int
    block_size: int
    dim: int
    dtype: str
    model_fingerprint: str


@dataclass
class KVReady:
    request_id: str
    prompt_ids: list[int]
    output_ids: list[int]  # tokens already sampled on the prefill worker (at least one)
    sampling: WireSampling
    gateway_id: str
    prefill_id: str
    prefill_address: bytes  # UCX worker address of the prefill worker
    lease_id: int
    num_blocks: int
    nbytes: int
    layout: KVLayout
    lease_expires_in_s: float = 30.0


@dataclass
class KVPull:
    request_id: str
    lease_id: int
    decode_address: bytes
    tag: int
    nbytes: int


@dataclass
class KVPullReply:
    ok: bool
    nbytes: int = 0
    error: str = ""


@dataclass
class KVRelease:
    request_id: str
    lease_id: int
    ok: bool = True


@dataclass
class Ack:
    ok: bool = True
    error: str = ""


@dataclass
class ErrorReply:
    error: str
    code: str = "bad_request"


@dataclass
class TokenLogprobWire:
    token_id: int
    logprob: float
    top: list[list[float]] = field(default_factory=list)  # [[token_id, logprob], ...]


@dataclass
class TokenUpdate:
    request_id: str
    token_ids: list[int]
    finish_reason: str | None = None  # stop | length | abort | error
    error: str | None = None
    num_prompt_tokens: int = 0
    logprobs: list[TokenLogprobWire] | None = None
    worker_id: str = ""


@dataclass
class TokenBatch:
    updates: list[TokenUpdate]
    sent_at: float = 0.0


@dataclass
class Abort:
    request_ids: list[str]
    reason: str = "client"


@dataclass
class WorkerLoad:
    num_running: int = 0
    num_waiting: int = 0
    num_free_blocks: int = 0
    num_blocks: int = 0
    outstanding_tokens: int = 0  # tokens still to generate for admitted requests


@dataclass
class Heartbeat:
    worker_id: str
    role: str  # prefill | decode | balancer | kv_store
    model: str
    load: WorkerLoad
    address: bytes = b""  # UCX worker address
    instance_id: str = ""
    dp_rank: int = 0
    dp_size: int = 1
    draining: bool = False
    interval_s: float = 1.0
    sent_at: float = 0.0


@dataclass
class StatsRequest:
    detail: bool = False


@dataclass
class WorkerStats:
    worker_id: str
    role: str
    load: WorkerLoad
    num_held: int = 0  # prefill: requests whose KV waits for a pull
    num_transfers: int = 0  # decode: KV pulls in flight
    staging_bytes_used: int = 0
    counters: dict[str, float] = field(default_factory=dict)
