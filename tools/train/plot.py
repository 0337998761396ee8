"""The loss curve of a training run, as a PNG (matplotlib, no display needed)."""

from __future__ import annotations

from pathlib import Path


def _smooth(xs: list[float], k: int) -> list[float]:
    out, acc = [], 0.0
    for i, x in enumerate(xs):
        acc += x
        if i >= k:
            acc -= xs[i - k]
        out.append(acc / min(i + 1, k))
    return out


def loss_png(result, path: Path, title: str) -> Path:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    k = max(1, len(result.losses) // 50)
    fig, ax = plt.subplots(figsize=(7, 4), dpi=110)
    steps = range(1, len(result.losses) + 1)
    ax.plot(steps, _smooth(result.losses, k), label=f"target, train (mean of {k})", color="tab:blue")
    if result.mtp_losses:
        ax.plot(steps, _smooth(result.mtp_losses, k), label=f"MTP draft, train (mean of {k})", color="tab:orange")
    if result.held_out:
        at = [s for s, _, _ in result.held_out]
        ax.plot(at, [t for _, t, _ in result.held_out], "o--", color="tab:blue", label="target, held out", ms=3)
        if result.mtp_losses:
            ax.plot(at, [d for _, _, d in result.held_out], "o--", color="tab:orange", label="MTP draft, held out",
                    ms=3)
    ax.set_xlabel("step")
    ax.set_ylabel("cross-entropy (nats/token)")
    ax.set_title(title, fontsize=10)
    ax.grid(alpha=0.3)
    ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path)
    plt.close(fig)
    return path
