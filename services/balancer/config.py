from __future__ import annotations

from dataclasses import dataclass

from moemesh.shared.config.common import ServiceConfig


@dataclass(frozen=True)
class BalancerConfig(ServiceConfig):
    check_interval_s: float = 5.0  # how often each instance's placement is reconsidered
    min_window_tokens: int = 2048  # below this the loads are too thin to act on
    algorithm: str = "ours"  # ours | ours-hierarchical | deepseek-global | deepseek-hierarchical
    num_nodes: int = 1  # for the hierarchical algorithms
    # When to move (shared/eplb/hysteresis.py): the current ratio on a held-out window
    # fell below trigger_ratio and the candidate beats it there by min_gain, or by
    # cooldown_gain within cooldown_windows checks of the last move.
    trigger_ratio: float = 0.95
    min_gain: float = 0.01
    cooldown_gain: float = 0.03
    cooldown_windows: int = 5
    incremental: bool = True  # start from the running placement: far fewer slots move
    layers_per_move: int = 0  # 0: all changed layers in one move; k: one move per k layers, in turn
    move_timeout_s: float = 30.0  # a move not staged and done by then is aborted
    auto: bool = True  # False: move only when asked (mm.eplb.{instance}.rebalance)
    debug_commit_delay_s: float = 0.0  # fault injection: a wait between staged and commit (at most to the deadline: abort)

    def __post_init__(self):
        super().__post_init__()
        if self.algorithm not in ("ours", "ours-hierarchical", "deepseek-global", "deepseek-hierarchical"):
            raise ValueError("algorithm must be ours, ours-hierarchical, deepseek-global or deepseek-hierarchical")
        if self.check_interval_s <= 0 or self.move_timeout_s <= 0:
            raise ValueError("check_interval_s and move_timeout_s must be > 0")
