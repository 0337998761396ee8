import pytest
import torch

from moemesh.shared.engine import sampler
from moemesh.shared.protocol.messages import SamplingParamError, SamplingParams


def test_greedy_is_argmax():
    logits = torch.tensor([[0.1, 3.0, 0.2], [5.0, 0.0, 0.0]])
    toks = sampler.sample(logits, [SamplingParams(temperature=0)] * 2, [None, None])
    assert toks.tolist() == [1, 0]


def test_top_k_and_top_p_restrict_support():
    logits = torch.log(torch.tensor([[0.5, 0.3, 0.15, 0.05]]))
    p = sampler.processed_probs(logits, [SamplingParams(top_k=2)])
    assert (p[0, 2:] == 0).all() and p[0, :2].sum() == pytest.approx(1)
    p = sampler.processed_probs(logits, [SamplingParams(top_p=0.7)])
    assert (p[0, 2:] == 0).all()  # 0.5 + 0.3 reaches 0.7; the rest is cut
    p = sampler.processed_probs(logits, [SamplingParams(top_p=0.4)])
    assert p[0, 0] == 1  # the top token always survives


def test_temperature_sharpens():
    logits = torch.tensor([[1.0, 2.0]])
    hot = sampler.processed_probs(logits, [SamplingParams(temperature=2.0)])[0, 1]
    cold = sampler.processed_probs(logits, [SamplingParams(temperature=0.5)])[0, 1]
    assert cold > hot


def test_seeded_rows_are_reproducible_regardless_of_batch():
    torch.manual_seed(0)
    logits = torch.randn(3, 50)
    params = [SamplingParams(temperature=1.0, seed=5)] * 3
    a = sampler.sample(logits, params, [torch.Generator().manual_seed(5) for _ in range(3)])
    b = sampler.sample(logits[1:2], params[:1], [torch.Generator().manual_seed(5)])
    assert a[1] == b[0]


def test_logprobs_report_chosen_and_top():
    logits = torch.log(torch.tensor([[0.7, 0.2, 0.1]]))
    lp = sampler.logprobs_of(logits, torch.tensor([1]), [2])[0]
    assert lp.token_id == 1 and lp.logprob == pytest.approx(torch.log(torch.tensor(0.2)).item(), abs=1e-5)
    assert lp.top_ids == [0, 1] and all(type(t) is int for t in lp.top_ids)
    assert lp.top_logprobs == sorted(lp.top_logprobs, reverse=True)


@pytest.mark.parametrize("kw,param", [
    ({"max_tokens": 0}, "max_tokens"), ({"temperature": -1}, "temperature"), ({"top_p": 0}, "top_p"),
    ({"top_k": -2}, "top_k"), ({"seed": 1.5}, "seed"), ({"stop": ("",)}, "stop"), ({"logprobs": 99}, "logprobs"),
    ({"max_tokens": True}, "max_tokens"), ({"temperature": float("nan")}, "temperature"),
])
def test_bad_parameters_name_themselves(kw, param):
    with pytest.raises(SamplingParamError) as e:
        SamplingParams(**kw)
    assert e.value.param == param


def test_a_top_p_below_float32_keeps_the_likeliest_token():
    # 5e-324 is a valid top_p and rounds to 0 in float32: the top token must still be sampled,
    # among the tokens a grammar left (the others are -inf), never a NaN draw
    logits = torch.full((2, 10), float("-inf"))
    logits[:, 3], logits[:, 7] = 1.0, 2.0
    p = SamplingParams(temperature=1.0, top_p=5e-324)
    probs = sampler._tempered_probs(logits, [p, p])
    assert not probs.isnan().any() and probs[:, 7].tolist() == [1.0, 1.0]
    assert sampler.sample(logits, [p, p], [None, None]).tolist() == [7, 7]


def test_masked_tokens_are_reported_at_a_finite_floor():
    # a grammar masks tokens to -inf; their logprobs must still be JSON numbers
    logits = torch.full((1, 6), float("-inf"))
    logits[0, 2] = 0.5
    (lp,) = sampler.logprobs_of(logits, torch.tensor([2]), [4])
    assert lp.logprob == 0.0 and lp.top_ids[0] == 2
    assert all(v == sampler.LOGPROB_FLOOR for v in lp.top_logprobs[1:])
