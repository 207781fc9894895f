"""GreedyHead (models/decoding.py): the float32 argmax of an LM head found by screening with a float16 or bfloat16
copy of the weight (or an int8 one: a single row weight-only or at 24 bits, several rows with int8 activations) and
recomputing
only the rows that could win, against ``F.linear(...).argmax``; greedy ``generate`` at batch 8 against the
reference loop with either screen of several rows."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from sublayer import kernels
from sublayer.models.decoding import GreedyHead

pytestmark = pytest.mark.skipif(not kernels.enabled(), reason="C++ kernels switched off or unavailable")


def _gen(seed: int) -> torch.Generator:
    return torch.Generator().manual_seed(seed)


SCREENS = [torch.float16, torch.bfloat16]


@pytest.mark.parametrize("rows", [1, 2, 7])
@pytest.mark.parametrize("bias", [False, True])
@pytest.mark.parametrize("screen", SCREENS)
@pytest.mark.parametrize("avx512", [True, False])
@pytest.mark.parametrize("int8", ["off", "panels", "rows"])
def test_equals_float32_argmax_on_random_heads(rows, bias, screen, avx512, int8):
    """Either screen, AVX-512 micro-kernels on and off (bfloat16 several rows: vdpbf16ps on x rounded to bf16),
    a single row and several rows on the int8 screens (a single row on int8 panels, or at 24 bits beside several
    rows' int8 activations) or the 16-bit one."""
    g = _gen(rows)
    w = torch.randn(1013, 37, generator=g) * 0.3
    b = torch.randn(1013, generator=g) if bias else None
    head = GreedyHead(w, b, screen=screen, int8_single_row=int8 != "off", int8_rows=int8 == "rows")
    assert head.screen == screen and head.usable
    assert (head.packed1 is not None) == (int8 == "panels") and (head.quads is not None) == (int8 == "rows")
    assert (head.bound24 is not None) == (int8 == "rows")
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
    head = GreedyHead(w, screen=torch.bfloat16, int8_rows=False)
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
        head = GreedyHead(w2, screen=screen, int8_rows=False)
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
    head, head_bf16 = (GreedyHead(w, screen=s, int8_rows=False) for s in SCREENS)
    assert not head.usable and head_bf16.usable
    x = torch.randn(4, 5, generator=_gen(4))
    assert head(x).tolist() == head_bf16(x).tolist() == F.linear(x, w).argmax(-1).tolist()


@pytest.mark.parametrize("int8_rows", [False, True])
@pytest.mark.parametrize("bias", [False, True])
def test_int8_screen_of_a_single_row_recomputes_near_ties_in_float32(bias, int8_rows):
    """Rows 0..10 differ by less than the int8 copy resolves: they tie on the screen (on int8 panels, or at 24
    bits beside several rows' int8 activations), float32 decides; an all-zero weight row (scale 1, q 0) is screened
    exactly."""
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
        head = GreedyHead(w2, b, int8_rows=int8_rows)
        want = F.linear(x, w2, b).argmax(-1)
        assert int(want[0]) == winner and (head.packed1 is None) == (head.bound24 is not None) == int8_rows
        q_only = (F.linear(x, head.q.float()) * head.scale + (0 if b is None else b)).argmax(-1)
        assert head(x).tolist() == want.tolist()
        ref, n_cand = head.reference(x)
        assert ref.tolist() == want.tolist() and int(n_cand[0]) >= 11
    assert int(q_only[0]) in range(11) and float(head.scale[-1]) == 1.0 and not head.q[-1].any()


def test_non_finite_weights_have_no_int8_screen():
    w = torch.randn(13, 5, generator=_gen(6))
    w[4, 2] = float("inf")
    head = GreedyHead(w, screen=torch.bfloat16)
    assert head.packed1 is None and head.bound24 is None
    x = torch.randn(1, 5, generator=_gen(7))
    assert head(x).tolist() == F.linear(x, w).argmax(-1).tolist()


def _int8_rows_head(w, b=None):
    head = GreedyHead(w, b, int8_rows=True)
    assert head.quads is not None and head.bound_q is not None
    return head


@pytest.mark.parametrize("avx512", [True, False])  # VNNI vpdpbusd, the portable loop
@pytest.mark.parametrize("bias", [False, True])
def test_int8_rows_screen_recomputes_near_ties_and_rows_of_any_norm(avx512, bias):
    """Several rows screened with int8 weights and int8 activations: vocabulary rows 0..12 (and 300..312, a
    duplicated block) differ by less than either quantization resolves, the input rows' norms span 2^-50..2^40
    (one below 2^-60 sends the whole call to float32), a row is all zeros; the argmax is float32's every time and
    every near-tied row was a candidate where the near ties lead."""
    g = _gen(13)
    k = 53
    base = torch.randn(1, k, generator=g)
    w = torch.cat([base.repeat(13, 1), torch.randn(287, k, generator=g) * 0.1, base.repeat(13, 1), torch.zeros(1, k)])
    b = torch.randn(314, generator=g) * 0.01 if bias else None
    if b is not None:
        b[:13] = b[300:313] = b[0]
    x = base + 0.1 * torch.randn(7, k, generator=g)
    x = x * (2.0 ** torch.tensor([-50.0, -20.0, -3.0, 0.0, 5.0, 17.0, 40.0]))[:, None]
    was = kernels.ops().decode_avx512(int(avx512))
    try:
        for winner in (0, 7, 12, 305):
            w2 = w.clone()
            w2[winner, 0] += 1e-4 * torch.sign(base[0, 0])
            head = _int8_rows_head(w2, b)
            want = F.linear(x, w2, b).argmax(-1)
            assert want[2:].tolist() == [winner] * 5  # (the bias decides the two smallest rows)
            screened = kernels.ops().int8_linear(x, head.quads, head.colsum, head.scale, head.bias, 314, 0, None)
            assert bool((screened[2:, winner] == screened[2:, 0]).all())  # the screen alone cannot tell them apart
            assert head(x).tolist() == want.tolist()
            ref, n_cand = head.reference(x)
            assert ref.tolist() == want.tolist() and bool((n_cand[2:] >= 26).all())
            tiny = x.clone()
            tiny[3] *= 2.0**-80
            assert not head._large(tiny) and head(tiny).tolist() == F.linear(tiny, w2, b).argmax(-1).tolist()
    finally:
        kernels.ops().decode_avx512(int(was))


@pytest.mark.parametrize("int8_rows", [True, False])
def test_int8_rows_screen_equals_float32_argmax_on_random_heads_and_falls_back(int8_rows):
    """Random heads and inputs of mixed scale (outliers widen the activations' quantization step); NaN and inf
    inputs recompute every row; int8_rows=False keeps the 16-bit screen."""
    g = _gen(17)
    w = torch.randn(2003, 41, generator=g) * 0.3
    b = torch.randn(2003, generator=g)
    head = GreedyHead(w, b, int8_rows=int8_rows)
    assert (head.quads is not None) == (head.bound24 is not None) == (head.packed1 is None) == int8_rows
    for seed in range(12):
        x = torch.randn(8, 41, generator=_gen(200 + seed)) * 3
        x[seed % 8, seed % 41] *= 100  # one outlier channel
        want = F.linear(x, w, b).argmax(-1)
        assert head(x).tolist() == want.tolist()
        ref, n_cand = head.reference(x)
        assert ref.tolist() == want.tolist() and bool((n_cand >= 1).all())
    x[2, 5], x[6, 1] = float("nan"), float("inf")
    assert head(x).tolist() == F.linear(x, w, b).argmax(-1).tolist()


def test_int8_rows_screen_needs_finite_weights_and_a_short_inner_dimension():
    w = torch.randn(13, 5, generator=_gen(6))
    w[4, 2] = float("inf")
    assert GreedyHead(w, int8_rows=True).quads is None
    assert GreedyHead(torch.randn(3, 2**16 + 1, generator=_gen(9)), int8_rows=True).quads is None


@pytest.mark.parametrize("int8_rows", [True, False])
def test_greedy_generate_at_batch_8_equals_the_reference_loop(int8_rows):
    """GPT-2 greedy decoding of 8 rows on the fast path, its head screened with int8 activations or the 16-bit
    copy, against the reference loop (float32 logits' argmax)."""
    from sublayer.models import GPT2, GPT2Config
    from sublayer.runtime import causal

    from tests.conftest import reference_decoding

    torch.manual_seed(3)
    cfg = GPT2Config(vocab_size=211, max_positions=29, d_model=24, n_layers=2, n_heads=3, d_ff=37,
                     dropout=0.0, embd_dropout=0.0, attn_dropout=0.0)  # fmt: skip
    model = GPT2(cfg).eval()
    W = causal.packed_weights(model)
    W.greedy = GreedyHead(W.greedy.weight, W.greedy.bias, int8_rows=int8_rows)
    calls = []
    real = GreedyHead.__call__
    x = torch.randint(0, 211, (8, 5), generator=_gen(4))
    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(GreedyHead, "__call__", lambda h, x: calls.append(h.quads is not None) or real(h, x))
        got = model.generate(x, 11)
    assert calls and set(calls) == {int8_rows} and causal.packed_weights(model) is W
    assert got.tolist() == reference_decoding(lambda: model.generate(x, 11)).tolist()
