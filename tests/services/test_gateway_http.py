"""The gateway's HTTP edge in one process (real uvicorn, real nats-server, no workers):
bad input is a 4xx naming the parameter, never a 500; a bug is a counted 500 that names
nothing internal and gives its in-flight slot back; slow and oversized requests are cut
off."""

from __future__ import annotations

import asyncio
import logging
import socket
import threading

import httpx
import pytest

from moemesh.services.gateway.api import openai_api
from moemesh.services.gateway.config import GatewayConfig
from moemesh.services.gateway.service import GatewayService
from moemesh.shared.service.lifecycle import configure_logging


def _serve(tiny_model, nats_url, body, **cfg):
    async def main():
        svc = GatewayService(GatewayConfig(model=tiny_model, served_model_name="tiny", nats_url=nats_url, port=0,
                                           **cfg))
        await svc.start()
        try:
            async with httpx.AsyncClient(base_url=f"http://127.0.0.1:{svc.port}", timeout=10) as client:
                await body(svc, client)
        finally:
            await svc.stop()

    asyncio.run(main())


def _requests_total(text: str, status: str) -> float:
    total = 0.0
    for line in text.splitlines():
        if line.startswith("moemesh_requests_total{") and f'status="{status}"' in line:
            total += float(line.rsplit(" ", 1)[1])
    return total


BAD = [
    ({"prompt": "hi", "seed": 2 ** 63}, "seed"),
    ({"prompt": "hi", "seed": 2 ** 70}, "seed"),
    ({"prompt": "hi", "top_k": 2 ** 40}, "top_k"),
    ({"prompt": "hi", "stop_token_ids": [2 ** 40]}, "stop_token_ids"),
    ({"prompt": "hi", "max_tokens": 2 ** 40}, "max_tokens"),
    ({"prompt": "hi", "min_tokens": 2 ** 40}, "min_tokens"),
    ({"prompt": "hi", "stream_options": {"include_usage": "yes"}}, "stream_options"),
    ({"prompt": "hi", "stream_options": {"continuous_usage_stats": 1}}, "stream_options"),
    ({"prompt": "hi", "stream_options": {"include_obfuscation": True}}, "stream_options"),  # not silently dropped
]


@pytest.mark.parametrize("fields, param", BAD)
def test_out_of_range_values_are_400s_naming_the_parameter(tiny_model, nats_url, fields, param):
    async def body(svc, client):
        r = await client.post("/v1/completions", json={"model": "tiny", **fields})
        assert r.status_code == 400, r.text
        assert r.json()["error"]["param"] == param

    _serve(tiny_model, nats_url, body)


def test_broken_json_is_a_400(tiny_model, nats_url):
    raw = [b'{"model": "tiny", "prompt": "\\ud800"}', b'{"model": "tiny", "prompt": ' + b"[" * 5000 + b"]" * 5000 + b"}",
           b'{"model": "tiny", "prompt": "x", "temperature": 1e400}', b"\xff\xfe"]

    async def body(svc, client):
        for data in raw:
            r = await client.post("/v1/completions", content=data, headers={"content-type": "application/json"})
            assert r.status_code == 400, (data[:40], r.text)

    _serve(tiny_model, nats_url, body)


def test_a_bug_is_a_counted_500_that_gives_its_slot_back(tiny_model, nats_url, caplog):
    async def body(svc, client):
        async def broken(*a, **kw):
            raise RuntimeError("mm.prefill.secret-worker.jobs exploded")

        svc.state.mesh.submit = broken
        for _ in range(5):  # more than max_inflight: a leaked slot would turn these into 429s
            r = await client.post("/v1/completions", json={"model": "tiny", "prompt": "hi", "max_tokens": 2})
            assert r.status_code == 500
            err = r.json()["error"]
            assert err["type"] == "server_error" and "mm." not in err["message"] and "secret" not in err["message"]
        assert svc.state.inflight == 0
        metrics = (await client.get("/metrics")).text
        assert _requests_total(metrics, "500") == 5

    with caplog.at_level(logging.ERROR):
        _serve(tiny_model, nats_url, body, max_inflight=2)
    assert "exploded" in caplog.text  # the operator sees the cause; the client does not


def test_no_workers_is_a_503_and_the_slot_comes_back(tiny_model, nats_url):
    async def body(svc, client):
        for _ in range(3):
            r = await client.post("/v1/completions", json={"model": "tiny", "prompt": "hi"})
            assert r.status_code == 503 and r.headers["retry-after"]
        assert svc.state.inflight == 0

    _serve(tiny_model, nats_url, body, max_inflight=1)


def test_a_body_over_the_limit_is_a_413(tiny_model, nats_url):
    big = {"model": "tiny", "prompt": "x" * 5000}

    async def body(svc, client):
        r = await client.post("/v1/completions", json=big)  # declared length
        assert r.status_code == 413, r.text

        async def chunks():  # no declared length: counted as it arrives
            yield b'{"model": "tiny", "prompt": "'
            for _ in range(10):
                yield b"x" * 1000
            yield b'"}'

        r = await client.post("/v1/completions", content=chunks(), headers={"content-type": "application/json"})
        assert r.status_code == 413, r.text
        assert svc.state.inflight == 0

    _serve(tiny_model, nats_url, body, max_body_bytes=4096)


def test_a_large_prompt_is_parsed_off_the_event_loop(tiny_model, nats_url, monkeypatch):
    threads = []
    real = openai_api.parse_completion

    def spy(*a, **kw):
        threads.append(threading.current_thread() is threading.main_thread())
        return real(*a, **kw)

    monkeypatch.setattr(openai_api, "parse_completion", spy)

    async def body(svc, client):
        for prompt in ("short", "word " * 60):
            r = await client.post("/v1/completions", json={"model": "tiny", "prompt": prompt})
            assert r.status_code == 503  # parsed and admitted; no workers to serve it

    _serve(tiny_model, nats_url, body, inline_parse_bytes=256)
    assert threads == [True, False]


def _raw(port: int) -> socket.socket:
    s = socket.create_connection(("127.0.0.1", port), timeout=5)
    return s


def test_slow_headers_and_a_slow_body_are_cut_off(tiny_model, nats_url):
    async def body(svc, client):
        loop = asyncio.get_running_loop()

        def slow_headers() -> bytes:
            with _raw(svc.port) as s:
                s.sendall(b"POST /v1/completions HTTP/1.1\r\nHost: x\r\n")  # and never the rest
                return s.recv(100)  # b"" once the server closes

        def slow_body() -> bytes:
            with _raw(svc.port) as s:
                s.sendall(b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
                          b"Content-Length: 100\r\n\r\n{\"model\"")
                return s.recv(200)

        assert await loop.run_in_executor(None, slow_headers) == b""
        assert b" 408 " in await loop.run_in_executor(None, slow_body)
        assert svc.state.inflight == 0

    _serve(tiny_model, nats_url, body, header_timeout_s=0.5, body_timeout_s=0.5)


def test_a_service_sets_its_own_log_level_over_an_earlier_setup():
    root = logging.getLogger()
    before = root.level
    try:
        root.setLevel(logging.WARNING)  # what `moemesh <service>` left when its flag shadowed the top-level one
        configure_logging("INFO")
        assert root.level == logging.INFO
    finally:
        root.setLevel(before)


@pytest.mark.parametrize("kind", ["chat", "completion"])
def test_a_counted_chunk_is_the_general_chunk_with_usage(kind):
    # The fast bytes and the general serialiser must agree, byte for byte.
    import orjson

    req = openai_api.GenerateRequest(kind, "tiny", [1, 2, 3], openai_api.SamplingParams(max_tokens=8),
                                     stream=True, continuous_usage=True)
    fast = openai_api.ChunkBytes(req)
    for text, n, cached in (("a\u2028b", 1, 0), ('"quoted"', 7, 16)):
        c = openai_api.chunk(req, text, None)
        c["usage"] = openai_api.usage(3, n, cached)
        assert fast.counted(text, n, cached) == b"data: " + orjson.dumps(c) + b"\n\n"
        assert fast.text(text) == b"data: " + orjson.dumps(openai_api.chunk(req, text, None)) + b"\n\n"


def test_the_serving_worker_is_named_in_a_header_only_when_asked_for():
    """Benchmarks split throughput per worker by x-moemesh-worker; clients otherwise never
    learn internal worker ids."""
    from types import SimpleNamespace

    from moemesh.services.gateway.http.app import _headers

    req, handle = SimpleNamespace(request_id="cmpl-1"), SimpleNamespace(decode_id="decode-7")
    off = SimpleNamespace(cfg=GatewayConfig(model="m"))
    on = SimpleNamespace(cfg=GatewayConfig(model="m", worker_header=True))
    assert _headers(off, req, handle) == {"x-request-id": "cmpl-1"}
    assert _headers(on, req, handle) == {"x-request-id": "cmpl-1", "x-moemesh-worker": "decode-7"}
