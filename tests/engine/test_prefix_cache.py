import random

from moemesh.shared.engine.block_manager import BlockManager
from moemesh.shared.protocol.prefix_hash import ROOT, block_hash, chain
from moemesh.shared.protocol.messages import SamplingParams


def test_hash_chain_is_content_addressed_and_prefix_sensitive():
    ident = b"i" * 16
    a = chain(list(range(40)), 16, ident)
    b = chain(list(range(40)) + [7, 7], 16, ident)
    assert len(a) == 2 and a == b[:2]  # equal prefixes, equal keys; the partial block is not hashed
    c = chain([99] + list(range(1, 40)), 16, ident)
    assert c[0] != a[0] and c[1] != a[1]  # a change anywhere changes every later key
    assert chain(list(range(40)), 16, b"j" * 16)[0] != a[0]  # another model or layout: other keys
    assert a[0] == block_hash(ROOT, list(range(16)), ident)


def test_freed_cached_blocks_are_reused_and_evicted_lru():
    bm = BlockManager(4, 16, enable_caching=True)
    x = bm.allocate(2)
    bm.register(x[0], b"h0")
    bm.register(x[1], b"h1")
    assert bm.drain_events() == ([b"h0", b"h1"], [])
    bm.free(x)
    assert bm.num_free_blocks == 4 and bm.lookup([b"h0", b"h1", b"h2"]) == x
    bm.acquire(x[:1])  # a new request reuses the first block
    assert bm.num_free_blocks == 3 and bm.ref_count(x[0]) == 1
    y = bm.allocate(3)  # uncached blocks go first, then the least recently freed cached one
    assert x[1] in y and bm.lookup([b"h0", b"h1"]) == [x[0]]
    assert bm.drain_events() == ([], [b"h1"])
    bm.free(y)
    bm.free(x[:1])
    bm.check()


def _run(eng, prompts, max_tokens=6, abort_every=0):
    outs = {}
    for i, p in enumerate(prompts):
        eng.add_request(f"r{i}", p, SamplingParams(max_tokens=max_tokens, temperature=0, ignore_eos=True))
        outs[f"r{i}"] = []
    step = 0
    while eng.has_unfinished():
        for o in eng.step():
            outs[o.request_id] += o.new_token_ids
        step += 1
        if abort_every and step % abort_every == 0 and eng.seqs:
            eng.abort(sorted(eng.seqs)[0])
    return outs


def test_reuse_gives_identical_greedy_output_and_counts_hits(tiny_engine_factory):
    rng = random.Random(0)
    common = [0] + [rng.randrange(4, 970) for _ in range(70)]
    prompts = [common + [rng.randrange(4, 970) for _ in range(rng.randrange(1, 30))] for _ in range(8)]
    off = _run(tiny_engine_factory(enable_prefix_caching=False), prompts)
    eng = tiny_engine_factory(enable_prefix_caching=True, max_num_batched_tokens=512)
    first = _run(eng, prompts[:1])
    again = _run(eng, prompts)  # every prompt shares 4 full blocks with the first
    assert first["r0"] == off["r0"] and [again[f"r{i}"] for i in range(8)] == [off[f"r{i}"] for i in range(8)]
    assert eng.num_cached_tokens_total >= 8 * 64
    assert eng.blocks.num_free_blocks == eng.blocks.num_blocks
    eng.blocks.check()


def test_random_traffic_with_sharing_and_aborts_never_leaks(tiny_engine_factory):
    rng = random.Random(3)
    eng = tiny_engine_factory(enable_prefix_caching=True, num_kv_blocks=48, max_num_batched_tokens=96)
    bases = [[0] + [rng.randrange(4, 970) for _ in range(rng.randrange(10, 60))] for _ in range(3)]
    for round_ in range(4):
        prompts = [rng.choice(bases) + [rng.randrange(4, 970) for _ in range(rng.randrange(0, 20))]
                   for _ in range(6)]
        _run(eng, prompts, max_tokens=rng.randrange(1, 12), abort_every=5 if round_ % 2 else 0)
        assert eng.blocks.num_free_blocks == eng.blocks.num_blocks
        eng.blocks.check()
    assert eng.blocks.num_cached_blocks > 0
