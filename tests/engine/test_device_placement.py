"""The step's device code keeps every tensor on the logits' device and never waits for the
device to copy a host list over, checked without a GPU. The logits sit on torch's `meta`
device, which has shapes but no data: an op that mixes a meta tensor with a CPU tensor
(other than a 0-d scalar) raises, as one mixing a CUDA tensor with it does. A copy to the
device that would wait for the device's queue (`non_blocking=False`, torch's default:
on CUDA it synchronizes the stream) is a host sync to the launch counter, and a failure here."""

from __future__ import annotations

import pytest
import torch

from moemesh.shared.engine import sampler
from moemesh.shared.engine.host_copy import to_device
from moemesh.shared.engine.spec_decode import verify_tensors
from moemesh.shared.protocol.messages import SamplingParams
from moemesh.tools.bench.launch_count import LaunchCounter

V = 50
PARAMS = {
    "greedy": SamplingParams(temperature=0),
    "temperature": SamplingParams(temperature=0.7),
    "top_k": SamplingParams(temperature=1.0, top_k=5),
    "top_p": SamplingParams(temperature=1.3, top_p=0.8),
    "plain": SamplingParams(temperature=1.0),
}


DEVICE = torch.device("meta")  # a device that is not the host's, on any machine


def _watched(fn):
    """(fn(), the host syncs it made: on the meta device, only copies that wait can be)."""
    with LaunchCounter() as counter:
        out = fn()
    return out, dict(counter.syncs["other"])


@pytest.mark.parametrize("mix", [["temperature"], ["top_k", "greedy"], ["top_p", "plain", "greedy"], ["greedy"]])
def test_sampling_stays_on_the_logits_device(mix):
    params = [PARAMS[m] for m in mix]

    def go():
        logits = torch.empty(len(params), V, device=DEVICE)
        return sampler.sample(logits, params, [None] * len(params)), sampler.processed_probs(logits, params)

    (tokens, probs), waits = _watched(go)
    assert tokens.device == probs.device == DEVICE and tokens.shape == (len(params),)
    assert waits == {}


@pytest.mark.parametrize("mix", [["temperature", "greedy"], ["top_p", "top_k"], ["greedy", "greedy"]])
def test_draft_verification_stays_on_the_logits_device(mix):
    """verify_tensors, greedy and sampled rows, drafts of different counts: queued work with
    nothing read back and nothing waited for."""
    params = [PARAMS[m] for m in mix]
    num_drafts = [2, 1][: len(params)]
    starts = [0, 3][: len(params)]

    def go():
        logits = torch.empty(sum(n + 1 for n in num_drafts), V, device=DEVICE)
        drafts = to_device([[7, 8], [9, 0]][: len(params)], torch.long, logits.device)
        return verify_tensors(logits, starts, num_drafts, drafts, params, [None] * len(params))

    (accepted, last), waits = _watched(go)
    assert accepted.device == last.device == DEVICE and accepted.shape == (len(params),)
    assert waits == {}


def test_to_device_leaves_a_cpu_list_on_the_cpu_and_copies_without_waiting():
    t = to_device([1, 2, 3], torch.long, torch.device("cpu"))
    assert t.tolist() == [1, 2, 3] and t.dtype == torch.long
    moved, waits = _watched(lambda: to_device([1.5, 2.5], torch.float32, DEVICE))
    assert moved.device == DEVICE and moved.dtype == torch.float32 and waits == {}
    _, waits = _watched(lambda: torch.tensor([1, 2]).to(DEVICE))
    assert waits == {"_to_copy": 1}  # what the check catches: torch's default copy waits


def test_no_host_list_goes_to_the_device_by_a_waiting_copy():
    """`torch.tensor(values, device=d)` copies with `non_blocking=False`: on a GPU the host
    waits there for everything queued before it (the forward in flight, when a step is
    planned while another runs). The engine and the model put host lists on the device
    with host_copy.to_device instead; this reads their source for the old form."""
    import ast
    from pathlib import Path

    root = Path(__file__).resolve().parents[2] / "shared"
    found = []
    for path in sorted([*(root / "engine").rglob("*.py"), *(root / "model").rglob("*.py")]):
        for node in ast.walk(ast.parse(path.read_text())):
            if (isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute) and node.func.attr == "tensor"
                    and isinstance(node.func.value, ast.Name) and node.func.value.id == "torch"
                    and any(k.arg == "device" for k in node.keywords)):
                found.append(f"{path.relative_to(root.parent)}:{node.lineno}")
    assert found == []


def test_the_launch_counter_counts_a_waiting_copy_as_a_host_sync():
    with LaunchCounter() as counter:
        torch.tensor([1, 2]).to(DEVICE)  # waits
        torch.tensor([1, 2]).to(DEVICE, non_blocking=True)
        to_device([3], torch.long, DEVICE)
        torch.empty(2, device=DEVICE).copy_(torch.tensor([1.0, 2.0]))  # waits
        torch.tensor([1, 2]) + 1  # on the host: no copy at all
    assert dict(counter.syncs["other"]) == {"_to_copy": 1, "copy_": 1}
