"""Per-request settings, validated once when the request arrives: how its tokens are
sampled, and its priority class, which travels with them to every worker that serves it."""

from __future__ import annotations

from dataclasses import dataclass, field


# Integers travel as MessagePack int64 and token ids as int32 (messages.py): a value beyond
# them would fail far from the request that sent it, so it is refused here.
INT64 = (-(1 << 63), (1 << 63) - 1)
INT32_MAX = (1 << 31) - 1


class SamplingParamError(ValueError):
    """A bad sampling parameter; `param` names it the way the OpenAI API spells it."""

    def __init__(self, param: str, message: str):
        super().__init__(f"{param}: {message}")
        self.param = param


# A request's class (vLLM's `priority`): lower is served earlier, 0 is the default class.
# Bounded so that a value from a client stays a small integer wherever it travels; a
# thousand classes either side is more than any deployment names.
PRIORITY_MIN, PRIORITY_MAX = -1000, 1000

GRAMMAR_KINDS = ("json_object", "json_schema", "lark")
MAX_GRAMMAR_CHARS = 1 << 20


@dataclass(frozen=True)
class GrammarSpec:
    """A constraint on what a request may generate, in a form no library owns: a JSON
    Schema (json_schema; json_object is any JSON object), or a Lark grammar (lark) such as
    the gateway writes for forced tool calls. Workers compile it (shared/grammar/)."""
    kind: str
    text: str = ""  # the schema as JSON text, or the grammar

    def __post_init__(self):
        if self.kind not in GRAMMAR_KINDS:
            raise SamplingParamError("response_format", f"grammar kind must be one of {GRAMMAR_KINDS}")
        if not isinstance(self.text, str) or len(self.text) > MAX_GRAMMAR_CHARS:
            raise SamplingParamError("response_format", f"a grammar is a string of at most {MAX_GRAMMAR_CHARS} "
                                                        f"characters")


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
    # The prompt's own tokens scored (vLLM's prompt_logprobs), in the forward that computes
    # their KV: None = off; n >= 0 = each prompt token's logprob plus n alternatives.
    prompt_logprobs: int | None = None
    min_tokens: int = 0
    grammar: GrammarSpec | None = None  # structured output: sampled tokens must keep to it
    # Its class: admission, the prefill queue and preemption go by (priority, arrival).
    priority: int = 0
    extra: dict = field(default_factory=dict, compare=False)

    def __post_init__(self):
        def need(cond: bool, param: str, msg: str) -> None:
            if not cond:
                raise SamplingParamError(param, msg)

        need(_is_int(self.max_tokens) and 1 <= self.max_tokens <= INT32_MAX, "max_tokens",
             f"must be an integer in [1, {INT32_MAX}]")
        need(_is_num(self.temperature) and 0 <= self.temperature <= 100, "temperature", "must be in [0, 100]")
        need(_is_num(self.top_p) and 0 < self.top_p <= 1, "top_p", "must be in (0, 1]")
        need(_is_int(self.top_k) and 0 <= self.top_k <= INT32_MAX, "top_k",
             f"must be an integer in [0, {INT32_MAX}] (0 disables it)")
        need(self.seed is None or (_is_int(self.seed) and INT64[0] <= self.seed <= INT64[1]), "seed",
             f"must be an integer in [{INT64[0]}, {INT64[1]}]")
        need(all(_is_int(t) and 0 <= t <= INT32_MAX for t in self.stop_token_ids), "stop_token_ids",
             f"must be token ids in [0, {INT32_MAX}]")
        need(len(self.stop_token_ids) <= 1024, "stop_token_ids", "at most 1024 stop token ids")
        need(all(isinstance(s, str) and s for s in self.stop), "stop", "must be non-empty strings")
        need(len(self.stop) <= 16, "stop", "at most 16 stop strings")
        need(self.logprobs is None or (_is_int(self.logprobs) and 0 <= self.logprobs <= 20), "logprobs",
             "must be an integer in [0, 20]")
        need(self.prompt_logprobs is None or (_is_int(self.prompt_logprobs) and 0 <= self.prompt_logprobs <= 20),
             "prompt_logprobs", "must be an integer in [0, 20]")
        need(_is_int(self.min_tokens) and 0 <= self.min_tokens <= self.max_tokens, "min_tokens",
             "must be in [0, max_tokens]")
        need(_is_int(self.priority) and PRIORITY_MIN <= self.priority <= PRIORITY_MAX, "priority",
             f"must be an integer in [{PRIORITY_MIN}, {PRIORITY_MAX}] (lower is served earlier)")

    @property
    def greedy(self) -> bool:
        return self.temperature == 0 or self.top_k == 1


def _is_int(v) -> bool:
    return isinstance(v, int) and not isinstance(v, bool)


def _is_num(v) -> bool:
    return isinstance(v, (int, float)) and not isinstance(v, bool) and v == v
