"""Request mixes for the planner: how many new tokens a request prefills, over how much
cached context, and how many tokens it generates.

Length spellings follow `bench serve` (tools/bench/serve/workload.py): `N` / `fixed:N`,
`uniform:LO-HI`, `lognormal:MEDIAN,SIGMA`, each clipped to [1, cap].

Named mixes (the lengths are assumptions, stated in docs/plan.md):
- chat: one turn, ISL lognormal(1500, 0.8), OSL lognormal(400, 0.7), nothing cached.
- agentic: sessions of `turns` turns over a context that grows to lognormal(32k, 0.8)
  (capped at 128k); the first turn prefills its whole context, each later one only its
  tool output, uniform 256-4096 tokens, over the cached rest; OSL lognormal(300, 0.7).
  The growing-context shape is `bench kv-reuse`'s (8k context + 512 tool tokens per
  turn, docs/benchmarks.md), stretched to the long contexts agents reach.
- fixed:ISL:OSL: every request the same, nothing cached (the benchmarks here).
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np


@dataclass(frozen=True)
class Length:
    kind: str
    a: float
    b: float = 0.0
    cap: int = 1 << 20

    @classmethod
    def parse(cls, spec: str, cap: int = 1 << 20) -> "Length":
        kind, _, arg = spec.partition(":") if ":" in spec else ("fixed", "", spec)
        try:
            if kind == "fixed":
                return cls("fixed", float(arg), cap=cap)
            if kind == "uniform":
                lo, hi = arg.split("-")
                return cls("uniform", float(lo), float(hi), cap=cap)
            if kind == "lognormal":
                med, sig = arg.split(",")
                return cls("lognormal", float(med), float(sig), cap=cap)
        except ValueError:
            pass
        raise ValueError(f"bad length {spec!r}: use N, uniform:LO-HI or lognormal:MEDIAN,SIGMA")

    def sample(self, rng: np.random.Generator, n: int) -> np.ndarray:
        if self.kind == "fixed":
            x = np.full(n, self.a)
        elif self.kind == "uniform":
            x = rng.uniform(self.a, self.b, n)
        else:
            x = self.a * np.exp(self.b * rng.standard_normal(n))
        return np.clip(np.rint(x), 1, self.cap)


@dataclass(frozen=True)
class Workload:
    """A request mix. Args: name; context: total prompt length (cached + new); osl; turns:
    turns per session (1: every request prefills its whole prompt); tool: new tokens of a
    later turn."""

    name: str
    context: Length
    osl: Length
    turns: int = 1
    tool: Length = Length("fixed", 0)

    def sample(self, rng: np.random.Generator, n: int) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
        """(new tokens, cached prefix, output tokens), each [n]."""
        ctx = self.context.sample(rng, n)
        osl = self.osl.sample(rng, n)
        if self.turns <= 1:
            return ctx, np.zeros(n), osl
        first = rng.random(n) < 1.0 / self.turns
        new = np.where(first, ctx, np.minimum(self.tool.sample(rng, n), ctx))
        return new, ctx - new, osl

    def means(self, rng: np.random.Generator | None = None, n: int = 4096) -> tuple[float, float]:
        """(mean new tokens, mean output tokens) per request."""
        new, _, osl = self.sample(rng or np.random.default_rng(0), n)
        return float(new.mean()), float(osl.mean())


WORKLOADS = {
    "chat": Workload("chat", Length("lognormal", 1500, 0.8, cap=32768), Length("lognormal", 400, 0.7, cap=8192)),
    "agentic": Workload("agentic", Length("lognormal", 32768, 0.8, cap=131072), Length("lognormal", 300, 0.7, cap=4096),
                        turns=8, tool=Length("uniform", 256, 4096)),
}


def get_workload(spec: str) -> Workload:
    """A named mix, or fixed:ISL:OSL."""
    if spec in WORKLOADS:
        return WORKLOADS[spec]
    kind, _, rest = spec.partition(":")
    if kind == "fixed":
        try:
            isl, osl = (int(x) for x in rest.split(":"))
        except ValueError:
            raise ValueError(f"workload {spec!r}: use fixed:ISL:OSL") from None
        return Workload(spec, Length("fixed", isl), Length("fixed", osl))
    raise ValueError(f"unknown workload {spec!r}; choose from {', '.join(WORKLOADS)} or fixed:ISL:OSL")
