"""``sublayer.plot``: figures for learners (matplotlib, imported only when a figure is drawn; it comes with the
``cli`` extra: ``pip install "sublayer[cli]"``)."""

from __future__ import annotations

import os
from collections.abc import Sequence

import torch
from torch import Tensor

__all__ = ["attention"]


def _as_grid(weights: Tensor | Sequence[Tensor]) -> Tensor:
    if not isinstance(weights, Tensor):
        if not isinstance(weights, Sequence) or not weights or not all(isinstance(w, Tensor) for w in weights):
            raise TypeError(
                "weights must be a Tensor or a non-empty sequence of Tensors (one per layer), "
                f"got {type(weights).__name__}"
            )
        shapes = {tuple(w.shape) for w in weights}
        if len(shapes) != 1:
            raise ValueError(f"the per-layer weights must share one shape, got {sorted(shapes)}")
        weights = torch.stack(list(weights))
    if weights.dim() not in (2, 3, 4):
        raise ValueError(
            "weights must be (T_q, T_k), (n_heads, T_q, T_k) or (n_layers, n_heads, T_q, T_k) — select one "
            f"example of a batch first (e.g. w[0]), got shape {tuple(weights.shape)}"
        )
    while weights.dim() < 4:
        weights = weights.unsqueeze(0)
    return weights.detach().float().cpu()


def _labels(name: str, tokens: Sequence[str] | None, n: int, axis: str) -> list[str] | None:
    if tokens is None:
        return None
    if isinstance(tokens, str) or len(tokens) != n:
        raise ValueError(
            f"{name} must give one label per {axis} ({n}), got "
            + (f"the string {tokens!r}" if isinstance(tokens, str) else f"{len(tokens)}")
        )
    return [str(t) for t in tokens]


def attention(
    weights: Tensor | Sequence[Tensor],
    src_tokens: Sequence[str] | None = None,
    tgt_tokens: Sequence[str] | None = None,
    *,
    xlabel: str = "Key positions",
    ylabel: str = "Query positions",
    title: str | None = None,
    cmap: str = "Reds",
    path: str | os.PathLike | None = None,
):
    """Attention heatmaps, one panel per (layer, head) — d2l's ``show_heatmaps`` in spirit: keys on x, queries
    on y, one shared colour bar from 0 to 1.

    Args:
        weights: (T_q, T_k), (n_heads, T_q, T_k), (n_layers, n_heads, T_q, T_k), or a sequence of per-layer
            (n_heads, T_q, T_k) tensors (e.g. ``[w[0] for w in maps["..."]]`` from
            :func:`sublayer.record_attention`, or ``Transformer.cross_attention_weights``, example 0).
        src_tokens: labels of the keys (T_k of them); None -> positions.
        tgt_tokens: labels of the queries (T_q); None -> ``src_tokens`` when T_q == T_k (self-attention),
            else positions.
        xlabel, ylabel, title, cmap: figure text and colour map.
        path: also save the figure there (PNG, by extension).

    Returns:
        A ``matplotlib.figure.Figure`` (no pyplot state: works headless; Jupyter shows it inline).

    Raises:
        ImportError: matplotlib is not installed (naming the extra to install).
        TypeError/ValueError: weights of another kind or rank; a label list of the wrong length.
    """
    try:
        from matplotlib.figure import Figure
    except ImportError:  # pragma: no cover - depends on the environment
        raise ImportError('sublayer.plot needs matplotlib: pip install "sublayer[cli]" (or matplotlib)') from None
    grid = _as_grid(weights)
    n_layers, n_heads, t_q, t_k = grid.shape
    keys = _labels("src_tokens", src_tokens, t_k, "key")
    if tgt_tokens is None and keys is not None and t_q == t_k:
        tgt_tokens = keys
    queries = _labels("tgt_tokens", tgt_tokens, t_q, "query")
    cell = 2.4 / max(t_k, 1)  # square cells, panels sized from the token counts, room for labels
    fig = Figure(figsize=(2.6 * n_heads + 1, n_layers * (cell * t_q + 0.3) + 1.3), layout="constrained")
    axes = fig.subplots(n_layers, n_heads, squeeze=False, sharex=True, sharey=True)
    im = None
    for i in range(n_layers):
        for j in range(n_heads):
            ax = axes[i][j]
            im = ax.imshow(grid[i, j].numpy(), cmap=cmap, vmin=0.0, vmax=1.0)
            if keys is not None:
                ax.set_xticks(range(t_k), keys, rotation=90, fontsize=7)
            if queries is not None:
                ax.set_yticks(range(t_q), queries, fontsize=7)
            ax.set_title(f"layer {i + 1}, head {j + 1}" if n_layers > 1 else f"head {j + 1}", fontsize=8)
            if i == n_layers - 1:
                ax.set_xlabel(xlabel, fontsize=8)
            if j == 0:
                ax.set_ylabel(ylabel, fontsize=8)
    fig.colorbar(im, ax=axes, shrink=0.6)
    if title is not None:
        fig.suptitle(title, fontsize=9)
    if path is not None:
        fig.savefig(os.fspath(path), dpi=110, bbox_inches="tight")
    return fig
