from __future__ import annotations

from dataclasses import dataclass

from moemesh.shared.config.common import WorkerConfig


@dataclass(frozen=True)
class PrefillConfig(WorkerConfig):
    lease_timeout_s: float = 30.0  # held KV is freed if no decode worker pulls it by then
    kv_ready_timeout_s: float = 2.0
    # Fault injection for tests of the failure paths; never set in production.
    # "drop": take a hand-off's reply but send nothing and say nothing; "error": fail every send.
    debug_kv_fault: str = ""

    def __post_init__(self):
        super().__post_init__()
        if self.debug_kv_fault not in ("", "drop", "error"):
            raise ValueError("debug_kv_fault must be '', 'drop' or 'error'")
        if self.lease_timeout_s <= 0:
            raise ValueError("lease_timeout_s must be > 0")
