from __future__ import annotations

from dataclasses import dataclass

from shared.config.common import ServiceConfig


@dataclass(frozen=True)
class BalancerConfig(ServiceConfig):
    check_interval_s: float = 5.0  # how often each instance's placement is reconsidered
    min_window_tokens: int = 2048  # below this the loads are too thin to act on
    algorithm: str = "ours"  # ours | deepseek-global | deepseek-hierarchical
    num_nodes: int = 1  # for the hierarchical reference algorithm
    trigger_ratio: float = 0.90  # consider a move only when the current ratio falls below this
    min_gain: float = 0.02  # ... and the candidate improves it by at least this much
    cooldown_s: float = 30.0  # after a move, wait this long before the next
    move_timeout_s: float = 30.0  # a move not staged and done by then is aborted
    auto: bool = True  # False: move only when asked (mm.eplb.{instance}.rebalance)

    def __post_init__(self):
        super().__post_init__()
        if self.algorithm not in ("ours", "deepseek-global", "deepseek-hierarchical"):
            raise ValueError("algorithm must be ours, deepseek-global or deepseek-hierarchical")
        if self.check_interval_s <= 0 or self.move_timeout_s <= 0:
            raise ValueError("check_interval_s and move_timeout_s must be > 0")
