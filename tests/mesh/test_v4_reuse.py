"""DeepSeek-V4 prefix reuse through the mesh: a multi-turn conversation whose later turns
the gateway sends to the prefill worker holding the earlier prompt (KV events, KV-aware
routing), which starts them on its cached blocks and boundary snapshot; the answers
are those of one engine without any cache."""

from __future__ import annotations

import asyncio
import time

import httpx
import pytest

from moemesh.shared.protocol.messages import SamplingParams
from tests.mesh.conftest import kill_prefill, start_mesh, wait_free, worker_stats

TURNS = ["Plan a trip to the mesh of experts", "Add the tool output: rank 3 is hot",
         "Now the router says balance again"]
SETTINGS = ["max_num_seqs=2", "heartbeat_interval_s=0.2"]
MAX_TOKENS = 12
PREFILL = ("prefill-t", "prefill-t1")


@pytest.fixture(scope="module")
def v4_reuse_mesh(tiny_v4_model, tmp_path_factory):
    m = start_mesh(tmp_path_factory.mktemp("v4-reuse"), tiny_v4_model, prefill_set=SETTINGS, decode_set=SETTINGS,
                   num_prefill=2)
    yield m
    m.group.stop()


@pytest.fixture(scope="module")
def no_reuse(tiny_v4_model):
    from moemesh.shared.engine.config import EngineConfig
    from moemesh.shared.engine.llm import LLM

    return LLM(EngineConfig(model=tiny_v4_model, num_kv_blocks=256, enable_prefix_caching=False))


def _message(turn: str) -> dict:
    return {"role": "user", "content": turn + " " + "with context " * 10}


def _want(llm, turns=TURNS, max_tokens=MAX_TOKENS) -> list[str]:
    msgs, answers = [], []
    for t in turns:
        msgs.append(_message(t))
        ids = llm.tokenizer.encode_chat(msgs)
        a = llm.generate([ids], SamplingParams(max_tokens=max_tokens, temperature=0, ignore_eos=True))[0].text
        answers.append(a)
        msgs.append({"role": "assistant", "content": a})
    return answers


def _chat(url: str, turns=TURNS, max_tokens=MAX_TOKENS) -> list[str]:
    msgs, answers = [], []
    with httpx.Client(timeout=120) as c:
        for t in turns:
            msgs.append(_message(t))
            r = c.post(url + "/v1/chat/completions", json={"model": "tiny", "messages": msgs,
                                                          "max_tokens": max_tokens, "temperature": 0,
                                                          "ignore_eos": True})
            assert r.status_code == 200, r.text
            a = r.json()["choices"][0]["message"]["content"]
            answers.append(a)
            msgs.append({"role": "assistant", "content": a})
            # The gateway counts a prompt it sent as queued at its worker until that worker's
            # next beat; a user's next turn comes later than this.
            time.sleep(0.5)
    return answers


def _counters(mesh, worker: str) -> dict[str, float]:
    return asyncio.run(worker_stats(mesh.nats_url, worker)).counters


def test_later_turns_reuse_the_prefix_on_the_worker_that_holds_it(v4_reuse_mesh, no_reuse):
    assert _chat(v4_reuse_mesh.url) == _want(no_reuse)
    stats = {w: _counters(v4_reuse_mesh, w) for w in PREFILL}
    holder = max(stats, key=lambda w: stats[w]["prompt_tokens"])
    other = next(w for w in PREFILL if w != holder)
    # Every turn went to the worker holding the conversation (the other computed nothing),
    # and turns 2 and 3 each started on at least the first turn's prompt minus a block.
    assert stats[other]["prompt_tokens"] == 0
    first = len(no_reuse.tokenizer.encode_chat([_message(TURNS[0])]))
    assert stats[holder]["prefix_cache_hit_tokens"] >= 2 * (first // 16 - 1) * 16 > 0
    v4_reuse_mesh.prefill_id = holder
    wait_free(v4_reuse_mesh)  # blocks cached, not held; rings and staging given back


def test_a_new_prefill_worker_pulls_the_prefix_and_its_snapshot_from_a_peer(v4_reuse_mesh, no_reuse):
    """The prefill worker holding a conversation dies; the next turn goes to the other one,
    which pulls the blocks and the boundary snapshot at their end from the decode worker
    (it holds the first turn with its answer, and a snapshot where its decode passed the
    last boundary). Prompts go as token ids: the next turn extends the first turn and its
    answer exactly, whatever re-tokenizing the answer's text would give."""
    tok, greedy = no_reuse.tokenizer, SamplingParams(max_tokens=20, temperature=0, ignore_eos=True)
    p1 = tok.encode_chat([_message("A second conversation about a different router")])
    a1 = no_reuse.generate([p1], greedy)[0]  # 20 tokens: the decode passes a boundary
    p2 = p1 + a1.token_ids + tok.encode(TURNS[1] + " with context" * 10, add_special_tokens=False)
    want2 = no_reuse.generate([p2], greedy)[0].text

    def complete(prompt: list[int]) -> str:
        r = httpx.post(v4_reuse_mesh.url + "/v1/completions", timeout=120, json={
            "model": "tiny", "prompt": prompt, "max_tokens": 20, "temperature": 0, "ignore_eos": True})
        assert r.status_code == 200, r.text
        return r.json()["choices"][0]["text"]

    start = {w: _counters(v4_reuse_mesh, w)["prompt_tokens"] for w in PREFILL}
    assert complete(p1) == a1.text
    time.sleep(0.5)  # the decode worker's KV events reach the gateway
    holder = next(w for w in PREFILL if _counters(v4_reuse_mesh, w)["prompt_tokens"] > start[w])
    kill_prefill(v4_reuse_mesh, holder)  # the worker holding the context is gone
    assert complete(p2) == want2
    other = next(w for w in PREFILL if w != holder)
    assert _counters(v4_reuse_mesh, other)["kv_pulled_tokens"] > 0
