"""A DeepSeek-V4 checkpoint that transformers built and wrote with save_pretrained,
served by the whole mesh: two prefill workers, a KV store and a DEP2 decode instance.

Token-id prompts come back as transformers' own greedy ids (through the offline engine,
which the check ties to transformers first); after the prefill worker holding a prompt
dies, the next turn on it pulls that context and gives what one engine without any cache
gives."""

from __future__ import annotations

import asyncio
import time

import httpx
import pytest

from moemesh.shared.engine.config import EngineConfig
from moemesh.shared.engine.llm import LLM
from moemesh.shared.protocol.messages import SamplingParams
from tests.checkpoint.hf_built import reference
from tests.mesh.conftest import kill_prefill, start_mesh, worker_stats

SETTINGS = ["max_num_seqs=2", "heartbeat_interval_s=0.2"]
PREFILL = ("prefill-t", "prefill-t1")
NEW = 8


@pytest.fixture(scope="module")
def saved_v4(hf_saved) -> str:
    return hf_saved("v4")


@pytest.fixture(scope="module")
def hf_mesh(saved_v4, tmp_path_factory):
    m = start_mesh(tmp_path_factory.mktemp("hf-v4"), saved_v4, prefill_set=SETTINGS, decode_set=SETTINGS,
                   num_prefill=2, kv_store_set=["capacity_mb=64"], decode_dp=2)
    yield m
    m.group.stop()


@pytest.fixture(scope="module")
def no_reuse(saved_v4):
    return LLM(EngineConfig(model=saved_v4, num_kv_blocks=256, enable_prefix_caching=False))


def _complete(mesh, prompt: list[int], max_tokens: int = NEW) -> str:
    r = httpx.post(mesh.url + "/v1/completions", timeout=120, json={
        "model": "tiny", "prompt": prompt, "max_tokens": max_tokens, "temperature": 0, "ignore_eos": True})
    assert r.status_code == 200, r.text
    return r.json()["choices"][0]["text"]


def _counters(mesh, worker: str) -> dict[str, float]:
    return asyncio.run(worker_stats(mesh.nats_url, worker)).counters


def test_prompts_through_pd_and_dep2_give_transformers_greedy_ids(hf_mesh, no_reuse, saved_v4):
    from transformers import AutoModelForCausalLM

    import torch

    hf = AutoModelForCausalLM.from_pretrained(saved_v4, dtype=torch.float32).eval()
    prompts, want = reference(hf, 11, [4, 17, 40], NEW)  # past the window (8) and HCA blocks (16)
    greedy = SamplingParams(max_tokens=NEW, temperature=0, ignore_eos=True)
    offline = no_reuse.generate(prompts, greedy)
    assert [o.token_ids for o in offline] == want
    assert [_complete(hf_mesh, p) for p in prompts] == [o.text for o in offline]


def test_a_new_prefill_worker_pulls_the_context_and_answers_as_one_engine(hf_mesh, no_reuse):
    tok, greedy = no_reuse.tokenizer, SamplingParams(max_tokens=20, temperature=0, ignore_eos=True)
    p1 = tok.encode_chat([{"role": "user", "content": "Route the experts of the saved model " * 4}])
    a1 = no_reuse.generate([p1], greedy)[0]
    p2 = p1 + a1.token_ids + tok.encode(" and now balance them again" * 4, add_special_tokens=False)
    want2 = no_reuse.generate([p2], greedy)[0].text

    start = {w: _counters(hf_mesh, w)["prompt_tokens"] for w in PREFILL}
    assert _complete(hf_mesh, p1, 20) == a1.text
    holder = next(w for w in PREFILL if _counters(hf_mesh, w)["prompt_tokens"] > start[w])
    deadline = time.monotonic() + 10  # the finished blocks and their snapshot reach the store in the background
    while not ((c := _counters(hf_mesh, "kv-store-t"))["held_blocks"] > 0 and c["held_snapshots"] > 0):
        assert time.monotonic() < deadline, c
        time.sleep(0.1)
    kill_prefill(hf_mesh, holder)  # the worker holding the context is gone
    assert _complete(hf_mesh, p2, 20) == want2
    other = next(w for w in PREFILL if w != holder)
    assert _counters(hf_mesh, other)["kv_pulled_tokens"] > 0
    assert _counters(hf_mesh, "kv-store-t")["blocks_hit"] > 0  # from the store (of equal depth, it wins the tie)
