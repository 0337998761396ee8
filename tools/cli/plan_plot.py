"""The PNG of `moemesh plan`: tokens/s per GPU against DEP width, one panel per phase."""

from __future__ import annotations


def write(result: dict, path: str) -> bool:
    """Writes the plot; False (and nothing written) when matplotlib is not installed."""
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return False
    fig, axes = plt.subplots(1, 2, figsize=(10, 4))
    for ax, phase in zip(axes, ("prefill", "decode")):
        rows = result.get(phase, [])
        widths = [r["width"] for r in rows]
        ax.plot(widths, [r["tokens_per_s_per_gpu"] for r in rows], marker="o", label="step model")
        rec = result.get("recommended", {})
        best = rec.get(f"{phase}_width")
        if best in widths:
            ax.axvline(best, color="grey", linestyle=":", label=f"most per GPU: DEP{best}")
        pool = (rec.get("pools") or {}).get(f"{phase}_width")
        if pool in widths and pool != best:
            ax.axvline(pool, color="tab:orange", linestyle="--", label=f"pools: DEP{pool}")
        ax.set_xscale("log", base=2)
        ax.set_xticks(widths, [str(w) for w in widths])
        ax.set_xlabel("DEP width (ranks)")
        ax.set_ylabel("tokens/s per GPU")
        ax.set_title(phase)
        ax.legend()
    fig.suptitle(f"moemesh plan: {result.get('config', {}).get('model', '')} on "
                 f"{result.get('config', {}).get('hardware', '')}")
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    plt.close(fig)
    return True
