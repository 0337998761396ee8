"""One rank of a DEP instance, run in a spawned process by the DEP tests."""

from __future__ import annotations


def run_rank(rank: int, world: int, init_method: str, model_dir: str, prompts: list[list[int]], redundant: int,
             max_tokens: int, num_spec: int, out_q) -> None:
    import torch

    torch.set_num_threads(1)
    from moemesh.shared.checkpoint.loader import load_model
    from moemesh.shared.engine.config import EngineConfig
    from moemesh.shared.engine.dp import DPGroup
    from moemesh.shared.engine.engine import LLMEngine
    from moemesh.shared.protocol.sampling import SamplingParams
    from moemesh.shared.model.config import ModelConfig
    from moemesh.shared.model.expert_parallel import ExpertParallel, contiguous_phy2log

    dp = DPGroup(rank, world, init_method)
    try:
        cfg = ModelConfig.from_dir(model_dir)
        layer_ids = cfg.moe_layer_ids + ([cfg.num_hidden_layers] if cfg.has_mtp else [])
        row = contiguous_phy2log(cfg.n_routed_experts, world, redundant)
        phy2log = row.repeat(len(layer_ids), 1)
        S = row.numel() // world
        model = load_model(model_dir, expert_slots=ExpertParallel.local_slot_map(phy2log, layer_ids, rank, world),
                           num_slots=S)
        ExpertParallel(model, rank, world, phy2log)
        eng = LLMEngine(EngineConfig(model=model_dir, num_kv_blocks=256, num_speculative_tokens=num_spec),
                        model=model, lockstep=True)
        mine = {i: p for i, p in enumerate(prompts) if i % world == rank}  # attention is data-parallel
        for i, p in mine.items():
            eng.add_request(f"r{i}", p, SamplingParams(max_tokens=max_tokens, temperature=0, ignore_eos=True))
        outs = {f"r{i}": [] for i in mine}
        steps = 0
        while any(v[0] for v in dp.exchange([int(eng.has_unfinished())])):
            for o in eng.step():
                outs[o.request_id] += o.new_token_ids
            steps += 1
        out_q.put((rank, outs, steps, eng.blocks.num_free_blocks == eng.blocks.num_blocks))
    finally:
        dp.close()
