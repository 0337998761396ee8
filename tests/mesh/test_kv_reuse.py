"""Prefix reuse across a multi-turn conversation: the prefill worker's own cache, a pull
from the KV store after that worker is gone, and a store that dies mid-run."""

from __future__ import annotations

import asyncio
import signal
import threading
import time

import httpx
import pytest

from moemesh.shared.engine.config import EngineConfig
from moemesh.shared.engine.llm import LLM
from moemesh.shared.protocol.messages import SamplingParams
from tests.mesh.conftest import kill_prefill, start_mesh, worker_stats

BLOCK_SIZE = EngineConfig.block_size  # the mesh's workers run with the default

TURNS = ["Plan a trip to the mesh of experts", "Add the tool output: rank 3 is hot",
         "Now the router says balance again", "Summarise what changed"]


@pytest.fixture(scope="module")
def no_reuse(tiny_model):
    return LLM(EngineConfig(model=tiny_model, num_kv_blocks=512, enable_prefix_caching=False))


def _want(no_reuse, turns=TURNS, max_tokens=24):
    """The conversation as the offline engine runs it without any cache."""
    msgs, answers = [], []
    for t in turns:
        msgs.append({"role": "user", "content": t + " " + "with context " * 12})
        ids = no_reuse.tokenizer.encode_chat(msgs)
        a = no_reuse.generate([ids], SamplingParams(max_tokens=max_tokens, temperature=0, ignore_eos=True))[0].text
        answers.append(a)
        msgs.append({"role": "assistant", "content": a})
    return answers


def _chat(url, turns=TURNS, max_tokens=24, usages=None):
    msgs, answers = [], []
    with httpx.Client(timeout=120) as c:
        for t in turns:
            msgs.append({"role": "user", "content": t + " " + "with context " * 12})
            r = c.post(url + "/v1/chat/completions", json={"model": "tiny", "messages": msgs, "max_tokens": max_tokens,
                                                          "temperature": 0, "ignore_eos": True})
            assert r.status_code == 200, r.text
            a = r.json()["choices"][0]["message"]["content"]
            answers.append(a)
            if usages is not None:
                usages.append(r.json()["usage"])
            msgs.append({"role": "assistant", "content": a})
    return answers


@pytest.fixture(scope="module")
def kv_mesh(tiny_model, tmp_path_factory):
    # A short transfer timeout: a fetch from a store gone silent waits this long.
    m = start_mesh(tmp_path_factory.mktemp("kv"), tiny_model, num_prefill=2, kv_store_set=["capacity_mb=64"],
                   prefill_set=["transfer_timeout_s=3"])
    yield m
    m.group.stop()


def _stats(mesh, worker):
    return asyncio.run(worker_stats(mesh.nats_url, worker))


def test_turns_reuse_the_prefix_and_match_a_no_reuse_run(kv_mesh, no_reuse):
    usages = []
    got = _chat(kv_mesh.url, usages=usages)
    assert got == _want(no_reuse)
    hits = sum(_stats(kv_mesh, w).counters["prefix_cache_hit_tokens"] for w in ("prefill-t", "prefill-t1"))
    assert hits > 3 * 40  # turns 2-4 each found at least the previous prompt's full blocks
    # the client sees the same reuse, request by request
    cached = [u["prompt_tokens_details"]["cached_tokens"] for u in usages]
    assert cached[0] == 0 and all(c > 0 for c in cached[1:]) and sum(cached) == hits


def test_a_new_prefill_worker_pulls_the_context_from_the_store(kv_mesh, no_reuse):
    turns = ["A second conversation about a different router"] + TURNS[1:3]
    want = _want(no_reuse, turns)
    held = _stats(kv_mesh, "kv-store-t").counters["held_blocks"]
    # The module's earlier conversations count too: the holder is the worker whose prompt
    # tokens grew with this one's first turn.
    start = {w: _stats(kv_mesh, w).counters["prompt_tokens"] for w in ("prefill-t", "prefill-t1")}
    usages = []
    got = _chat(kv_mesh.url, turns[:1], usages=usages)
    # The prompt's full blocks reach the store in the background, after the answer.
    full = usages[0]["prompt_tokens"] // BLOCK_SIZE
    deadline = time.monotonic() + 20
    while _stats(kv_mesh, "kv-store-t").counters["held_blocks"] < held + full:
        assert time.monotonic() < deadline, "the first turn's blocks never reached the store"
        time.sleep(0.1)
    holder = max(start, key=lambda w: _stats(kv_mesh, w).counters["prompt_tokens"] - start[w])
    kill_prefill(kv_mesh, holder)  # the worker holding the context is gone
    assert _chat(kv_mesh.url, turns)[1:] == want[1:] and got == want[:1]
    other = "prefill-t1" if holder == "prefill-t" else "prefill-t"
    assert _stats(kv_mesh, other).counters["kv_pulled_tokens"] > 0


def test_a_store_gone_silent_is_given_up_on_and_the_prefix_recomputed(kv_mesh, no_reuse):
    """The store's host stops answering (SIGSTOP: its NATS interest stays, as a dead host's
    does until the server notices): a turn-2 prefix fetch from it times out, the prompt is
    computed whole, and the answer is the same."""
    convos = [["A third conversation, before the store goes quiet"] + TURNS[1:2],
              ["A fourth conversation, asked while it is quiet"] + TURNS[2:3]]
    want = [_want(no_reuse, turns) for turns in convos]
    held = _stats(kv_mesh, "kv-store-t").counters["held_blocks"]
    computed = 0
    for turns, w in zip(convos, want):
        usage = []
        assert _chat(kv_mesh.url, turns[:1], usages=usage) == w[:1]
        computed += (usage[0]["prompt_tokens"] + usage[0]["completion_tokens"] - 1) // BLOCK_SIZE  # the last: no KV
    # The decode worker offers a finished turn (prompt and answer) to the store in the
    # background; once it is there, the store holds more of turn 2 than the prefill worker.
    deadline = time.monotonic() + 30
    while _stats(kv_mesh, "kv-store-t").counters["held_blocks"] < held + computed:
        assert time.monotonic() < deadline, "the finished turns never reached the store"
        time.sleep(0.1)
    alive = {c.name for c in kv_mesh.group.children if c.alive()}
    prefills = [w for w in ("prefill-t", "prefill-t1") if kv_mesh.process_of[w] in alive]
    before = {w: _stats(kv_mesh, w).counters for w in prefills}
    store = next(c for c in kv_mesh.group.children if c.name == "kv_store")
    store.popen.send_signal(signal.SIGSTOP)
    try:
        replies = [httpx.post(kv_mesh.url + "/v1/chat/completions", timeout=120, json={
            "model": "tiny", "max_tokens": 24, "temperature": 0, "ignore_eos": True, "messages": [
                {"role": "user", "content": turns[0] + " " + "with context " * 12},
                {"role": "assistant", "content": w[0]},
                {"role": "user", "content": turns[1] + " " + "with context " * 12}]})
            for turns, w in zip(convos, want)]
    finally:
        store.popen.send_signal(signal.SIGCONT)
    for r, w in zip(replies, want):
        assert r.status_code == 200, r.text
        assert r.json()["choices"][0]["message"]["content"] == w[1]
        assert r.json()["usage"]["prompt_tokens_details"]["cached_tokens"] > 0  # its own blocks still served
    failed = {w: _stats(kv_mesh, w).counters["kv_pulls_failed"] - before[w]["kv_pulls_failed"] for w in prefills}
    assert sum(failed.values()) >= 1, failed


def test_killing_the_store_mid_run_loses_no_request(kv_mesh, no_reuse):
    store = next(c for c in kv_mesh.group.children if c.name == "kv_store")
    results, errors = [], []

    def convo(i):
        try:
            results.append(_chat(kv_mesh.url, [f"Session {i} opens"] + TURNS[1:3], max_tokens=12))
        except AssertionError as e:
            errors.append(str(e))

    threads = [threading.Thread(target=convo, args=(i,)) for i in range(6)]
    for t in threads:
        t.start()
    time.sleep(0.5)
    store.popen.send_signal(signal.SIGKILL)
    for t in threads:
        t.join(120)
    assert not errors and len(results) == 6
