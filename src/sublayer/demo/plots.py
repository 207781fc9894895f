"""The demo's figures: loss curves and cross-attention heatmaps."""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path

from ..checkpoints.io import atomic_write
from ..models.transformer import Transformer
from ..plot import attention
from .task import EOS, Vocab, detokenize, collate


def _save_figure(fig, path: Path) -> None:
    atomic_write(path, lambda p: fig.savefig(p, format="png", dpi=110, bbox_inches="tight"))


def smooth(values: Sequence[float], window: int | None = None) -> list[float]:
    """Centred moving average (no lag, unlike an EMA on a short run); the window shrinks symmetrically at the
    ends, so a linear trend is kept exactly. Default window: about a tenth of the run, odd, 1 to 51."""
    n = len(values)
    half = (window if window is not None else max(1, min(51, n // 10))) // 2
    out = []
    for i in range(n):
        h = min(half, i, n - 1 - i)
        out.append(sum(values[i - h : i + h + 1]) / (2 * h + 1))
    return out


def loss_figure(history: dict, title: str = "sublayer demo: numbers words ↔ digits"):
    """The figure of :func:`plot_losses` (a matplotlib Figure)."""
    from matplotlib.figure import Figure
    from matplotlib.ticker import FuncFormatter, NullFormatter

    fig = Figure(figsize=(6.4, 4.0))
    ax = fig.add_subplot()
    if history["train"]:
        steps, losses = zip(*history["train"])
        ax.plot(steps, losses, color="tab:blue", alpha=0.25, lw=0.8)
        ax.plot(steps, smooth(losses), color="tab:blue", label="train (smoothed)")
    if history["val"]:
        vs, vl = zip(*history["val"])
        ax.plot(vs, vl, "o-", color="tab:orange", ms=3, label="validation (held-out)")
    ax.set_yscale("log")
    # plain numbers ("4", "0.3"), not "4×10⁰"; the 2..9 ticks get labels only when less than a decade is shown
    plain = FuncFormatter(lambda v, _: f"{v:g}")
    lo, hi = ax.get_ylim()
    ax.yaxis.set_major_formatter(plain)
    ax.yaxis.set_minor_formatter(plain if hi / lo < 10 else NullFormatter())
    ax.set_xlabel("step")
    ax.set_ylabel("cross-entropy per token")
    ax.set_title(title)
    ax.grid(True, which="both", alpha=0.3)
    ax.legend()
    return fig


def plot_losses(history: dict, path: str | Path, **kw) -> None:
    """Training loss (raw and smoothed) and validation loss against steps, log scale; ``kw``: :func:`loss_figure`'s."""
    _save_figure(loss_figure(history, **kw), Path(path))


def plot_cross_attention(model: Transformer, vocab: Vocab, pair: tuple[list[str], list[str]], path: str | Path) -> None:
    """Cross-attention heatmaps of one pair, d2l style: a grid of layers × heads, keys (source tokens) on x,
    queries (the target token each position predicts) on y, one shared colour bar."""
    b = collate([pair], vocab)
    weights = model.cross_attention_weights(b.src, b.tgt_in, src_key_padding_mask=b.src_mask)
    fig = attention([w[0] for w in weights], pair[0], [*pair[1], EOS], xlabel="Key positions (source)",
                    ylabel="Query positions (output)",
                    title=f"cross-attention: {detokenize(pair[0][1:])} → {detokenize(pair[1])}")  # fmt: skip
    _save_figure(fig, Path(path))
