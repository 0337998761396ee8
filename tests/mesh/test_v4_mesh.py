"""DeepSeek-V4 through the mesh: a prompt prefilled on one worker and decoded on another
(its state travels as one flat buffer) gives what one engine gives on its own."""

from __future__ import annotations

import asyncio

import httpx
import openai
import pytest

from moemesh.shared.protocol.messages import SamplingParams
from tests.mesh.conftest import start_mesh, wait_free, worker_stats

# Two running sequences per worker means four window rings (two more for held requests):
# a hand-off that kept one would stall the requests after the first few.
SETTINGS = ["max_num_seqs=2"]
MAX_TOKENS = 10


@pytest.fixture(scope="module")
def v4_mesh(tiny_v4_model, tmp_path_factory):
    m = start_mesh(tmp_path_factory.mktemp("v4-mesh"), tiny_v4_model, prefill_set=SETTINGS, decode_set=SETTINGS)
    yield m
    m.group.stop()


@pytest.fixture(scope="module")
def v4_offline(tiny_v4_model):
    from moemesh.shared.engine.config import EngineConfig
    from moemesh.shared.engine.llm import LLM

    return LLM(EngineConfig(model=tiny_v4_model, num_kv_blocks=256))


def _greedy(llm, ids: list[int]) -> str:
    out = llm.generate([ids], SamplingParams(max_tokens=MAX_TOKENS, temperature=0, ignore_eos=True))[0]
    assert len(out.token_ids) == MAX_TOKENS
    return out.text


async def _stream(client: openai.AsyncOpenAI, kind: str, prompt) -> tuple[str, int]:
    """(text, completion tokens) of one streamed greedy request."""
    common = dict(model="tiny", max_tokens=MAX_TOKENS, temperature=0, stream=True,
                  stream_options={"include_usage": True}, extra_body={"ignore_eos": True})
    if kind == "chat":
        chunks = [c async for c in await client.chat.completions.create(messages=prompt, **common)]
        text = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    else:
        chunks = [c async for c in await client.completions.create(prompt=prompt, **common)]
        text = "".join(c.choices[0].text for c in chunks if c.choices)
    return text, chunks[-1].usage.completion_tokens


def test_prefill_to_decode_handoff_matches_one_engine_and_frees_everything(v4_mesh, v4_offline):
    tok = v4_offline.tokenizer
    long_text = "The experts of the fourth model route every token through the mesh, " * 3
    chats = [[{"role": "user", "content": "hi"}], [{"role": "user", "content": long_text}]]
    # Token-id prompts: 3 tokens (less than a block), 21, and 45 (past the sliding window
    # and an HCA group, so compressed entries and carried window rows both travel).
    ids = [[(i * 37 + n) % 900 + 5 for i in range(n)] for n in (3, 21, 45)]
    requests = [("chat", m, tok.encode_chat(m)) for m in chats] + [("completion", p, p) for p in ids]
    assert max(len(r[2]) for r in requests) > 40
    want = [_greedy(v4_offline, prompt_ids) for _, _, prompt_ids in requests]

    async def main():
        client = openai.AsyncOpenAI(base_url=v4_mesh.url + "/v1", api_key="unused", max_retries=0, timeout=120)
        try:
            one_by_one = [await _stream(client, kind, p) for kind, p, _ in requests]
            # Then all at once: one prefill step's hand-offs share a KVReady and a transfer.
            together = await asyncio.gather(*(_stream(client, kind, p) for kind, p, _ in requests))
            return one_by_one, together
        finally:
            await client.close()

    one_by_one, together = asyncio.run(main())
    assert [t for t, _ in one_by_one] == want
    assert [t for t, _ in together] == want
    assert all(n == MAX_TOKENS for _, n in one_by_one + list(together))
    wait_free(v4_mesh)
    dec = asyncio.run(worker_stats(v4_mesh.nats_url, v4_mesh.decode_id))
    assert dec.load.num_running == 0 and dec.load.num_waiting == 0
    assert httpx.get(v4_mesh.url + "/health").json()["inflight"] == 0


@pytest.mark.parametrize("worker", ["prefill_id", "decode_id"])
def test_a_malformed_block_fetch_from_a_v4_worker_is_refused_plainly(v4_mesh, worker):
    """A V4 block travels with the boundary snapshot at its prefix's end; a peer that asks
    for blocks in a size they do not have gets the reason, not a transfer."""
    import nats

    from moemesh.shared.protocol.messages import KVFetch, KVFetchReply
    from moemesh.shared.protocol.subjects import Subjects
    from moemesh.shared.service.nats_io import request

    async def go():
        nc = await nats.connect(v4_mesh.nats_url)
        try:
            subject = Subjects(v4_mesh.prefix).kv_fetch(getattr(v4_mesh, worker))
            return await request(nc, subject, KVFetch([b"\x01" * 16], b"addr", 7, 1024), KVFetchReply, 10)
        finally:
            await nc.close()

    reply = asyncio.run(go())
    assert not reply.ok and "size mismatch" in reply.error
