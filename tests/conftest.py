"""Shared fixtures: small random-weight checkpoints, written once per test session."""

from __future__ import annotations

import os

import pytest

os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")

# pytest-xdist (--dist loadfile) hands the workers one test file at a time in collection
# order, and by default first reorders the files by how many tests they hold: files of one
# long test (the GPU check's CPU rehearsal, the OpenAPI fuzz) came last, each on one worker
# while the other had nothing left. The longest files (`--durations=0` summed by file,
# 2026-12-07, after the cuts of that day) go first instead, the rest as collected;
# scripts/test turns xdist's reorder off.
LONG_FIRST = (
    "tests/bench/test_gpu_check.py", "tests/mesh/test_dep_mesh.py", "tests/mesh/test_up.py",
    "tests/mesh/test_openapi_fuzz.py", "tests/kernels/test_engine_with_kernels.py", "tests/bench/test_bench_tools.py",
    "tests/mesh/test_faults.py", "tests/mesh/test_guidellm.py", "tests/oracle/test_v4_against_transformers.py",
    "tests/mesh/test_trace_replay.py", "tests/bench/test_serve_e2e.py", "tests/mesh/test_dep_move_cuts.py",
    "tests/kernels/test_launches.py", "tests/mesh/test_v4_dep_mesh.py", "tests/services/test_migration.py",
    "tests/mesh/test_kv_reuse.py", "tests/cli/test_cli.py", "tests/mesh/test_transformers_checkpoint.py",
    "tests/mesh/test_openai_api.py", "tests/services/test_parallel_sampling.py",
)


def pytest_collection_modifyitems(config, items) -> None:
    rank = {path: i for i, path in enumerate(LONG_FIRST)}
    # A stable sort: each file keeps its tests' order.
    items.sort(key=lambda item: rank.get(item.nodeid.split("::", 1)[0], len(LONG_FIRST)))


@pytest.fixture(scope="session")
def tiny_model(tmp_path_factory) -> str:
    from moemesh.shared.checkpoint.writer import init_model

    return str(init_model(tmp_path_factory.mktemp("tiny"), "tiny", seed=0))


@pytest.fixture(scope="session")
def tiny_v2_model(tmp_path_factory) -> str:
    from moemesh.shared.checkpoint.writer import init_model

    return str(init_model(tmp_path_factory.mktemp("tiny-v2"), "tiny-v2", seed=1))


@pytest.fixture(scope="session")
def tiny_v4_model(tmp_path_factory) -> str:
    from moemesh.shared.checkpoint.writer import init_model

    return str(init_model(tmp_path_factory.mktemp("tiny-v4"), "v4-tiny", seed=0))


@pytest.fixture(scope="session")
def tiny_trained(tmp_path_factory):
    """A short seeded `init-model --train` run of the tiny model (the full run is ~1,500
    steps): a TrainResult, the checkpoint in .out_dir."""
    pytest.importorskip("transformers")
    from moemesh.tools.train.config import TrainConfig
    from moemesh.tools.train.trainer import train

    cfg = TrainConfig(steps=24, batch=8, seq_len=64, warmup=4, eval_every=12, eval_batches=2, corpus_mb=0.25)
    return train(tmp_path_factory.mktemp("trained") / "tiny", "tiny", cfg, progress=lambda step, loss: None)


@pytest.fixture(scope="session")
def hf_saved(tmp_path_factory):
    """hf_saved(arch, **save_kwargs): a checkpoint that transformers built and wrote with
    save_pretrained (tests/checkpoint/hf_built.py), made once per session and arguments."""
    made: dict = {}

    def get(arch: str, **save_kwargs) -> str:
        key = (arch, tuple(sorted(save_kwargs.items())))
        if key not in made:
            from tests.checkpoint.hf_built import build, save

            model, tok = build(arch, seed=7)
            made[key] = str(save(model, tok, tmp_path_factory.mktemp(f"hf-saved-{arch}"), **save_kwargs))
        return made[key]

    return get


def _engine_factory(model_dir: str, **defaults):
    """Builds engines on one model, reusing one loaded copy of its weights."""
    from moemesh.shared.checkpoint.loader import load_model
    from moemesh.shared.engine.config import EngineConfig
    from moemesh.shared.engine.engine import LLMEngine

    model = load_model(model_dir)

    def make(**kw) -> LLMEngine:
        return LLMEngine(EngineConfig(model=model_dir, **{**defaults, **kw}), model=model)

    return make


@pytest.fixture(scope="session")
def tiny_engine_factory(tiny_model):
    return _engine_factory(tiny_model, num_kv_blocks=512)


@pytest.fixture(scope="session")
def tiny_v4_engine_factory(tiny_v4_model):
    return _engine_factory(tiny_v4_model, max_num_seqs=8)


@pytest.fixture(scope="session")
def offline(tiny_model):
    """The offline engine, for outputs a mesh must reproduce exactly."""
    from moemesh.shared.engine.config import EngineConfig
    from moemesh.shared.engine.llm import LLM

    return LLM(EngineConfig(model=tiny_model, num_kv_blocks=512))
