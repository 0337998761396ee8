"""Offline generation: the engine in the `both` role plus the tokenizer."""

from __future__ import annotations

import itertools
from dataclasses import dataclass, field

from moemesh.shared.engine.config import EngineConfig
from moemesh.shared.engine.engine import LLMEngine
from moemesh.shared.protocol.messages import PromptLogprobs, SamplingParams
from moemesh.shared.engine.sequence import FinishReason
from moemesh.shared.tokenizer.tokenizer import IncrementalDetokenizer, Tokenizer


@dataclass
class Completion:
    request_id: str
    prompt_token_ids: list[int]
    token_ids: list[int] = field(default_factory=list)
    text: str = ""
    finish_reason: str | None = None
    logprobs: list = field(default_factory=list)
    prompt_logprobs: PromptLogprobs | None = None  # when its params asked (engine/prompt_scores.py)


class LLM:
    def __init__(self, cfg: EngineConfig, engine: LLMEngine | None = None):
        self.engine = engine or LLMEngine(cfg)
        self.tokenizer = Tokenizer(cfg.model)
        self._ids = itertools.count()

    def generate(self, prompts: list[str] | list[list[int]], params: SamplingParams | list[SamplingParams]) -> list[Completion]:
        plist = params if isinstance(params, list) else [params] * len(prompts)
        done: dict[str, Completion] = {}
        detoks: dict[str, IncrementalDetokenizer] = {}
        order = []
        for prompt, p in zip(prompts, plist):
            ids = self.tokenizer.encode(prompt) if isinstance(prompt, str) else list(prompt)
            rid = f"offline-{next(self._ids)}"
            self.engine.add_request(rid, ids, p)
            done[rid] = Completion(rid, ids)
            detoks[rid] = IncrementalDetokenizer(self.tokenizer, p.stop)
            order.append(rid)
        while self.engine.has_unfinished():
            for out in self.engine.step():
                c, d = done[out.request_id], detoks[out.request_id]
                c.token_ids += out.new_token_ids
                if out.logprobs:
                    c.logprobs += out.logprobs
                if out.prompt_logprobs is not None:
                    c.prompt_logprobs = out.prompt_logprobs
                c.text += d.add(out.new_token_ids)
                if d.stopped and not out.finished:
                    self.engine.abort(out.request_id)
                    c.finish_reason = FinishReason.STOP.value
                elif out.finished:
                    c.text += d.flush()
                    c.finish_reason = out.finish_reason.value
        return [done[r] for r in order]
