from dataclasses import replace

from moemesh.services.decode.config import DecodeConfig
from moemesh.shared.engine.config import EngineConfig


def test_a_workers_settings_reach_its_engine():
    cfg = DecodeConfig(model="m", block_size=32, max_num_seqs=7, num_speculative_tokens=-1, num_kv_blocks=0)
    e = EngineConfig.for_worker(cfg, "decode")
    assert (e.role, e.block_size, e.max_num_seqs) == ("decode", 32, 7)
    assert e.num_speculative_tokens is None and e.num_kv_blocks is None and e.num_prefix_snapshots is None
    e = EngineConfig.for_worker(replace(cfg, num_prefix_snapshots=0, num_speculative_tokens=2), "decode")
    assert e.num_prefix_snapshots == 0 and e.num_speculative_tokens == 2
