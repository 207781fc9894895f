"""Packing helpers of padding-free execution: pack/unpack index and the packed-documents mask."""

from __future__ import annotations

import pytest
import torch
from torch.testing import assert_close

from sublayer.functional.packing import Packing, document_mask


def test_pack_unpack_round_trip_zeros_at_padding():
    kpm = torch.tensor([[False, False, True], [True, False, False]])
    x = torch.randn(2, 3, 5, requires_grad=True)
    pk = Packing(kpm)
    assert pk.n_tokens == 4 and pk.index.tolist() == [0, 1, 4, 5]
    p = pk.pack(x)
    assert_close(p, torch.stack([x[0, 0], x[0, 1], x[1, 1], x[1, 2]]))
    back = pk.unpack(p)
    assert_close(back[~kpm], x[~kpm])
    assert_close(back[kpm], torch.zeros(2, 5))
    back.sum().backward()  # both differentiable: gradient 1 at real tokens, 0 at padding
    assert_close(x.grad, (~kpm)[..., None].float().expand(2, 3, 5))


def test_pack_broadcasts_a_shared_row_and_no_mask_only_reshapes():
    pk = Packing(torch.tensor([[False, True], [False, False]]))
    assert pk.pack(torch.arange(2)[None]).tolist() == [0, 0, 1]
    plain = Packing(None, batch=2, seq_len=3)
    x = torch.randn(2, 3, 7)
    assert plain.index is None and plain.n_tokens == 6
    assert_close(plain.unpack(plain.pack(x)), x)
    with pytest.raises(ValueError, match="needs a key_padding_mask or both batch and seq_len"):
        Packing(None, batch=2)


def test_document_mask_is_block_diagonal_where_positions_restart():
    assert document_mask(torch.arange(5)[None]) is None  # one document per row
    pos = torch.tensor([[0, 1, 2, 0, 1], [3, 4, 0, 1, 2]])
    m = document_mask(pos)
    assert m.shape == (2, 1, 5, 5)
    allowed = ~m[:, 0]
    want0 = torch.block_diag(torch.ones(3, 3), torch.ones(2, 2)).bool()
    want1 = torch.block_diag(torch.ones(2, 2), torch.ones(3, 3)).bool()  # positions before the first 0: one doc
    assert torch.equal(allowed[0], want0) and torch.equal(allowed[1], want1)


def test_pack_and_unpack_gradcheck_in_float64():
    pk = Packing(torch.tensor([[False, True, False], [True, True, False]]))
    x = torch.randn(2, 3, 2, dtype=torch.float64, requires_grad=True)
    assert torch.autograd.gradcheck(lambda t: pk.pack(t), (x,))
    y = torch.randn(3, 2, dtype=torch.float64, requires_grad=True)
    assert torch.autograd.gradcheck(lambda t: pk.unpack(t), (y,))
    assert torch.autograd.gradgradcheck(lambda t: pk.unpack(pk.pack(t) * 2), (x,))


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("left", [False, True])
def test_padded_layout_additive_mask_equals_masked_fill(dtype, left):
    # The padded layout adds its mask (-inf / 0, built once per dtype) to the scores in place instead of
    # masked_fill: the same scores, hence bit-equal outputs and gradients (dropout on, same Philox seed); dead rows
    # (a fully padded row, left padding) included.
    from sublayer.functional import packing

    lengths = [7, 3, 0]
    pad = torch.arange(7)[None] >= torch.tensor(lengths)[:, None]
    pad = pad.flip(1) if left else pad
    pk = packing.PackedBatch(pad, attention="padded")
    mask = pk._self_mask(True, torch.device("cpu"))
    g = torch.Generator().manual_seed(5)
    q, k, v, gy = (torch.randn(3, 2, 7, 5, generator=g).to(dtype) for _ in range(4))
    runs = []
    for m in (mask, None):
        qq, kk, vv = (t.clone().requires_grad_(True) for t in (q, k, v))
        torch.manual_seed(11)
        out = packing._core(qq, kk, vv, 0.3, mask.blocked, m)
        out.backward(gy)
        runs.append((out, qq.grad, kk.grad, vv.grad))
    assert mask.bias(dtype).dtype == dtype and mask.bias(dtype) is mask.bias(dtype)
    for a, b in zip(*runs):
        assert torch.isfinite(a).all()
        assert torch.equal(a, b)
