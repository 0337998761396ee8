"""Where one engine step's time went.

forward: model compute (target and MTP forwards), collectives excluded.
host: everything on the CPU around it: scheduling, batch building, sampling, draft
      bookkeeping, and the serving loop's own work between steps (publishing tokens,
      applying requests).
rank_wait: time in collectives, the per-step agreement and the MoE all-to-all; on an
      expert-parallel instance that is mostly waiting for the slowest rank.
"""

from __future__ import annotations

from dataclasses import dataclass

from shared.engine.engine import StepStats


@dataclass(frozen=True)
class StepAccount:
    forward_s: float
    host_s: float
    rank_wait_s: float
    num_tokens: int
    num_seqs: int

    @property
    def total_s(self) -> float:
        return self.forward_s + self.host_s + self.rank_wait_s


def account(st: StepStats, comm_s: float = 0.0, agree_s: float = 0.0, gap_s: float = 0.0) -> StepAccount:
    model_s = st.forward_s + st.draft_s
    return StepAccount(
        forward_s=max(0.0, model_s - comm_s),
        host_s=max(0.0, st.total_s - model_s) + gap_s,
        rank_wait_s=comm_s + agree_s,
        num_tokens=st.num_tokens,
        num_seqs=st.num_seqs,
    )
