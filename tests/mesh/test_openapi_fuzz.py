"""The served OpenAPI document against the gateway, fuzzed by schemathesis: every request
the document allows is served, every one it forbids is a 4xx, and nothing is a 5xx. The
mesh is `moemesh up` on the mock engine (the forward is not what is tested here).

The allowed exceptions (EXCEPTIONS) are what a JSON schema of the request cannot bound, as
the document says: a prompt plus max_tokens that does not fit the context (400
context_length_exceeded), a response_format or tool schema the grammar library cannot
enforce (400 unenforceable_schema), and tool settings that disagree with each other (400
tool_mismatch). The default run tries a few dozen cases per operation; `-m slow` runs a
thousand."""

from __future__ import annotations

import os
import re
import signal
import subprocess
import sys
import time

import pytest

schemathesis = pytest.importorskip("schemathesis")
from hypothesis import HealthCheck, Phase, given, settings  # noqa: E402

from schemathesis import GenerationMode  # noqa: E402


@pytest.fixture(scope="module")
def mock_mesh_url(tmp_path_factory, tiny_model):
    logs = tmp_path_factory.mktemp("fuzz-logs")
    p = subprocess.Popen([sys.executable, "-m", "moemesh.tools.cli.main", "up", "--model", tiny_model, "--port", "0",
                          "--log-dir", str(logs), "--set", "engine=mock", "--set", "mock_step_ms=0"],
                         stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, env=dict(os.environ))
    url, lines = None, []
    try:
        deadline = time.monotonic() + 120
        while url is None and time.monotonic() < deadline:
            line = p.stdout.readline()
            if not line:
                break
            lines.append(line)
            m = re.search(r"moemesh is up: (http://\S+)", line)
            url = m.group(1) if m else None
        assert url, "".join(lines)
        yield url
    finally:
        p.send_signal(signal.SIGINT)
        p.wait(60)
        p.stdout.close()


@pytest.fixture(scope="module")
def api_schema(mock_mesh_url):
    schema = schemathesis.openapi.from_url(mock_mesh_url + "/openapi.json")
    schema.config.generation.update(modes=[GenerationMode.POSITIVE, GenerationMode.NEGATIVE])
    return schema.include(method="POST")


def _fuzz(api_schema, examples: int, derandomize: bool = False) -> None:
    # Hypothesis drives the schema's strategies directly: one property per operation.
    for result in api_schema.get_all_operations():
        operation = result.ok()

        @given(case=operation.as_strategy())
        # No shrinking: replaying a case through schemathesis' extra-field generator is not
        # reproducible (hypothesis calls it flaky), and the first failing case says enough.
        @settings(max_examples=examples, deadline=None, suppress_health_check=list(HealthCheck), database=None,
                  phases=[Phase.generate], derandomize=derandomize)
        def agree(case):
            response = case.call(timeout=60)
            if response.status_code == 400 and response.json()["error"].get("code") in EXCEPTIONS:
                return
            case.validate_response(response)

        agree()


# What a JSON schema of the request cannot bound, each a 400 with its own code that the
# document describes: a prompt too long in tokens, a JSON Schema the grammar library cannot
# enforce, and tool settings that disagree with each other.
EXCEPTIONS = ("context_length_exceeded", "unenforceable_schema", "tool_mismatch")


def test_the_document_and_the_gateway_agree(api_schema):
    # The same 40 cases every run: the default suite passes or fails by the code, not by
    # which cases came up (and takes the same time); the long run below explores.
    _fuzz(api_schema, 40, derandomize=True)


@pytest.mark.slow
@pytest.mark.timeout(3600)
def test_the_document_and_the_gateway_agree_at_length(api_schema):
    _fuzz(api_schema, 1000)
