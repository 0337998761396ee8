"""The gateway's API-key middleware on its own: which requests pass, the 401 shape, and
the comparison that never stops at the first key."""

from __future__ import annotations

import hmac

import pytest
from starlette.applications import Starlette
from starlette.middleware import Middleware
from starlette.responses import PlainTextResponse
from starlette.routing import Route
from starlette.testclient import TestClient

from moemesh.services.gateway.http import auth
from moemesh.services.gateway.http.auth import ApiKeyError, ApiKeyMiddleware, load_api_keys

KEYS = ("sk-first-0123456789", "sk-second-abcdefghij")


def _client(keys) -> TestClient:
    async def ok(request):
        return PlainTextResponse("ok")

    app = Starlette(routes=[Route("/v1/models", ok), Route("/health", ok), Route("/health/ready", ok)],
                    middleware=[Middleware(ApiKeyMiddleware, keys=load_api_keys(keys))])
    return TestClient(app)


def test_every_configured_key_is_accepted():
    c = _client(KEYS)
    for k in KEYS:
        r = c.get("/v1/models", headers={"Authorization": f"Bearer {k}"})
        assert r.status_code == 200 and r.text == "ok"
    assert c.get("/v1/models", headers={"Authorization": f"bearer {KEYS[0]}"}).status_code == 200


@pytest.mark.parametrize("header", [None, "Bearer sk-wrong", f"Basic {KEYS[0]}", "Bearer", f"Bearer {KEYS[0]}x",
                                    f"Bearer {KEYS[0][:-1]}"])
def test_missing_or_wrong_key_is_401_in_openai_shape(header):
    headers = {} if header is None else {"Authorization": header}
    r = _client(KEYS).get("/v1/models", headers=headers)
    assert r.status_code == 401
    assert r.headers["www-authenticate"].startswith("Bearer")
    err = r.json()["error"]
    assert set(err) == {"message", "type", "param", "code"}
    assert (err["type"], err["param"], err["code"]) == ("invalid_request_error", None, "invalid_api_key")
    assert "sk-" not in err["message"]  # a wrong key is never echoed back


def test_health_stays_open_and_no_keys_means_open():
    c = _client(KEYS)
    assert c.get("/health").status_code == 200
    assert c.get("/health/ready").status_code == 200
    assert _client(()).get("/v1/models").status_code == 200


def test_comparison_visits_every_key_even_after_a_match(monkeypatch):
    calls = []
    real = hmac.compare_digest

    def counting(a, b):
        calls.append(b)
        return real(a, b)

    monkeypatch.setattr(auth.hmac, "compare_digest", counting)
    keys = load_api_keys(["k1", "k2", "k3"])
    assert auth.key_matches(b"k1", keys)
    assert calls == [b"k1", b"k2", b"k3"]
    calls.clear()
    assert not auth.key_matches(b"nope", keys)
    assert len(calls) == 3


def test_keys_file(tmp_path):
    f = tmp_path / "keys"
    f.write_text("# rotated 2025-01\nsk-a\n\n  sk-b  \nsk-a\n")
    assert load_api_keys(["sk-inline, "], str(f)) == (b"sk-inline,", b"sk-a", b"sk-b")
    (tmp_path / "empty").write_text("# nothing yet\n\n")
    with pytest.raises(ApiKeyError, match="holds no key"):
        load_api_keys([], str(tmp_path / "empty"))
    with pytest.raises(ApiKeyError, match="missing"):
        load_api_keys([], str(tmp_path / "missing"))


def test_keys_stay_out_of_the_config_repr():
    from moemesh.services.gateway.config import GatewayConfig

    cfg = GatewayConfig(model="/m", api_keys=("sk-secret-repr-check",))
    assert "sk-secret-repr-check" not in repr(cfg)
