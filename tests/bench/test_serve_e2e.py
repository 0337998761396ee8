"""`moemesh bench serve` end to end against a stub OpenAI-compatible server."""

from __future__ import annotations

import asyncio
import json
import subprocess
import sys
from pathlib import Path

import pytest

from moemesh.tools.bench.serve import runner
from moemesh.tools.bench.serve.client import ClientConfig
from moemesh.tools.bench.serve.workload import LengthDist, WorkloadConfig
from moemesh.tools.cli.main import main
from tests.bench.stub_server import StubServer

ROOT = Path(__file__).resolve().parents[2]
SUMMARY_KEYS = {"num_requests", "num_ok", "num_errors", "duration_s", "requests_per_s", "output_tokens_per_s",
                "input_tokens_per_s", "total_output_tokens", "total_input_tokens", "ttft_ms", "tpot_ms",
                "itl_ms", "e2e_ms", "tps_per_user", "decode_tps_per_user", "headline_p90_tps_per_user",
                "goodput", "errors"}
RECORD_KEYS = {"index", "session", "turn", "group", "start", "end", "chunk_times", "chunk_tokens",
               "output_tokens", "input_tokens", "max_tokens", "target_input_tokens", "token_source", "status",
               "error", "finish_reason", "worker", "ttft_ms", "tpot_ms", "e2e_ms"}


@pytest.fixture(scope="module")
def stub():
    with StubServer() as s:
        yield s


def bench(stub, out: Path, *args: str) -> dict:
    cmd = [sys.executable, "-m", "moemesh.tools.cli.main", "bench", "serve", "--url", stub.url,
           "--out-dir", str(out), "--no-progress", *args]
    p = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True, timeout=60)
    assert p.returncode == 0, p.stderr[-3000:]
    assert "| point |" in p.stdout
    return json.loads((out / "result.json").read_text())


def test_completions_sweep_with_failures(stub, tmp_path):
    stub.state.reset(fail_every=4, stream_error_every=7, tokens_per_chunk=1)
    out = tmp_path / "run"
    r = bench(stub, out, "--isl", "16", "--osl", "6", "--num-requests", "10", "--sweep", "concurrency=1,3",
              "--warmup", "2", "--seed", "5", "--label", "skew=zipf0.69", "--label", "note=a=b",
              "--slo-ttft-ms", "500", "--slo-tpot-ms", "100")
    assert {"bench", "schema_version", "config", "seeds", "env", "warmup", "points"} <= set(r)
    assert r["config"]["labels"] == {"skew": "zipf0.69", "note": "a=b"}
    assert r["config"]["model"] == "stub-model" and r["config"]["mode"] == "concurrency"
    assert r["seeds"]["seed"] == 5 and [p["text_salt"] for p in r["seeds"]["points"]] == [0, 1]
    assert {"python", "moemesh", "versions"} <= set(r["env"])
    assert r["warmup"] == {"num_requests": 2, "num_errors": 0}
    assert [(p["mode"], p["value"]) for p in r["points"]] == [("concurrency", 1), ("concurrency", 3)]
    # 2 warm-up + 20 measured requests; the stub fails every 4th with a 500 and breaks every 7th stream
    total_500 = sum(p["summary"]["errors"]["by_status"].get("500", 0) for p in r["points"])
    total_stream = sum(p["summary"]["errors"]["by_status"].get("stream_error", 0) for p in r["points"])
    assert (total_500, total_stream) == (5, 3)
    for p in r["points"]:
        s = p["summary"]
        assert SUMMARY_KEYS <= set(s)
        assert s["num_requests"] == 10 and s["num_ok"] + s["num_errors"] == 10
        assert s["output_tokens_per_s"] > 0 and s["goodput"]["num_good"] <= s["num_ok"]
        assert set(s["per_worker_output_tokens_per_s"]) == {"w0", "w1"}
        assert len(p["requests"]) == 10 and all(RECORD_KEYS <= set(q) for q in p["requests"])
        for q in p["requests"]:
            if q["error"] is None:
                assert q["output_tokens"] == 6 and q["input_tokens"] == 16 and len(q["chunk_times"]) == 6
    bodies = stub.state.bodies
    assert all(b["ignore_eos"] is True and b["max_tokens"] == 6 and b["stream"] for b in bodies)
    assert len(bodies) == 22
    assert (out / "summary.md").read_text().count("concurrency=") >= 2
    for png in ("latency_cdf.png", "throughput.png"):
        assert (out / png).read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def test_chat_agentic_rate_with_chunked_tokens(stub, tmp_path):
    stub.state.reset(tokens_per_chunk=3, continuous_usage=True, workers=())
    out = tmp_path / "agentic"
    r = bench(stub, out, "--endpoint", "chat", "--workload", "agentic", "--num-sessions", "2", "--turns", "3",
              "--isl", "12", "--tool-len", "5", "--osl", "7", "--rate", "50", "--no-ignore-eos")
    (p,) = r["points"]
    assert (p["mode"], p["value"]) == ("rate", 50)
    s = p["summary"]
    assert s["num_ok"] == 6 and "ttft_ms_by_turn" in s and "per_worker_output_tokens_per_s" not in s
    reqs = p["requests"]
    assert sorted((q["session"], q["turn"]) for q in reqs) == [(0, 1), (0, 2), (0, 3), (1, 1), (1, 2), (1, 3)]
    for q in reqs:
        assert q["chunk_tokens"] == [3, 3, 1] and q["token_source"] == "usage" and q["output_tokens"] == 7
    assert s["itl_ms"]["count"] == 6 * 4  # tokens after the first chunk
    # each chat context is the previous one plus the answer plus the tool output
    msgs = [b["messages"] for b in stub.state.bodies]
    assert all("ignore_eos" not in b for b in stub.state.bodies)
    assert sorted(len(m) for m in msgs) == [1, 1, 3, 3, 5, 5]
    for m in msgs:
        if len(m) > 1:
            assert m[-2] == {"role": "assistant", "content": "tok " * 7}
            assert m[:-2] in msgs
    assert (out / "latency_cdf.png").exists() and not (out / "throughput.png").exists()


def test_requests_that_outgrow_the_servers_context_are_announced(stub, tmp_path):
    # turn 1: 12 + 7 tokens; turn 2 resends them with 5 more and asks for 7: 31 > 30
    stub.state.reset(workers=(), max_model_len=30)
    out = tmp_path / "long"
    cmd = [sys.executable, "-m", "moemesh.tools.cli.main", "bench", "serve", "--url", stub.url, "--out-dir", str(out),
           "--no-progress", "--endpoint", "chat", "--workload", "agentic", "--num-sessions", "2", "--turns", "3",
           "--isl", "12", "--tool-len", "5", "--osl", "7", "--concurrency", "2"]
    p = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True, timeout=60)
    assert p.returncode == 0, p.stderr[-3000:]
    assert "4 of 6 requests will not fit the server's 30-token context" in p.stderr
    r = json.loads((out / "result.json").read_text())
    assert r["config"]["server_max_model_len"] == 30 and r["points"][0]["over_context_requests"] == 4


def test_server_errors_are_counted_not_fatal(stub):
    stub.state.reset(bad_every=2)
    cfg = runner.ServeBenchConfig(
        client=ClientConfig(url=stub.url + "/v1/"), progress=False, values=(2,),
        workload=WorkloadConfig(kind="fixed", num_requests=6, isl=LengthDist.parse("4"), osl=LengthDist.parse("3")))
    r = asyncio.run(runner.run_async(cfg))
    s = r["points"][0]["summary"]
    assert (s["num_ok"], s["num_errors"]) == (3, 3)
    assert s["errors"]["by_status"] == {"400": 3}
    assert s["errors"]["messages"] == [{"message": "HTTP 400: bad request from stub", "count": 3}]


def test_unreachable_server_and_bad_arguments(capsys):
    import socket

    with socket.socket() as sock:  # a port with nothing listening
        sock.bind(("127.0.0.1", 0))
        port = sock.getsockname()[1]
    assert main(["bench", "serve", "--url", f"http://127.0.0.1:{port}", "--no-progress"]) == 2
    assert "pass --model" in capsys.readouterr().err
    for bad in (["--sweep", "batch=1,2"], ["--isl", "uniform:5"], ["--label", "novalue"],
                ["--sweep", "concurrency=0"], ["--rate", "2", "--sweep", "concurrency=1,2"]):
        assert main(["bench", "serve", "--url", "http://127.0.0.1:1", "--no-progress", *bad]) == 2, bad


def test_the_tokenizer_sets_prompt_lengths_and_never_counts_output(stub, tmp_path):
    from tokenizers import Tokenizer, models, pre_tokenizers

    tok = Tokenizer(models.WordLevel({"[UNK]": 0, "tok": 1}, unk_token="[UNK]"))
    tok.pre_tokenizer = pre_tokenizers.Whitespace()
    tok.save(str(tmp_path / "tokenizer.json"))
    stub.state.reset(tokens_per_chunk=2)
    cfg = runner.ServeBenchConfig(
        client=ClientConfig(url=stub.url, model="any", stream_usage=False), progress=False,
        tokenizer=str(tmp_path), workload=WorkloadConfig(
            kind="fixed", num_requests=2, isl=LengthDist.parse("9"), osl=LengthDist.parse("5")))
    r = asyncio.run(runner.run_async(cfg))
    for q in r["points"][0]["requests"]:
        # no usage at all: one token per chunk, and the record says so
        assert (q["chunk_tokens"], q["token_source"], q["output_tokens"]) == ([1, 1, 1], "chunks", 3)
        assert q["input_tokens"] is None and q["target_input_tokens"] == 9
    assert all("stream_options" not in b and b["model"] == "any" for b in stub.state.bodies)
    # the word-level tokenizer makes prompt lengths exact: 9 words, one token each
    assert all(len(b["prompt"].split()) == 9 for b in stub.state.bodies)


@pytest.mark.parametrize("line_end", ["\n", "\r\n", "\r"])
def test_line_separators_inside_text_and_multi_token_chunks_are_read_exactly(stub, line_end):
    # U+2028, U+0085 and U+2029 in the streamed text are not line ends; the counts come from usage
    stub.state.reset(tokens_per_chunk=3, continuous_usage=True, token_text="a\u2028b\u0085c\u2029 ",
                     line_end=line_end)
    cfg = runner.ServeBenchConfig(client=ClientConfig(url=stub.url), progress=False, workload=WorkloadConfig(
        kind="fixed", num_requests=4, isl=LengthDist.parse("4"), osl=LengthDist.parse("8")))
    r = asyncio.run(runner.run_async(cfg))
    s = r["points"][0]["summary"]
    assert (s["num_ok"], s["num_errors"]) == (4, 0), s["errors"]
    for q in r["points"][0]["requests"]:
        assert (q["chunk_tokens"], q["token_source"], q["output_tokens"]) == ([3, 3, 2], "usage", 8)
    assert s["total_output_tokens"] == s["completed"] * 8 == 32  # vLLM's names beside ours
    assert s["itl_ms"]["count"] == 4 * 5 and len(s["itls"]) == 4 and all(len(x) == 2 for x in s["itls"])
    assert all(b["stream_options"] == {"include_usage": True, "continuous_usage_stats": True}
               for b in stub.state.bodies)


def test_tokens_of_no_text_still_arrive_when_the_usage_says_so(stub):
    # A one-token answer whose token decodes to nothing yet (half a UTF-8 character) is
    # still an answer: the chunk's own usage counts it.
    stub.state.reset(continuous_usage=True, token_text="")
    cfg = runner.ServeBenchConfig(client=ClientConfig(url=stub.url), progress=False, workload=WorkloadConfig(
        kind="fixed", num_requests=2, isl=LengthDist.parse("4"), osl=LengthDist.parse("1")))
    r = asyncio.run(runner.run_async(cfg))
    assert r["points"][0]["summary"]["num_ok"] == 2, r["points"][0]["summary"]["errors"]
    for q in r["points"][0]["requests"]:
        assert (q["chunk_tokens"], q["output_tokens"], q["ttft_ms"] is not None) == ([1], 1, True)


def test_a_final_usage_is_spread_over_multi_token_chunks(stub):
    stub.state.reset(tokens_per_chunk=3)  # no usage per chunk, a total at the end
    cfg = runner.ServeBenchConfig(client=ClientConfig(url=stub.url), progress=False, workload=WorkloadConfig(
        kind="fixed", num_requests=2, isl=LengthDist.parse("4"), osl=LengthDist.parse("7")))
    r = asyncio.run(runner.run_async(cfg))
    for q in r["points"][0]["requests"]:
        assert (q["chunk_tokens"], q["token_source"], q["output_tokens"]) == ([2, 2, 3], "spread", 7)


def test_a_dataset_file_drives_the_prompts(stub, tmp_path):
    jl = tmp_path / "prompts.jsonl"
    jl.write_text('{"prompt": "one two three", "output_len": 4}\n\n{"prompt": "four five"}\n')
    share = tmp_path / "sharegpt.json"
    share.write_text(json.dumps([
        {"conversations": [{"from": "human", "value": "hello there"}, {"from": "gpt", "value": "a b c d e f"}]},
        {"conversations": [{"from": "gpt", "value": "no human turn"}]},
        {"conversations": [{"from": "human", "value": "just asking"}]}]))
    for path, want in ((jl, {("one two three", 4), ("four five", 3)}),
                       (share, {("hello there", 6), ("just asking", 3)})):
        stub.state.reset()
        cfg = runner.ServeBenchConfig(client=ClientConfig(url=stub.url), progress=False, workload=WorkloadConfig(
            kind="dataset", dataset_path=str(path), num_requests=10, osl=LengthDist.parse("3")))
        r = asyncio.run(runner.run_async(cfg))
        assert r["points"][0]["summary"]["num_ok"] == 2
        assert {(b["prompt"], b["max_tokens"]) for b in stub.state.bodies} == want
    for name, text, needle in (("a.jsonl", '{"text": "x"}\n', "non-empty string"), ("b.jsonl", "{oops\n", "not JSON"),
                               ("c.jsonl", '{"prompt": "x", "output_len": 0}\n', "positive integer"),
                               ("d.json", "[]", "no prompts"), ("missing.json", None, "cannot read")):
        if text is not None:
            (tmp_path / name).write_text(text)
        with pytest.raises(ValueError, match=needle):
            runner.wl.load_dataset(tmp_path / name)
    assert main(["bench", "serve", "--url", stub.url, "--workload", "dataset", "--no-progress"]) == 2


def test_a_priority_mix_sends_its_share_high_and_reports_each_class(stub, tmp_path):
    stub.state.reset(fail_every=3, fail_status=429, workers=())
    out = tmp_path / "mix"
    cmd = [sys.executable, "-m", "moemesh.tools.cli.main", "bench", "serve", "--url", stub.url, "--out-dir", str(out),
           "--no-progress", "--isl", "8", "--osl", "4", "--num-requests", "10", "--concurrency", "1",
           "--priority-mix", "0.3", "--high-priority", "-2"]
    p = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True, timeout=60)
    assert p.returncode == 0, p.stderr[-3000:]
    assert "| point | priority | ok/total | 429 |" in p.stdout
    r = json.loads((out / "result.json").read_text())
    assert r["config"]["workload"]["priority_mix"] == 0.3
    (point,) = r["points"]
    reqs, by = point["requests"], point["summary"]["by_priority"]
    assert list(by) == ["-2", "0"]  # best class first
    assert [b.get("priority") for b in stub.state.bodies].count(-2) == 3  # the rest send no field
    assert sum("priority" in b for b in stub.state.bodies) == 3
    for cls, b in by.items():
        mine = [q for q in reqs if q["priority"] == int(cls)]
        assert b["num_requests"] == len(mine) == (3 if cls == "-2" else 7)
        assert b["num_429"] == sum(q["status"] == 429 for q in mine)
        assert b["num_ok"] == sum(q["error"] is None for q in mine) == b["ttft_ms"]["count"]
    assert sum(b["num_429"] for b in by.values()) == 3  # every third request
    assert "By priority class" in (out / "summary.md").read_text()
