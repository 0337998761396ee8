"""`moemesh profile` output: text tables and one PNG (matplotlib, Agg)."""

from __future__ import annotations

from pathlib import Path

from moemesh.tools.profile.breakdown import PHASES, STEP_PHASES
from moemesh.tools.profile.overhead import PARTS

LABELS = {"queue": "queue", "prefill": "prefill", "kv_transfer": "KV transfer", "decode": "decode",
          "streaming": "streaming", "other": "other (dispatch, hand-off)", "forward": "forward",
          "host": "host", "rank_wait": "rank wait", "forward_drift": "forward drift",
          "rest": "rest (outside the step)"}
COLUMNS = {"host": "host", "rank_wait": "rank wait", "forward_drift": "fwd drift", "rest": "rest"}
COLORS = {"queue": "#9e9e9e", "prefill": "#1f77b4", "kv_transfer": "#ff7f0e", "decode": "#2ca02c",
          "streaming": "#9467bd", "other": "#d3d3d3", "forward": "#2ca02c", "host": "#d62728",
          "rank_wait": "#ff7f0e", "forward_drift": "#8c564b", "rest": "#7f7f7f"}


def _f(x, spec: str = ".2f", width: int = 9) -> str:
    return f"{'-':>{width}}" if x is None else f"{x:>{width}{spec}}"


def _row(label: str, st: dict, share=None) -> str:
    return (f"{label:<28}{st['n']:>6}" + "".join(_f(st[k]) for k in ("p50", "p90", "p99", "mean"))
            + (_f(share, ".1%", 8) if share is not None else f"{'':>8}"))


HEADER = f"{'':<28}{'n':>6}{'p50 ms':>9}{'p90 ms':>9}{'p99 ms':>9}{'mean ms':>9}{'share':>8}"


def requests_table(s: dict) -> str:
    inc = "; ".join(f"{why}: {n}" for why, n in sorted(s["incomplete"].items()))
    lines = [f"per request: {s['num_complete']} complete of {s['num_requests']}"
             + (f" ({s['num_decode_only']} decode-only)" if s["num_decode_only"] else "")
             + (f"; incomplete: {inc}" if inc else ""), HEADER]
    lines += [_row(LABELS[k], s["phases"][k], s["phases"][k]["share"]) for k in PHASES]
    lines.append(_row("end-to-end", s["e2e_ms"]))
    lines.append(_row("TTFT (streamed requests)", s["ttft_ms"]))
    return "\n".join(lines)


def steps_table(s: dict) -> str:
    workers = ", ".join(s["workers"]) or "-"
    lines = [f"per decode step: {s['num_steps']} steps from {s['num_events']} step events (workers: {workers})",
             HEADER]
    lines += [_row(LABELS[k], s["phases"][k], s["phases"][k]["share"]) for k in STEP_PHASES]
    lines.append(_row("step", s["step_ms"]))
    b = s["batch_num_seqs"]
    lines.append(f"{'batch (seqs)':<28}{b['n']:>6}" + "".join(_f(b[k], ".1f") for k in ("p50", "p90", "p99", "mean")))
    return "\n".join(lines)


def overhead_table(o: dict) -> str:
    lines = ["serving overhead = 1 - end-to-end tok/s / forward-only tok/s (points of end-to-end time; "
             "host includes the loop gap)"]
    for run in o["runs"]:
        lines.append(f"[{run['label']}{' ' + run['skew'] if run['skew'] else ''}]")
        lines.append(f"{'batch':>6}{'e2e tok/s':>11}{'fwd tok/s':>11}{'overhead':>10}"
                     + "".join(f"{COLUMNS[k]:>11}" for k in PARTS) + f"{'loop gap':>10}")
        for p in run["points"]:
            parts = p["parts"] or {}
            lines.append(f"{p['batch']:>6}{p['e2e_tokens_per_s']:>11.0f}{p['forward_only_tokens_per_s']:>11.0f}"
                         f"{p['serving_overhead']:>10.1%}" + "".join(_f(parts.get(k), ".1%", 11) for k in PARTS)
                         + _f(p["loop_gap"], ".1%", 10))
        h = run["headline"]
        if h is None:
            lines.append(f"no points between batch {o['min_batch']} and {o['max_batch']}")
            continue
        lines.append(f"headline: serving overhead {h['mean']:.1%} (mean over batch {min(h['batches'])}.."
                     f"{max(h['batches'])}; {h['min']:.1%} at {h['min_batch']}, {h['max']:.1%} at {h['max_batch']})")
        if h["parts"] is not None:
            p = h["parts"]
            gap = f" (loop gap {h['loop_gap'] * 100:.1f})" if h["loop_gap"] is not None else ""
            over = "" if h["parts_over_batches"] == h["batches"] else \
                f" [over batch {', '.join(map(str, h['parts_over_batches']))}, the points with step figures]"
            lines.append(f"made of: host {p['host'] * 100:.1f} pts{gap}, rank wait {p['rank_wait'] * 100:.1f}, "
                         f"forward drift {p['forward_drift'] * 100:.1f}, rest {p['rest'] * 100:.1f} "
                         f"(serving-path losses outside the engine step: request turnover, TTFT, part-full steps)"
                         + over)
        else:
            lines.append("made of: unknown (the decode result has no decode_steps)")
    lines += [f"note: {n}" for n in o["notes"]]
    return "\n".join(lines)


def _plt():
    import matplotlib

    matplotlib.use("Agg")  # files only; never needs a display
    import matplotlib.pyplot as plt

    return plt


def _bars(ax, means: dict[str, float], title: str, unit: str) -> None:
    """One bar per phase on a log axis: decode runs for seconds while a KV transfer takes
    milliseconds, and in a stacked bar the small phases vanish. Each bar is labelled with
    its value and its share of the sum."""
    shown = [(k, v) for k, v in means.items() if v and v > 0]
    total = sum(v for _, v in shown)
    ys = list(range(len(shown)))[::-1]  # the first phase on top
    for y, (k, v) in zip(ys, shown):
        ax.barh([y], [v], color=COLORS[k])
        ax.annotate(f" {v:.3g} {unit} ({100 * v / total:.1f}%)", (v, y), va="center", fontsize="small")
    ax.set(title=title, xlabel=f"{unit}, log scale")
    ax.set_yticks(ys, [LABELS[k] for k, _ in shown])
    if shown:
        ax.set_xscale("log")
        lo, hi = min(v for _, v in shown), max(v for _, v in shown)
        ax.set_xlim(lo / 3, hi * 30)  # room for the labels right of the longest bar
    ax.grid(axis="x", alpha=0.3)


def plot(path: Path, requests: dict | None, steps: dict | None, overhead: dict | None) -> Path | None:
    """Writes the chart: mean request phases, mean step phases, overhead vs batch (those given)."""
    panels = [x for x in (("req", requests), ("step", steps), ("ovh", overhead)) if x[1] is not None]
    if not panels:
        return None
    plt = _plt()
    fig, axes = plt.subplots(1, len(panels), figsize=(6.5 * len(panels), 4.5), squeeze=False)
    for ax, (kind, data) in zip(axes[0], panels):
        if kind == "req":
            means = {k: data["phases"][k]["mean_of_all"] or 0.0 for k in PHASES}
            _bars(ax, means, f"mean per request ({data['num_complete']} complete)", "ms")
        elif kind == "step":
            means = {k: data["phases"][k]["mean"] or 0.0 for k in STEP_PHASES}
            _bars(ax, means, f"mean per decode step ({data['num_steps']} steps)", "ms")
        else:
            _plot_overhead(ax, data)
    fig.tight_layout()
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=100)
    plt.close(fig)
    return path


def _plot_overhead(ax, o: dict) -> None:
    for run in o["runs"]:
        pts = run["points"]
        if not pts:
            continue
        xs = [p["batch"] for p in pts]
        name = run["label"] + (f" {run['skew']}" if run["skew"] else "")
        line = ax.plot(xs, [p["serving_overhead"] for p in pts], marker="o", label=f"{name}: overhead")[0]
        split_pts = [p for p in pts if p["parts"] is not None]
        for k, style in (("host", "--"), ("rank_wait", ":"), ("rest", "-.")):
            if split_pts:
                ax.plot([p["batch"] for p in split_pts], [p["parts"][k] for p in split_pts], style,
                        color=line.get_color(), alpha=0.7, label=f"{name}: {LABELS[k]}")
    ax.set(title="serving overhead vs batch", xlabel="batch", ylabel="fraction of end-to-end time")
    if ax.has_data():
        ax.set_xscale("log", base=2)
        batches = sorted({p["batch"] for run in o["runs"] for p in run["points"]})
        ax.set_xticks(batches, [str(b) for b in batches])
        ax.minorticks_off()
        ax.axhline(0, color="black", linewidth=0.5)
        ax.legend(fontsize="x-small")
    ax.grid(alpha=0.3)
