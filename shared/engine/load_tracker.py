"""Per-layer, per-logical-expert token counts over a sliding window of engine steps.

The target model's MoE layers and the MTP draft head's are counted side by side but
reported apart: they route differently, and the balancer places them separately.
L = MoE layers tracked (target then MTP), E = logical experts, W = window in steps.
"""

from __future__ import annotations

import threading
from collections import deque

import torch


class LoadTracker:
    def __init__(self, model, window_steps: int):
        self.layer_ids = sorted(model.moe_layers())
        self.num_target_layers = model.cfg.num_hidden_layers
        self._row = {lid: i for i, lid in enumerate(self.layer_ids)}
        self.num_experts = model.cfg.n_routed_experts
        self.window_steps = window_steps
        self._current = torch.zeros(len(self.layer_ids), self.num_experts, dtype=torch.long)  # [L, E]
        self._steps: deque[torch.Tensor] = deque()
        self._window = torch.zeros_like(self._current)
        self.total_steps = 0
        # The device thread routes step N+1 into _current while the engine loop closes step
        # N: the close takes _current and puts a fresh one in its place at once, so no count
        # lands in a step after it was summed into the window (its subtraction when the step
        # leaves would drive the window negative, and the balancer refuses such loads).
        self._lock = threading.Lock()
        for lid, moe in model.moe_layers().items():
            moe.on_route = self._on_route

    def _on_route(self, layer_id: int, ids: torch.Tensor) -> None:
        # Counted where the routing ran: reading ids to the host would stop the host at
        # every MoE layer of every step until the device caught up.
        flat = ids.reshape(-1)
        with self._lock:
            if self._current.device != flat.device:  # once, at the first step
                self._current, self._window = self._current.to(flat.device), self._window.to(flat.device)
            self._current[self._row[layer_id]].index_add_(0, flat, torch.ones_like(flat))

    def end_step(self) -> None:
        """Close the current step's counts into the window (call between steps). Reads
        nothing from the device."""
        self.total_steps += 1
        with self._lock:  # the window too: the first route moves it to the device
            closed, self._current = self._current, torch.zeros_like(self._current)
            self._steps.append(closed)
            self._window += closed
            while len(self._steps) > self.window_steps:
                self._window -= self._steps.popleft()

    def window(self) -> torch.Tensor:
        """[L, E] tokens per layer and logical expert over the last window_steps steps, on the CPU."""
        return self._window.to("cpu", copy=True)
