"""guidellm (pinned in the test extra) against a mesh, run as its own CLI in a subprocess
and not patched: its OpenAI HTTP backend streams synthetic prompts of a fixed length
through the gateway, its processor is the mesh's model directory, and nothing is
downloaded. One synchronous run on the chat route, one sweep (synchronous, throughput,
one constant rate) on the completions route, each benchmark a few requests.

From its saved JSON: no request failed, each prompt is as long as asked (guidellm cuts it
to length with the model's tokenizer, BOS included) and as long as the mesh's own
/tokenize counts it, each output as long as asked; and the mesh's counters saw exactly
those requests and tokens. Request counts are fixed by max_requests, so nothing here
depends on how fast the mesh runs; max_duration only bounds a mesh that stopped answering.

guidellm 0.8.1 can leave the last request of a benchmark out of its report: the update
that completes it sets the scheduler's shutdown event before it is queued for the
benchmarker (scheduler/worker_group.py: received_callback, then sync_put), and a
benchmarker poll that times out in between ends the benchmark without it. The request
itself completed; only the record is missing. `_recorded` accepts exactly that gap, and
the mesh's counters, which count every request guidellm sent, still must agree."""

from __future__ import annotations

import asyncio
import json
import os
import subprocess
import sys

import httpx
import pytest

from tests.services.conftest import nats_url  # noqa: F401 (fixture)
from tests.services.test_in_process import _wait_free, mesh

PROMPT_TOKENS = 32
OUTPUT_TOKENS = 16
NUM_REQUESTS = 4  # per benchmark
MAX_SECONDS = 60  # per benchmark


def _guidellm(url: str, model_dir: str, tmp_path, name: str, request_format: str, profile: str) -> dict:
    """One `guidellm run`; returns its saved report."""
    out = tmp_path / f"{name}.json"
    env = {"HF_HUB_OFFLINE": "1", "HF_DATASETS_OFFLINE": "1", "TRANSFORMERS_OFFLINE": "1",
           "HF_HOME": str(tmp_path / "hf-home"), "TOKENIZERS_PARALLELISM": "false",
           # its default, up to 10 spawned workers for a throughput benchmark, takes ~15 s to start on 2 cores
           "GUIDELLM__MAX_WORKER_PROCESSES": "2"}
    cmd = [sys.executable, "-m", "guidellm", "run",
           "--backend", f"kind=openai_http,target={url},model=tiny,request_format={request_format}",
           "--profile", profile,
           "--constraint", f"kind=max_requests,count={NUM_REQUESTS}",
           "--constraint", f"kind=max_duration,seconds={MAX_SECONDS}",
           "--tokenizer", f"kind=hf_auto,model={model_dir}",
           "--data", f"kind=synthetic_text,prompt_tokens={PROMPT_TOKENS},output_tokens={OUTPUT_TOKENS}",
           "--output", f"kind=json,path={out}",
           "--disable-progress"]
    p = subprocess.run(cmd, cwd=tmp_path, env={**os.environ, **env}, capture_output=True, text=True, timeout=240)
    assert p.returncode == 0 and out.exists(), p.stdout[-4000:] + p.stderr[-4000:]
    return json.loads(out.read_text())


def _recorded(benchmark: dict) -> list[dict]:
    """The benchmark's request records, after checking that guidellm sent NUM_REQUESTS and
    that none failed or was cut short; all of them, or all but the last (module docstring)."""
    state, reqs = benchmark["scheduler_state"], benchmark["requests"]
    assert state["created_requests"] == NUM_REQUESTS, state
    assert state["errored_requests"] == state["cancelled_requests"] == 0, state
    assert not reqs["errored"] and not reqs["incomplete"], reqs
    done = reqs["successful"]
    if len(done) == NUM_REQUESTS - 1:  # the last completion's update was not yet taken in
        assert state["processed_requests"] == NUM_REQUESTS - 1 and state["processing_requests"] == 1, state
        assert state["end_processing_time"] is None, state
    else:
        assert len(done) == NUM_REQUESTS and state["successful_requests"] == NUM_REQUESTS, state
    return done


def _check_lengths(done: list[dict], c: httpx.Client) -> int:
    """Each recorded request's prompt and output are the lengths asked, as the mesh counts
    them; returns the prompt's length with the route's framing (the same for every prompt)."""
    lengths = set()
    for r in done:
        assert r["info"]["error"] is None and r["info"]["status"] == "completed", r["info"]
        body = json.loads(r["request_args"])["body"]
        assert body["stream"] is True and body["ignore_eos"] is True, body
        if "messages" in body:
            (msg,) = body["messages"]
            text = "".join(part["text"] for part in msg["content"])
            framed = c.post("/tokenize", json={"messages": body["messages"]}).json()["count"]
        else:
            text = body["prompt"]
            framed = c.post("/tokenize", json={"prompt": text}).json()["count"]
        # the text guidellm made is as long as asked, by the mesh's tokenizer (BOS included) ...
        assert c.post("/tokenize", json={"prompt": text}).json()["count"] == PROMPT_TOKENS, text
        # ... and the usage the mesh streamed back, which guidellm reports, agrees
        assert r["prompt_tokens"] == framed, (r["prompt_tokens"], framed, body)
        assert r["output_tokens"] == OUTPUT_TOKENS, r
        assert r["time_to_first_token_ms"] > 0 and r["inter_token_latency_ms"] > 0, r
        lengths.add(framed)
    (length,) = lengths
    return length


def _metric(render: str, name: str, **labels) -> float:
    """Sum of `name`'s samples whose labels include `labels`."""
    return sum(float(line.rsplit(" ", 1)[1]) for line in render.splitlines()
               if line.startswith(name + "{") and all(f'{k}="{v}"' in line for k, v in labels.items()))


def _run(nats_url, model_dir, engines, tmp_path, request_format, profile, strategies):  # noqa: F811
    """guidellm against a fresh mesh, its report checked there (/tokenize needs the mesh)."""
    def check(url: str, report: dict) -> None:
        benchmarks = report["benchmarks"]
        assert [b["config"]["strategy"]["type_"] for b in benchmarks] == strategies
        with httpx.Client(base_url=url, timeout=30) as c:
            prompt_len = {_check_lengths(_recorded(b), c) for b in benchmarks}
        (prompt_len,) = prompt_len
        if request_format == "/v1/completions":
            assert prompt_len == PROMPT_TOKENS
        sent = NUM_REQUESTS * len(benchmarks)
        gateway = httpx.get(url + "/metrics", timeout=10).text
        prefill = m.prefill.rt.metrics.render()[0].decode()
        # exactly guidellm's requests reached the mesh, each complete: no retries, no probes
        assert _metric(gateway, "moemesh_requests_total", route=request_format, status="200") == sent
        assert _metric(gateway, "moemesh_requests_total") == sent
        assert _metric(gateway, "moemesh_output_tokens_total") == OUTPUT_TOKENS * sent
        assert _metric(gateway, "moemesh_ttft_seconds_count") == sent
        assert _metric(prefill, "moemesh_prompt_tokens_total") == prompt_len * sent

    async def go():
        nonlocal m
        async with mesh(nats_url, model_dir, tmp_path, engines) as m:
            report = await asyncio.to_thread(_guidellm, m.url, model_dir, tmp_path, "report", request_format,
                                             profile)
            await _wait_free(m)
            await asyncio.to_thread(check, m.url, report)

    m = None
    asyncio.run(go())


def _engines(factory):
    return factory(role="prefill", num_kv_blocks=256), factory(role="decode", num_kv_blocks=256)


def test_guidellm_synchronous_on_the_chat_route(nats_url, tiny_model, tiny_engine_factory, tmp_path):  # noqa: F811
    pytest.importorskip("guidellm")
    _run(nats_url, tiny_model, _engines(tiny_engine_factory), tmp_path, "/v1/chat/completions",
         "kind=synchronous", ["synchronous"])


def test_guidellm_sweep_on_the_completions_route(nats_url, tiny_model, tiny_engine_factory, tmp_path):  # noqa: F811
    pytest.importorskip("guidellm")
    # sweep_size=3: synchronous, throughput at max_concurrency, and one constant rate between their rates
    _run(nats_url, tiny_model, _engines(tiny_engine_factory), tmp_path, "/v1/completions",
         "kind=sweep,sweep_size=3,max_concurrency=4", ["synchronous", "throughput", "constant"])
