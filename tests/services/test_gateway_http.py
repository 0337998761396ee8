"""The gateway's HTTP edge in one process (real uvicorn, real nats-server, no workers):
bad input is a 4xx naming the parameter, never a 500; a bug is a counted 500 that names
nothing internal and gives its in-flight slot back; slow and oversized requests are cut
off."""

from __future__ import annotations

import asyncio
import json
import logging
import socket
import threading
import time
import urllib.error
import urllib.request

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


def test_seed_is_checked_against_both_int64_bounds(tiny_model, nats_url):
    # orjson reads integers below -2^63 as floats, -2^63 - 1 as exactly -2^63: the low
    # bound once let through what the high bound refused.
    lo, hi = -(2 ** 63), 2 ** 63 - 1
    bodies = {"/v1/completions": {"model": "tiny", "prompt": "hi"},
              "/v1/chat/completions": {"model": "tiny", "messages": [{"role": "user", "content": "hi"}]}}

    async def body(svc, client):
        for path, base in bodies.items():
            for seed in (lo, hi):  # admitted; no workers to serve it
                r = await client.post(path, json={**base, "seed": seed})
                assert r.status_code == 503, (path, seed, r.text)
            for seed in (lo - 1, lo - 1024, hi + 1, 2 ** 64):
                r = await client.post(path, json={**base, "seed": seed})
                assert r.status_code == 400, (path, seed, r.text)
                assert r.json()["error"]["param"] == "seed"
                assert str(lo) in r.json()["error"]["message"]

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


def _chat_body(n: int) -> bytes:
    return b'{"model": "tiny", "messages": [{"role": "user", "content": "' + b"x" * n + b'"}]}'


def _read_response(s: socket.socket) -> tuple[bytes, bytes]:
    """Head and body of a response on a connection the server closes after it; a reset
    instead of that close raises."""
    data = b""
    while chunk := s.recv(65536):
        data += chunk
    head, _, rest = data.partition(b"\r\n\r\n")
    return head, rest


def test_a_client_that_writes_its_whole_body_before_reading_gets_the_413(tiny_model, nats_url):
    # Far more than the socket buffers hold: the server must read it to be heard.
    big = _chat_body(16 << 20)

    async def body(svc, client):
        loop = asyncio.get_running_loop()

        def with_urllib() -> tuple[int, dict]:  # sends Connection: close, declares the length
            req = urllib.request.Request(f"http://127.0.0.1:{svc.port}/v1/chat/completions", data=big,
                                         headers={"content-type": "application/json"})
            with pytest.raises(urllib.error.HTTPError) as e:
                urllib.request.urlopen(req, timeout=10)
            return e.value.code, json.loads(e.value.read())

        def chunked_keep_alive() -> tuple[bytes, bytes]:  # no declared length: counted as it comes
            with _raw(svc.port) as s:
                s.sendall(b"POST /v1/chat/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
                          b"Transfer-Encoding: chunked\r\n\r\n")
                for i in range(0, len(big), 1 << 20):
                    part = big[i:i + (1 << 20)]
                    s.sendall(b"%x\r\n%s\r\n" % (len(part), part))
                s.sendall(b"0\r\n\r\n")
                return _read_response(s)

        status, err = await loop.run_in_executor(None, with_urllib)
        assert status == 413 and err["error"]["code"] == "body_too_large"
        head, rest = await loop.run_in_executor(None, chunked_keep_alive)
        assert head.startswith(b"HTTP/1.1 413 ") and b"connection: close" in head.lower()
        assert json.loads(rest)["error"]["code"] == "body_too_large"
        assert svc.state.inflight == 0

    _serve(tiny_model, nats_url, body, max_body_bytes=4096)


def _send_until_cut_off(s: socket.socket, most: int, pause_s: float = 0.0) -> int:
    """Bytes sent before the server closed the connection; `most` if it never did."""
    sent, part = 0, b"x" * (64 << 10 if not pause_s else 1024)
    while sent < most:
        try:
            s.sendall(part)
        except (BrokenPipeError, ConnectionResetError):
            return sent
        sent += len(part)
        if pause_s:
            time.sleep(pause_s)
    return sent


def test_a_client_that_keeps_sending_after_its_answer_is_cut_off(tiny_model, nats_url):
    head = (b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
            b"Content-Length: 1000000000000\r\n\r\n")

    async def body(svc, client):
        loop = asyncio.get_running_loop()

        def fast() -> int:  # as fast as it can: cut off by bytes
            with _raw(svc.port) as s:
                s.sendall(head)
                return _send_until_cut_off(s, 1 << 30)

        def slow() -> tuple[bytes, int]:  # a trickle: cut off by time (within 10 s of 0.2 s)
            with _raw(svc.port) as s:
                s.sendall(head)
                answer = s.recv(100)
                return answer, _send_until_cut_off(s, 500 << 10, pause_s=0.02)

        sent = await loop.run_in_executor(None, fast)
        assert sent < 64 << 20  # 1 MiB lingered over, plus what the socket buffers held
        answer, sent = await loop.run_in_executor(None, slow)
        assert answer.startswith(b"HTTP/1.1 413 ") and sent < 500 << 10
        assert svc.state.inflight == 0

    _serve(tiny_model, nats_url, body, max_body_bytes=4096, linger_bytes=1 << 20, linger_s=0.2)


def test_a_lingering_connection_does_not_hold_up_shutdown(tiny_model, nats_url):
    async def main():
        svc = GatewayService(GatewayConfig(model=tiny_model, served_model_name="tiny", nats_url=nats_url, port=0,
                                           max_body_bytes=4096, linger_s=600))
        await svc.start()
        loop = asyncio.get_running_loop()
        s = _raw(svc.port)
        try:
            s.sendall(b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Length: 100000\r\n\r\n")
            assert (await loop.run_in_executor(None, s.recv, 100)).startswith(b"HTTP/1.1 413 ")
            t0 = time.monotonic()
            await svc.stop()
            assert time.monotonic() - t0 < 5  # uvicorn waits for open connections, 10 s at most here
        finally:
            s.close()

    asyncio.run(main())


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


def test_priority_from_the_field_or_the_header_and_bad_values_are_400s(tiny_model, nats_url):
    chat = {"model": "tiny", "messages": [{"role": "user", "content": "hi"}]}
    completion = {"model": "tiny", "prompt": "hi"}

    async def body(svc, client):
        for path, base in (("/v1/completions", completion), ("/v1/chat/completions", chat)):
            for fields, headers in (({"priority": -5}, {}), ({}, {"x-request-priority": "-5"}),
                                    ({"priority": 3}, {"x-request-priority": "-5"})):
                r = await client.post(path, json={**base, **fields}, headers=headers)
                assert r.status_code == 503, r.text  # admitted; no workers to serve it
            for fields, headers, param in (({"priority": "urgent"}, {}, "priority"),
                                           ({"priority": 1001}, {}, "priority"),
                                           ({}, {"x-request-priority": "urgent"}, "x-request-priority"),
                                           ({}, {"x-request-priority": "-1001"}, "x-request-priority")):
                r = await client.post(path, json={**base, **fields}, headers=headers)
                assert r.status_code == 400 and r.json()["error"]["param"] == param, r.text
        assert svc.state.inflight == 0 and svc.state.gate.num_waiting == 0
        doc = (await client.get("/openapi.json")).json()
        op = doc["paths"]["/v1/chat/completions"]["post"]
        assert [p["name"] for p in op["parameters"]] == ["x-request-priority"]
        schema = op["requestBody"]["content"]["application/json"]["schema"]
        assert schema["properties"]["priority"]["anyOf"][0]["minimum"] == -1000

    _serve(tiny_model, nats_url, body)
