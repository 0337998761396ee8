"""`moemesh plan`: DEP widths and pool sizes for each phase, from the step model (shared/plan).

All file reading happens here: the model's config.json, a recorded load window, this
host's benchmark results. The model itself is pure.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

from moemesh.tools.cli.bench_io import ints


def register(sub) -> None:
    p = sub.add_parser("plan", help="which DEP width serves prefill and decode best (a step-level model)")
    p.add_argument("--model", default="v4-flash",
                   help="model directory (its config.json) or an init-model preset name (default v4-flash)")
    p.add_argument("--hardware", default="gb300-nvl72",
                   help="h200, b200, gb200-nvl72, gb300-nvl72, this-host (needs --forward), or "
                        "mock:STEP_MS[:EXPERT_SHARE]: DEP ranks of the mock engine (default share 0.5)")
    p.add_argument("--gpus", type=int, default=72, help="GPUs to split into prefill and decode pools")
    p.add_argument("--workload", default="agentic", help="chat, agentic or fixed:ISL:OSL")
    p.add_argument("--skew", default="zipf:0.69",
                   help="target routing skew: uniform, zipf:A, hot:N:SHARE, or file:PATH (a loads file or "
                        "a `bench eplb` result)")
    p.add_argument("--draft-skew", default="hot:4:0.42", help="the MTP draft head's skew (ratios only); '' for none")
    p.add_argument("--host", default="after-9",
                   help="host time per step: after-9, before-9, lockstep, mtp, lockstep-mtp, none, or a "
                        "`bench decode` result file")
    p.add_argument("--host-overhead-ms", type=float, default=None,
                   help="host time per step in ms, not overlapped (overrides --host)")
    p.add_argument("--forward", default="", help="`bench forward` result of --model (for --hardware this-host), or "
                                                 "a `bench plan-check` result: its collectives and fitted figures too")
    p.add_argument("--widths", type=ints, default=(), help="DEP widths (default: powers of two up to --gpus)")
    p.add_argument("--target-tps-user", type=float, default=20.0, help="P90 decode tokens/s per user")
    p.add_argument("--decode-batch", type=int, default=0, help="sequences per decode rank (default: the most "
                                                               "that meet the target)")
    p.add_argument("--prefill-tokens", type=int, default=16384, help="most new tokens a prefill rank takes per step")
    p.add_argument("--prefill-requests", type=int, default=0,
                   help="requests a prefill rank has at hand per step (default 0: its queue never empties)")
    p.add_argument("--redundant", type=int, default=1, help="EPLB redundant slots per rank")
    p.add_argument("--without", default="", help="terms to switch off: attention,experts,a2a,host,barrier,skew,eplb")
    p.add_argument("--steps", type=int, default=32, help="sampled steps per point")
    p.add_argument("--scenario", choices=["seed"], default=None, help="reproduce the seed's findings")
    p.add_argument("--seed", type=int, default=0, help="seed of the skew windows and the sampled steps")
    p.add_argument("--out", default="bench-results/plan.json", help="where the JSON result goes")
    p.add_argument("--plot", default="", help="PNG of tokens/s per GPU against width (default: --out with .png)")
    p.set_defaults(func=run)


def run(args: argparse.Namespace) -> int:
    from moemesh.tools.cli.bench_io import save

    try:
        if args.scenario == "seed":
            result, text = _seed(args)
        else:
            result, text = _plan(args)
    except (ValueError, OSError, KeyError) as e:
        print(f"moemesh: error: {e}", file=sys.stderr)
        return 2
    print(text)
    save(result, args.out)
    if args.scenario is None:
        from moemesh.tools.cli import plan_plot

        png = args.plot or str(Path(args.out).with_suffix(".png"))
        if plan_plot.write(result, png):
            print(f"saved {png}", file=sys.stderr)
    return 0


def _plan(args: argparse.Namespace) -> tuple[dict, str]:
    from moemesh.shared.plan import report
    from moemesh.shared.plan.calibrate import from_plan_check, host_from_decode, this_host
    from moemesh.shared.plan.costs import Roofline
    from moemesh.shared.plan.hardware import get_hardware
    from moemesh.shared.plan.host import HostModel, get_host
    from moemesh.shared.plan.step import Terms
    from moemesh.shared.plan.sweep import Inputs, PlanConfig, plan
    from moemesh.shared.plan.workload import get_workload
    from moemesh.tools.bench.env import environment

    dims, model_cfg = load_dims(args.model)
    if args.hardware == "this-host":
        if not args.forward:
            raise ValueError("--hardware this-host needs --forward: a `moemesh bench plan-check` result of this model "
                             "(forward, collectives and the figures fitted in the mesh) or a `bench forward` one")
        cal = _json(args.forward)
        if not isinstance(cal, dict):
            raise ValueError(f"{args.forward}: not a `bench forward` or `bench plan-check` result")
        hw = None
        costs = from_plan_check(cal, dims) if cal.get("bench") == "plan-check" else this_host(cal, dims)
    elif args.hardware.startswith("mock:"):
        hw, costs = None, _mock_costs(args.hardware, dims)
    else:
        hw = get_hardware(args.hardware)
        costs = Roofline(dims, hw)
    if args.host_overhead_ms is not None:
        host = HostModel(f"{args.host_overhead_ms:g} ms", fixed_s=args.host_overhead_ms / 1e3)
    elif Path(args.host).is_file():
        host = host_from_decode(_json(args.host), name=args.host)
    else:
        host = get_host(args.host)
    target = read_skew(args.skew, dims, "target", args.seed)
    draft = read_skew(args.draft_skew, dims, "draft", args.seed, num_layers=1) if args.draft_skew else None
    cfg = PlanConfig(gpus=args.gpus, widths=args.widths, decode_batch=args.decode_batch,
                     prefill_tokens=args.prefill_tokens, prefill_requests=args.prefill_requests,
                     target_tps_user=args.target_tps_user,
                     num_redundant=args.redundant, num_steps=args.steps, terms=Terms.without(args.without),
                     seed=args.seed)
    p = plan(cfg, Inputs(dims, costs, hw, get_workload(args.workload), host, target, draft))
    title = (f"{dims.name} on {args.gpus} x {args.hardware}, workload {args.workload}, skew {args.skew}, "
             f"host {host.name}" + (f", without {args.without}" if args.without else ""))
    result = {"bench": "plan", "config": {k: v for k, v in vars(args).items() if k != "func"}, "env": environment(),
              "model": model_cfg, **report.to_dict(p)}
    return result, report.text(p, title)


def _mock_costs(spec: str, dims):
    from moemesh.shared.plan.costs import MockDEPStep

    parts = spec.split(":")[1:]
    try:
        step_ms, share = float(parts[0]), float(parts[1]) if len(parts) > 1 else 0.5
    except (IndexError, ValueError):
        raise ValueError(f"--hardware {spec!r}: use mock:STEP_MS or mock:STEP_MS:EXPERT_SHARE") from None
    if step_ms <= 0 or not 0 <= share <= 1 or len(parts) > 2:
        raise ValueError(f"--hardware {spec!r}: the step must be > 0 ms and the share in [0, 1]")
    return MockDEPStep(step_ms / 1e3, share, dims.num_moe_layers)


def _seed(args: argparse.Namespace) -> tuple[dict, str]:
    from moemesh.shared.plan import report
    from moemesh.shared.plan.scenario import run_seed, with_overrides
    from moemesh.tools.bench.env import environment

    r = run_seed(with_overrides(seed=args.seed))
    lines = ["seed scenario; assumptions:"] + [f"  - {a}" for a in r["assumptions"]] + [""]
    lines.append("prefill, agentic mix")
    lines.append(report.phase_table(list(r["prefill"].values())))
    for host, rows in r["decode"].items():
        lines += ["", f"decode, host {host}", report.phase_table(list(rows.values()))]
    lines += ["", f"{'finding':<34} {'value':>7}  band        holds"]
    for name, c in r["checks"].items():
        lines.append(f"{name:<34} {c['value']:>7.3f}  {str(c['band']):<11} {'yes' if c['holds'] else 'NO'}")
    result = {"bench": "plan-seed", "config": r["config"], "env": environment(), "assumptions": r["assumptions"],
              "checks": r["checks"], "all_hold": r["all_hold"],
              "prefill": {str(w): report.row_dict(x) for w, x in r["prefill"].items()},
              "decode": {h: {str(w): report.row_dict(x) for w, x in rows.items()} for h, rows in r["decode"].items()}}
    return result, "\n".join(lines)


def load_dims(model: str):
    """(ModelDims, the config dict) of a model directory or an init-model preset name."""
    from moemesh.shared.checkpoint.presets import PRESETS, preset_config
    from moemesh.shared.plan.dims import from_config

    if model in PRESETS:
        raw = preset_config(model)
    else:
        raw = _json(str(Path(model) / "config.json"))
    return from_config(raw, name=Path(model).name or model), raw


def read_skew(spec: str, dims, which: str, seed: int, num_layers: int | None = None):
    """A synthetic skew, or `file:PATH`: a loads file ({"loads": [[...]]}, or {"loads":
    {"target": ..., "draft": ...}}) or a `bench eplb` result (its naive window's `which` rows)."""
    import torch

    from moemesh.shared.plan import skew as skews

    layers = num_layers or dims.num_moe_layers
    if not spec.startswith("file:"):
        return skews.parse(spec, layers, dims.num_experts, dims.top_k, seed=seed)
    path = spec[5:]
    obj = _json(path)
    rows = None
    if isinstance(obj, dict) and "phases" in obj:  # a `bench eplb` result
        rows = obj["phases"][0].get("loads", {}).get(which)
    elif isinstance(obj, dict) and "loads" in obj:
        rows = obj["loads"].get(which) if isinstance(obj["loads"], dict) else obj["loads"]
    elif isinstance(obj, list):
        rows = obj
    if not rows:
        raise ValueError(f"{path}: no recorded {which} loads")
    loads = torch.tensor(rows, dtype=torch.float64)
    if loads.dim() != 2 or loads.shape[1] != dims.num_experts:
        raise ValueError(f"{path}: {which} loads must be [layers][{dims.num_experts} experts]")
    return skews.from_loads(loads, layers, spec=spec)


def _json(path: str):
    try:
        return json.loads(Path(path).read_text())
    except json.JSONDecodeError as e:
        raise ValueError(f"{path}: not valid JSON ({e})") from None
