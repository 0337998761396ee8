import pytest
import torch

from moemesh.shared.engine.engine import RequestError
from moemesh.shared.engine.llm import LLM
from moemesh.shared.engine.config import EngineConfig
from moemesh.shared.protocol.messages import SamplingParams


def _drain(eng):
    outs = {}
    while eng.has_unfinished():
        for o in eng.step():
            rec = outs.setdefault(o.request_id, {"ids": [], "reason": None, "lp": []})
            rec["ids"] += o.new_token_ids
            rec["lp"] += o.logprobs or []
            if o.finished:
                rec["reason"] = o.finish_reason.value
    return outs


def test_prompt_longer_than_context_is_a_clear_error(tiny_engine_factory):
    eng = tiny_engine_factory(max_model_len=64)
    with pytest.raises(RequestError, match="prompt has 64 tokens but the model's context is 64") as e:
        eng.add_request("x", [5] * 64, SamplingParams())
    assert e.value.param == "prompt"
    with pytest.raises(RequestError, match="empty"):
        eng.add_request("y", [], SamplingParams())
    vocab = eng.model_config.vocab_size
    with pytest.raises(RequestError, match=rf"token ids must be in \[0, {vocab}\)"):
        eng.add_request("z", [5, 99999], SamplingParams())
    assert not eng.has_unfinished()


def test_request_too_big_for_the_cache_is_refused(tiny_engine_factory):
    eng = tiny_engine_factory(num_kv_blocks=4)
    with pytest.raises(RequestError, match="KV blocks but the cache holds 4"):
        eng.add_request("x", [5] * 40, SamplingParams(max_tokens=100))


def test_abort_frees_everything_mid_decode(tiny_engine_factory):
    eng = tiny_engine_factory()
    for i in range(4):
        eng.add_request(f"r{i}", [0, 5, 6, 7] * (i + 1), SamplingParams(max_tokens=50, ignore_eos=True))
    for _ in range(3):
        eng.step()
    assert eng.blocks.num_used_blocks > 0
    for i in range(4):
        assert eng.abort(f"r{i}")
    assert eng.blocks.num_free_blocks == eng.blocks.num_blocks and not eng.has_unfinished()
    assert not eng.abort("r0")


def test_max_tokens_stop_ids_min_tokens_and_eos(tiny_engine_factory):
    eng = tiny_engine_factory()
    prompt = [0, 11, 12, 13]
    eng.add_request("ref", prompt, SamplingParams(max_tokens=12, temperature=0, ignore_eos=True))
    ref = _drain(eng)["ref"]
    assert len(ref["ids"]) == 12 and ref["reason"] == "length"
    stop_at = ref["ids"][5]
    eng.add_request("stop", prompt, SamplingParams(max_tokens=12, temperature=0, stop_token_ids=(stop_at,)))
    eng.add_request("min", prompt, SamplingParams(max_tokens=12, temperature=0, stop_token_ids=(stop_at,),
                                                   min_tokens=12, ignore_eos=True))
    out = _drain(eng)
    first = ref["ids"].index(stop_at)
    assert out["stop"]["ids"] == ref["ids"][: first + 1] and out["stop"]["reason"] == "stop"
    assert out["min"]["ids"] == ref["ids"] and out["min"]["reason"] == "length"


def test_seeded_sampling_is_reproducible_and_batch_independent(tiny_engine_factory):
    eng = tiny_engine_factory(num_speculative_tokens=0)
    p = SamplingParams(max_tokens=10, temperature=1.0, top_p=0.9, seed=42, ignore_eos=True)
    eng.add_request("a", [0, 9, 9, 9], p)
    alone = _drain(eng)["a"]["ids"]
    for i in range(5):
        eng.add_request(f"n{i}", [0, 3 + i, 8], SamplingParams(max_tokens=10, temperature=1.0, ignore_eos=True))
    eng.add_request("b", [0, 9, 9, 9], p)
    assert _drain(eng)["b"]["ids"] == alone
    eng.add_request("c", [0, 9, 9, 9], SamplingParams(max_tokens=10, temperature=1.0, top_p=0.9, seed=43,
                                                       ignore_eos=True))
    assert _drain(eng)["c"]["ids"] != alone


def test_logprobs_are_returned_per_token(tiny_engine_factory):
    eng = tiny_engine_factory()
    eng.add_request("a", [0, 4, 5], SamplingParams(max_tokens=5, temperature=0, logprobs=3, ignore_eos=True))
    out = _drain(eng)["a"]
    assert len(out["lp"]) == 5
    for tid, lp in zip(out["ids"], out["lp"]):
        assert lp.token_id == tid and lp.logprob <= 0 and len(lp.top_ids) == len(lp.top_logprobs) == 3
        assert lp.top_ids[0] == tid  # greedy picks the most likely token


def test_acceptance_rate_is_tracked(tiny_engine_factory):
    eng = tiny_engine_factory(num_speculative_tokens=2)
    eng.add_request("a", [0, 4, 5, 6], SamplingParams(max_tokens=20, temperature=0, ignore_eos=True))
    _drain(eng)
    assert eng.num_drafted_total > 0 and 0 <= eng.acceptance_rate <= 1


def test_offline_llm_applies_stop_strings(tiny_model):
    llm = LLM(EngineConfig(model=tiny_model, num_kv_blocks=256))
    full = llm.generate(["The model"], SamplingParams(max_tokens=24, temperature=0, ignore_eos=True))[0]
    assert len(full.token_ids) == 24
    cut = full.text[3:6]
    assert cut.strip(), full.text
    stopped = llm.generate(["The model"], SamplingParams(max_tokens=24, temperature=0, stop=(cut,),
                                                         ignore_eos=True))[0]
    assert stopped.text == full.text[: full.text.index(cut)]
    assert stopped.finish_reason == "stop"
    assert llm.engine.blocks.num_free_blocks == llm.engine.blocks.num_blocks


def test_bf16_and_fp16_run_on_cpu(tiny_model):
    for dtype in ("bfloat16", "float16"):
        llm = LLM(EngineConfig(model=tiny_model, dtype=dtype, num_kv_blocks=64))
        out = llm.generate(["Hello"], SamplingParams(max_tokens=4, temperature=0, ignore_eos=True))[0]
        assert len(out.token_ids) == 4
        assert llm.engine.kv.tensor.dtype == getattr(torch, dtype)
