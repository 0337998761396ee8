"""Where one engine step's time went.

forward: device compute (target and MTP forwards), collectives excluded. For an
      overlapped step this is the device's whole step: forward, LM head and sampling.
host: everything on the CPU around it: scheduling, batch building, sampling, draft
      bookkeeping, and the serving loop's own work (publishing tokens, applying
      requests). When the loop overlaps the host with the device, most of it runs
      beside the forward:
host_exposed: the part of host the device waited for. Without overlap, all of it.
rank_wait: time in collectives, the per-step agreement and the MoE all-to-all; on an
      expert-parallel instance that is mostly waiting for the slowest rank.
"""

from __future__ import annotations

from dataclasses import dataclass

from moemesh.shared.engine.outputs import StepStats


@dataclass(frozen=True)
class StepAccount:
    forward_s: float
    host_s: float
    rank_wait_s: float
    num_tokens: int
    num_seqs: int
    host_exposed_s: float = -1.0  # -1: same as host_s (no overlap)

    @property
    def exposed_s(self) -> float:
        return self.host_s if self.host_exposed_s < 0 else self.host_exposed_s

    @property
    def total_s(self) -> float:
        """The step's length as the device sees it."""
        return self.forward_s + self.exposed_s + self.rank_wait_s


def account(st: StepStats, comm_s: float = 0.0, agree_s: float = 0.0, gap_s: float = 0.0) -> StepAccount:
    if st.host_exposed_s is not None:  # overlapped: sampling ran on the device thread
        # A lockstep rank's collectives ran inside its device window: rank wait, not forward.
        # An MTP step's verification and draft pass ran on the device thread after its wait
        # (draft_s): host work too, and the part the next step waited for is in exposed.
        return StepAccount(forward_s=max(0.0, st.forward_s + st.sample_s - comm_s),
                           host_s=(st.loop_host_s or 0.0) + st.draft_s,
                           rank_wait_s=comm_s + agree_s, num_tokens=st.num_tokens, num_seqs=st.num_seqs,
                           host_exposed_s=st.host_exposed_s)
    model_s = st.forward_s + st.draft_s
    return StepAccount(
        forward_s=max(0.0, model_s - comm_s),
        host_s=max(0.0, st.total_s - model_s) + gap_s,
        rank_wait_s=comm_s + agree_s,
        num_tokens=st.num_tokens,
        num_seqs=st.num_seqs,
    )
