"""DeepSeek-V4's hash-routed layers are counted by the load tracker like the learned ones."""

from __future__ import annotations

import torch

from moemesh.shared.engine.config import EngineConfig
from moemesh.shared.engine.engine import LLMEngine
from moemesh.shared.engine.load_tracker import LoadTracker
from moemesh.shared.protocol.messages import SamplingParams


def test_every_v4_layer_is_counted_and_hash_layers_follow_their_table(tiny_v4_model):
    eng = LLMEngine(EngineConfig(model=tiny_v4_model, num_kv_blocks=64, num_speculative_tokens=0))
    cfg = eng.model_config
    tracker = LoadTracker(eng.model, window_steps=1000)
    assert tracker.layer_ids == list(range(cfg.num_cache_layers))  # every layer, and the MTP head apart
    prompt = [0, 5, 9, 5, 77, 300, 12]
    eng.add_request("r", prompt, SamplingParams(max_tokens=4, temperature=0, ignore_eos=True))
    eng.step()  # the prompt, in one chunk
    tracker.end_step()
    w = tracker.window()
    K, L = cfg.num_experts_per_tok, cfg.num_hidden_layers
    assert (w[:L].sum(dim=1) == len(prompt) * K).all()
    for layer in range(L):
        if cfg.is_hash_layer(layer):
            table = eng.model.model.layers[layer].mlp.gate.tid2eid
            want = torch.bincount(table[torch.tensor(prompt)].reshape(-1), minlength=cfg.n_routed_experts)
            assert torch.equal(w[layer], want), layer
    assert cfg.is_hash_layer(0) and not cfg.is_hash_layer(L - 1)
