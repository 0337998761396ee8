"""The gateway through the official openai client, over real HTTP, NATS and UCX, and one
trace across the three service processes. (The request logic itself, disconnects and
malformed messages are tested in one process: tests/services/test_in_process.py.)"""

from __future__ import annotations

import asyncio
import json
import time

import httpx
import openai
import pytest

from moemesh.shared.protocol.messages import SamplingParams

PROMPTS = [f"The expert number {i} routes tokens to the mesh" + " and more" * (i % 5) for i in range(32)]


@pytest.fixture
def request_cleanup():
    clients = []
    yield clients.append
    for c in clients:
        c.close()


def _client(mesh) -> openai.OpenAI:
    return openai.OpenAI(base_url=mesh.url + "/v1", api_key="unused", max_retries=0, timeout=60)


def test_completions_and_chat_stream_and_non_stream(mesh, offline, request_cleanup):
    c = _client(mesh)
    request_cleanup(c)
    want = offline.generate(["Hello world"], SamplingParams(max_tokens=8, temperature=0, ignore_eos=True))[0]
    r = c.completions.create(model="tiny", prompt="Hello world", max_tokens=8, temperature=0,
                             extra_body={"ignore_eos": True})
    assert r.choices[0].text == want.text and r.usage.completion_tokens == 8 and r.choices[0].finish_reason == "length"
    parts = list(c.completions.create(model="tiny", prompt="Hello world", max_tokens=8, temperature=0,
                                      stream=True, extra_body={"ignore_eos": True}))
    assert "".join(p.choices[0].text for p in parts) == want.text
    assert parts[-1].choices[0].finish_reason == "length"

    msgs = [{"role": "user", "content": "hi there"}]
    ids = offline.tokenizer.encode_chat(msgs)
    want = offline.generate([ids], SamplingParams(max_tokens=6, temperature=0, ignore_eos=True))[0]
    r = c.chat.completions.create(model="tiny", messages=msgs, max_tokens=6, temperature=0,
                                  extra_body={"ignore_eos": True})
    assert r.choices[0].message.content == want.text and r.choices[0].message.role == "assistant"
    assert r.usage.prompt_tokens == len(ids) and r.usage.prompt_tokens_details.cached_tokens == 0
    chunks = list(c.chat.completions.create(model="tiny", messages=msgs, max_tokens=6, temperature=0, stream=True,
                                            stream_options={"include_usage": True}, extra_body={"ignore_eos": True}))
    assert chunks[0].choices[0].delta.role == "assistant"
    assert "".join(ch.choices[0].delta.content or "" for ch in chunks if ch.choices) == want.text
    assert chunks[-1].usage.completion_tokens == 6


def test_n_choices_over_ucx_through_the_official_client(mesh, offline, request_cleanup):
    """n > 1 across processes: one prefill, each child's KV over UCX, every choice the
    offline engine's greedy answer, streamed under its index, and nothing left held."""
    from tests.mesh.conftest import wait_free

    c = _client(mesh)
    request_cleanup(c)
    want = offline.generate(["Hello world"], SamplingParams(max_tokens=8, temperature=0, ignore_eos=True))[0].text
    r = c.completions.create(model="tiny", prompt="Hello world", max_tokens=8, temperature=0, n=3,
                             extra_body={"ignore_eos": True})
    assert [ch.text for ch in r.choices] == [want] * 3 and r.usage.completion_tokens == 24
    texts: dict[int, str] = {}
    for part in c.completions.create(model="tiny", prompt="Hello world", max_tokens=8, temperature=0, n=2,
                                     stream=True, extra_body={"ignore_eos": True}):
        for ch in part.choices:
            texts[ch.index] = texts.get(ch.index, "") + ch.text
    assert texts == {0: want, 1: want}
    wait_free(mesh)


def test_continuous_usage_counts_every_chunk(mesh):
    # vLLM's stream_options.continuous_usage_stats: a client counts tokens per chunk exactly
    body = {"model": "tiny", "prompt": "Hello world", "max_tokens": 9, "temperature": 0, "ignore_eos": True,
            "stream": True, "stream_options": {"include_usage": True, "continuous_usage_stats": True}}
    with httpx.stream("POST", mesh.url + "/v1/completions", json=body, timeout=60) as r:
        events = [json.loads(line[6:]) for line in r.iter_lines() if line.startswith("data: {")]
    counts = [e["usage"]["completion_tokens"] for e in events if e["choices"]]
    assert counts[-1] == 9 and counts[:9] == list(range(1, 10))  # the finish chunk repeats the count
    assert events[-1]["choices"] == [] and events[-1]["usage"]["completion_tokens"] == 9


def test_32_concurrent_streams_match_the_offline_engine(mesh, offline):
    params = SamplingParams(max_tokens=12, temperature=0, ignore_eos=True)
    want = [o.text for o in offline.generate(PROMPTS, params)]
    client = openai.AsyncOpenAI(base_url=mesh.url + "/v1", api_key="unused", max_retries=0, timeout=120)

    async def one(p: str) -> str:
        stream = await client.completions.create(model="tiny", prompt=p, max_tokens=12, temperature=0, stream=True,
                                                 extra_body={"ignore_eos": True})
        return "".join([ch.choices[0].text async for ch in stream])

    async def main():
        try:
            return await asyncio.gather(*(one(p) for p in PROMPTS))
        finally:
            await client.close()

    got = asyncio.run(main())
    assert got == want


def test_workers_report_each_requests_phases_with_tracing_off_in_their_stats(mesh):
    """Prefill: queue and prefill; decode: the hand-off's dispatch, transfer and import,
    then its first decode step: a row per request, stamped when its last phase ended."""
    from tests.mesh.conftest import worker_stats

    t0 = time.time()
    r = httpx.post(mesh.url + "/v1/completions", json={"model": "tiny", "prompt": "phases", "max_tokens": 4,
                                                      "ignore_eos": True}, timeout=60)
    assert r.status_code == 200
    pre = asyncio.run(worker_stats(mesh.nats_url, mesh.prefill_id, detail=True))
    deadline = time.monotonic() + 10
    while True:  # the decode row lands with the first decode step's outputs, before the last token
        dec = asyncio.run(worker_stats(mesh.nats_url, mesh.decode_id, detail=True))
        if any(row[0] >= t0 for row in dec.recent_requests) or time.monotonic() > deadline:
            break
        time.sleep(0.05)
    assert pre.request_phases == ["queue", "prefill"]
    assert dec.request_phases == ["dispatch", "transfer", "import", "first_step"]
    for st in (pre, dec):
        rows = [row for row in st.recent_requests if row[0] >= t0]
        assert rows and all(len(row) == 1 + len(st.request_phases) and min(row[1:]) >= 0 for row in rows)
    assert asyncio.run(worker_stats(mesh.nats_url, mesh.decode_id)).recent_requests == []  # only with detail


def test_bench_serve_with_the_mesh_nats_adds_the_workers_phases_to_each_point(mesh, tmp_path):
    from moemesh.tools.bench.serve import report, runner
    from moemesh.tools.bench.serve.client import ClientConfig
    from moemesh.tools.bench.serve.workload import LengthDist, WorkloadConfig

    work = WorkloadConfig(kind="fixed", num_requests=4, isl=LengthDist("fixed", 8), osl=LengthDist("fixed", 4))
    cfg = runner.ServeBenchConfig(client=ClientConfig(url=mesh.url), workload=work, values=(2,), progress=False,
                                  nats_url=mesh.nats_url)
    [p] = runner.run(cfg)["points"]
    ph = p["server_phases"]
    assert ph["prefill"]["requests"] >= 4 and ph["prefill"]["queue"]["p50"] >= 0
    assert ph["decode"]["requests"] >= 4 and ph["decode"]["handoff"]["p90"] > 0
    assert "handoff_steps" not in ph["decode"]  # a real engine's steps are not of one length
    assert "server phases: queue " in report.markdown({"config": runner.config_json(cfg) | {"model": "tiny"},
                                                       "warmup": {"num_requests": 0, "num_errors": 0},
                                                       "points": [p]}, [])


def test_logprobs_stop_strings_and_seeds(mesh, offline, request_cleanup):
    c = _client(mesh)
    request_cleanup(c)
    r = c.completions.create(model="tiny", prompt="The model", max_tokens=5, temperature=0, logprobs=2,
                             extra_body={"ignore_eos": True})
    lp = r.choices[0].logprobs
    assert len(lp.token_logprobs) == 5 and all(len(t) == 2 for t in lp.top_logprobs)
    full = offline.generate(["The model"], SamplingParams(max_tokens=20, temperature=0, ignore_eos=True))[0].text
    stop = full[4:7]
    r = c.completions.create(model="tiny", prompt="The model", max_tokens=20, temperature=0, stop=[stop],
                             extra_body={"ignore_eos": True})
    assert r.choices[0].text == full[: full.index(stop)] and r.choices[0].finish_reason == "stop"
    a = c.completions.create(model="tiny", prompt="x", max_tokens=8, temperature=1, seed=7)
    b = c.completions.create(model="tiny", prompt="x", max_tokens=8, temperature=1, seed=7)
    assert a.choices[0].text == b.choices[0].text


@pytest.mark.parametrize("body,status,param", [
    ({"model": "tiny", "prompt": "x", "temperature": "hot"}, 400, "temperature"),
    ({"model": "tiny", "prompt": "x", "max_tokens": 0}, 400, "max_tokens"),
    ({"model": "tiny", "prompt": "x", "n": 17}, 400, "n"),
    ({"model": "tiny", "prompt": "x", "n": 2, "best_of": 2}, 400, "best_of"),
    ({"model": "tiny"}, 400, "prompt"),
    ({"model": "other", "prompt": "x"}, 404, "model"),
    ({"model": "tiny", "prompt": "x", "max_tokens": 100000}, 400, "prompt"),
])
def test_errors_use_openai_shape(mesh, body, status, param):
    r = httpx.post(mesh.url + "/v1/completions", json=body, timeout=10)
    assert r.status_code == status
    err = r.json()["error"]
    assert err["param"] == param and err["message"]
    if "100000" in str(body):
        assert "maximum context length is 4096" in err["message"]


def test_malformed_http_and_unsupported_shapes(mesh):
    r = httpx.post(mesh.url + "/v1/chat/completions", content=b"{nope", timeout=10)
    assert r.status_code == 400 and "not valid JSON" in r.json()["error"]["message"]
    r = httpx.post(mesh.url + "/v1/chat/completions", json={"model": "tiny", "messages": []}, timeout=10)
    assert r.status_code == 400 and r.json()["error"]["param"] == "messages"
    r = httpx.get(mesh.url + "/v1/nothing", timeout=10)
    assert r.status_code == 404 and "error" in r.json()


def test_models_health_metrics_openapi(mesh):
    assert httpx.get(mesh.url + "/v1/models").json()["data"][0]["id"] == "tiny"
    m = _client(mesh).models.retrieve("tiny")  # the official client's own call
    assert m.id == "tiny" and m.object == "model"
    r = httpx.get(mesh.url + "/v1/models/other/model", timeout=10)
    assert r.status_code == 404 and r.json()["error"]["code"] == "model_not_found"
    h = httpx.get(mesh.url + "/health").json()
    assert h["status"] == "ok" and h["ready"] and h["workers"] == {"prefill": 1, "decode": 1}
    assert httpx.get(mesh.url + "/health/ready").status_code == 200
    m = httpx.get(mesh.url + "/metrics").text
    assert "moemesh_ttft_seconds_bucket" in m and "moemesh_requests_total" in m
    # vLLM-level: model_name on every moemesh series, process metrics, per-request ITL, hours-long requests
    assert 'moemesh_inter_token_latency_seconds_count{model_name="tiny"}' in m
    assert 'moemesh_request_seconds_bucket{le="7680.0",model_name="tiny"}' in m
    assert "process_cpu_seconds_total" in m and "python_gc_objects_collected_total" in m
    assert all('model_name="tiny"' in line for line in m.splitlines() if line.startswith("moemesh_"))
    spec = httpx.get(mesh.url + "/openapi.json").json()
    assert "/v1/chat/completions" in spec["paths"]


def test_one_request_is_one_trace_across_all_services(mesh):
    client_trace = "4bf92f3577b34da6a3ce929d0e0e4736"
    client_span = "00f067aa0ba902b7"
    headers = {"traceparent": f"00-{client_trace}-{client_span}-01"}
    r = httpx.post(mesh.url + "/v1/chat/completions", headers=headers, timeout=30, json={
        "model": "tiny", "messages": [{"role": "user", "content": "trace me"}], "max_tokens": 4, "stream": True,
        "ignore_eos": True})  # four tokens, so a decode step runs whatever the random model samples
    assert r.status_code == 200 and r.text.endswith("data: [DONE]\n\n")
    deadline = time.monotonic() + 10
    while True:
        spans = [json.loads(l) for l in mesh.trace_file.read_text().splitlines() if l.strip()]
        mine = [s for s in spans if s["trace_id"] == client_trace]
        services = {s["resource"]["service.name"] for s in mine}
        names = {s["name"] for s in mine}
        if {"decode", "kv.transfer", "kv.send", "stream"} <= names or time.monotonic() > deadline:
            break
        time.sleep(0.2)
    assert services == {"moemesh-gateway", "moemesh-prefill", "moemesh-decode"}, names
    by_id = {s["span_id"]: s for s in mine}
    roots = [s for s in mine if s["parent_span_id"] == client_span]
    assert [s["name"] for s in roots] == ["POST /v1/chat/completions"]
    for s in mine:
        assert s["parent_span_id"] == client_span or s["parent_span_id"] in by_id, s["name"]

    def parent(name):
        return by_id[next(s for s in mine if s["name"] == name)["parent_span_id"]]["name"]

    assert parent("prefill") == "POST /v1/chat/completions"
    assert parent("decode") == "prefill"
    assert parent("kv.transfer") == "decode"
    assert parent("kv.send") == "kv.transfer"
    assert parent("stream") == "POST /v1/chat/completions"
    assert parent("queue.wait") == "prefill" and parent("prefill.batch") == "prefill"
    dec = next(s for s in mine if s["name"] == "decode")
    assert [e["name"] for e in dec["events"]].count("step") == dec["attributes"]["decode.steps"]
    # the HTTP and generative-AI semantic conventions on the request's span
    a = roots[0]["attributes"]
    assert (a["http.request.method"], a["http.route"], a["http.response.status_code"]) == \
        ("POST", "/v1/chat/completions", 200)
    assert (a["gen_ai.operation.name"], a["gen_ai.request.model"], a["gen_ai.request.max_tokens"]) == ("chat", "tiny", 4)
    assert a["gen_ai.usage.output_tokens"] == 4 and a["gen_ai.usage.input_tokens"] > 0
    assert a["gen_ai.response.finish_reasons"] == ["length"] and a["gen_ai.response.id"].startswith("chatcmpl-")
