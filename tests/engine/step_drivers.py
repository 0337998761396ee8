"""Driving an engine's planned steps the way the serving loop does, on one thread, and
its whole steps: what the overlap tests compare."""

import torch

from moemesh.shared.engine import spec_overlap
from moemesh.shared.engine.engine import BLOCKED, LLMEngine
from moemesh.shared.engine.outputs import request_outputs, step_outputs


def collect(outs: dict, step_outs) -> None:
    for o in request_outputs(step_outs):
        rec = outs.setdefault(o.request_id, {"ids": [], "reason": None})
        rec["ids"] += o.new_token_ids
        if o.finished:
            rec["reason"] = o.finish_reason.value


def drive_overlapped(eng: LLMEngine, actions: dict[int, list]) -> tuple[dict, int]:
    """Plan the next step with the previous one still unlanded, run it, then land the
    previous one; a step the engine must run whole (spec_overlap.WHOLE) runs with none in
    flight. actions: round -> callables run on the engine at its start. Returns the
    outputs and how many steps were planned with one in flight."""
    outs, inflight, i, overlapped = {}, None, 0, 0
    while True:
        for act in actions.pop(i, []):
            act(eng)
        plan = eng.plan_step(inflight)
        if plan is spec_overlap.WHOLE:
            assert inflight is None
            collect(outs, step_outputs(eng.whole_step()))
            plan = None
        elif plan is BLOCKED:
            plan = None
        if plan is not None:
            overlapped += inflight is not None
            eng.blocks.begin_step(plan.step_id)
            with torch.inference_mode():
                eng.run_step(plan)
        if inflight is not None:
            eng.blocks.end_step(inflight.step_id)
            collect(outs, eng.land_step(inflight))
        inflight = plan
        i += 1
        if inflight is None and not actions and not eng.has_unfinished():
            return outs, overlapped
        assert i < 5000, "the engine stopped making progress"


def run_whole(eng: LLMEngine) -> dict:
    outs = {}
    while eng.has_unfinished():
        for o in eng.step():
            rec = outs.setdefault(o.request_id, {"ids": [], "reason": None})
            rec["ids"] += o.new_token_ids
            if o.finished:
                rec["reason"] = o.finish_reason.value
    return outs


def run_overlapped(eng: LLMEngine, actions: dict[int, list]) -> dict:
    """drive_overlapped's outputs alone."""
    return drive_overlapped(eng, actions)[0]
