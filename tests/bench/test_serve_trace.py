"""Trace replay: the trace's sharing kept token for token, its lengths scaled to fit, its
hit rate implied, and bad files refused with where they went wrong."""

from __future__ import annotations

import json

import pytest

from moemesh.tools.bench.serve import trace as tr

VOCAB = list(range(100, 600))


def mooncake(path, rows) -> str:
    path.write_text("".join(json.dumps(dict(zip(("timestamp", "input_length", "output_length", "hash_ids"), r)))
                            + "\n" for r in rows))
    return str(path)


def test_shared_hash_ids_share_tokens_and_others_do_not(tmp_path):
    # Blocks of 8: the second request shares the first's two blocks, the third only block 0.
    t = tr.load([mooncake(tmp_path / "t.jsonl", [(0, 20, 4, [0, 1, 2]), (1500, 19, 3, [0, 1, 3]),
                                                (3000, 10, 2, [0, 4])])], block_size=8)
    assert [r.t_s for r in t.requests] == [0.0, 1.5, 3.0] and t.formats == ("mooncake",)
    a, b, c = tr.replay(t, 1, VOCAB, seed=7)
    assert [len(x.prompt_ids) for x in (a, b, c)] == [20, 19, 10]
    assert a.prompt_ids[:16] == b.prompt_ids[:16] and a.prompt_ids[16:19] != b.prompt_ids[16:19]
    assert c.prompt_ids[:8] == a.prompt_ids[:8] and c.prompt_ids[8:] != a.prompt_ids[8:10]
    assert (a.max_tokens, b.max_tokens, c.max_tokens) == (4, 3, 2)
    assert all(i in VOCAB for x in (a, b, c) for i in x.prompt_ids)
    # Same seed, same tokens; another seed (a sweep's next point) shares nothing with it.
    assert tr.replay(t, 1, VOCAB, seed=7)[1] == b
    assert tr.replay(t, 1, VOCAB, seed=8)[0].prompt_ids[:8] != a.prompt_ids[:8]
    assert [x.implied_hit for x in (a, b, c)] == [0, 16, 8] == tr.implied_hits(t)


def test_a_prompt_fully_seen_still_computes_its_last_token(tmp_path):
    t = tr.load([mooncake(tmp_path / "t.jsonl", [(0, 16, 1, [5, 6]), (10, 16, 1, [5, 6]), (20, 12, 1, [5, 6])])],
                block_size=8)
    assert tr.implied_hits(t) == [0, 15, 11]


def test_scaling_keeps_the_sharing_and_divides_every_length(tmp_path):
    rows = [(0, 4000, 300, list(range(8))), (5, 4100, 100, [*range(7), 99, 100])]
    t = tr.load([mooncake(tmp_path / "t.jsonl", rows)])  # Mooncake: 512-token blocks
    assert t.block_size == 512 and t.longest == 4300
    assert tr.scale_for(t, None) == 1 and tr.scale_for(t, 8192) == 1
    assert tr.scale_for(t, 4096) == 2 and tr.scale_for(t, 1024) == 8
    f = tr.scale_for(t, 600)
    assert f == 8  # 4100/8 + 100/8 = 513 + 13 fits; at 4 the prompt alone (1025) does not
    a, b = tr.replay(t, f, VOCAB)
    assert (len(a.prompt_ids), a.max_tokens, len(b.prompt_ids), b.max_tokens) == (500, 38, 513, 13)
    assert a.prompt_ids[:7 * 64] == b.prompt_ids[:7 * 64] and a.prompt_ids[7 * 64:] != b.prompt_ids[7 * 64:500]
    assert b.implied_hit == 7 * 64 and tr.implied_hits(t, 1)[1] == 7 * 512
    with pytest.raises(ValueError, match="no factor that divides its 512-token blocks fits it into 4"):
        tr.scale_for(t, 4)
    with pytest.raises(ValueError, match="does not divide"):
        tr.replay(t, 3, VOCAB)


def test_fewer_blocks_than_tokens_are_made_up_with_tokens_of_its_own(tmp_path):
    t = tr.load([mooncake(tmp_path / "t.jsonl", [(0, 30, 1, [1]), (1, 30, 1, [1])])], block_size=8)
    a, b = tr.replay(t, 1, VOCAB)
    assert len(a.prompt_ids) == len(b.prompt_ids) == 30
    assert a.prompt_ids[:8] == b.prompt_ids[:8] and a.prompt_ids[8:] != b.prompt_ids[8:]


def test_kv_cache_tester_sessions_are_converted_and_their_ids_kept_apart(tmp_path):
    def session(name, reqs):
        p = tmp_path / name
        p.write_text(json.dumps({"id": name, "block_size": 4, "hash_id_scope": "local", "requests": reqs}))
        return str(p)

    one = session("a.json", [{"t": 0.0, "type": "n", "in": 8, "out": 2, "hash_ids": [1, 2]},
                             {"t": 30.0, "type": "n", "in": 12, "out": 5, "hash_ids": [1, 2, 3]}])
    two = session("b.json", [{"t": 10.0, "type": "n", "in": 8, "out": 1, "hash_ids": [1, 2]},
                             {"t": 12.0, "type": "subagent", "requests": [
                                 {"t": 0.0, "type": "n", "in": 4, "out": 1, "hash_ids": [7]},
                                 {"t": 3.5, "type": "n", "in": 8, "out": 1, "hash_ids": [7, 8]}]}])
    t = tr.load([one, two])
    assert t.formats == ("kv-cache-tester", "kv-cache-tester") and t.block_size == 4
    # Each file's clock starts at its first request; a subagent's from its own start.
    assert [(r.t_s, r.input_len) for r in t.requests] == [(0.0, 8), (0.0, 8), (2.0, 4), (5.5, 8), (30.0, 12)]
    a0, b0, s0, s1, a1 = tr.replay(t, 1, VOCAB)
    assert a0.prompt_ids != b0.prompt_ids  # the same ids, in files of their own
    assert a1.prompt_ids[:8] == a0.prompt_ids and s1.prompt_ids[:4] == s0.prompt_ids
    assert tr.implied_hits(t) == [0, 0, 0, 4, 8]
    assert len(tr.load([one, two], limit=2).requests) == 2
    with pytest.raises(ValueError, match="different block sizes"):
        tr.load([one, mooncake(tmp_path / "m.jsonl", [(0, 5, 1, [0])])])


@pytest.mark.parametrize("text, match", [
    ('{"timestamp": 0, "input_length": 5, "output_length": 1, "hash_ids": [0]}\nnot json\n', r"t.jsonl:2: not JSON"),
    ('{"timestamp": -1, "input_length": 5, "output_length": 1, "hash_ids": [0]}\n', r":1: 'timestamp'"),
    ('{"timestamp": 0, "input_length": 0, "output_length": 1, "hash_ids": [0]}\n', r"input_length must be"),
    ('{"timestamp": 0, "input_length": 5, "output_length": 1, "hash_ids": ["a"]}\n', r"hash_ids must be"),
    ('[1, 2]\n', r"each line must be an object"),
    ('\n\n', r"no requests"),
    ('{"block_size": 4, "requests": [{"t": 0, "in": 3, "out": 1}]}', r"request 0: hash_ids"),
    ('{"block_size": 0, "requests": []}', r"block_size must be"),
])
def test_a_bad_trace_is_refused_with_where(tmp_path, text, match):
    p = tmp_path / "t.jsonl"
    p.write_text(text)
    with pytest.raises(ValueError, match=match):
        tr.load([str(p)])


def test_a_missing_file_is_refused():
    with pytest.raises(ValueError, match="cannot read trace /nonexistent"):
        tr.load(["/nonexistent/t.jsonl"])


def test_bands_by_the_traces_own_length():
    assert [tr.band(n) for n in (10, 4096, 20000, 70000)] == ["<4k", "4k-16k", "16k-64k", ">=64k"]
    assert tr.band_order() == ["<4k", "4k-16k", "16k-64k", ">=64k"]


def test_the_token_pool_leaves_out_special_tokens(tiny_model):
    from moemesh.tools.bench.serve.workload import load_tokenizer

    tok = load_tokenizer(tiny_model)
    pool = tr.token_pool(tok)
    specials = set(tok.get_added_tokens_decoder())
    assert pool and not specials & set(pool) and max(pool) < tok.get_vocab_size()


def _args(*extra: str):
    import argparse

    from moemesh.tools.cli import bench_serve

    p = argparse.ArgumentParser()
    bench_serve.register(p.add_subparsers())
    return bench_serve.build_config(p.parse_args(["serve", "--url", "http://127.0.0.1:1", *extra]))


def test_the_trace_workload_replays_at_its_own_times_on_completions(tmp_path):
    f = mooncake(tmp_path / "t.jsonl", [(0, 20, 4, [0, 1])])
    cfg = _args("--workload", "trace", "--trace", f, "--time-scale", "3", "--trace-scale", "4")
    assert (cfg.mode, cfg.values, cfg.workload.trace_scale, cfg.workload.num_requests_set) == ("trace", (3.0,), 4, False)
    for bad, match in [(("--rate", "2"), "replays at its own times"), (("--sweep", "concurrency=1,2"), "own times"),
                       (("--endpoint", "chat"), "only --endpoint completions"), (("--trace-scale", "3"), "power of two"),
                       (("--trace-scale", "x"), "auto or a power of two"), (("--time-scale", "0"), "--time-scale")]:
        with pytest.raises(ValueError, match=match):
            _args("--workload", "trace", "--trace", f, *bad)
    with pytest.raises(ValueError, match="--trace goes with --workload trace"):
        _args("--trace", f)


def test_a_trace_stream_needs_the_vocabulary_and_states_its_scale(tmp_path, tiny_model):
    from moemesh.tools.bench.serve import workload as wl

    f = mooncake(tmp_path / "t.jsonl", [(0, 3000, 200, list(range(6))), (2000, 3100, 100, [*range(6), 7])])
    cfg = wl.WorkloadConfig(kind="trace", trace_paths=(f,), num_requests_set=False)
    with pytest.raises(ValueError, match="needs --tokenizer"):
        wl.build(cfg, 0)
    w = wl.build(cfg, 0, tokenizer=wl.load_tokenizer(tiny_model), max_model_len=1024)
    assert w.arrivals == (0.0, 2.0) and w.trace["scale"] == 4 and w.trace["block_tokens"] == 128
    assert [t.input_len for s in w.sessions for t in s.turns] == [750, 775]
    assert w.trace["implied_hit_rate"] == pytest.approx(6 * 128 / (750 + 775))
    assert wl.over_context(w, 1024) == 0


def test_the_gateway_admits_a_context_past_the_model_only_when_told():
    from moemesh.services.gateway.http.app import context_length

    assert context_length(0, 4096, False) == 4096 and context_length(2048, 4096, False) == 2048
    assert context_length(65536, 4096, False) == 4096 and context_length(65536, 4096, True) == 65536
