from __future__ import annotations

from dataclasses import dataclass

from moemesh.shared.config.common import WorkerConfig


@dataclass(frozen=True)
class DecodeConfig(WorkerConfig):
    # What to do when pulling a request's KV fails or times out: "recompute" runs the
    # prompt again here; "fail" ends the request with an error. Blocks are freed either way.
    on_transfer_failure: str = "recompute"
    # Decode-only benchmarking: requests sent straight to this worker get a dummy-filled
    # cache instead of a prefill (bench decode). Never on in serving; it is logged loudly
    # and only a gateway started with decode_only_bench sends such requests.
    bench_dummy_kv: bool = False

    def __post_init__(self):
        super().__post_init__()
        if self.on_transfer_failure not in ("recompute", "fail"):
            raise ValueError("on_transfer_failure must be 'recompute' or 'fail'")
