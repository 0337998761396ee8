"""lm-eval against a mesh: its `local-completions` model runs a small multiple-choice task
(a YAML task over a local JSONL file: nothing is downloaded) through the gateway, with the
mesh's own tokenizer (it probes /tokenizer_info and /tokenize), batches of token id
prompts and echo with logprobs. The loglikelihoods it gets must be transformers' on the
same checkpoint, in float32, within 1e-4: the prefill's prompt scores are the model's."""

from __future__ import annotations

import asyncio
import json

import pytest
import torch

from tests.services.conftest import nats_url  # noqa: F401 (fixture)
from tests.services.test_in_process import _wait_free, mesh

ITEMS = [
    {"question": "The capital of France is", "choices": [" Paris", " London", " a river"], "answer": 0},
    {"question": "Two plus two makes", "choices": [" four", " five", " seven apples"], "answer": 0},
    {"question": "The experts of a mixture", "choices": [" route tokens", " sleep", " are routed to"], "answer": 0},
    {"question": "Water boils at", "choices": [" 100 degrees", " noon"], "answer": 0},
    {"question": "A mesh of services talks over", "choices": [" NATS", " carrier pigeons", " UCX and NATS"],
     "answer": 2},
]
# For the model trained on the standard library's sources: Python, against noise.
CODE_ITEMS = [
    {"question": "def __init__(self", "choices": [", name):", " the river", " über alles"], "answer": 0},
    {"question": "import os\nimport", "choices": [" sys", " café"], "answer": 0},
    {"question": "        return", "choices": [" None", " 日本語"], "answer": 0},
    {"question": "for i in", "choices": [" range(", " pigeons"], "answer": 0},
    {"question": "    if not", "choices": [" isinstance(", " 🙂 🙂"], "answer": 0},
]
TASK = "moemesh_tiny_choice"


def _task_dir(tmp_path, items) -> str:
    d = tmp_path / "tasks"
    d.mkdir()
    data = d / "items.jsonl"
    data.write_text("".join(json.dumps(i) + "\n" for i in items))
    (d / f"{TASK}.yaml").write_text(f"""task: {TASK}
dataset_path: json
dataset_kwargs:
  data_files:
    test: {data}
  cache_dir: {tmp_path / "datasets"}
test_split: test
output_type: multiple_choice
doc_to_text: "{{{{question}}}}"
doc_to_choice: "{{{{choices}}}}"
doc_to_target: "{{{{answer}}}}"
metric_list:
  - metric: acc
""")
    return str(d)


def _served(metrics: str) -> int:
    """Completion requests the gateway answered with a 200."""
    return sum(int(float(line.rsplit(" ", 1)[1])) for line in metrics.splitlines()
               if line.startswith("moemesh_requests_total{") and 'route="/v1/completions"' in line
               and 'status="200"' in line)


def _transformers_loglikelihood(model_dir: str, pairs: list[tuple[list[int], list[int]]]) -> list[float]:
    from transformers import AutoModelForCausalLM

    hf = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()
    out = []
    with torch.no_grad():
        for ctx, cont in pairs:
            lp = torch.log_softmax(hf(torch.tensor([ctx + cont])).logits[0].float(), dim=-1)
            rows = torch.arange(len(ctx) - 1, len(ctx) + len(cont) - 1)
            out.append(float(lp[rows, torch.tensor(cont)].sum()))
    return out


@pytest.fixture(params=["random", "trained"])
def subject(request):
    """(model dir, engine factory, task items): the seeded random tiny model on English
    choices, or the (shortly) trained one on Python."""
    if request.param == "random":
        return request.getfixturevalue("tiny_model"), request.getfixturevalue("tiny_engine_factory"), ITEMS
    from tests.conftest import _engine_factory

    model_dir = str(request.getfixturevalue("tiny_trained").out_dir)
    return model_dir, _engine_factory(model_dir, num_kv_blocks=512), CODE_ITEMS


@pytest.mark.filterwarnings("ignore::DeprecationWarning", "ignore::FutureWarning", "ignore::UserWarning")
def test_lm_eval_loglikelihoods_are_transformers(nats_url, subject, tmp_path, monkeypatch):  # noqa: F811
    for var in ("HF_HUB_OFFLINE", "HF_DATASETS_OFFLINE", "TRANSFORMERS_OFFLINE"):
        monkeypatch.setenv(var, "1")
    monkeypatch.setenv("HF_HOME", str(tmp_path / "hf-home"))
    lm_eval = pytest.importorskip("lm_eval")
    from lm_eval.models.openai_completions import LocalCompletionsAPI
    from lm_eval.tasks import TaskManager

    model_dir, engine_factory, items = subject
    tasks = _task_dir(tmp_path, items)

    def evaluate(url: str):
        # include_defaults=False: only this task is indexed, not lm-eval's 14,000 built-in
        # ones (11 s of YAML per test here, for tasks never run).
        lm = LocalCompletionsAPI(base_url=url + "/v1/completions", model="tiny", batch_size=2, max_retries=1)
        assert lm.tokenizer_backend == "remote"  # it found /tokenizer_info and /tokenize
        res = lm_eval.simple_evaluate(model=lm, tasks=[TASK], task_manager=TaskManager(include_path=tasks, include_defaults=False),
                                      log_samples=True)
        # each sample's arguments: (context, continuation) per choice; encoded as lm-eval did
        pairs = [lm._encode_pair(*args) for inst in res["samples"][TASK] for args in inst["arguments"]]
        return res, pairs

    async def go():
        engines = (engine_factory(role="prefill", num_kv_blocks=256, max_num_batched_tokens=8),
                   engine_factory(role="decode", num_kv_blocks=256))
        async with mesh(nats_url, model_dir, tmp_path, engines) as m:
            res, pairs = await asyncio.to_thread(evaluate, m.url)
            await _wait_free(m)
            return res, pairs, _served(m.gateway.state.metrics.render()[0].decode())

    res, pairs, served = asyncio.run(go())
    samples = res["samples"][TASK]
    assert len(samples) == len(items) and 0 <= res["results"][TASK]["acc,none"] <= 1
    got = [resp[0][0] for inst in samples for resp in inst["resps"]]
    assert len(got) == len(pairs) == sum(len(i["choices"]) for i in items)
    assert served == -(-len(pairs) // 2)  # two prompts a request: lm-eval's batches went as batches
    want = _transformers_loglikelihood(model_dir, pairs)
    worst = max(abs(a - b) for a, b in zip(got, want))
    print(f"lm-eval {lm_eval.__version__}: acc {res['results'][TASK]['acc,none']:.2f}, max |Δ loglikelihood| vs "
          f"transformers {worst:.2e} over {len(got)} continuations")
    assert worst < 1e-4, (worst, got, want)
