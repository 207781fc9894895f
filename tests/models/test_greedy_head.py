"""GreedyHead (models/decoding.py): the float32 argmax of an LM head found by screening with a float16 or bfloat16
copy of the weight and recomputing only the rows that could win, against ``F.linear(...).argmax``."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from sublayer import kernels
from sublayer.models.decoding import GreedyHead

pytestmark = pytest.mark.skipif(not kernels.available(), reason="C++ kernels unavailable")


def _gen(seed: int) -> torch.Generator:
    return torch.Generator().manual_seed(seed)


SCREENS = [torch.float16, torch.bfloat16]


@pytest.mark.parametrize("rows", [1, 2, 7])
@pytest.mark.parametrize("bias", [False, True])
@pytest.mark.parametrize("screen", SCREENS)
@pytest.mark.parametrize("avx512", [True, False])
@pytest.mark.parametrize("int8", [True, False])
def test_equals_float32_argmax_on_random_heads(rows, bias, screen, avx512, int8):
    """Either screen, AVX-512 micro-kernels on and off (bfloat16 several rows: vdpbf16ps on x rounded to bf16),
    a single row on the int8 screen or the 16-bit one."""
    g = _gen(rows)
    w = torch.randn(1013, 37, generator=g) * 0.3
    b = torch.randn(1013, generator=g) if bias else None
    head = GreedyHead(w, b, screen=screen, int8_single_row=int8)
    assert head.screen == screen and head.usable and (head.packed1 is not None) == int8
    was = kernels.ops().decode_avx512(int(avx512))
    try:
        for seed in range(20):
            x = torch.randn(rows, 37, generator=_gen(100 + seed)) * 4
            want = F.linear(x, w, b).argmax(-1)
            assert head(x).tolist() == want.tolist()
            ref, n_cand = head.reference(x)
            assert ref.tolist() == want.tolist() and bool((n_cand >= 1).all())
    finally:
        kernels.ops().decode_avx512(int(was))


def test_bfloat16_screen_bound_covers_rounded_rows_and_tiny_rows_go_float32():
    """Several rows multiply x rounded to bf16 against the bfloat16 screen: logits that differ only below x's
    bf16 rounding tie on the screen (its own argmax would take row 0) and are decided in float32; rows of norm
    below 2^-60 (where underflow could exceed the bound) are multiplied in float32."""
    w = torch.cat([torch.eye(2, 11), torch.randn(97, 11, generator=_gen(7)) * 0.01])
    head = GreedyHead(w, screen=torch.bfloat16)
    x = torch.zeros(3, 11)
    x[:, 0], x[:, 1] = 1 + 2.0**-13, 1 + 2.0**-12  # both round to 1 in bfloat16
    screened_only = F.linear(x.bfloat16().float(), w.bfloat16().float()).argmax(-1)
    assert screened_only.tolist() == [0, 0, 0] and F.linear(x, w).argmax(-1).tolist() == [1, 1, 1]
    assert head(x).tolist() == [1, 1, 1]
    ref, n_cand = head.reference(x)
    assert ref.tolist() == [1, 1, 1] and bool((n_cand >= 2).all())
    tiny = torch.randn(3, 11, generator=_gen(8)) * 2.0**-80
    assert not head._large(tiny) and head._large(tiny * 2.0**70)
    assert head(tiny).tolist() == F.linear(tiny, w).argmax(-1).tolist()


def test_screen_must_be_a_16_bit_float():
    with pytest.raises(ValueError, match="screen must be torch.float16 or torch.bfloat16, got torch.float32"):
        GreedyHead(torch.randn(5, 3), screen=torch.float32)


@pytest.mark.parametrize("screen", SCREENS)
def test_near_ties_below_float16_resolution_are_decided_in_float32(screen):
    # rows 0..9 differ from row 10 by less than float16 can see: the float16 logits tie, float32 ones do not
    g = _gen(5)
    base = torch.randn(1, 41, generator=g)
    w = torch.cat([base.repeat(11, 1), torch.randn(200, 41, generator=g) * 0.1])
    x = torch.randn(3, 41, generator=g)
    for winner in (0, 4, 10):
        w2 = w.clone()
        # nudge column 0 of row `winner` towards the sign of x[:, 0] by a tenth of a float16 ulp
        w2[winner, 0] += 1e-5 * torch.sign(x[0, 0])
        head = GreedyHead(w2, screen=screen)
        want = F.linear(x, w2).argmax(-1)
        assert int(want[0]) == winner
        assert head(x).tolist() == want.tolist()
        _, n_cand = head.reference(x)
        assert int(n_cand[0]) >= 11  # every near-tied row was recomputed


def test_ties_take_the_first_index_as_torch_argmax():
    w = torch.zeros(9, 5)
    w[3] = w[6] = torch.tensor([1.0, 2.0, 0.5, -1.0, 0.25])
    x = torch.tensor([[0.5, 1.0, 2.0, 0.0, 1.0]])
    assert GreedyHead(w)(x).tolist() == F.linear(x, w).argmax(-1).tolist() == [3]


def test_non_finite_inputs_fall_back_to_every_row():
    w = torch.randn(31, 7, generator=_gen(1))
    x = torch.randn(2, 7, generator=_gen(2))
    x[1, 3] = float("nan")
    assert GreedyHead(w)(x).tolist() == F.linear(x, w).argmax(-1).tolist()


def test_weights_beyond_float16_range_skip_the_screening():
    w = torch.randn(13, 5, generator=_gen(3))
    w[2, 1] = 1e6  # float16 overflows to inf; bfloat16 has float32's range
    head, head_bf16 = GreedyHead(w, screen=torch.float16), GreedyHead(w, screen=torch.bfloat16)
    assert not head.usable and head_bf16.usable
    x = torch.randn(4, 5, generator=_gen(4))
    assert head(x).tolist() == head_bf16(x).tolist() == F.linear(x, w).argmax(-1).tolist()


@pytest.mark.parametrize("bias", [False, True])
def test_int8_screen_of_a_single_row_recomputes_near_ties_in_float32(bias):
    """Rows 0..10 differ by less than the int8 copy resolves: they tie on the screen, float32 decides; an all-zero
    weight row (scale 1, q 0) is screened exactly."""
    g = _gen(11)
    base = torch.randn(1, 43, generator=g)
    w = torch.cat([base.repeat(11, 1), torch.randn(300, 43, generator=g) * 0.1, torch.zeros(1, 43)])
    b = torch.randn(312, generator=g) * 0.01 if bias else None
    if b is not None:
        b[:11] = b[0]  # the tied rows tie on their bias too
    x = base + 0.1 * torch.randn(1, 43, generator=g)  # rows 0..10 lead the random ones by far
    for winner in (0, 5, 10):
        w2 = w.clone()
        w2[winner, 0] += 1e-4 * torch.sign(x[0, 0])
        head = GreedyHead(w2, b)
        want = F.linear(x, w2, b).argmax(-1)
        assert int(want[0]) == winner and head.packed1 is not None
        q_only = (F.linear(x, head.q.float()) * head.scale + (0 if b is None else b)).argmax(-1)
        assert head(x).tolist() == want.tolist()
        ref, n_cand = head.reference(x)
        assert ref.tolist() == want.tolist() and int(n_cand[0]) >= 11
    assert int(q_only[0]) in range(11) and float(head.scale[-1]) == 1.0 and not head.q[-1].any()


def test_non_finite_weights_have_no_int8_screen():
    w = torch.randn(13, 5, generator=_gen(6))
    w[4, 2] = float("inf")
    head = GreedyHead(w, screen=torch.bfloat16)
    assert head.packed1 is None
    x = torch.randn(1, 5, generator=_gen(7))
    assert head(x).tolist() == F.linear(x, w).argmax(-1).tolist()
