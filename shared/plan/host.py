"""Host time per step: what the CPU adds to a lockstep step, and what the barrier adds to that.

A rank's host work (scheduling, batch building, sampling, publishing tokens) runs beside
the device's forward when the serving loop overlaps them, so only part of it lengthens
the step: `hidden_share` of it can hide, and only as much as the step's device time
covers. Rare stalls (a garbage collection, a page fault storm) hit one rank at a time;
in lockstep every rank waits for the one that stalled, so a stall that costs one rank
`stall_s` once every `stall_every` steps costs an N-rank instance that much about N times
as often. That is the barrier term.

Presets are this mesh's measurements (docs/benchmarks.md, "Host overhead"):
- before-9: the loop before the host-overhead work (issue 9): ~5 ms of host per decode
  step at batch 256, none of it overlapped, and full garbage collections that paused a
  loop for 40-60 ms every few hundred steps (taken as 50 ms every 300 steps).
- after-9: after it: 1.46 ms per step at batch 256 with 93% hidden behind a 20 ms step
  (`bench decode --mock-step-ms 20`), 0.30 ms at batch 8 and ~0.5 ms at batch 64 (the V3
  mock rows), i.e. 0.27 ms + 4.5 us per sequence; no collections of start-up objects.
- lockstep: a DEP rank as it steps now: whole steps, none of the host hidden (the
  agreement beside the step is rank wait, not host). DEP-2 on tiny (`bench decode --dep 2
  --batch 16,64`): 0.7 ms a step with 8 sequences a rank, 1.0 ms with 32, i.e. 0.6 ms +
  12.5 us per sequence.
- mtp: whole MTP steps (one draft) as they run now, none hidden: on the mock with a 20 ms
  step (`bench stream --spec-tokens 1 --accept-rate 0.7`, sampled drafts verified
  together), 2.4-2.8 ms a step at 64 sequences and 7.4-9.1 ms at 256, i.e. 0.72 ms +
  29 us per sequence.
- lockstep-mtp: a rank of a mock DEP4 instance with one draft, its steps planned while the
  one before runs, on this 2-core host (`bench stream --dep 4 --spec-tokens 1 --skew
  zipf:1.2`, naive placement): what its step takes beyond the mock's device terms (`plan
  --hardware mock:20`), 3.8 ms with 16 sequences a rank and 5.7 ms with 64, i.e. 3.1 ms +
  40 us per sequence, none hidden: the verification, the ranks' later starts (four rank
  processes share two cores) and the mock's own lag past its set step. Whole steps
  (`overlap_mtp = false`) took 6.1 ms + 178 us.
- none: a host that costs nothing.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np


@dataclass(frozen=True)
class HostModel:
    """Args: name; fixed_s + per_seq_s * sequences = host time per step; hidden_share:
    the part the loop overlaps with the device; stall_s, stall_every: a stall of
    stall_s once every stall_every steps on each rank (0: none); jitter: coefficient of
    variation of the host time between ranks and steps."""

    name: str
    fixed_s: float = 0.0
    per_seq_s: float = 0.0
    hidden_share: float = 0.0
    stall_s: float = 0.0
    stall_every: float = 0.0
    jitter: float = 0.0

    def __post_init__(self) -> None:
        if min(self.fixed_s, self.per_seq_s, self.stall_s, self.stall_every, self.jitter) < 0:
            raise ValueError("host times must be >= 0")
        if not 0 <= self.hidden_share <= 1:
            raise ValueError("hidden_share must be in [0, 1]")

    def host_s(self, seqs: float) -> float:
        return self.fixed_s + self.per_seq_s * seqs

    def sample(self, seqs: np.ndarray, device_s: np.ndarray, rng: np.random.Generator) -> np.ndarray:
        """[S, N] host time each rank adds to its step, stalls apart (expected_stall_s: a
        stall is rare enough that a few dozen sampled steps would miss or overcount it).

        Args:
            seqs: [S, N] sequences each rank runs (decode) or requests it prefills.
            device_s: [S] the step's device time, which the overlapped part hides behind.
        """
        host = self.host_s(seqs)
        if self.jitter:
            host = host * np.clip(1 + self.jitter * rng.standard_normal(host.shape), 0, None)
        hideable = host * self.hidden_share
        return host - hideable + np.maximum(hideable - device_s[:, None], 0)

    def expected_stall_s(self, width: int) -> tuple[float, float]:
        """(a rank's own stall time per step, the instance's) in expectation: each rank
        stalls independently with probability 1/stall_every a step, and the instance
        waits whenever any of its `width` ranks does."""
        if not (self.stall_s and self.stall_every):
            return 0.0, 0.0
        q = 1 / self.stall_every
        return self.stall_s * q, self.stall_s * (1 - (1 - q) ** width)


HOSTS = {
    "none": HostModel("none"),
    "before-9": HostModel("before-9", fixed_s=5e-3, hidden_share=0.0, stall_s=50e-3, stall_every=300),
    "after-9": HostModel("after-9", fixed_s=0.27e-3, per_seq_s=4.5e-6, hidden_share=0.93),
    "lockstep": HostModel("lockstep", fixed_s=0.6e-3, per_seq_s=12.5e-6, hidden_share=0.0),
    "mtp": HostModel("mtp", fixed_s=0.72e-3, per_seq_s=29e-6, hidden_share=0.0),
    "lockstep-mtp": HostModel("lockstep-mtp", fixed_s=3.1e-3, per_seq_s=40e-6, hidden_share=0.0),
}


def get_host(spec: str) -> HostModel:
    """A preset name, or a number of milliseconds: that much host per step, not overlapped."""
    if spec in HOSTS:
        return HOSTS[spec]
    try:
        ms = float(spec)
    except ValueError:
        raise ValueError(f"host overhead {spec!r}: use {', '.join(HOSTS)} or milliseconds per step") from None
    return HostModel(f"{ms:g} ms", fixed_s=ms / 1e3)
