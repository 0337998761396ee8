"""`init-model --train`: a short seeded run (the default run is 1,500 steps, 1,200 on v4-tiny; this is 24)
writes a checkpoint in the usual layout that the engine runs as the trainer computed it,
the MTP draft head included, with its loss curve and what it trained on."""

from __future__ import annotations

import json

import pytest
import torch

from moemesh.tools.train.config import TrainConfig

pytest.importorskip("transformers")



@pytest.fixture
def trained(tiny_trained):  # tests/conftest.py: 24 steps
    return tiny_trained


def test_the_run_learns_and_says_what_it_did(trained):
    assert len(trained.losses) == 24 and len(trained.mtp_losses) == 24
    assert trained.losses[-1] < trained.losses[0] - 0.05  # seeded: the same numbers every run
    assert [s for s, _, _ in trained.held_out] == [12, 24]
    info = json.loads((trained.out_dir / "moemesh_init.json").read_text())["trained"]
    assert info["steps"] == 24 and info["mtp"] == "trained"
    assert info["corpus"]["source"].endswith("standard library, top-level modules")
    assert len(info["corpus"]["sha256"]) == 64 and info["corpus_tokens"] == trained.tokens
    assert (trained.out_dir / "train_loss.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    curve = json.loads((trained.out_dir / "train_loss.json").read_text())
    assert curve["loss"] == trained.losses


def test_the_engine_runs_the_trained_weights_target_and_draft(trained):
    """Greedy through the engine, and its MTP pass over the prompt, against the trainer's
    own forward (transformers' target and decoder layer) on the saved checkpoint."""
    from tokenizers import Tokenizer

    from moemesh.shared.checkpoint.loader import load_model
    from moemesh.shared.engine.config import EngineConfig
    from moemesh.shared.engine.engine import LLMEngine
    from moemesh.shared.protocol.messages import SamplingParams
    from moemesh.tools.train.trainer import _V3Trainee

    d = trained.out_dir
    raw = json.loads((d / "config.json").read_text())
    ref = _V3Trainee(d, raw).eval()
    p = Tokenizer.from_file(str(d / "tokenizer.json")).encode("def __init__(self, name):\n    self.",
                                                              add_special_tokens=False).ids
    model = load_model(str(d))
    seen: list[torch.Tensor] = []
    real = model.mtp_forward

    def spy(batch, prev, cache):
        seen.append(real(batch, prev, cache))
        return seen[-1]

    model.mtp_forward = spy
    eng = LLMEngine(EngineConfig(model=str(d), num_kv_blocks=64, num_speculative_tokens=1,
                                 enable_prefix_caching=False), model=model)
    # two tokens: a request that ends at its prefill has no draft pass
    eng.add_request("r", p, SamplingParams(max_tokens=2, temperature=0, ignore_eos=True))
    first = [t for o in eng.step() for t in o.new_token_ids][:1]
    with torch.no_grad():
        logits, draft = ref.logits(torch.tensor([p + first]))
    assert first == [int(logits[0, len(p) - 1].argmax())]
    ours = model.mtp_logits(seen[0])
    assert ours.shape == draft[0].shape
    assert (ours - draft[0]).abs().max().item() < 1e-4


def test_routing_skew_is_reported_for_target_and_draft(trained):
    from moemesh.tools.train.skew import measure

    r = measure(str(trained.out_dir), windows=4, window_len=64, ranks=4, redundant=1)
    assert r.layers == [1, 2, 3] and r.draft_layer == 3
    assert all(0 < x <= 1 for x in r.naive + r.balanced)
    assert "| 3 | MTP draft |" in r.table()


def test_correction_bias_moves_toward_the_idle_experts():
    from moemesh.tools.train.trainer import balance_bias

    bias = torch.zeros(4)
    balance_bias(bias, torch.tensor([10, 0, 5, 5]), 0.01)
    assert bias.tolist() == pytest.approx([-0.01, 0.01, 0.0, 0.0])


def test_learning_rate_warms_up_then_decays_to_a_tenth():
    from moemesh.tools.train.trainer import lr_at

    cfg = TrainConfig(steps=100, warmup=10, lr=1.0)
    assert lr_at(0, cfg) == pytest.approx(0.1) and lr_at(9, cfg) == pytest.approx(1.0)
    assert lr_at(99, cfg) == pytest.approx(0.1, abs=1e-3)
    assert all(lr_at(s, cfg) >= lr_at(s + 1, cfg) for s in range(10, 99))


@pytest.mark.parametrize("field, value", [("steps", 0), ("seq_len", 4), ("lr", 0.0)])
def test_bad_training_settings_are_refused(field, value):
    with pytest.raises(ValueError, match=field.replace("_", "-")):
        TrainConfig(**{field: value})


def test_cli_refuses_presets_it_cannot_train(tmp_path, capsys):
    from moemesh.tools.cli.main import main

    assert main(["init-model", str(tmp_path / "m"), "--preset", "bench", "--train"]) == 2
    assert "tiny presets" in capsys.readouterr().err
    assert main(["init-model", str(tmp_path / "m"), "--preset", "tiny", "--train", "--num-layers", "2"]) == 2
    assert not (tmp_path / "m").exists()


@pytest.mark.parametrize("preset, given, steps", [("tiny", None, 1500), ("v4-tiny", None, 1200), ("v4-tiny", "7", 7)])
def test_the_default_run_is_sized_per_preset(tmp_path, monkeypatch, preset, given, steps):
    """v4-tiny's step costs about twice the V3 tiny's: its default run is shorter, so each
    fits in 15 minutes on 2 cores; --train-steps overrides either."""
    from moemesh.tools.cli.main import main
    from moemesh.tools.train import trainer

    seen = []
    monkeypatch.setattr(trainer, "train", lambda out, preset, cfg, init_seed: seen.append(cfg) or 1 / 0)
    with pytest.raises(ZeroDivisionError):  # stopped before any training
        main(["init-model", str(tmp_path / "m"), "--preset", preset, "--train",
              *(["--train-steps", given] if given else [])])
    assert [c.steps for c in seen] == [steps]
