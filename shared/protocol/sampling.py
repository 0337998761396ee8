"""Per-request sampling settings, validated once when the request arrives."""

from __future__ import annotations

from dataclasses import dataclass, field


class SamplingParamError(ValueError):
    """A bad sampling parameter; `param` names it the way the OpenAI API spells it."""

    def __init__(self, param: str, message: str):
        super().__init__(f"{param}: {message}")
        self.param = param


@dataclass(frozen=True)
class SamplingParams:
    max_tokens: int = 16
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = 0  # 0 = off
    seed: int | None = None
    stop_token_ids: tuple[int, ...] = ()
    stop: tuple[str, ...] = ()
    ignore_eos: bool = False
    logprobs: int | None = None  # None = off; n >= 0 = chosen token plus n alternatives
    min_tokens: int = 0
    extra: dict = field(default_factory=dict, compare=False)

    def __post_init__(self):
        def need(cond: bool, param: str, msg: str) -> None:
            if not cond:
                raise SamplingParamError(param, msg)

        need(_is_int(self.max_tokens) and self.max_tokens >= 1, "max_tokens", "must be an integer >= 1")
        need(_is_num(self.temperature) and 0 <= self.temperature <= 100, "temperature", "must be in [0, 100]")
        need(_is_num(self.top_p) and 0 < self.top_p <= 1, "top_p", "must be in (0, 1]")
        need(_is_int(self.top_k) and self.top_k >= 0, "top_k", "must be an integer >= 0 (0 disables it)")
        need(self.seed is None or _is_int(self.seed), "seed", "must be an integer")
        need(all(_is_int(t) and t >= 0 for t in self.stop_token_ids), "stop_token_ids", "must be token ids >= 0")
        need(all(isinstance(s, str) and s for s in self.stop), "stop", "must be non-empty strings")
        need(len(self.stop) <= 16, "stop", "at most 16 stop strings")
        need(self.logprobs is None or (_is_int(self.logprobs) and 0 <= self.logprobs <= 20), "logprobs",
             "must be an integer in [0, 20]")
        need(_is_int(self.min_tokens) and 0 <= self.min_tokens <= self.max_tokens, "min_tokens",
             "must be in [0, max_tokens]")

    @property
    def greedy(self) -> bool:
        return self.temperature == 0 or self.top_k == 1


def _is_int(v) -> bool:
    return isinstance(v, int) and not isinstance(v, bool)


def _is_num(v) -> bool:
    return isinstance(v, (int, float)) and not isinstance(v, bool) and v == v
