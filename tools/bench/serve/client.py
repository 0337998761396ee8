"""A streaming client for any OpenAI-compatible server, recording when each chunk lands.

Lifecycle of one request: sent -> (non-200: error body read) | streaming: the body parsed
as server-sent events per the standard (tools/bench/serve/sse.py), content chunks timed ->
ended by `[DONE]`, the stream closing, an error event or a transport error. A failure is
written into the record; `send` never raises.

Tokens are counted from what the server says, never by tokenizing its text again (a
word split across chunks would count twice). Per content chunk, in order of preference:
1. `usage.completion_tokens` on every chunk (vLLM's `continuous_usage_stats`, which we
   ask for; moemesh sends it too): the delta. `token_source` = usage.
2. The final `usage.completion_tokens` spread evenly over the chunks, when it differs
   from the number of chunks: `token_source` = spread (ITL is then an estimate).
3. One token per chunk: `token_source` = chunks (exact when the final usage agrees).
With per-chunk usage, a chunk of no text whose usage grew counts as content: its tokens
arrived, they only decode to nothing yet.
The request's output_tokens is the final `usage.completion_tokens` when the server sends
it (we ask with `stream_options.include_usage`), otherwise the sum over chunks.
"""

from __future__ import annotations

import json
import time
from dataclasses import dataclass, field

import httpx

from moemesh.tools.bench.serve.metrics import RequestRecord
from moemesh.tools.bench.serve.sse import SSEParser

ENDPOINTS = {"completions": "/v1/completions", "chat": "/v1/chat/completions"}
DONE = "[DONE]"


@dataclass(frozen=True)
class ClientConfig:
    url: str
    endpoint: str = "completions"
    model: str | None = None  # None: the first id from GET /v1/models
    ignore_eos: bool = True
    stream_usage: bool = True
    continuous_usage: bool = True  # ask for usage on every chunk (vLLM's continuous_usage_stats)
    api_key: str | None = None
    timeout_s: float = 600.0  # per connect/read, not per request
    worker_header: str = "x-moemesh-worker"
    temperature: float | None = None
    extra_body: dict = field(default_factory=dict)

    def __post_init__(self) -> None:
        if self.endpoint not in ENDPOINTS:
            raise ValueError(f"endpoint must be one of {', '.join(ENDPOINTS)}, got {self.endpoint!r}")
        if not self.url.startswith(("http://", "https://")):
            raise ValueError(f"--url must start with http:// or https://, got {self.url!r}")

    @property
    def base_url(self) -> str:
        u = self.url.rstrip("/")
        return u[:-3] if u.endswith("/v1") else u


def parse_event(data: str) -> dict | str:
    """One event's data -> its JSON object, or DONE."""
    data = data.strip()
    if data == DONE:
        return DONE
    try:
        ev = json.loads(data)
    except ValueError:
        return {"error": {"message": f"unparseable SSE data: {data[:120]}"}}
    return ev if isinstance(ev, dict) else {"error": {"message": f"unexpected SSE data: {data[:120]}"}}


def event_error(ev: dict) -> str | None:
    """The message of an error event, in OpenAI's ({"error": {...}}) or vLLM's form."""
    err = ev.get("error")
    if isinstance(err, dict):
        return str(err.get("message") or err)
    if err:
        return str(err)
    if ev.get("object") == "error":
        return str(ev.get("message") or ev)
    return None


def event_content(ev: dict, endpoint: str) -> tuple[str, str, str | None]:
    """(timed text, answer text, finish_reason) of a chunk. Reasoning text counts for
    timing but is left out of the answer fed back into an agentic context."""
    choices = ev.get("choices") or []
    if not choices or not isinstance(choices[0], dict):
        return "", "", None
    c = choices[0]
    if endpoint == "completions":
        text = c.get("text") or ""
        return text, text, c.get("finish_reason")
    delta = c.get("delta") or {}
    answer = delta.get("content") or ""
    reasoning = delta.get("reasoning_content") or delta.get("reasoning") or ""
    return reasoning + answer, answer, c.get("finish_reason")


def error_body(body: bytes) -> str:
    try:
        msg = event_error(json.loads(body))
    except (ValueError, AttributeError):
        msg = None
    return msg or body.decode("utf-8", "replace").strip()[:200] or "(empty body)"


class ServeClient:
    """async with ServeClient(cfg, tokenizer) as c: await c.send(record, messages)."""

    def __init__(self, cfg: ClientConfig):
        self.cfg = cfg
        self.model = cfg.model
        self.max_model_len: int | None = None  # the server's context, if /v1/models says (vLLM's field)
        self._http: httpx.AsyncClient | None = None
        self._t0 = time.perf_counter()

    async def __aenter__(self) -> ServeClient:
        headers = {"Authorization": f"Bearer {self.cfg.api_key}"} if self.cfg.api_key else {}
        # No pool limit: a capped pool would queue requests inside the client and show up
        # as server TTFT at high concurrency.
        self._http = httpx.AsyncClient(
            base_url=self.cfg.base_url, headers=headers, timeout=httpx.Timeout(self.cfg.timeout_s),
            limits=httpx.Limits(max_connections=None, max_keepalive_connections=None))
        return self

    async def __aexit__(self, *exc) -> None:
        if self._http is not None:
            await self._http.aclose()
            self._http = None

    def reset_clock(self) -> None:
        self._t0 = time.perf_counter()

    def now(self) -> float:
        return time.perf_counter() - self._t0

    async def resolve_model(self) -> str:
        """The model to name in requests: the configured one, or the server's first. Also
        notes that model's context length where the server gives it."""
        try:
            r = await self._http.get("/v1/models")
            r.raise_for_status()
            cards = r.json()["data"]
            card = cards[0] if self.model is None else next((c for c in cards if c.get("id") == self.model), {})
            if self.model is None:
                self.model = card["id"]
            n = card.get("max_model_len")
            self.max_model_len = n if isinstance(n, int) and n > 0 else None
        except (httpx.HTTPError, ValueError, KeyError, IndexError, TypeError, AttributeError) as e:
            if self.model is None:
                raise ValueError(f"could not read a model from {self.cfg.base_url}/v1/models "
                                 f"({type(e).__name__}: {e}); pass --model") from None
        return self.model

    def body(self, messages: list[dict] | None, max_tokens: int, prompt_ids=None, priority: int | None = None) -> dict:
        """prompt_ids: the prompt as token ids (a replayed trace), for completions only.
        priority: the request's class; the default class (0 or None) sends no field."""
        from moemesh.tools.bench.serve.workload import render_completion

        b = {"model": self.model, "max_tokens": max_tokens, "stream": True}
        if prompt_ids is not None:
            if self.cfg.endpoint == "chat":
                raise ValueError("token-id prompts go to the completions endpoint")
            b["prompt"] = list(prompt_ids)
        elif self.cfg.endpoint == "chat":
            b["messages"] = messages
        else:
            b["prompt"] = render_completion(messages)
        if self.cfg.stream_usage:
            b["stream_options"] = {"include_usage": True}
            if self.cfg.continuous_usage:
                b["stream_options"]["continuous_usage_stats"] = True
        if self.cfg.ignore_eos:
            b["ignore_eos"] = True
        if self.cfg.temperature is not None:
            b["temperature"] = self.cfg.temperature
        if priority:
            b["priority"] = priority
        return b | self.cfg.extra_body

    async def send(self, rec: RequestRecord, messages: list[dict] | None, prompt_ids=None) -> None:
        """Send one request and fill rec in; never raises for a failed request."""
        body = self.body(messages, rec.max_tokens, prompt_ids, rec.priority)
        rec.start = self.now()
        try:
            async with self._http.stream("POST", ENDPOINTS[self.cfg.endpoint], json=body) as resp:
                rec.status = resp.status_code
                rec.worker = resp.headers.get(self.cfg.worker_header) if self.cfg.worker_header else None
                if resp.status_code != 200:
                    rec.error = f"HTTP {resp.status_code}: {error_body(await resp.aread())}"
                else:
                    await self._read_stream(rec, resp)
        except Exception as e:  # noqa: BLE001 - one failed request must not end the run
            rec.error = f"{type(e).__name__}: {e}".rstrip(": ")
        rec.end = self.now()
        if rec.error is None and not rec.chunk_times:
            rec.error = "stream ended with no content"
        if rec.error is None:
            settle_tokens(rec)

    async def _read_stream(self, rec: RequestRecord, resp: httpx.Response) -> None:
        parser, last_usage, continuous = SSEParser(), 0, None
        async for data in resp.aiter_bytes():
            for raw in parser.feed(data):
                ev = parse_event(raw)
                if ev == DONE:
                    return
                if (msg := event_error(ev)) is not None:
                    rec.error = f"stream error: {msg}"
                    return
                timed, answer, finish = event_content(ev, self.cfg.endpoint)
                usage = ev.get("usage") if isinstance(ev.get("usage"), dict) else None
                # A choice chunk whose own usage says tokens came, though their text is empty
                # (a token that decodes to nothing yet: half of a UTF-8 character), is still
                # those tokens arriving.
                grew = (bool(ev.get("choices")) and continuous is not False and usage is not None
                        and isinstance(usage.get("completion_tokens"), int) and usage["completion_tokens"] > last_usage)
                if timed or grew:
                    rec.chunk_times.append(self.now())
                    if continuous is None:
                        continuous = usage is not None and "completion_tokens" in usage
                    if continuous and usage is not None:
                        n = int(usage.get("completion_tokens", last_usage))
                        rec.chunk_tokens.append(max(0, n - last_usage))
                        last_usage, rec.token_source = n, "usage"
                    else:
                        rec.chunk_tokens.append(1)
                    rec.text += answer
                if usage is not None:
                    if usage.get("completion_tokens") is not None:
                        rec.output_tokens = int(usage["completion_tokens"])
                    if usage.get("prompt_tokens") is not None:
                        rec.input_tokens = int(usage["prompt_tokens"])
                    details = usage.get("prompt_tokens_details")
                    if isinstance(details, dict) and details.get("cached_tokens") is not None:
                        rec.cached_tokens = int(details["cached_tokens"])
                rec.finish_reason = finish or rec.finish_reason


def settle_tokens(rec: RequestRecord) -> None:
    """Reconcile per-chunk counts with the request's total, once its stream has ended."""
    if not rec.output_tokens:
        rec.output_tokens = sum(rec.chunk_tokens)
    elif rec.token_source != "usage" and rec.chunk_tokens and sum(rec.chunk_tokens) != rec.output_tokens:
        total, n = rec.output_tokens, len(rec.chunk_tokens)
        rec.chunk_tokens = [total * (i + 1) // n - total * i // n for i in range(n)]
        rec.token_source = "spread"
