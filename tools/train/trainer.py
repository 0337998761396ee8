"""`moemesh init-model --train`: a tiny model trained on CPU, so that its routers skew the
way trained routers do, and its greedy text is learned rather than random.

The model is transformers' own implementation, the reference the engine is exact
against, so the weights it learns mean the same thing when the engine loads them. Only
the MTP draft head is outside transformers; it is built from a transformers decoder
layer plus the parts the engine gives it (shared/model/deepseek.py MTPLayer): from
(embedding of token i+1, the target's final-normed hidden state at i) it predicts token
i+2, at position i. Target and draft train together, the draft's loss weighted as
DeepSeek-V3 weights it.

Routers balance as DeepSeek-V3's do, without an auxiliary loss: after each step every
MoE layer's correction bias moves by a fixed rate toward the experts that got fewer
tokens than the mean (`bias_rate`; 0 turns it off). What skew remains is the model's.

The checkpoint starts as `init_model` writes it (config, tokenizer learned on the corpus,
seeded weights) and is written back in the same layout with the trained tensors, the
MTP layer's included. DeepSeek-V4 trains its target the same way; its MTP head, whose
block transformers does not build, keeps its seeded weights (`moemesh_init.json` says
so under "trained").
"""

from __future__ import annotations

import json
import math
import sys
import time
from collections.abc import Callable
from contextlib import contextmanager
from dataclasses import asdict, dataclass
from pathlib import Path

import torch
from torch import nn

from moemesh.tools.train import corpus as corpus_mod
from moemesh.tools.train.config import TrainConfig


@dataclass
class TrainResult:
    out_dir: Path
    losses: list[float]  # train loss per step (target)
    mtp_losses: list[float]  # train loss per step (draft), empty without an MTP head
    held_out: list[tuple[int, float, float]]  # (step, target loss, draft loss or nan)
    seconds: float
    tokens: int  # of the corpus, train and held out
    mtp_trained: bool


def lr_at(step: int, cfg: TrainConfig) -> float:
    """Linear warm-up, then cosine decay to a tenth."""
    if step < cfg.warmup:
        return cfg.lr * (step + 1) / cfg.warmup
    t = (step - cfg.warmup) / max(1, cfg.steps - cfg.warmup)
    return cfg.lr * (0.1 + 0.9 * 0.5 * (1.0 + math.cos(math.pi * min(1.0, t))))


def balance_bias(bias: torch.Tensor, counts: torch.Tensor, rate: float) -> None:
    """DeepSeek-V3's auxiliary-loss-free balancing: experts above the mean load lose
    `rate` of bias, those below gain it. counts: [E] tokens per expert this step."""
    bias.add_(rate * torch.sign(counts.float().mean() - counts.float()))


@contextmanager
def quiet_load():
    """transformers' load report lists the MTP tensors it leaves to us, and a bar: neither
    is news here."""
    from transformers.utils import logging as hf_logging

    verbosity = hf_logging.get_verbosity()
    hf_logging.set_verbosity_error()
    hf_logging.disable_progress_bar()
    try:
        yield
    finally:
        hf_logging.set_verbosity(verbosity)
        hf_logging.enable_progress_bar()


class _Draft(nn.Module):
    """The MTP head's parts outside its decoder layer, named as the checkpoint names them
    under `model.layers.{N}.` (the embedding and head are the target's, shared)."""

    def __init__(self, hidden: int, eps: float):
        super().__init__()
        from transformers.models.deepseek_v3.modeling_deepseek_v3 import DeepseekV3RMSNorm

        self.enorm = DeepseekV3RMSNorm(hidden, eps)
        self.hnorm = DeepseekV3RMSNorm(hidden, eps)
        self.eh_proj = nn.Linear(2 * hidden, hidden, bias=False)
        self.shared_head_norm = DeepseekV3RMSNorm(hidden, eps)


class _V3Trainee(nn.Module):
    """Target (transformers' DeepseekV3ForCausalLM) and MTP draft, one loss."""

    def __init__(self, model_dir: Path, raw: dict):
        super().__init__()
        from transformers import AutoConfig, AutoModelForCausalLM

        self.num_layers = raw["num_hidden_layers"]
        self.has_mtp = raw.get("num_nextn_predict_layers", 0) > 0
        # The MTP layer is on disk as model.layers.{N}: one layer more, and transformers
        # loads (and converts) its decoder block as it does the others'.
        config = AutoConfig.from_pretrained(model_dir, attn_implementation="sdpa")
        if self.has_mtp:
            config.num_hidden_layers = self.num_layers + 1
        with quiet_load():
            self.hf = AutoModelForCausalLM.from_pretrained(model_dir, config=config, dtype=torch.float32)
        self.hf.config.num_hidden_layers = self.num_layers  # the target runs the first N
        self.draft = _Draft(raw["hidden_size"], raw["rms_norm_eps"]) if self.has_mtp else None
        if self.draft is not None:  # its own tensors, which transformers leaves unread
            on_disk = _read_all(model_dir)
            n = f"model.layers.{self.num_layers}."
            self.draft.load_state_dict({k: on_disk[n + k.replace("shared_head_norm", "shared_head.norm")]
                                        for k in self.draft.state_dict()})

    def named_tensors(self) -> dict[str, torch.Tensor]:
        """Every trained tensor under transformers' in-memory names, the MTP layer's as
        model.layers.{N}.*, with its copies of the shared embedding and head."""
        out = {k: v.detach() for k, v in self.hf.state_dict().items()}
        if self.draft is not None:
            n = f"model.layers.{self.num_layers}."
            d = self.draft
            out.update({n + "enorm.weight": d.enorm.weight.detach(), n + "hnorm.weight": d.hnorm.weight.detach(),
                        n + "eh_proj.weight": d.eh_proj.weight.detach(),
                        n + "shared_head.norm.weight": d.shared_head_norm.weight.detach(),
                        n + "embed_tokens.weight": out["model.embed_tokens.weight"],
                        n + "shared_head.head.weight": out["lm_head.weight"]})
        return out

    def routers(self) -> list[nn.Module]:
        return [layer.mlp.gate for layer in self.hf.model.layers if hasattr(layer.mlp, "gate")]

    def forward(self, ids: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor | None]:
        """ids [B, L] -> (target loss, draft loss or None), mean cross-entropy in nats."""
        ce = nn.functional.cross_entropy
        logits, mtp_logits = self.logits(ids)
        loss = ce(logits[:, :-1].flatten(0, 1), ids[:, 1:].flatten())
        if mtp_logits is None:
            return loss, None
        return loss, ce(mtp_logits[:, :-1].flatten(0, 1), ids[:, 2:].flatten())

    def logits(self, ids: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor | None]:
        """ids [B, L] -> (target logits [B, L, V], draft logits [B, L-1, V] or None): the
        draft's row i predicts token i+2."""
        hidden = self.hf.model(input_ids=ids).last_hidden_state  # final-normed, as the engine's
        logits = self.hf.lm_head(hidden)
        if self.draft is None:
            return logits, None
        d, m = self.draft, self.hf.model
        e = d.enorm(m.embed_tokens(ids[:, 1:]))  # token i+1 at position i
        x = d.eh_proj(torch.cat([e, d.hnorm(hidden[:, :-1])], dim=-1))
        pos = torch.arange(x.shape[1]).unsqueeze(0)
        x = m.layers[self.num_layers](x, position_ids=pos, position_embeddings=m.rotary_emb(x, pos))
        return logits, self.hf.lm_head(d.shared_head_norm(x))


class _V4Trainee(nn.Module):
    """Target only (transformers' DeepseekV4ForCausalLM); the MTP head is left as seeded."""

    has_mtp = False

    def __init__(self, model_dir: Path, raw: dict):
        super().__init__()
        from transformers import AutoModelForCausalLM

        with quiet_load():
            self.hf = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32)
        self.draft = None

    def named_tensors(self) -> dict[str, torch.Tensor]:
        return {k: v.detach() for k, v in self.hf.state_dict().items()}

    def routers(self) -> list[nn.Module]:
        return [layer.mlp.gate for layer in self.hf.model.layers
                if getattr(getattr(layer.mlp, "gate", None), "e_score_correction_bias", None) is not None]

    def forward(self, ids: torch.Tensor) -> tuple[torch.Tensor, None]:
        logits = self.hf(input_ids=ids).logits
        return nn.functional.cross_entropy(logits[:, :-1].flatten(0, 1), ids[:, 1:].flatten()), None


def _reinit(model: nn.Module, seed: int) -> None:
    """Training starts from small seeded weights (std 0.02), unit norms and zero biases;
    the writer's draws are sized for exactness tests, not for learning."""
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if name.endswith("norm.weight") or name.endswith("layernorm.weight"):
                p.fill_(1.0)
            elif p.dim() >= 2 and "_hc" not in name and "hc_head" not in name:
                p.copy_(torch.randn(p.shape, generator=g) * 0.02)
        for name, b in model.named_buffers():
            if name.endswith("e_score_correction_bias"):
                b.zero_()


class _Routes:
    """Tokens per expert per router in the current step, from the routers' own top-k."""

    def __init__(self, routers: list[nn.Module]):
        self.counts: dict[int, torch.Tensor] = {}
        self.routers = routers
        for i, r in enumerate(routers):
            r.register_forward_hook(self._hook(i))

    def _hook(self, i: int):
        def hook(module, args, out):
            ids = out[-1] if isinstance(out, tuple) else out
            if ids.dtype in (torch.int64, torch.int32):
                e = module.e_score_correction_bias.numel()
                self.counts[i] = torch.bincount(ids.detach().flatten(), minlength=e)
        return hook

    def rebalance(self, rate: float) -> None:
        if rate > 0:
            for i, counts in self.counts.items():
                balance_bias(self.routers[i].e_score_correction_bias, counts, rate)
        self.counts.clear()


class Progress:
    """One line on stderr: a bar, the step, its loss and the time left."""

    def __init__(self, total: int, stream=None):
        self.total, self.stream, self.t0 = total, stream or sys.stderr, time.perf_counter()
        self.tty = getattr(self.stream, "isatty", lambda: False)()
        self._last = -1

    def __call__(self, step: int, loss: float) -> None:
        done = step + 1
        pct = done * 100 // self.total
        if not self.tty and pct // 10 == self._last // 10 and done != self.total:
            return  # not a terminal: one line per tenth
        self._last = pct
        el = time.perf_counter() - self.t0
        eta = el / done * (self.total - done)
        bar = "#" * (pct // 4) + "." * (25 - pct // 4)
        line = f"train [{bar}] {done}/{self.total} loss {loss:.3f} {el:.0f}s elapsed, {eta:.0f}s left"
        self.stream.write(("\r" + line + ("\n" if done == self.total else "")) if self.tty else line + "\n")
        self.stream.flush()


def train(out_dir: str | Path, preset: str, cfg: TrainConfig, *, init_seed: int = 0,
          progress: Callable[[int, float], None] | None = None) -> TrainResult:
    """Writes a trained `preset` checkpoint into out_dir. Needs transformers."""
    from tokenizers import Tokenizer

    from moemesh.shared.checkpoint import writer, writer_transformers
    from moemesh.shared.checkpoint.presets import VOCAB_FROM_TOKENIZER

    if not writer_transformers.available():
        raise ValueError("--train needs transformers installed (pip install transformers)")
    if preset not in VOCAB_FROM_TOKENIZER or preset == "bench":
        raise ValueError(f"--train is for the tiny presets (tiny, tiny-v2, v4-tiny), not {preset!r}")
    t0 = time.perf_counter()
    torch.manual_seed(cfg.seed)
    text = corpus_mod.stdlib(int(cfg.corpus_mb * (1 << 20)))
    out = writer.init_model(out_dir, preset, seed=init_seed, layout="transformers", tokenizer_texts=text.texts)
    raw = json.loads((out / "config.json").read_text())
    tok = Tokenizer.from_file(str(out / "tokenizer.json"))
    ids = corpus_mod.encode(tok, text.texts, raw["eos_token_id"])
    train_ids, held_ids = corpus_mod.split(ids, cfg.held_out)

    model = (_V4Trainee if raw["model_type"] == "deepseek_v4" else _V3Trainee)(out, raw)
    _reinit(model, cfg.seed)
    model.train()
    routes = _Routes(model.routers())
    decay = [p for n, p in model.named_parameters() if p.dim() >= 2]
    rest = [p for n, p in model.named_parameters() if p.dim() < 2]
    opt = torch.optim.AdamW([{"params": decay, "weight_decay": cfg.weight_decay},
                             {"params": rest, "weight_decay": 0.0}], lr=cfg.lr, betas=(0.9, 0.95))
    gen = torch.Generator().manual_seed(cfg.seed)
    eval_gen = torch.Generator().manual_seed(cfg.seed + 1)
    held_batches = [corpus_mod.windows(held_ids, cfg.batch, cfg.seq_len, eval_gen) for _ in range(cfg.eval_batches)]
    losses, mtp_losses, held = [], [], []
    report = progress or Progress(cfg.steps)
    for step in range(cfg.steps):
        for group in opt.param_groups:
            group["lr"] = lr_at(step, cfg)
        loss, mtp = model(corpus_mod.windows(train_ids, cfg.batch, cfg.seq_len, gen))
        total = loss if mtp is None else loss + cfg.mtp_weight * mtp
        opt.zero_grad(set_to_none=True)
        total.backward()
        nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        opt.step()
        with torch.no_grad():
            routes.rebalance(cfg.bias_rate)
        losses.append(loss.item())
        if mtp is not None:
            mtp_losses.append(mtp.item())
        if (step + 1) % cfg.eval_every == 0 or step + 1 == cfg.steps:
            held.append((step + 1, *_evaluate(model, held_batches, routes)))
        report(step, losses[-1])
    model.eval()
    _save(out, raw, model.named_tensors())
    result = TrainResult(out, losses, mtp_losses, held, time.perf_counter() - t0, len(ids), model.draft is not None)
    info = json.loads((out / "moemesh_init.json").read_text())
    info["trained"] = {**asdict(cfg), "corpus": text.describe(), "corpus_tokens": len(ids),
                       "final_loss": _tail_mean(losses), "final_mtp_loss": _tail_mean(mtp_losses),
                       "held_out_loss": held[-1][1], "held_out_mtp_loss": held[-1][2],
                       "mtp": "trained" if result.mtp_trained else "seeded (not trained)",
                       "seconds": round(result.seconds, 1)}
    (out / "moemesh_init.json").write_text(json.dumps(info, indent=2) + "\n")
    (out / "train_loss.json").write_text(json.dumps({"loss": losses, "mtp_loss": mtp_losses, "held_out": held}) + "\n")
    from moemesh.tools.train.plot import loss_png

    loss_png(result, out / "train_loss.png", f"{preset}: {cfg.steps} steps of {cfg.batch}x{cfg.seq_len} tokens")
    return result


def _tail_mean(xs: list[float], n: int = 20) -> float | None:
    return round(sum(xs[-n:]) / len(xs[-n:]), 4) if xs else None


@torch.no_grad()
def _evaluate(model: nn.Module, batches: list[torch.Tensor], routes: _Routes) -> tuple[float, float]:
    model.eval()
    target, draft = 0.0, 0.0
    for b in batches:
        loss, mtp = model(b)
        target += loss.item()
        draft += mtp.item() if mtp is not None else math.nan
    routes.counts.clear()  # held-out text does not move the biases
    model.train()
    return target / len(batches), draft / len(batches)


def _save(out: Path, raw: dict, tensors: dict[str, torch.Tensor]) -> None:
    """The trained tensors over the seeded checkpoint, in its layout (transformers')."""
    from moemesh.shared.checkpoint import writer, writer_transformers

    seeded = _read_all(out)
    grouped = sorted(tensors.items(), key=lambda kv: writer_transformers.layer_group(kv[0]))
    saved = dict(writer_transformers.as_saved(raw, grouped))
    missing = [k for k in seeded if k not in saved]
    if any(not k.startswith("mtp.") for k in missing):  # only V4's MTP head is not trained
        raise RuntimeError(f"trained model lacks checkpoint tensors: {missing[:5]}")
    for k in missing:
        saved[k] = seeded[k]
    extra = [k for k in saved if k not in seeded]
    if extra:
        raise RuntimeError(f"trained model has tensors the checkpoint does not: {extra[:5]}")
    for p in out.glob("model*.safetensors*"):
        p.unlink()
    writer.write_shards(out, ((k, saved[k].to(seeded[k].dtype).clone()) for k in seeded), 2 << 30)


def _read_all(out: Path) -> dict[str, torch.Tensor]:
    from safetensors.torch import load_file

    tensors: dict[str, torch.Tensor] = {}
    for p in sorted(out.glob("model*.safetensors")):
        tensors.update(load_file(str(p)))
    return tensors
