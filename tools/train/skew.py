"""The expert-load skew a checkpoint's own routers produce, target and MTP draft apart.

The engine prefills windows of text through the model (the draft head runs over every
prompt position, as it does in serving) with a hook on every MoE layer counting routed
tokens per expert. Per layer it reports the balance ratio (mean over max rank load) of
the naive placement, E/R experts per rank in order, and of the balancer's placement
(`build_placement`, with `redundant` extra slots per rank) built on the first half of
the windows and scored on the second, held out, as the live balancer would see it.

    python -m moemesh.tools.train.skew MODEL_DIR [--ranks 4] [--redundant 1]
"""

from __future__ import annotations

import argparse
import json
from dataclasses import dataclass
from pathlib import Path

import torch


@dataclass
class SkewReport:
    layers: list[int]  # MoE layer ids; the MTP layer's is num_hidden_layers
    draft_layer: int | None
    naive: list[float]  # per layer, held-out windows
    balanced: list[float]  # per layer, held-out windows, placement from the first half
    ranks: int
    redundant: int
    tokens: int

    def table(self) -> str:
        rows = ["| layer | role | naive ratio | after EPLB (held out) |", "|---|---|---|---|"]
        for i, layer in enumerate(self.layers):
            role = "MTP draft" if layer == self.draft_layer else "target"
            rows.append(f"| {layer} | {role} | {self.naive[i]:.3f} | {self.balanced[i]:.3f} |")
        return "\n".join(rows)


def balance(loads_fit: torch.Tensor, loads_eval: torch.Tensor, ranks: int, redundant: int) -> tuple[list, list]:
    """Per-layer ratios on loads_eval [L, E]: naive placement, and ours built on loads_fit."""
    from moemesh.shared.eplb import build_placement, naive_placement

    L, E = loads_eval.shape
    naive = naive_placement(L, E, ranks, 0).layer_ratios(loads_eval)
    placed = build_placement(loads_fit, ranks, redundant).layer_ratios(loads_eval)
    return [float(x) for x in naive], [float(x) for x in placed]


def synthetic(kind: str, num_layers: int, num_experts: int, top_k: int, tokens: int, ranks: int,
              redundant: int) -> tuple[list, list]:
    """The same two ratios for a calibrated synthetic workload (shared/eplb/workloads.py) of
    the model's shape: placement on one window, scored on the next."""
    from moemesh.shared.eplb.workloads import Workload

    w = Workload(kind=kind, num_layers=num_layers, num_experts=num_experts, tokens_per_window=tokens,
                 top_k=top_k).windows(2).float()
    return balance(w[0], w[1], ranks, redundant)


def measure(model_dir: str, texts: list[str] | None = None, *, windows: int = 32, window_len: int = 256,
            ranks: int = 4, redundant: int = 1) -> SkewReport:
    """texts: what to route; by default the held-out tail of the corpus the model trained on."""
    from tokenizers import Tokenizer

    from moemesh.shared.checkpoint.loader import load_model
    from moemesh.shared.engine.config import EngineConfig
    from moemesh.shared.engine.engine import LLMEngine
    from moemesh.shared.protocol.messages import SamplingParams
    from moemesh.tools.train import corpus as corpus_mod

    tok = Tokenizer.from_file(str(Path(model_dir) / "tokenizer.json"))
    raw = json.loads((Path(model_dir) / "config.json").read_text())
    if texts is None:
        info = json.loads((Path(model_dir) / "moemesh_init.json").read_text()).get("trained", {})
        text = corpus_mod.stdlib(int(info.get("corpus_mb", 4.0) * (1 << 20)))
        ids = corpus_mod.split(corpus_mod.encode(tok, text.texts, raw["eos_token_id"]), info.get("held_out", 0.02))[1]
    else:
        ids = corpus_mod.encode(tok, texts, raw["eos_token_id"])
    gen = torch.Generator().manual_seed(0)
    prompts = corpus_mod.windows(ids, windows, window_len, gen).tolist()
    model = load_model(model_dir)
    layers = model.moe_layers()
    order = sorted(layers)
    E = raw["n_routed_experts"]
    counts = {lid: [torch.zeros(E, dtype=torch.long), torch.zeros(E, dtype=torch.long)] for lid in order}
    part = 0  # 0: the windows the placement is built on, 1: those it is scored on

    def hook(layer_id: int, ids_: torch.Tensor) -> None:
        counts[layer_id][part] += torch.bincount(ids_.flatten().cpu(), minlength=E)

    for m in layers.values():
        m.on_route = hook
    eng = LLMEngine(EngineConfig(model=model_dir, num_kv_blocks=max(64, 2 * window_len // 16 + 8),
                                 enable_prefix_caching=False), model=model)
    # two tokens: a request that ends at its prefill has no draft pass over its prompt
    for i, p in enumerate(prompts):
        part = 0 if i < len(prompts) // 2 else 1
        eng.add_request(f"w{i}", p, SamplingParams(max_tokens=2, temperature=0, ignore_eos=True))
        while eng.has_unfinished():
            eng.step()
    for m in layers.values():
        m.on_route = None
    fit = torch.stack([counts[lid][0] for lid in order]).float()
    held = torch.stack([counts[lid][1] for lid in order]).float()
    naive, placed = balance(fit, held, ranks, redundant)
    nl = raw["num_hidden_layers"]
    return SkewReport(order, nl if nl in layers else None, naive, placed, ranks, redundant,
                      windows * window_len)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("model_dir")
    ap.add_argument("--ranks", type=int, default=4)
    ap.add_argument("--redundant", type=int, default=1)
    ap.add_argument("--windows", type=int, default=32)
    ap.add_argument("--window-len", type=int, default=256)
    args = ap.parse_args(argv)
    r = measure(args.model_dir, windows=args.windows, window_len=args.window_len, ranks=args.ranks,
                redundant=args.redundant)
    print(f"{r.tokens} tokens, {r.ranks} ranks, {r.redundant} redundant slot(s) per rank")
    print(r.table())
    raw = json.loads((Path(args.model_dir) / "config.json").read_text())
    for kind in ("zipf", "hot"):
        naive, placed = synthetic(kind, len(r.layers), raw["n_routed_experts"], raw["num_experts_per_tok"],
                                  r.tokens // 2, r.ranks, r.redundant)
        print(f"synthetic {kind} at this shape: naive {min(naive):.3f}-{max(naive):.3f}, "
              f"after EPLB {min(placed):.3f}-{max(placed):.3f}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
