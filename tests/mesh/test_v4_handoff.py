"""DeepSeek-V4's prefill -> decode hand-off at the lengths where its cache is subtle:
prompts that end inside a compression group and prompts past the sliding window, with
MTP drafts on the decode side; and the bytes each request moves, as both workers
report them, against the cache's own accounting.

v4-tiny: sliding window 8, CSA groups of 4, HCA groups of 16, 16-token blocks. The
services run in this process with the loopback transport (tests/services/
test_in_process.py); the same hand-off over UCX between processes is in test_v4_mesh.py.
"""

from __future__ import annotations

import asyncio
import json
import math

import httpx
import pytest

from moemesh.shared.protocol.messages import SamplingParams
from tests.services.conftest import nats_url  # noqa: F401 (fixture)
from tests.services.test_in_process import _metric, _wait_free, mesh

MAX_TOKENS = 12
# 17: one past a block (and an HCA group); 23: inside a CSA group and an HCA group;
# 33: one past two blocks; 70: inside a CSA group, many windows on; 130: past eight
# blocks, inside a CSA group. All but the first end inside a CSA group of 4.
LENGTHS = (17, 23, 33, 70, 130)


def _prompt(n: int) -> list[int]:
    return [(i * 53 + n * 7) % 900 + 5 for i in range(n)]


@pytest.fixture(scope="module")
def v4_offline(tiny_v4_model):
    from moemesh.shared.engine.config import EngineConfig
    from moemesh.shared.engine.llm import LLM

    return LLM(EngineConfig(model=tiny_v4_model, num_kv_blocks=256))


def _handoff_bytes(n_tokens: int, itemsize: int) -> int:
    """A v4-tiny hand-off, from the architecture rather than the engine: per 16-token block
    each CSA layer (two) keeps 4 entries of 32 values and 4 index keys of 16, the HCA
    layer one entry of 32; the carried look-back is, per cache layer (four and the MTP
    layer), the window's last 7 keys of 32 values, and per compressed layer its open
    groups' compressor projections: CSA 7 positions of 2 * 2 * 32 (kv | gate, two series)
    and 7 of the indexer's 4 * 16; HCA 15 positions of 2 * 32."""
    main_per_block = 2 * (4 * 32 + 4 * 16) + 1 * 32
    carry = 5 * 7 * 32 + 2 * (7 * 128 + 7 * 64) + 15 * 64
    return (math.ceil(n_tokens / 16) * main_per_block + carry) * itemsize


def test_v4_handoff_matches_one_engine_at_group_and_window_edges(nats_url, tiny_v4_model, v4_offline,  # noqa: F811
                                                                 tmp_path):
    prompts = [_prompt(n) for n in LENGTHS]
    greedy = SamplingParams(max_tokens=MAX_TOKENS, temperature=0, ignore_eos=True)
    done = v4_offline.generate(prompts, greedy)
    assert all(len(c.token_ids) == MAX_TOKENS for c in done)
    want = [c.text for c in done]

    async def go():
        async with mesh(nats_url, tiny_v4_model, tmp_path) as m:
            assert m.decode.rt.engine.num_spec >= 1, "MTP drafts on the decode side"
            spec = m.decode.rt.kv_spec
            assert spec.hybrid and spec == m.prefill.rt.kv_spec
            async with httpx.AsyncClient(timeout=120) as c:
                async def one(p):
                    body = {"model": "tiny", "prompt": p, "max_tokens": MAX_TOKENS, "temperature": 0,
                            "ignore_eos": True}
                    r = await c.post(m.url + "/v1/completions", json=body)
                    assert r.status_code == 200, r.text
                    return r.json()
                one_by_one = [await one(p) for p in prompts]
                together = await asyncio.gather(*(one(p) for p in prompts))
            await _wait_free(m)
            sent = _metric(m.prefill.rt.metrics.render()[0], "moemesh_kv_bytes_sent_total")
            received = _metric(m.decode.rt.metrics.render()[0], "moemesh_kv_bytes_received_total")
            return one_by_one, together, spec, m.decode.rt.engine, sent, received, m.trace_file

    one_by_one, together, spec, engine, sent, received, trace = asyncio.run(go())
    for got in (one_by_one, together):
        assert [r["choices"][0]["text"] for r in got] == want
        assert all(r["usage"]["completion_tokens"] == MAX_TOKENS for r in got)

    # Bytes per request: the KVSpec both workers describe their cache with, the engine's
    # buffer shape and the layout worked out by hand all agree ...
    size = {n: spec.nbytes(math.ceil(n / spec.block_size)) for n in LENGTHS}
    for n in LENGTHS:
        blocks = math.ceil(n / spec.block_size)
        assert size[n] == math.prod(engine.kv_shape(blocks)) * engine.kv_dtype.itemsize
        assert size[n] == _handoff_bytes(n, engine.kv_dtype.itemsize)
    # ... and each request's transfer, as the decode side's `kv.transfer` span and the
    # prefill side's `kv.send` span report it, is exactly that size.
    spans = [json.loads(line) for line in trace.read_text().splitlines() if line.strip()]
    prompt_len = {s["trace_id"]: s["attributes"]["prompt.tokens"] for s in spans if s["name"] == "decode"}
    def sizes_of(name: str) -> list[tuple[int, int]]:
        return sorted((prompt_len[s["trace_id"]], s["attributes"]["kv.bytes"]) for s in spans if s["name"] == name)

    pulled, pushed = sizes_of("kv.transfer"), sizes_of("kv.send")
    expected = sorted((n, size[n]) for n in LENGTHS for _ in range(2))
    assert pulled == expected and pushed == expected
    # The workers' counters add up to the same: every byte that left prefill reached decode.
    assert sent == received == 2 * sum(size.values())
