from dataclasses import replace

import pytest

from moemesh.shared.eplb.hysteresis import SwitchConfig, SwitchState, decide
from moemesh.shared.eplb.placement import naive_placement
from moemesh.shared.eplb.policy import build_placement
from moemesh.shared.eplb.workloads import HOT

STATIONARY = replace(HOT, num_layers=8, num_experts=64, tokens_per_window=16384, drift=0.0)


def _count_switches(config: SwitchConfig, num_windows: int = 12) -> int:
    windows = STATIONARY.windows(num_windows + 1).double()
    current, state, switches = naive_placement(8, 64, 8, 1), SwitchState(), 0
    for t in range(num_windows):
        # Built on window t, judged on window t+1 that it has not seen.
        candidate = build_placement(windows[t], 8, 1, current=current)
        d = decide(current, candidate, windows[t + 1], state, config)
        state = d.state
        if d.switch:
            current, switches = candidate, switches + 1
    return switches


def test_stationary_noisy_loads_switch_once_then_hold():
    assert _count_switches(SwitchConfig()) == 1


def test_without_thresholds_the_same_loads_thrash():
    # The control: any held-out gain at all switches, and noise supplies plenty.
    assert _count_switches(SwitchConfig(trigger=1.0, min_gain=0.0, cooldown_gain=0.0)) >= 4


def test_cooldown_demands_a_larger_gain():
    w = STATIONARY.windows(2).double()
    naive, built = naive_placement(8, 64, 8, 1), build_placement(w[0], 8, 1)
    gain = built.instance_ratio(w[1]) - naive.instance_ratio(w[1])
    cfg = SwitchConfig(trigger=1.0, min_gain=gain / 2, cooldown_gain=gain * 2, cooldown_windows=3)
    cooling = decide(naive, built, w[1], SwitchState(windows_since_switch=1), cfg)
    assert not cooling.switch and "cooldown" in cooling.reason
    assert cooling.state.windows_since_switch == 2
    after = decide(naive, built, w[1], SwitchState(windows_since_switch=3), cfg)
    assert after.switch and after.state.windows_since_switch == 0
    assert after.candidate_ratio - after.current_ratio == pytest.approx(gain)


def test_healthy_placement_is_left_alone():
    w = STATIONARY.windows(2).double()
    built = build_placement(w[0], 8, 1)
    d = decide(built, naive_placement(8, 64, 8, 1), w[1], config=SwitchConfig(trigger=0.5))
    assert not d.switch and "trigger" in d.reason


def test_config_is_validated():
    with pytest.raises(ValueError):
        SwitchConfig(min_gain=0.05, cooldown_gain=0.01)
