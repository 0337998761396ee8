from __future__ import annotations

from dataclasses import dataclass

from moemesh.shared.config.common import ServiceConfig


@dataclass(frozen=True)
class KVStoreConfig(ServiceConfig):
    capacity_mb: int = 1024  # CPU memory tier
    disk_dir: str = ""  # empty: no disk tier
    disk_capacity_mb: int = 8192
    staging_mb: int = 256
    ucx_net_devices: str = ""
    ucx_tls: str = ""
    ucx_send_spin_us: float = 400.0
    transfer_timeout_s: float = 10.0

    def __post_init__(self):
        super().__post_init__()
        if self.capacity_mb < 1 or self.staging_mb < 1:
            raise ValueError("capacity_mb and staging_mb must be >= 1")
        if self.ucx_send_spin_us < 0:
            raise ValueError(f"ucx_send_spin_us must be >= 0, got {self.ucx_send_spin_us}")
