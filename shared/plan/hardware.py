"""The machines the planner knows: published per-GPU figures, and this host as measured.

Every figure of the table is from a public source; docs/plan.md names each one. NVIDIA
quotes tensor FLOP/s with 2:4 sparsity; the table holds the dense figure (half). NVLink
is quoted as the sum of both directions; the table holds one direction, which is what
an all-to-all's sender sees. What a kernel reaches of these peaks (the efficiencies) is
an assumption, not a published figure, and is kept apart so it can be changed.

Units: bytes/s and FLOP/s.
"""

from __future__ import annotations

from dataclasses import dataclass, replace

TB, GB, TF, PF = 1e12, 1e9, 1e12, 1e15


@dataclass(frozen=True)
class Hardware:
    """One GPU of a system, and the links between GPUs.

    Args:
        name: key in HARDWARE.
        hbm_bw: HBM bandwidth.
        bf16_flops, fp8_flops: dense tensor-core peaks.
        nvlink_bw: NVLink bandwidth per GPU, one direction.
        net_bw: scale-out network per GPU, one direction (the NIC's line rate).
        gpus_per_domain: GPUs that reach each other over NVLink.
        hbm_bytes: HBM capacity (bounds a decode rank's batch by its KV cache; 0 = no bound).
        compute_eff, mem_eff: fraction of the peaks a kernel reaches (assumption).
        a2a_eff: fraction of the link an all-to-all reaches (DeepEP: 153 of ~160 GB/s
            over NVLink, 43-58 of ~50 GB/s over RDMA).
        a2a_latency_s: fixed cost of one dispatch + combine, on top of its bytes.
        cores: CPU cores a rank shares with the other ranks and services (this host only;
            0 = a rank never waits for a core).
    """

    name: str
    hbm_bw: float
    bf16_flops: float
    fp8_flops: float
    nvlink_bw: float
    net_bw: float
    gpus_per_domain: int
    hbm_bytes: float = 0.0
    compute_eff: float = 0.6
    mem_eff: float = 0.75
    a2a_eff: float = 0.9
    a2a_latency_s: float = 30e-6
    cores: int = 0

    def __post_init__(self) -> None:
        if min(self.hbm_bw, self.bf16_flops, self.fp8_flops, self.nvlink_bw, self.net_bw) <= 0:
            raise ValueError(f"{self.name}: bandwidths and FLOP/s must be positive")
        if self.gpus_per_domain < 1 or not 0 < self.compute_eff <= 1 or not 0 < self.mem_eff <= 1:
            raise ValueError(f"{self.name}: need gpus_per_domain >= 1 and efficiencies in (0, 1]")

    def peer_split(self, width: int) -> tuple[float, float]:
        """(share of a rank's traffic to other ranks in its NVLink domain, share off it)."""
        if width <= 1:
            return 0.0, 0.0
        local = min(width, self.gpus_per_domain) - 1
        return local / width, (width - 1 - local) / width


# Dense figures; sources in docs/plan.md ("Hardware").
HARDWARE: dict[str, Hardware] = {
    # H200 SXM: 4.8 TB/s HBM3e; 1,979 TF BF16 and 3,958 TF FP8 with sparsity; NVLink 900
    # GB/s both ways; 141 GB; HGX H200 boards of 8; one 400 Gb/s ConnectX-7 per GPU (DGX H200).
    "h200": Hardware("h200", hbm_bw=4.8 * TB, bf16_flops=989 * TF, fp8_flops=1979 * TF, nvlink_bw=450 * GB,
                     net_bw=50 * GB, gpus_per_domain=8, hbm_bytes=141 * GB),
    # HGX B200: 8 GPUs, 1.44 TB and 64 TB/s of HBM3e in all; 36 PF BF16 and 72 PF FP8 with sparsity for
    # the 8; NVLink 5 at 1.8 TB/s per GPU both ways; 400 Gb/s ConnectX-7 per GPU (DGX B200).
    "b200": Hardware("b200", hbm_bw=8.0 * TB, bf16_flops=2250 * TF, fp8_flops=4500 * TF, nvlink_bw=900 * GB,
                     net_bw=50 * GB, gpus_per_domain=8, hbm_bytes=180 * GB),
    # GB200 NVL72: 13.4 TB and 576 TB/s of HBM3e, 360 PF BF16 and 720 PF FP8 with sparsity, 130 TB/s
    # NVLink, all for 72 GPUs in one NVLink domain; 400 Gb/s ConnectX-7 per GPU.
    "gb200-nvl72": Hardware("gb200-nvl72", hbm_bw=8.0 * TB, bf16_flops=2500 * TF, fp8_flops=5000 * TF,
                            nvlink_bw=900 * GB, net_bw=50 * GB, gpus_per_domain=72, hbm_bytes=186 * GB),
    # GB300 NVL72: 20 TB (279 GB per GPU) and 576 TB/s of HBM3e, 360 PF BF16 and 720 PF FP8 with sparsity (Blackwell
    # Ultra keeps B200's FP8 rate and raises FP4), 130 TB/s NVLink, 72 GPUs; 800 Gb/s
    # ConnectX-8 SuperNIC per GPU.
    "gb300-nvl72": Hardware("gb300-nvl72", hbm_bw=8.0 * TB, bf16_flops=2500 * TF, fp8_flops=5000 * TF,
                            nvlink_bw=900 * GB, net_bw=100 * GB, gpus_per_domain=72, hbm_bytes=279 * GB),
}


def get_hardware(name: str, **overrides) -> Hardware:
    """A table entry, with fields replaced (e.g. compute_eff=0.5)."""
    if name not in HARDWARE:
        raise ValueError(f"unknown hardware {name!r}; choose from {', '.join(HARDWARE)} or this-host")
    return replace(HARDWARE[name], **overrides) if overrides else HARDWARE[name]
