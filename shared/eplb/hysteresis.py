"""When to replace the running placement with a candidate: threshold and hysteresis.

Every window the balancer can build a candidate, but switching costs expert copies,
and on stationary traffic a fresh candidate is only better on the window it was built
from. So the decision is judged HELD OUT, on loads the candidate was not built from,
and a switch needs all of:

1. trigger: the current placement's ratio on those loads fell below `trigger`;
2. gain: the candidate beats it there by more than `min_gain`;
3. hysteresis: within `cooldown_windows` windows of the last switch, by more than
   `cooldown_gain` instead, so a switch is not undone by the next wobble.

Pure: the caller keeps the SwitchState and passes the one returned back in.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from moemesh.shared.eplb.placement import Placement


@dataclass(frozen=True)
class SwitchConfig:
    trigger: float = 0.95
    min_gain: float = 0.01
    cooldown_gain: float = 0.03
    cooldown_windows: int = 5

    def __post_init__(self) -> None:
        if not 0 < self.trigger <= 1 or self.min_gain < 0 or self.cooldown_gain < self.min_gain:
            raise ValueError("need 0 < trigger <= 1 and 0 <= min_gain <= cooldown_gain")
        if self.cooldown_windows < 0:
            raise ValueError("cooldown_windows must be >= 0")


@dataclass(frozen=True)
class SwitchState:
    """windows_since_switch: windows decided since the last switch (large: none yet)."""

    windows_since_switch: int = 1 << 30


@dataclass(frozen=True)
class SwitchDecision:
    switch: bool
    reason: str
    current_ratio: float
    candidate_ratio: float
    state: SwitchState


def decide(current: Placement, candidate: Placement, held_out_loads: torch.Tensor,
           state: SwitchState = SwitchState(), config: SwitchConfig = SwitchConfig()) -> SwitchDecision:
    """Whether to switch from `current` to `candidate`.

    Args:
        current: the running placement.
        candidate: the proposed one.
        held_out_loads: [L, E] loads of a window the candidate was NOT built from,
            normally the one after its build window.
        state: from the previous decision.
        config: thresholds.
    Returns:
        The decision, both instance ratios on held_out_loads, and the next state.
    """
    now = current.instance_ratio(held_out_loads)
    new = candidate.instance_ratio(held_out_loads)
    cooling = state.windows_since_switch < config.cooldown_windows
    need = config.cooldown_gain if cooling else config.min_gain
    if now >= config.trigger:
        reason, switch = f"current ratio {now:.4f} >= trigger {config.trigger}", False
    elif new - now <= need:
        phase = "in cooldown " if cooling else ""
        reason, switch = f"{phase}gain {new - now:+.4f} <= {need}", False
    else:
        reason, switch = f"gain {new - now:+.4f} > {need}", True
    after = SwitchState(0 if switch else state.windows_since_switch + 1)
    return SwitchDecision(switch, reason, now, new, after)
