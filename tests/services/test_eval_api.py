"""What evaluation tools ask of /v1/completions, through a real mesh in one process: the
prompt echoed with its tokens scored by the prefill (echo with logprobs, max_tokens 0),
vLLM's prompt_logprobs, batches of prompts as strings or token ids, and the tokenizer
endpoints (/tokenize, /detokenize, /tokenizer_info) that lm-eval probes."""

from __future__ import annotations

import asyncio
import json

import httpx
import pytest

from moemesh.shared.protocol.messages import SamplingParams
from tests.services.test_in_process import _wait_free, mesh

PROMPTS = ["The experts of the mesh", "route every token to", "a few of them"]


@pytest.fixture(scope="module")
def scored(offline):
    """prompt text -> (its ids, its scores with 2 alternatives, its greedy first 2 tokens), offline."""
    out = {}
    for text in PROMPTS:
        (c,) = offline.generate([text], SamplingParams(max_tokens=2, temperature=0, ignore_eos=True,
                                                       prompt_logprobs=2))
        out[text] = (c.prompt_token_ids, c.prompt_logprobs, c.token_ids)
    return out


def _serve(nats_url, tiny_model, tiny_engine_factory, tmp_path, go):
    async def run():
        engines = (tiny_engine_factory(role="prefill", num_kv_blocks=256),
                   tiny_engine_factory(role="decode", num_kv_blocks=256))
        async with mesh(nats_url, tiny_model, tmp_path, engines) as m:
            async with httpx.AsyncClient(base_url=m.url, timeout=60) as c:
                out = await go(c)
            await _wait_free(m)
            return out

    return asyncio.run(run())


def _close(got: list, want: list, tol: float = 1e-5) -> None:
    assert len(got) == len(want) and all(abs(a - b) < tol for a, b in zip(got, want)), (got, want)


def test_echo_with_logprobs_and_no_tokens_scores_the_prompts_of_a_batch(nats_url, tiny_model, tiny_engine_factory,
                                                                       offline, scored, tmp_path):
    """lm-eval's loglikelihood request (older versions send max_tokens 0): token id prompts,
    batched, each echoed with its tokens' logprobs from the prefill, nothing generated."""
    ids = [scored[t][0] for t in PROMPTS]

    async def go(c):
        body = {"model": "tiny", "prompt": ids, "echo": True, "logprobs": 1, "max_tokens": 0, "temperature": 0}
        r = await c.post("/v1/completions", json=body)
        assert r.status_code == 200, r.text
        stream = await c.post("/v1/completions", json={**body, "stream": True})
        return r.json(), stream.text

    got, stream = _serve(nats_url, tiny_model, tiny_engine_factory, tmp_path, go)
    assert [ch["index"] for ch in got["choices"]] == [0, 1, 2]
    assert got["usage"] == {"prompt_tokens": sum(map(len, ids)), "completion_tokens": 0,
                            "total_tokens": sum(map(len, ids)), "prompt_tokens_details": {"cached_tokens": 0}}
    text = offline.tokenizer.decode
    for ch, t in zip(got["choices"], PROMPTS):
        p_ids, p_scores, _ = scored[t]
        lp = ch["logprobs"]
        assert ch["text"] == text(p_ids, skip_special_tokens=False) and ch["finish_reason"] == "length"
        assert lp["tokens"] == [text([i], skip_special_tokens=False) for i in p_ids]
        assert lp["token_logprobs"][0] is None and lp["top_logprobs"][0] is None
        _close(lp["token_logprobs"][1:], p_scores.logprobs)
        # the token itself, then the most likely one (the same text when it is the most likely)
        for i, top in enumerate(lp["top_logprobs"][1:]):
            assert list(top)[0] == lp["tokens"][i + 1] and len(top) == (1 if p_scores.ranks[i] == 1 else 2)
        assert lp["text_offset"] == [sum(map(len, lp["tokens"][:i])) for i in range(len(p_ids))]
        assert "prompt_logprobs" not in ch  # not asked for
    # streamed: each choice one chunk, its prompt and the end together
    chunks = [json.loads(line[6:]) for line in stream.splitlines() if line.startswith("data: {")]
    by_index = {ch["index"]: ch for c in chunks for ch in c["choices"]}
    assert len(chunks) == 3 and stream.endswith("data: [DONE]\n\n")
    for i, ch in by_index.items():
        assert ch["text"] == got["choices"][i]["text"] and ch["finish_reason"] == "length"
        _close(ch["logprobs"]["token_logprobs"][1:], got["choices"][i]["logprobs"]["token_logprobs"][1:])


def test_echo_then_generated_tokens_and_prompt_logprobs(nats_url, tiny_model, tiny_engine_factory, offline, scored,
                                                        tmp_path):
    """lm-eval 0.4.13's request (echo, logprobs 1, max_tokens 1) and vLLM's prompt_logprobs,
    on string prompts, streamed and not."""
    text = PROMPTS[0]
    p_ids, p_scores, out_ids = scored[text]

    async def go(c):
        body = {"model": "tiny", "prompt": text, "echo": True, "logprobs": 1, "max_tokens": 2, "temperature": 0,
                "ignore_eos": True, "prompt_logprobs": 2}
        r = await c.post("/v1/completions", json=body)
        assert r.status_code == 200, r.text
        s = await c.post("/v1/completions", json={**body, "stream": True})
        plain = await c.post("/v1/completions", json={"model": "tiny", "prompt": [text, PROMPTS[1]],
                                                       "prompt_logprobs": 0, "max_tokens": 2, "temperature": 0,
                                                       "ignore_eos": True, "n": 2})
        assert plain.status_code == 200, plain.text
        return r.json(), s.text, plain.json()

    got, stream, plain = _serve(nats_url, tiny_model, tiny_engine_factory, tmp_path, go)
    (ch,) = got["choices"]
    want_text = offline.tokenizer.decode(out_ids)
    assert ch["text"] == text + want_text
    lp = ch["logprobs"]
    assert len(lp["tokens"]) == len(p_ids) + 2 and lp["token_logprobs"][0] is None
    _close(lp["token_logprobs"][1:len(p_ids)], p_scores.logprobs)
    assert all(v is not None for v in lp["token_logprobs"][len(p_ids):])
    assert got["usage"]["completion_tokens"] == 2
    # vLLM's prompt_logprobs: the token itself (with its rank), then the 2 most likely
    prompt = ch["prompt_logprobs"]
    assert prompt[0] is None and len(prompt) == len(p_ids)
    for i, entry in enumerate(prompt[1:]):
        own = entry[str(p_ids[i + 1])]
        assert own["rank"] == p_scores.ranks[i] and abs(own["logprob"] - p_scores.logprobs[i]) < 1e-5
        top_ids, _ = p_scores.top(i)
        assert list(entry) == list(dict.fromkeys([str(p_ids[i + 1])] + [str(t) for t in top_ids]))
        assert [entry[str(t)]["rank"] for t in top_ids] == [1, 2]
    # streamed: the first chunk holds the prompt and the first token, its offsets run on after
    chunks = [json.loads(line[6:])["choices"][0] for line in stream.splitlines() if line.startswith("data: {")]
    assert "".join(c["text"] for c in chunks) == ch["text"]
    assert chunks[0]["prompt_logprobs"] == prompt and chunks[0]["text"].startswith(text)
    offsets = [o for c in chunks if c["logprobs"] for o in c["logprobs"]["text_offset"]]
    assert offsets == lp["text_offset"]
    # a batch of two string prompts, n = 2: choice p * n + i is prompt p's i-th
    assert [c["index"] for c in plain["choices"]] == [0, 1, 2, 3]
    for c in plain["choices"]:
        p = PROMPTS[c["index"] // 2]
        assert c["text"] == offline.tokenizer.decode(scored[p][2])  # greedy: every choice alike
        assert [e and list(e) for e in c["prompt_logprobs"]] == [None] + [[str(t)] for t in scored[p][0][1:]]
        assert c["logprobs"] is None
    assert plain["usage"]["prompt_tokens"] == len(scored[PROMPTS[0]][0]) + len(scored[PROMPTS[1]][0])
    assert plain["usage"]["completion_tokens"] == 8


def test_the_tokenizer_endpoints_answer_in_vllms_shapes(nats_url, tiny_model, tiny_engine_factory, offline,
                                                         tmp_path):
    tok = offline.tokenizer

    async def go(c):
        out = {
            "info": await c.get("/tokenizer_info"),
            "plain": await c.post("/tokenize", json={"prompt": "Hello world", "add_special_tokens": False,
                                                     "return_token_strs": True}),
            "special": await c.post("/tokenize", json={"model": "tiny", "prompt": "Hello world"}),
            "chat": await c.post("/tokenize", json={"messages": [{"role": "user", "content": "hi"}]}),
            "detok": await c.post("/detokenize", json={"tokens": tok.encode("Hello world")}),
            "bad_model": await c.post("/tokenize", json={"model": "other", "prompt": "x"}),
            "bad_field": await c.post("/tokenize", json={"prompt": "x", "truncate": 3}),
            "bad_ids": await c.post("/detokenize", json={"tokens": [tok.vocab_size]}),
            "no_prompt": await c.post("/tokenize", json={}),
        }
        return {k: (r.status_code, r.json()) for k, r in out.items()}

    got = _serve(nats_url, tiny_model, tiny_engine_factory, tmp_path, go)
    status, info = got["info"]
    assert status == 200 and info["eos_token"] == tok.eos_token and info["bos_token"] == tok.bos_token
    assert info["chat_template"] == tok.chat_template and isinstance(info["tokenizer_class"], str)
    ids = tok.encode("Hello world", add_special_tokens=False)
    assert got["plain"] == (200, {"count": len(ids), "max_model_len": got["plain"][1]["max_model_len"],
                                  "tokens": ids, "token_strs": [tok.id_to_token(i) for i in ids]})
    assert got["special"][1]["tokens"] == tok.encode("Hello world") and got["special"][1]["token_strs"] is None
    assert got["chat"][1]["tokens"] == tok.encode(tok.apply_chat_template([{"role": "user", "content": "hi"}]),
                                                  add_special_tokens=False)
    assert got["detok"] == (200, {"prompt": tok.decode(tok.encode("Hello world"), skip_special_tokens=False)})
    assert got["bad_model"][0] == 404 and got["bad_model"][1]["error"]["param"] == "model"
    for k, param in (("bad_field", "truncate"), ("bad_ids", "tokens"), ("no_prompt", "prompt")):
        assert got[k][0] == 400 and got[k][1]["error"]["param"] == param, got[k]


def test_tokens_as_token_ids_name_every_logprob_by_its_id(nats_url, tiny_model, tiny_engine_factory, scored,
                                                          tmp_path):
    """vLLM's return_tokens_as_token_ids, on completions (legacy arrays, prompt_logprobs) and
    chat (content): each token is "token_id:<id>"; text and text offsets stay the text's."""
    text = PROMPTS[0]
    p_ids, _, out_ids = scored[text]

    async def go(c):
        body = {"model": "tiny", "prompt": text, "echo": True, "logprobs": 1, "max_tokens": 2, "temperature": 0,
                "ignore_eos": True, "prompt_logprobs": 1}
        plain = (await c.post("/v1/completions", json=body)).json()
        ids = (await c.post("/v1/completions", json={**body, "return_tokens_as_token_ids": True})).json()
        chat = await c.post("/v1/chat/completions", json={
            "model": "tiny", "messages": [{"role": "user", "content": text}], "max_tokens": 2, "temperature": 0,
            "ignore_eos": True, "logprobs": True, "top_logprobs": 1, "return_tokens_as_token_ids": True})
        bad = await c.post("/v1/completions", json={**body, "return_tokens_as_token_ids": "yes"})
        return plain, ids, chat.json(), bad

    plain, ids, chat, bad = _serve(nats_url, tiny_model, tiny_engine_factory, tmp_path, go)
    (p,), (q,) = plain["choices"], ids["choices"]
    assert q["text"] == p["text"] and q["logprobs"]["text_offset"] == p["logprobs"]["text_offset"]
    assert q["logprobs"]["tokens"] == [f"token_id:{t}" for t in [*p_ids, *out_ids]]
    assert q["logprobs"]["token_logprobs"] == p["logprobs"]["token_logprobs"]
    assert all(k.startswith("token_id:") for top in q["logprobs"]["top_logprobs"][1:] for k in top)
    assert q["prompt_logprobs"][1][str(p_ids[1])]["decoded_token"] == f"token_id:{p_ids[1]}"
    content = chat["choices"][0]["logprobs"]["content"]
    assert len(content) == 2 and all(e["token"].startswith("token_id:") for e in content)
    assert all(t["token"].startswith("token_id:") for e in content for t in e["top_logprobs"])
    assert bad.status_code == 400 and bad.json()["error"]["param"] == "return_tokens_as_token_ids"


def test_add_special_tokens_reaches_the_tokenizer(nats_url, tiny_model, tiny_engine_factory, offline, tmp_path):
    """vLLM's add_special_tokens: on by default for a prompt, off for messages (the chat
    template writes its own BOS); either may be turned the other way."""
    text = PROMPTS[1]
    messages = [{"role": "user", "content": text}]

    async def go(c):
        out = {}
        for flag in (None, True, False):
            extra = {} if flag is None else {"add_special_tokens": flag}
            r = await c.post("/v1/completions", json={"model": "tiny", "prompt": text, "max_tokens": 1, **extra})
            q = await c.post("/v1/chat/completions", json={"model": "tiny", "messages": messages, "max_tokens": 1,
                                                          **extra})
            out[flag] = (r.json()["usage"]["prompt_tokens"], q.json()["usage"]["prompt_tokens"])
        bad = await c.post("/v1/completions", json={"model": "tiny", "prompt": text, "add_special_tokens": 1})
        return out, bad

    out, bad = _serve(nats_url, tiny_model, tiny_engine_factory, tmp_path, go)
    tok = offline.tokenizer
    templ = tok.apply_chat_template(messages)
    assert out[None] == (len(tok.encode(text)), len(tok.encode(templ, add_special_tokens=False)))
    assert out[True] == (len(tok.encode(text)), len(tok.encode(templ, add_special_tokens=True)))
    assert out[False] == (len(tok.encode(text, add_special_tokens=False)), out[None][1])
    assert bad.status_code == 400 and bad.json()["error"]["param"] == "add_special_tokens"
