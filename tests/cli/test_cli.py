"""The moemesh command as a user runs it: exit codes and printed output. A model made and
used, and the one-line errors, in a subprocess as a user sees them; the rest in this process
(tests/cli_in_process.py)."""

import json
import subprocess
import sys

from tests.cli_in_process import moemesh as in_process


def moemesh(*args, timeout=300):
    return subprocess.run([sys.executable, "-m", "moemesh.tools.cli.main", *args], capture_output=True, text=True,
                          timeout=timeout)


def test_init_model_then_generate(tmp_path):
    d = tmp_path / "m"
    r = moemesh("init-model", str(d), "--preset", "tiny-v2", "--seed", "3")
    assert r.returncode == 0, r.stderr
    assert (d / "config.json").is_file() and (d / "tokenizer.json").is_file()
    r = moemesh("generate", "--model", str(d), "--max-tokens", "5", "--json", "Hello there", "Second prompt")
    assert r.returncode == 0, r.stderr
    lines = [json.loads(x) for x in r.stdout.splitlines()]
    assert [x["prompt"] for x in lines] == ["Hello there", "Second prompt"]
    assert all(len(x["token_ids"]) <= 5 for x in lines)


def test_generate_with_chat_template(tiny_model):
    r = in_process("generate", "--model", tiny_model, "--chat", "--max-tokens", "3", "hi")
    assert r.returncode == 0, r.stderr
    assert "--- 'hi'" in r.stdout


def test_generate_on_deepseek_v4_gives_the_engines_greedy_tokens(tiny_v4_model):
    from moemesh.shared.engine.config import EngineConfig
    from moemesh.shared.engine.llm import LLM
    from moemesh.shared.protocol.messages import SamplingParams

    prompts = ["Hello there", "The experts of the fourth model route every token through the mesh " * 3]
    r = in_process("generate", "--model", tiny_v4_model, "--max-tokens", "8", "--json", *prompts)
    assert r.returncode == 0, r.stderr
    got = [json.loads(x)["token_ids"] for x in r.stdout.splitlines()]
    llm = LLM(EngineConfig(model=tiny_v4_model))
    assert len(llm.tokenizer.encode(prompts[1])) > 40
    want = [o.token_ids for o in llm.generate(prompts, SamplingParams(max_tokens=8, temperature=0))]
    assert got == want and all(got)


def test_bad_inputs_give_one_line_errors(tmp_path, tiny_model):
    r = moemesh("generate", "--model", str(tmp_path / "missing"), "x")
    assert r.returncode == 2 and "does not exist" in r.stderr and "Traceback" not in r.stderr
    r = moemesh("generate", "--model", tiny_model, "--temperature", "-3", "x")
    assert r.returncode == 2 and "temperature" in r.stderr and "Traceback" not in r.stderr
    r = moemesh("init-model", str(tmp_path / "x"), "--preset", "tiny", "--num-layers", "1")
    assert r.returncode == 2 and "--num-layers" in r.stderr


def test_bench_forward_prints_and_saves(tiny_model, tmp_path):
    out = tmp_path / "fwd.json"
    r = in_process("bench", "forward", "--model", tiny_model, "--batch-sizes", "1,4", "--context-len", "40",
                "--prefill-lens", "16", "--steps", "2", "--warmup", "1", "--out", str(out))
    assert r.returncode == 0, r.stderr
    assert "fwd tok/s" in r.stdout
    res = json.loads(out.read_text())
    assert [d["batch"] for d in res["decode"]] == [1, 4]
    assert res["env"]["torch"] and res["model"]["model_type"] == "deepseek_v3"
    assert all(d["forward_ms_p50"] > 0 and d["forward_tokens_per_s"] > 0 for d in res["decode"])
    assert res["prefill"][0]["prompt_len"] == 16
