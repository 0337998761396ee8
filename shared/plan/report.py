"""A plan as text tables and as a JSON-ready dict (no I/O: the CLI writes them)."""

from __future__ import annotations

from dataclasses import asdict

from moemesh.shared.plan.step import TERMS, StepResult
from moemesh.shared.plan.sweep import Plan


def row_dict(r: StepResult) -> dict:
    d = asdict(r)
    d.update(tokens_per_s_per_gpu=r.tokens_per_s_per_gpu, tps_per_user_p90=r.tps_per_user_p90)
    return d


def to_dict(p: Plan) -> dict:
    return {"prefill": [row_dict(r) for r in p.prefill], "decode": [row_dict(r) for r in p.decode],
            "draft_ratios": {str(w): {"before": b, "after": a} for w, (b, a) in p.draft_ratios.items()},
            "recommended": {"prefill_width": p.prefill_width, "decode_width": p.decode_width,
                            "pools": asdict(p.pools) if p.pools else None}}


def phase_table(rows: list[StepResult], draft: dict[int, tuple[float, float]] | None = None) -> str:
    if not rows:
        return "(no width fits)"
    decode = rows[0].phase == "decode"
    head = (f"{'DEP':>4} {'batch':>6} {'tok/s/GPU':>10} {'step ms':>8} "
            + " ".join(f"{t[:7]:>7}" for t in TERMS)
            + f" {'wait ms':>8} {'ratio':>11}" + (f" {'draft':>11}" if draft else "")
            + (f" {'tok/s/user':>10}" if decode else f" {'TTFT ms':>8}"))
    lines = [head]
    for r in rows:
        terms = " ".join(f"{v * 1e3:>7.2f}" for v in r.terms_s().values())
        ratio = f"{r.ratio_before:.2f}->{r.ratio_after:.2f}"
        line = (f"{r.width:>4} {r.batch:>6} {r.tokens_per_s_per_gpu:>10.0f} {r.step_s * 1e3:>8.2f} {terms} "
                f"{r.rank_wait_s * 1e3:>8.2f} {ratio:>11}")
        if draft:
            b, a = draft.get(r.width, (1.0, 1.0))
            line += f" {f'{b:.2f}->{a:.2f}':>11}"
        if decode:
            line += f" {r.tps_per_user_p90:>10.1f}" + ("" if r.extra.get("meets_target", True) else "  (misses target)")
        else:
            line += f" {r.ttft_s * 1e3:>8.0f}"
        lines.append(line)
    return "\n".join(lines)


def text(p: Plan, title: str = "") -> str:
    out = [title] if title else []
    out += ["prefill (terms in ms per step; ratio = balance before -> after EPLB)", phase_table(p.prefill), "",
            "decode (batch = sequences per rank)", phase_table(p.decode, p.draft_ratios), ""]
    out.append(f"most tokens/s per GPU: prefill DEP{p.prefill_width}, decode "
               + (f"DEP{p.decode_width}" if p.decode_width else "none meets the target"))
    if p.pools:
        q = p.pools
        out.append(f"recommended pools: prefill DEP{q.prefill_width} x {q.prefill_instances} ({q.prefill_gpus} GPUs), "
                   f"decode DEP{q.decode_width} x {q.decode_instances} ({q.decode_gpus} GPUs): "
                   f"{q.requests_per_s:.1f} requests/s (prefill pool {q.prefill_requests_per_s:.1f}, "
                   f"decode pool {q.decode_requests_per_s:.1f})")
    else:
        out.append("recommended pools: none (no prefill and decode instance fit in the GPUs together)")
    return "\n".join(out)
