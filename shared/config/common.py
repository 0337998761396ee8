"""Settings every worker service shares. Each service's config extends this one."""

from __future__ import annotations

import os
import socket
from dataclasses import dataclass

from shared.engine.config import EngineConfig


def default_worker_id(role: str) -> str:
    return f"{role}-{socket.gethostname().split('.')[0]}-{os.getpid()}"


@dataclass(frozen=True)
class ServiceConfig:
    nats_url: str = "nats://127.0.0.1:4222"
    nats_user: str = ""
    nats_password: str = ""
    nats_creds: str = ""
    subject_prefix: str = "mm"
    worker_id: str = ""
    model: str = ""
    served_model_name: str = ""
    trace_file: str = ""
    otlp_endpoint: str = ""
    log_level: str = "INFO"
    heartbeat_interval_s: float = 1.0
    drain_timeout_s: float = 30.0

    def __post_init__(self):
        if self.heartbeat_interval_s <= 0:
            raise ValueError("heartbeat_interval_s must be > 0")

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
    num_threads: int = 0
    staging_mb: int = 256
    ucx_net_devices: str = ""
    ucx_tls: str = ""
    transfer_timeout_s: float = 10.0

    def __post_init__(self):
        super().__post_init__()
        if not self.model:
            raise ValueError("model is required (a Hugging Face layout directory)")

    def engine_config(self, role: str) -> EngineConfig:
        return EngineConfig(
            model=self.model, role=role, dtype=self.dtype, device=self.device, block_size=self.block_size,
            num_kv_blocks=self.num_kv_blocks or None, kv_cache_memory_mb=self.kv_cache_memory_mb,
            max_num_seqs=self.max_num_seqs, max_num_batched_tokens=self.max_num_batched_tokens,
            max_model_len=self.max_model_len or None,
            num_speculative_tokens=None if self.num_speculative_tokens < 0 else self.num_speculative_tokens,
            num_threads=self.num_threads or None,
        )
