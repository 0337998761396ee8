"""Expert-parallel load balancing: where each MoE layer's experts live, as pure functions.

- placement.py: the Placement structure (phy2log, log2phy, ratios, JSON), naive placement.
- policy.py: our policy (build_placement).
- policies.py: the PlacementPolicy seam, and the policies by name (ours, node-aware, DeepSeek's).
- replicas.py, packing.py, expected.py: its steps, replica counts, slot arrangement and
  the choice, per layer, between it and DeepSeek's by the next window's expected balance.
- reference.py: DeepSeek's EPLB rewritten, to compare against.
- align.py: relabel a new placement onto the running one so few weights move.
- hysteresis.py: whether a candidate is worth switching to.
- workloads.py, compare.py: synthetic loads and the held-out comparison.

No I/O and no service state here; the balancer service owns windows and moves.
"""

from moemesh.shared.eplb.align import align, moves_per_layer
from moemesh.shared.eplb.hysteresis import SwitchConfig, SwitchDecision, SwitchState, decide
from moemesh.shared.eplb.placement import Placement, naive_placement, route_to_slots
from moemesh.shared.eplb.policies import PlacementPolicy, get_policy
from moemesh.shared.eplb.policy import build_placement

__all__ = ["Placement", "PlacementPolicy", "SwitchConfig", "SwitchDecision", "SwitchState", "align",
           "build_placement", "decide", "get_policy", "moves_per_layer", "naive_placement", "route_to_slots"]
