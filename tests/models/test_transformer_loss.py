"""``Transformer.loss``: equal to ``F.cross_entropy`` on the forward's logits (value and every parameter's
gradient), with padding, label smoothing, sum reduction; edge cases and argument errors."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from torch.testing import assert_close

from sublayer.models import Transformer

SRC_V, TGT_V, PAD = 11, 13, 0


def tiny(seed: int = 0, **kw) -> Transformer:
    torch.manual_seed(seed)
    args = {"d_model": 14, "n_heads": 2, "d_ff": 22, "n_layers": 2, "dropout": 0.0, "max_len": 23, **kw}
    return Transformer(SRC_V, TGT_V, **args).eval()


def batch(b: int = 3, s: int = 5, t: int = 7, seed: int = 1):
    g = torch.Generator().manual_seed(seed)
    src = torch.randint(3, SRC_V, (b, s), generator=g)
    tgt_in = torch.randint(3, TGT_V, (b, t), generator=g)
    tgt_out = torch.randint(3, TGT_V, (b, t), generator=g)
    src_mask = torch.zeros(b, s, dtype=torch.bool)
    src_mask[0, 3:] = True
    tgt_mask = torch.zeros(b, t, dtype=torch.bool)
    tgt_mask[1, 4:] = True
    tgt_mask[2, 1:] = True
    return src, tgt_in, tgt_out, src_mask, tgt_mask


def _reference(m, src, tgt_in, tgt_out, src_mask, tgt_mask, **kw):
    logits = m(src, tgt_in, src_key_padding_mask=src_mask, tgt_key_padding_mask=tgt_mask)
    targets = tgt_out if tgt_mask is None else tgt_out.masked_fill(tgt_mask, kw.get("ignore_index", -100))
    return F.cross_entropy(logits.flatten(0, 1), targets.flatten(), **kw)


@pytest.mark.parametrize(
    "norm_first, kw, masks",
    [(False, {}, True), (True, {}, True), (False, {}, False), (True, {"label_smoothing": 0.1}, True),
     (False, {"reduction": "sum", "label_smoothing": 0.2}, True)],
)  # fmt: skip
def test_loss_and_gradients_equal_forward_plus_cross_entropy(norm_first, kw, masks):
    m = tiny(norm_first=norm_first)
    src, tgt_in, tgt_out, src_mask, tgt_mask = batch()
    if not masks:
        src_mask = tgt_mask = None
    got = m.loss(src, tgt_in, tgt_out, src_key_padding_mask=src_mask, tgt_key_padding_mask=tgt_mask, **kw)
    params = list(m.parameters())
    g_got = torch.autograd.grad(got, params)
    want = _reference(m, src, tgt_in, tgt_out, src_mask, tgt_mask, **kw)
    g_want = torch.autograd.grad(want, params)
    assert_close(got, want)
    for (name, _), a, b in zip(m.named_parameters(), g_got, g_want):
        assert_close(a, b, msg=lambda msg, name=name: f"{name}: {msg}")


def test_a_hook_on_the_output_projection_sees_the_loss_and_shapes_it():
    """The head's forward hooks run in loss as in forward (a hook that changes the logits changes both)."""
    m = tiny()
    src, tgt_in, tgt_out, src_mask, tgt_mask = batch()
    calls = []
    m.out_proj.register_forward_hook(lambda mod, args, out: calls.append(out.shape) or out * 2.0)
    kw = {"label_smoothing": 0.1}
    got = m.loss(src, tgt_in, tgt_out, src_key_padding_mask=src_mask, tgt_key_padding_mask=tgt_mask, **kw)
    assert calls == [(3, 7, TGT_V)]  # the padded layout, as forward gives it
    assert_close(got, _reference(m, src, tgt_in, tgt_out, src_mask, tgt_mask, **kw))


def test_the_demo_semantics_pad_targets_ignored_by_id():
    # the demo: pad id 0 in tgt_out is ignored, summed loss, no target mask given to the decoder
    m = tiny()
    src, tgt_in, tgt_out, src_mask, tgt_mask = batch()
    tgt_in, tgt_out = tgt_in.masked_fill(tgt_mask, PAD), tgt_out.masked_fill(tgt_mask, PAD)
    got = m.loss(src, tgt_in, tgt_out, src_key_padding_mask=src_mask, label_smoothing=0.1, ignore_index=PAD,
                 reduction="sum")  # fmt: skip
    want = F.cross_entropy(
        m(src, tgt_in, src_key_padding_mask=src_mask).flatten(0, 1), tgt_out.flatten(), ignore_index=PAD,
        label_smoothing=0.1, reduction="sum",
    )  # fmt: skip
    assert_close(got, want)
    # giving the decoder the target padding mask too changes nothing at real positions
    masked = m.loss(src, tgt_in, tgt_out, src_key_padding_mask=src_mask, tgt_key_padding_mask=tgt_in == PAD,
                    label_smoothing=0.1, ignore_index=PAD, reduction="sum")  # fmt: skip
    assert_close(masked, want)


def test_one_token_and_no_target():
    m = tiny()
    src, tgt_in, tgt_out, src_mask, _ = batch(t=1)
    assert_close(m.loss(src, tgt_in, tgt_out), _reference(m, src, tgt_in, tgt_out, None, None))
    every = torch.ones_like(tgt_in, dtype=torch.bool)
    with pytest.raises(ValueError, match="no target position.*undefined"):
        m.loss(src, tgt_in, tgt_out, tgt_key_padding_mask=every)
    with pytest.raises(ValueError, match="no target position"):
        m.loss(src, tgt_in, torch.full_like(tgt_out, -100))
    zero = m.loss(src, tgt_in, tgt_out, tgt_key_padding_mask=every, reduction="sum")
    assert zero.item() == 0.0


def test_bad_inputs():
    m = tiny()
    src, tgt_in, tgt_out, src_mask, tgt_mask = batch()
    with pytest.raises(ValueError, match=r"tgt_out must have the shape of tgt_in \(3, 7\), got \(3, 6\)"):
        m.loss(src, tgt_in, tgt_out[:, :6])
    with pytest.raises(ValueError, match=rf"tgt_out must lie in \[0, vocab_size={TGT_V}\)"):
        m.loss(src, tgt_in, tgt_out.masked_fill(tgt_mask, TGT_V))
    with pytest.raises(TypeError, match="tgt_out must hold integer class ids"):
        m.loss(src, tgt_in, tgt_out.float())
    with pytest.raises(ValueError, match="src and tgt_in must share the batch size"):
        m.loss(src[:2], tgt_in, tgt_out)
    with pytest.raises(TypeError, match="tgt_key_padding_mask must be bool"):
        m.loss(src, tgt_in, tgt_out, tgt_key_padding_mask=tgt_mask.long())
    with pytest.raises(ValueError, match="label_smoothing must be in \\[0, 1\\], got -0.1"):
        m.loss(src, tgt_in, tgt_out, label_smoothing=-0.1)
    with pytest.raises(ValueError, match="unknown reduction 'none'"):
        m.loss(src, tgt_in, tgt_out, reduction="none")
    with pytest.raises(TypeError, match="tgt_in must hold integer token ids"):
        m.loss(src, tgt_in.float(), tgt_out)


def test_uint8_targets_equal_int64_targets():
    """Padded uint8 targets: the padding's ignore_index=-100 is not written as the byte 156 (a real target)."""
    torch.manual_seed(0)
    m = Transformer(SRC_V, 257, d_model=14, n_heads=2, d_ff=22, n_layers=1, dropout=0.0, max_len=23).eval()
    src, tgt_in, _, src_mask, tgt_mask = batch()
    tgt_out = torch.tensor([156, 255, 3, 156, 7, 0, 156]).repeat(3, 1)
    want = m.loss(src, tgt_in, tgt_out, src_key_padding_mask=src_mask, tgt_key_padding_mask=tgt_mask)
    got = m.loss(src, tgt_in, tgt_out.to(torch.uint8), src_key_padding_mask=src_mask, tgt_key_padding_mask=tgt_mask)
    assert_close(got, want)
    assert_close(want, _reference(m, src, tgt_in, tgt_out, src_mask, tgt_mask))
