from __future__ import annotations

from dataclasses import dataclass, field

from moemesh.shared.config.common import ServiceConfig
from moemesh.shared.protocol.forks import MAX_N


@dataclass(frozen=True)
class GatewayConfig(ServiceConfig):
    host: str = "127.0.0.1"
    port: int = 8000
    max_inflight: int = 512  # admitted requests in flight at most
    # Requests that find max_inflight in flight wait for a slot, by priority class and then
    # arrival (services/gateway/admission/): at most admission_queue of them (0: refused at
    # once), each for at most admission_wait_s; then, or when the queue is full of classes
    # as good or better, 429 with Retry-After. A better class takes the place of the worst
    # class's latest waiter when the queue is full.
    admission_queue: int = 256
    admission_wait_s: float = 5.0
    # Of max_inflight, the slots only classes below admission_reserve_below may take (by
    # default those better than the default class, 0): the others stop short of them, so
    # that a better class arriving under overload finds a slot at once rather than waiting
    # for one to free. 0: no reserve; every class may take every slot. Sized above the
    # decode pool's seats (max_inflight = their max_num_seqs + the reserve), it costs no
    # throughput: the decode scheduler seats a better class first and parks the worse
    # (docs/architecture.md#priority-classes).
    admission_reserve: int = 0
    admission_reserve_below: int = 0
    retry_after_s: int = 1
    prefill_timeout_s: float = 5.0  # for a prefill worker to accept a job
    # A new request's job waits this long for the gateway's NATS link to come back (and
    # the workers to re-subscribe) before the request is a 503 (LinkState, in
    # services/gateway/mesh/client.py).
    nats_outage_wait_s: float = 30.0
    max_migrations: int = 3  # times one request is moved to other workers when its worker dies
    # How long (in its heartbeat intervals) a worker may be silent while it is still
    # subscribed on NATS (stopped, swapping, cut off) before its requests move anyway. A
    # dead one moves sooner: once it has missed two beats (one when suspect), a probe
    # finds nothing subscribed to its subjects (services/gateway/mesh/migration.py).
    silent_worker_limit: float = 6.0
    inactivity_timeout_s: float = 60.0  # no token for this long: the request fails
    default_max_tokens: int = 256
    max_body_bytes: int = 8 << 20  # a larger request body is refused with 413
    body_timeout_s: float = 30.0  # a client that has not sent its whole body by then gets 408
    header_timeout_s: float = 10.0  # a connection whose request headers take longer is closed
    # After an answer given before the body was all read (413, 408, 429), the rest of the
    # body is read and discarded, so that a client still writing it gets the answer and not
    # a reset; up to this many bytes and seconds (services/gateway/http/server.py).
    linger_bytes: int = 128 << 20
    linger_s: float = 5.0
    # Bodies larger than this are parsed and tokenized on a thread: a long prompt must not
    # hold up every other request (and /health) on the event loop.
    inline_parse_bytes: int = 16 << 10
    max_model_len: int = 0  # 0: the model's own
    # Admit a max_model_len past the model's positions: for meshes of mock engines (engine =
    # "mock"), which serve any length, to replay traces at their recorded lengths.
    allow_long_max_model_len: bool = False
    # Decode-only benchmarking: send requests straight to decode workers started with
    # bench_dummy_kv, skipping prefill and KV transfer. Logged loudly, shown in /v1/models.
    decode_only_bench: bool = False
    # Name the decode worker that served a response in an x-moemesh-worker header, for
    # `moemesh bench serve`'s per-worker throughput. Off: it tells clients internal names.
    worker_header: bool = False
    # Bearer keys clients must send (services/gateway/http/auth.py); none given: the API is open.
    # Prefer api_keys_file or the environment: flags show up in `ps`. repr=False keeps keys
    # out of any log line that prints the config.
    api_keys: tuple[str, ...] = field(default=(), repr=False)
    api_keys_file: str = ""
    # Parallel sampling: the most choices (`n`) one request may ask for; each is a sequence
    # on the workers (a request of n counts n against their max_num_seqs).
    max_n: int = 16
    # A completion's batch of prompts (`prompt` as an array of them): the most one request
    # may hold; each is a request of its own on the workers, n sequences each.
    max_prompts: int = 64

    def __post_init__(self):
        super().__post_init__()
        if not self.model:
            raise ValueError("model is required: the gateway tokenizes with the model's tokenizer")
        if not 0 < self.port < 65536 and self.port != 0:
            raise ValueError("port must be in [0, 65535]")
        if self.max_inflight < 1:
            raise ValueError("max_inflight must be >= 1")
        if self.admission_queue < 0 or not self.admission_wait_s > 0:
            raise ValueError("admission_queue must be >= 0 and admission_wait_s > 0")
        if not 0 <= self.admission_reserve < self.max_inflight:
            raise ValueError("admission_reserve must be in [0, max_inflight)")
        if not 1 <= self.max_n <= MAX_N:
            raise ValueError(f"max_n must be in [1, {MAX_N}]")
        if self.max_prompts < 1:
            raise ValueError("max_prompts must be >= 1")
        if self.max_body_bytes < 1024:
            raise ValueError("max_body_bytes must be >= 1024")
        if self.body_timeout_s <= 0 or self.header_timeout_s <= 0:
            raise ValueError("body_timeout_s and header_timeout_s must be > 0")
        if self.linger_bytes < 0 or self.linger_s <= 0:
            raise ValueError("linger_bytes must be >= 0 and linger_s > 0")
