"""Writing a `bench serve` result: result.json, summary.md and PNG plots in one directory."""

from __future__ import annotations

import json
import math
from pathlib import Path

from moemesh.tools.bench import request_phases


def write_all(result: dict, out_dir: str | Path) -> list[Path]:
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    paths = [out / "result.json", out / "summary.md"]
    paths[0].write_text(json.dumps(_finite(result), indent=2, allow_nan=False) + "\n")
    paths += plot_latency_cdfs(result, out / "latency_cdf.png")
    if len(result["points"]) > 1:
        paths += plot_sweep(result, out / "throughput.png")
    paths[1].write_text(markdown(result, [p.name for p in paths[2:]]))
    return paths


def _finite(x):
    """JSON has no inf/NaN: a rate of inf is written as the string "inf", NaN as null."""
    if isinstance(x, float) and not math.isfinite(x):
        return None if math.isnan(x) else ("inf" if x > 0 else "-inf")
    if isinstance(x, dict):
        return {k: _finite(v) for k, v in x.items()}
    if isinstance(x, (list, tuple)):
        return [_finite(v) for v in x]
    return x


def _f(x, spec: str = ".1f") -> str:
    return "-" if x is None else format(x, spec)


def _point_name(p: dict) -> str:
    return f"{p['mode']}={p['value']:g}"


def table(result: dict) -> str:
    """One row per point; the headline is tok/s/user p90."""
    head = ("| point | ok/total | req/s | out tok/s | TTFT p50/p90/p99 ms | TPOT p50/p90/p99 ms "
            "| ITL p50/p99 ms | E2E p50/p99 ms | tok/s/user p10/p50/p90 | goodput req/s (share) |")
    lines = [head, "|" + "---|" * (head.count("|") - 1)]
    for p in result["points"]:
        s = p["summary"]
        t, o, i, e, u, g = (s["ttft_ms"], s["tpot_ms"], s["itl_ms"], s["e2e_ms"], s["tps_per_user"], s["goodput"])
        good = "-" if g is None else f"{_f(g['requests_per_s'], '.2f')} ({_f(g['share'], '.0%')})"
        lines.append(
            f"| {_point_name(p)} | {s['num_ok']}/{s['num_requests']} | {_f(s['requests_per_s'], '.2f')} "
            f"| {_f(s['output_tokens_per_s'])} | {_f(t['p50'])}/{_f(t['p90'])}/{_f(t['p99'])} "
            f"| {_f(o['p50'], '.2f')}/{_f(o['p90'], '.2f')}/{_f(o['p99'], '.2f')} "
            f"| {_f(i['p50'], '.2f')}/{_f(i['p99'], '.2f')} | {_f(e['p50'])}/{_f(e['p99'])} "
            f"| {_f(u['p10'])}/{_f(u['p50'])}/**{_f(u['p90'])}** | {good} |")
    return "\n".join(lines)


def priority_lines(result: dict) -> list[str]:
    """Per point and class (a priority mix), best class first: requests, how many were
    served and refused for capacity (429), and their TTFT, ITL and E2E."""
    rows = [(p, c, b) for p in result["points"] for c, b in p["summary"].get("by_priority", {}).items()]
    if not rows:
        return []
    lines = ["| point | priority | ok/total | 429 | TTFT p50/p90/p99 ms | ITL p50/p99 ms | E2E p50/p99 ms |",
             "|---|---|---|---|---|---|---|"]
    for p, c, b in rows:
        t, i, e = b["ttft_ms"], b["itl_ms"], b["e2e_ms"]
        lines.append(f"| {_point_name(p)} | {c} | {b['num_ok']}/{b['num_requests']} | {b['num_429']} "
                     f"| {_f(t['p50'])}/{_f(t['p90'])}/{_f(t['p99'])} | {_f(i['p50'], '.2f')}/{_f(i['p99'], '.2f')} "
                     f"| {_f(e['p50'])}/{_f(e['p99'])} |")
    return lines


def trace_lines(p: dict) -> list[str]:
    """A replayed trace's point: its scale, the hit rate it implies beside the server's, and
    TTFT/ITL by the trace's context-length band."""
    t = p.get("trace")
    if not t:
        return []
    a = t["achieved"]
    pct = lambda x: "-" if x is None else f"{x:.1%}"  # noqa: E731
    lines = [f"trace {'+'.join(t['formats'])}: {t['requests']} requests over {t['span_s']:.0f} s at time scale "
             f"{t['time_scale']:g}; lengths / {t['scale']} ({t['block_size']}-token blocks sent as "
             f"{t['block_tokens']} tokens; the longest context {t['longest_context']} before scaling)",
             f"prefix hit rate: trace implies {pct(t['implied_hit_rate'])}, server achieved {pct(a['hit_rate'])} "
             f"({a['cached_tokens']} of {a['prompt_tokens']} prompt tokens cached, "
             f"{a['requests_reporting_cached']} requests reporting)",
             "", "| context (trace) | requests | TTFT p50/p90/p99 ms | ITL p50/p99 ms |", "|---|---|---|---|"]
    for name, b in t["by_band"].items():
        f, i = b["ttft_ms"], b["itl_ms"]
        lines.append(f"| {name} | {b['count']} | {_f(f['p50'])}/{_f(f['p90'])}/{_f(f['p99'])} "
                     f"| {_f(i['p50'], '.2f')}/{_f(i['p99'], '.2f')} |")
    return lines


def markdown(result: dict, images: list[str]) -> str:
    c = result["config"]
    w = c["workload"]
    labels = ", ".join(f"{k}={v}" for k, v in c["labels"].items()) or "none"
    lines = [
        "# bench serve", "",
        f"- server: {c['url']} ({c['endpoint']}), model `{c['model']}`",
        (f"- workload: trace {', '.join(w['trace_paths'])}" if w["kind"] == "trace" else
         f"- workload: {w['kind']}, ISL {w['isl']}, OSL {w['osl']}"
         + (f", {w['num_sessions']} sessions x {w['turns']} turns, tool output {w['tool_len']}"
            if w["kind"] == "agentic" else f", {w['num_requests']} requests"))
        + (f", {w['num_prefix_groups']} prefix groups of {w['prefix_len']} tokens" if w["kind"] == "prefix" else ""),
        (f"- arrival: the trace's times, sped up {c['values'][0]:g}x" if c["mode"] == "trace" else
         f"- arrival: {c['mode']} sweep {', '.join(f'{v:g}' for v in c['values'])}")
        + (f", max concurrency {c['max_concurrency']}" if c["max_concurrency"] else ""),
        f"- seed {c['seed']}, warm-up {result['warmup']['num_requests']} requests "
        f"({result['warmup']['num_errors']} errors), ignore_eos {c['ignore_eos']}, "
        f"token lengths by {'tokenizer ' + c['tokenizer'] if c['tokenizer'] else 'words-per-token estimate'}",
        f"- labels: {labels}",
        f"- SLO: TTFT {_f(c['slo_ttft_ms'], 'g')} ms, TPOT {_f(c['slo_tpot_ms'], 'g')} ms", "",
        table(result), "",
        "tok/s/user is output tokens / end-to-end latency of each request; **p90** is the headline.", "",
    ]
    if prio := priority_lines(result):
        lines += [f"By priority class (lower is served earlier; {w.get('priority_mix', 0):.0%} of requests sent at "
                  f"{w.get('high_priority')}, the rest at the default 0):", "", *prio, ""]
    for p in result["points"]:
        s = p["summary"]
        extra = []
        if "per_worker_output_tokens_per_s" in s:
            extra.append("per-worker out tok/s: " + ", ".join(
                f"{k} {_f(v)}" for k, v in s["per_worker_output_tokens_per_s"].items()))
        if "ttft_ms_by_turn" in s:
            b = s["ttft_ms_by_turn"]
            extra.append(f"TTFT p50 turn 1: {_f(b['1']['p50'])} ms, turns >= 2: {_f(b['2+']['p50'])} ms")
        ph = p.get("server_phases")
        if ph:
            extra.append("server phases: " + (ph["error"] if "error" in ph else request_phases.line(ph)))
        if s["errors"]["count"]:
            kinds = ", ".join(f"{k}: {n}" for k, n in s["errors"]["by_status"].items())
            extra.append(f"errors ({kinds}): " + "; ".join(
                f"{m['count']}x {m['message']}" for m in s["errors"]["messages"][:3]))
        if extra:
            lines += [f"**{_point_name(p)}**", ""] + [f"- {x}" for x in extra] + [""]
        if p.get("trace"):
            lines += trace_lines(p) + [""]
    lines += [f"![{name}]({name})" for name in images]
    return "\n".join(lines) + "\n"


def _plt():
    import matplotlib

    matplotlib.use("Agg")  # files only; never needs a display
    import matplotlib.pyplot as plt

    return plt


def plot_latency_cdfs(result: dict, path: Path) -> list[Path]:
    plt = _plt()
    fig, axes = plt.subplots(1, 3, figsize=(15, 4))
    for ax, key, title in zip(axes, ("ttft_ms", "tpot_ms", "e2e_ms"), ("TTFT", "TPOT", "end-to-end")):
        for p in result["points"]:
            xs = sorted(r[key] for r in p["requests"] if r[key] is not None and r["error"] is None)
            if xs:
                ax.plot(xs, [(k + 1) / len(xs) for k in range(len(xs))], drawstyle="steps-post",
                        label=_point_name(p))
        ax.set(title=f"{title} CDF", xlabel="ms", ylabel="fraction of requests", ylim=(0, 1.01))
        ax.grid(alpha=0.3)
        if ax.has_data():
            ax.legend(fontsize="small")
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    plt.close(fig)
    return [path]


def plot_sweep(result: dict, path: Path) -> list[Path]:
    plt = _plt()
    pts = result["points"]
    mode = pts[0]["mode"]
    values = [p["value"] for p in pts]
    # A rate of inf has no place on a numeric axis, so such a sweep is plotted by position.
    categorical = not all(math.isfinite(v) for v in values)
    xs = list(range(len(values))) if categorical else values
    total = [p["summary"]["output_tokens_per_s"] for p in pts]
    fig, axes = plt.subplots(1, 3, figsize=(15, 4))
    axes[0].plot(xs, total, marker="o")
    axes[0].set(title="total output tokens/s", xlabel=mode, ylabel="tok/s")
    for q in ("p10", "p50", "p90"):
        axes[1].plot(xs, [p["summary"]["tps_per_user"][q] for p in pts], marker="o", label=q)
    axes[1].set(title="output tokens/s per user", xlabel=mode, ylabel="tok/s/user")
    axes[1].legend(fontsize="small")
    user = [p["summary"]["tps_per_user"]["p90"] for p in pts]
    axes[2].plot(user, total, marker="o")
    for x, y, v in zip(user, total, values):
        if x is not None and y is not None:
            axes[2].annotate(f"{v:g}", (x, y), fontsize="small")
    axes[2].set(title="throughput vs interactivity", xlabel="tok/s/user p90", ylabel="total tok/s")
    for ax in axes[:2]:
        if categorical:
            ax.set_xticks(xs, [f"{v:g}" for v in values])
        elif min(xs) > 0 and max(xs) / min(xs) >= 8:
            ax.set_xscale("log", base=2)
    for ax in axes:
        ax.grid(alpha=0.3)
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    plt.close(fig)
    return [path]
