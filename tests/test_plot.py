"""sublayer.plot.attention: the heatmap grid (layers × heads), labels, saving, and its errors."""

from __future__ import annotations

import pytest
import torch

pytest.importorskip("matplotlib")

from sublayer import plot  # noqa: E402


def test_grid_of_layers_and_heads_with_token_labels(tmp_path):
    w = torch.rand(2, 3, 4, 5).softmax(-1)  # 2 layers, 3 heads, 4 queries, 5 keys
    src, tgt = list("abcde"), ["x", "y", "z", "<eos>"]
    fig = plot.attention(w, src, tgt, title="demo", path=tmp_path / "a.png")
    axes = fig.get_axes()
    assert len(axes) == 2 * 3 + 1  # panels + colour bar
    ax, bottom_left = axes[0], axes[3]  # shared axes: tick labels on the outer panels
    assert [t.get_text() for t in bottom_left.get_xticklabels()] == src
    assert [t.get_text() for t in bottom_left.get_yticklabels()] == tgt
    assert ax.get_title() == "layer 1, head 1" and axes[5].get_title() == "layer 2, head 3"
    img = ax.get_images()[0].get_array()
    torch.testing.assert_close(torch.as_tensor(img.data), w[0, 0])
    assert (tmp_path / "a.png").stat().st_size > 1000


def test_list_of_layers_2d_map_and_self_attention_labels():
    layers = [torch.rand(2, 3, 3), torch.rand(2, 3, 3)]
    fig = plot.attention(layers, ["a", "b", "c"])  # self-attention: queries labelled like the keys
    assert len(fig.get_axes()) == 2 * 2 + 1
    assert [t.get_text() for t in fig.get_axes()[2].get_yticklabels()] == ["a", "b", "c"]
    fig = plot.attention(torch.rand(3, 3))
    assert len(fig.get_axes()) == 2 and fig.get_axes()[0].get_title() == "head 1"


def test_errors_name_the_problem():
    with pytest.raises(ValueError, match=r"select one example.*got shape \(1, 2, 3, 4, 5\)"):
        plot.attention(torch.rand(1, 2, 3, 4, 5))
    with pytest.raises(ValueError, match=r"src_tokens must give one label per key \(5\), got 2"):
        plot.attention(torch.rand(4, 5), ["a", "b"])
    with pytest.raises(ValueError, match=r"tgt_tokens must give one label per query \(4\)"):
        plot.attention(torch.rand(4, 5), list("abcde"), "wxyz")
    with pytest.raises(TypeError, match="weights must be a Tensor"):
        plot.attention([[0.5, 0.5]])
    with pytest.raises(ValueError, match="share one shape"):
        plot.attention([torch.rand(2, 3, 3), torch.rand(2, 3, 4)])


def test_d2l_show_heatmaps_keeps_the_books_call():
    from sublayer import d2l

    w = torch.rand(2, 4, 5, 5)  # (num_blks, num_heads, queries, keys), as the chapter's enc_attention_weights
    fig = d2l.show_heatmaps(
        w, xlabel="Key positions", ylabel="Query positions", titles=["Head %d" % i for i in range(1, 5)], figsize=(7, 3.5)
    )
    axes = fig.get_axes()
    assert len(axes) == 2 * 4 + 1 and axes[5].get_title() == "Head 2" and axes[4].get_xlabel() == "Key positions"
    assert tuple(fig.get_size_inches()) == (7.0, 3.5)
