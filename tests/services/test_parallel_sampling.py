"""`n` > 1 through the gateway, with the official openai client: one prefill of the
prompt forked into n children, each handed to decode and streamed under its `index`
(DeepSeek-V2/V3 and V4); usage counts every choice; a client that leaves frees every
child on both workers; a decode worker that dies moves each child on its own."""

from __future__ import annotations

import asyncio
import json
from contextlib import AsyncExitStack

import httpx
import openai

from moemesh.services.decode.config import DecodeConfig
from moemesh.services.decode.service import DecodeService
from moemesh.services.gateway.config import GatewayConfig
from moemesh.services.gateway.service import GatewayService
from moemesh.services.prefill.config import PrefillConfig
from moemesh.services.prefill.service import PrefillService
from moemesh.shared.protocol.forks import fork_seed
from moemesh.shared.protocol.messages import SamplingParams
from moemesh.shared.transport.loopback import LoopbackHub, LoopbackTransport
from tests.services.test_in_process import _all_free, _wait_free, kv_ready_seen, mesh

PROMPT = "The experts of the mesh route every token"


def _client(url: str) -> openai.AsyncOpenAI:
    return openai.AsyncOpenAI(base_url=url + "/v1", api_key="unused", max_retries=0, timeout=60)


def test_n_choices_stream_and_collect_from_one_prefill(nats_url, tiny_model, tiny_engine_factory, offline, tmp_path):
    greedy = SamplingParams(max_tokens=8, temperature=0, ignore_eos=True)
    want = offline.generate([PROMPT], greedy)[0].text
    msgs = [{"role": "user", "content": "hi there"}]
    chat_ids = offline.tokenizer.encode_chat(msgs)
    want_chat = offline.generate([chat_ids], SamplingParams(max_tokens=6, temperature=0, ignore_eos=True))[0].text
    n_prompt = len(offline.tokenizer.encode(PROMPT))

    async def go():
        engines = (tiny_engine_factory(role="prefill", num_kv_blocks=256),
                   tiny_engine_factory(role="decode", num_kv_blocks=256))
        async with mesh(nats_url, tiny_model, tmp_path, engines) as m:
            c = _client(m.url)
            pre = m.prefill.rt.engine
            before = pre.num_prompt_tokens_total
            async with kv_ready_seen(nats_url, m.prefix) as seen:
                r = await c.completions.create(model="tiny", prompt=PROMPT, max_tokens=8, temperature=0, n=3,
                                               extra_body={"ignore_eos": True})
            prefilled = pre.num_prompt_tokens_total - before
            spec = m.prefill.rt.kv_spec
            # Streamed chat, choices interleaved, each told apart by its index.
            texts, reasons, usage = {}, {}, None
            stream = await c.chat.completions.create(model="tiny", messages=msgs, max_tokens=6, temperature=0, n=2,
                                                     stream=True, stream_options={"include_usage": True},
                                                     extra_body={"ignore_eos": True})
            async for part in stream:
                if part.usage is not None:
                    usage = part.usage
                for ch in part.choices:
                    texts[ch.index] = texts.get(ch.index, "") + (ch.delta.content or "")
                    if ch.finish_reason:
                        reasons[ch.index] = ch.finish_reason
            # Seeds: choice i is what n = 1 with seed fork_seed(seed, i) gives.
            seeded = await c.completions.create(model="tiny", prompt=PROMPT, max_tokens=8, temperature=1, seed=11,
                                                n=3)
            singles = [await c.completions.create(model="tiny", prompt=PROMPT, max_tokens=8, temperature=1,
                                                  seed=fork_seed(11, i)) for i in range(3)]
            # A stop string ends each choice where its text has it (and aborts that child alone).
            stop = want[4:7]
            cut, cut_reasons = {}, {}
            stream = await c.completions.create(model="tiny", prompt=PROMPT, max_tokens=8, temperature=0, n=2,
                                                stop=[stop], stream=True, extra_body={"ignore_eos": True})
            async for part in stream:
                for ch in part.choices:
                    cut[ch.index] = cut.get(ch.index, "") + ch.text
                    if ch.finish_reason:
                        cut_reasons[ch.index] = ch.finish_reason
            assert cut == {0: want[: want.index(stop)], 1: want[: want.index(stop)]}
            assert cut_reasons == {0: "stop", 1: "stop"}
            await c.close()
            await _wait_free(m)
            return r, prefilled, texts, reasons, usage, seeded, singles, seen, spec

    r, prefilled, texts, reasons, usage, seeded, singles, seen, spec = asyncio.run(go())
    assert [ch.index for ch in r.choices] == [0, 1, 2]
    assert [ch.text for ch in r.choices] == [want] * 3 and {ch.finish_reason for ch in r.choices} == {"length"}
    assert (r.usage.prompt_tokens, r.usage.completion_tokens) == (n_prompt, 24)
    assert prefilled == n_prompt  # the prompt was prefilled once, not per choice
    # ... and its KV moved once: one item, the shared blocks and each child's last block.
    items = [i for ready in seen for i in ready.items]
    assert [(i.request_id, [f.request_id for f in i.forks]) for i in items] == \
        [(r.id.removeprefix("cmpl-") + "-0", [r.id.removeprefix("cmpl-") + f"-{k}" for k in (1, 2)])]
    assert items[0].nbytes == spec.nbytes((n_prompt - 1) // spec.block_size + 3)
    assert texts == {0: want_chat, 1: want_chat} and reasons == {0: "length", 1: "length"}
    assert usage.completion_tokens == 12 and usage.prompt_tokens == len(chat_ids)
    assert [ch.text for ch in seeded.choices] == [s.choices[0].text for s in singles]
    assert len({ch.text for ch in seeded.choices}) == 3


def test_v4_choices_prefill_once_and_move_as_one_buffer(nats_url, tiny_v4_model, tmp_path):
    """A DeepSeek-V4 mesh forks too: the prompt is computed once and the children's KV
    moves as one item (the shared blocks' main rows once, then each child's last block,
    then each child's ring look-back); every greedy choice is the single request's, and
    seeded choice i what n = 1 with seed fork_seed(seed, i) gives, from the prefix cache
    as well (the repeated prompt's parent starts on the first one's blocks and snapshot)."""
    from moemesh.shared.engine.config import EngineConfig
    from moemesh.shared.engine.llm import LLM

    prompt = [(i * 53 + 7) % 900 + 5 for i in range(40)]
    want = LLM(EngineConfig(model=tiny_v4_model, num_kv_blocks=64)).generate(
        [prompt], SamplingParams(max_tokens=8, temperature=0, ignore_eos=True))[0].text

    async def go():
        async with mesh(nats_url, tiny_v4_model, tmp_path) as m:
            c = _client(m.url)
            pre, dec = m.prefill.rt.engine, m.decode.rt.engine
            assert pre.hybrid and dec.num_spec >= 1, "V4, MTP drafts on the decode side"
            before = pre.num_prompt_tokens_total
            async with kv_ready_seen(nats_url, m.prefix) as seen:
                r = await c.completions.create(model="tiny", prompt=prompt, max_tokens=8, temperature=0, n=3,
                                               extra_body={"ignore_eos": True})
            prefilled = pre.num_prompt_tokens_total - before
            seeded = await c.completions.create(model="tiny", prompt=prompt, max_tokens=8, temperature=1, seed=11,
                                                n=3)
            singles = [await c.completions.create(model="tiny", prompt=prompt, max_tokens=8, temperature=1,
                                                  seed=fork_seed(11, i)) for i in range(3)]
            await c.close()
            await _wait_free(m)
            for _ in range(500):  # rings go back with the blocks, that _wait_free saw back
                if all(e.blocks.num_free_rings == e.blocks.num_rings for e in (pre, dec)):
                    break
                await asyncio.sleep(0.02)
            else:
                raise AssertionError("a ring is still held")
            return r, prefilled, seen, m.prefill.rt.kv_spec, seeded, singles

    r, prefilled, seen, spec, seeded, singles = asyncio.run(go())
    assert [ch.text for ch in r.choices] == [want] * 3 and {ch.finish_reason for ch in r.choices} == {"length"}
    assert prefilled == len(prompt)
    items = [i for ready in seen for i in ready.items]
    assert [len(i.forks) for i in items] == [2]
    s = (len(prompt) - 1) // spec.block_size
    assert items[0].num_blocks == s + 3 and items[0].nbytes == spec.nbytes(s + 3, 3) < 3 * spec.nbytes(s + 1)
    assert [ch.text for ch in seeded.choices] == [x.choices[0].text for x in singles]
    assert len({ch.text for ch in seeded.choices}) == 3


def test_a_client_that_leaves_frees_every_choice(nats_url, tiny_model, tmp_path):
    async def go():
        async with mesh(nats_url, tiny_model, tmp_path, engine="mock", mock_step_ms=2.0) as m:
            body = {"model": "tiny", "prompt": "a long story " * 5, "max_tokens": 3900, "stream": True, "n": 4,
                    "temperature": 0, "ignore_eos": True}
            async with httpx.AsyncClient(timeout=30) as c:
                async with c.stream("POST", m.url + "/v1/completions", json=body) as r:
                    assert r.status_code == 200
                    rid = r.headers["x-request-id"]
                    lines = r.aiter_lines()
                    seen = set()
                    while len(seen) < 4:  # every choice has its first token
                        line = await anext(lines)
                        if line.startswith("data: {"):
                            seen.add(json.loads(line[6:])["choices"][0]["index"])
                    kids = {f"{rid}-{i}" for i in range(4)}
                    while not kids <= set(m.decode.active):  # all four decode there now
                        await asyncio.sleep(0.01)
                    assert not _all_free(m)
            await _wait_free(m)
            assert m.gateway.state.inflight == 0 and not m.gateway.state.mesh.handles

    asyncio.run(go())


def test_errors_name_n_and_best_of_and_usage_counts_every_choice(nats_url, tiny_model, tmp_path):
    async def go():
        async with mesh(nats_url, tiny_model, tmp_path, engine="mock", mock_step_ms=1.0) as m:
            async with httpx.AsyncClient(timeout=30) as c:
                out = []
                for extra in ({"n": 17}, {"n": 0}, {"n": 2.5}, {"n": 2, "best_of": 3}):
                    r = await c.post(m.url + "/v1/completions", json={"model": "tiny", "prompt": "x", **extra})
                    out.append((r.status_code, r.json()["error"]["param"]))
                r = await c.post(m.url + "/v1/completions", json={"model": "tiny", "prompt": "x", "n": 16,
                                                                  "max_tokens": 2})
                # continuous usage: every chunk counts the tokens sent so far, of every choice
                body = {"model": "tiny", "prompt": "x", "n": 2, "max_tokens": 5, "ignore_eos": True, "stream": True,
                        "stream_options": {"include_usage": True, "continuous_usage_stats": True}}
                async with c.stream("POST", m.url + "/v1/completions", json=body) as s:
                    events = [json.loads(line[6:]) async for line in s.aiter_lines() if line.startswith("data: {")]
                return out, r.status_code, len(r.json()["choices"]), events

    out, status, n, events = asyncio.run(go())
    assert out == [(400, "n"), (400, "n"), (400, "n"), (400, "best_of")]
    assert (status, n) == (200, 16)
    tokens = [e for e in events if e["choices"] and e["choices"][0]["finish_reason"] is None]
    assert [e["usage"]["completion_tokens"] for e in tokens] == list(range(1, 11))
    assert sorted(e["choices"][0]["index"] for e in tokens) == [0] * 5 + [1] * 5
    assert events[-1]["choices"] == [] and events[-1]["usage"]["completion_tokens"] == 10


def test_each_choice_of_a_dead_decode_worker_moves_on_its_own(nats_url, tiny_model, tmp_path):
    """The worker that decodes the choices stops (silent, as a killed process): each child
    is moved as its own request (its prompt plus what it streamed) and every choice ends
    whole, the same as without the failure (greedy: the mock's tokens follow positions)."""
    max_tokens = 300

    async def go():
        prefix, hub = "par-mig", LoopbackHub()
        common = dict(nats_url=nats_url, model=tiny_model, subject_prefix=prefix, served_model_name="tiny",
                      heartbeat_interval_s=0.25, staging_mb=16, num_kv_blocks=256, engine="mock",
                      mock_step_ms=20.0)
        async with AsyncExitStack() as stack:
            await stack.enter_async_context(PrefillService(PrefillConfig(worker_id="prefill-p", **common), None,
                                                           lambda: LoopbackTransport(hub)))
            decs = [await stack.enter_async_context(DecodeService(
                DecodeConfig(worker_id=f"decode-p{i}", **common), None, lambda: LoopbackTransport(hub)))
                for i in range(2)]
            gw = await stack.enter_async_context(GatewayService(GatewayConfig(
                nats_url=nats_url, model=tiny_model, subject_prefix=prefix, served_model_name="tiny", port=0,
                worker_id="gw-p")))
            url = f"http://127.0.0.1:{gw.port}"
            body = {"model": "tiny", "prompt": "moving on", "max_tokens": max_tokens, "ignore_eos": True,
                    "temperature": 0}
            async with httpx.AsyncClient(timeout=60) as c:
                while (await c.get(url + "/health")).json()["workers"]["decode"] < 2:
                    await asyncio.sleep(0.05)
                want = (await c.post(url + "/v1/completions", json=body)).json()["choices"][0]["text"]
                task = asyncio.create_task(c.post(url + "/v1/completions", json={**body, "n": 3}))
                while not any(len(d.active) == 3 for d in decs):
                    await asyncio.sleep(0.01)
                victim = next(d for d in decs if d.active)
                await victim.rt.heartbeat.stop()
                await victim.rt.bus.nc.close()
                r = await task
                metrics = (await c.get(url + "/metrics")).text
            return want, r, metrics

    want, r, metrics = asyncio.run(go())
    assert r.status_code == 200, r.text
    got = r.json()
    assert [ch["text"] for ch in got["choices"]] == [want] * 3
    assert [ch["finish_reason"] for ch in got["choices"]] == ["length"] * 3
    assert got["usage"]["completion_tokens"] == 3 * max_tokens
    moved = next(float(line.split()[-1]) for line in metrics.splitlines()
                 if line.startswith(("moemesh_request_migrations_total ", "moemesh_request_migrations_total{")))
    assert 0 < moved <= 3


def test_a_lease_of_children_goes_with_the_last_of_them():
    from moemesh.services.prefill.service import LeaseTable
    from moemesh.shared.protocol.messages import PrefillJob, WireSampling

    t = LeaseTable(30.0)
    lease = t.grant(PrefillJob("r-0", [1, 2], WireSampling(), "gw", "dec"), 3, 300, forks=["r-1", "r-2"])
    assert lease.request_ids == ["r-0", "r-1", "r-2"] and t.of("r-2") is lease and t.of("r-0") is lease
    lease.live.discard("r-0")
    assert t.of("r-1") is lease and lease.live == {"r-1", "r-2"}
    assert t.pop("r-0") is lease and t.of("r-1") is None and not t.by_request
