"""Settings every worker service shares. Each service's config extends this one."""

from __future__ import annotations

import os
import socket
from dataclasses import dataclass, field

# start-up placements of experts over a DEP instance's ranks (shared/eplb/placement.py)
EXPERT_PLACEMENTS = ("linear", "round_robin")


def default_worker_id(role: str) -> str:
    return f"{role}-{socket.gethostname().split('.')[0]}-{os.getpid()}"


@dataclass(frozen=True)
class ServiceConfig:
    nats_url: str = "nats://127.0.0.1:4222"
    nats_user: str = ""
    nats_password: str = field(default="", repr=False)  # never printed, never logged
    nats_creds: str = ""
    # Where replies to this service's requests arrive; "" for _INBOX.<nats_user> (or
    # nats-py's _INBOX without a user). Each NATS user may read only its own prefix.
    nats_inbox_prefix: str = ""
    subject_prefix: str = "mm"
    # The first connection to NATS gives up after this long, naming the URL (a service
    # that cannot reach it exits, and its supervisor restarts it); later outages are
    # waited out for ever.
    nats_connect_timeout_s: float = 10.0
    worker_id: str = ""
    model: str = ""
    served_model_name: str = ""
    trace_file: str = ""
    otlp_endpoint: str = ""
    log_level: str = "INFO"
    heartbeat_interval_s: float = 1.0
    drain_timeout_s: float = 30.0
    metrics_host: str = "127.0.0.1"  # /metrics and /health of services without a web app
    metrics_port: int = -1  # -1: off, 0: any free port

    def __post_init__(self):
        if self.heartbeat_interval_s <= 0:
            raise ValueError("heartbeat_interval_s must be > 0")
        if self.nats_connect_timeout_s <= 0:
            raise ValueError("nats_connect_timeout_s must be > 0")
        for name in ("nats_user", "worker_id"):
            if any(c in getattr(self, name) for c in ".*> \t"):
                # Both are subject tokens (heartbeats, inbox prefixes): a dot or a wildcard
                # would let one identity's permissions cover another's subjects.
                raise ValueError(f"{name} may not hold '.', '*', '>' or whitespace")

    @property
    def inbox_prefix(self) -> str:
        if self.nats_inbox_prefix:
            return self.nats_inbox_prefix
        return f"_INBOX.{self.nats_user}" if self.nats_user else "_INBOX"

    @property
    def model_name(self) -> str:
        return self.served_model_name or (os.path.basename(os.path.normpath(self.model)) if self.model else "")


@dataclass(frozen=True)
class WorkerConfig(ServiceConfig):
    dtype: str = "float32"
    device: str = "cpu"
    block_size: int = 16
    num_kv_blocks: int = 0  # 0: size from kv_cache_memory_mb
    kv_cache_memory_mb: int = 256
    max_num_seqs: int = 64
    max_num_batched_tokens: int = 1024
    max_model_len: int = 0  # 0: the model's own
    num_speculative_tokens: int = -1  # -1: 1 when the checkpoint has an MTP layer
    # torch intra-op threads. A mesh runs several processes per host, and OpenMP threads that
    # contend for cores turn 0.4 ms ops into 8 ms ones; 1 is the safe default (0: torch's).
    num_threads: int = 1
    staging_mb: int = 256
    ucx_net_devices: str = ""
    ucx_tls: str = ""
    # a send waits this long progressing UCX before sleeping on its event fd (0: never)
    ucx_send_spin_us: float = 400.0
    transfer_timeout_s: float = 10.0
    # sent token batches are kept this long, for a gateway that lost some (a NATS outage)
    token_retention_s: float = 30.0
    enable_prefix_caching: bool = True  # reuse KV of prefixes computed before (and share it)
    num_prefix_snapshots: int = -1  # DeepSeek-V4: boundary snapshots kept for reuse (-1: max_num_seqs; 0: none)
    decode_graphs: str = "auto"  # decode steps as CUDA graphs: auto (on a GPU), on, eager (static path, no capture), off
    # Wide expert parallelism: this process is rank dp_rank of a DEP-dp_size instance.
    dp_size: int = 1
    dp_rank: int = 0
    instance_id: str = ""
    dist_init: str = ""  # tcp://host:port, the same for every rank of the instance
    expert_parallel: bool = False  # implied by dp_size > 1; with 1 rank, redundant slots still rebalance
    eplb_redundant: int = 0  # redundant expert slots per rank
    # The start-up placement of experts over the ranks (shared/eplb/placement.py):
    # linear (rank r: a contiguous run) or round_robin (rank r: r, r + N, ...).
    expert_placement: str = "linear"
    load_window_steps: int = 256
    load_publish_interval_s: float = 1.0
    dp_timeout_s: float = 60.0
    move_timeout_s: float = 30.0
    # Routing skew on purpose, for balanced-vs-skewed benchmarks (see shared/model/skew.py).
    skew: str = ""
    draft_skew: str = ""
    skew_seed: int = 0
    debug_fail_move: bool = False  # fault injection: this rank fails every expert move
    # "mock": no model compute, a fixed step time (infrastructure benchmarks only).
    engine: str = "model"
    mock_step_ms: float = 10.0
    # The mock's draft head: < 0, none; else each of its num_speculative_tokens drafts a
    # step is accepted with this probability (a hash of request and position decides).
    mock_accept_rate: float = -1.0
    # As a DEP rank, the part of the mock's step its experts take: a rank's step is
    # mock_step_ms × ((1 - s) + s × its expert load / the instance's mean load).
    mock_expert_share: float = 0.5
    # MTP steps planned while the step before runs (shared/engine/spec_overlap.py), where
    # the engine can; False: every MTP step runs whole.
    overlap_mtp: bool = True
    # A DEP rank's steps without MTP planned while the one before runs; False: whole steps.
    overlap_lockstep: bool = True

    def __post_init__(self):
        super().__post_init__()
        if not self.model:
            raise ValueError("model is required (a Hugging Face layout directory)")
        if self.decode_graphs not in ("auto", "on", "eager", "off"):
            raise ValueError(f"decode_graphs must be auto, on, eager or off, got {self.decode_graphs!r}")
        if not 0 <= self.dp_rank < self.dp_size:
            raise ValueError(f"dp_rank must be in [0, dp_size={self.dp_size})")
        if self.uses_ep and not self.dist_init:
            raise ValueError("dist_init (tcp://host:port shared by the ranks) is required with expert parallelism")
        if self.mock_accept_rate > 1:
            raise ValueError(f"mock_accept_rate must be at most 1 (or < 0: no draft head), got {self.mock_accept_rate}")
        if self.eplb_redundant < 0:
            raise ValueError("eplb_redundant must be >= 0")
        if self.expert_placement not in EXPERT_PLACEMENTS:
            raise ValueError(f"expert_placement must be one of {', '.join(EXPERT_PLACEMENTS)}, "
                             f"got {self.expert_placement!r}")
        if self.ucx_send_spin_us < 0:
            raise ValueError(f"ucx_send_spin_us must be >= 0, got {self.ucx_send_spin_us}")
        if self.engine not in ("model", "mock"):
            raise ValueError("engine must be 'model' or 'mock'")
        if not 0 <= self.mock_expert_share <= 1:
            raise ValueError(f"mock_expert_share must be in [0, 1], got {self.mock_expert_share}")

    @property
    def uses_ep(self) -> bool:
        return self.dp_size > 1 or self.expert_parallel

    @property
    def instance(self) -> str:
        return self.instance_id or self.worker_id
