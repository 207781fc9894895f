"""The fused Philox dropout: the stream itself, its statistics, seeding, determinism."""

from __future__ import annotations

import math

import pytest
import torch
from torch.testing import assert_close

import sublayer
from sublayer import kernels
from sublayer.functional import fused

pytestmark = pytest.mark.skipif(not kernels.available(), reason="C++ kernels failed to build (see test_loader)")


@pytest.fixture(params=["avx512", "avx2"])
def philox_isa(request):
    """The Philox rounds on AVX-512VL (skipped where not compiled in) or on AVX2 (the switch turned off)."""
    ops = kernels.ops()
    if request.param == "avx512" and not ops.philox_avx512(-1):
        pytest.skip("no AVX-512VL Philox rounds compiled in")
    was = ops.philox_avx512(int(request.param == "avx512"))
    yield request.param
    ops.philox_avx512(int(was))


def _scalar_draws(n: int, seed: int) -> torch.Tensor:
    """The 16-bit dropout draws of elements 0..n-1 from the scalar Philox words: element e takes word
    (e // 64) * 32 + (e % 64) % 32, its low half for e % 64 < 32, else its high half."""
    words = kernels.ops().philox_words(0, (n + 63) // 64 * 32, seed, True)
    e = torch.arange(n)
    w = words[(e // 64) * 32 + (e % 64) % 32]
    return torch.where(e % 64 < 32, w & 0xFFFF, w >> 16)


def test_philox_known_answer_and_vector_path_equals_scalar(philox_isa):
    ops = kernels.ops()
    # Random123's published known answer for philox4x32-10, counter 0, key 0: words 0..3 of counter 0 land at
    # elements 0, 8, 16, 24 (a block of 32 elements takes word k of counter l at 8k + l).
    w = ops.philox_words(0, 32, 0, True)
    assert [int(w[i]) for i in (0, 8, 16, 24)] == [0x6627E8D5, 0xE169C58D, 0xBC57AC4C, 0x9B00DBD8]
    for start, n, seed in ((0, 100, 7), (13, 77, 2**40 + 5), (2**33 - 5, 70, 1)):  # unaligned, 64-bit counters
        assert torch.equal(ops.philox_words(start, n, seed, False), ops.philox_words(start, n, seed, True))


@pytest.mark.parametrize("shape", [(7, 128), (5, 193), (3, 61)])  # whole block pairs, unaligned rows, short rows
def test_dropout_mask_is_the_scalar_stream(philox_isa, shape):
    # the vector rounds (two blocks at a time, then single blocks, then a partial one) draw exactly the scalar words
    p, seed = 0.3, fused.dropout_seed(torch.Generator().manual_seed(11))
    out = fused.dropout(torch.ones(shape), p, generator=torch.Generator().manual_seed(11), impl="fused")
    keep = _scalar_draws(out.numel(), seed) >= round(p * 65536)
    assert torch.equal(out.reshape(-1) != 0, keep)


@pytest.mark.parametrize("p", [0.1, 0.5])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_keep_rate_and_scaling(p, dtype):
    n = 200_000
    x = torch.full((n // 100, 100), 3.0, dtype=dtype)
    out = fused.dropout(x, p, impl="fused")
    kept = out != 0
    rate = kept.double().mean().item()
    assert abs(rate - (1 - p)) < 5 * math.sqrt(p * (1 - p) / n)  # 5 sigma
    # kept values scaled by 1 / the real keep rate (1 - p rounded to 2^-16), not 1/(1-p): the mean is unbiased
    keep = fused.keep_probability(p)
    assert abs(keep - (1 - p)) <= 2**-17
    assert_close(out[kept], (x[kept].double() / keep).to(dtype))


def test_mask_is_not_biased_by_position():
    # each column (and each of the 32 positions inside a Philox block) keeps about 1 - p
    out = fused.dropout(torch.ones(4000, 32), 0.3, impl="fused")
    rates = (out != 0).double().mean(0)
    assert ((rates - 0.7).abs() < 5 * math.sqrt(0.21 / 4000)).all()


def test_same_seed_same_mask_and_manual_seed_reproduces():
    x = torch.randn(37, 11)
    torch.manual_seed(5)
    a = fused.dropout(x, 0.5, impl="fused")
    b = fused.dropout(x, 0.5, impl="fused")  # the generator advanced: another mask
    torch.manual_seed(5)
    c = fused.dropout(x, 0.5, impl="fused")
    assert torch.equal(a, c) and not torch.equal(a, b)
    g1, g2 = torch.Generator().manual_seed(1), torch.Generator().manual_seed(1)
    assert torch.equal(fused.dropout(x, 0.5, generator=g1, impl="fused"), fused.dropout(x, 0.5, generator=g2, impl="fused"))


def test_mask_depends_on_flat_index_only():
    x = torch.randn(6, 10)
    a = fused.dropout(x, 0.5, generator=torch.Generator().manual_seed(2), impl="fused")
    b = fused.dropout(x.reshape(60), 0.5, generator=torch.Generator().manual_seed(2), impl="fused")
    assert torch.equal(a.reshape(60), b)


def test_eval_and_p0_are_identity_and_backward_uses_the_mask():
    x = torch.randn(7, 13, requires_grad=True)
    assert fused.dropout(x, 0.5, training=False) is x
    assert fused.dropout(x, 0.0) is x
    out = fused.dropout(x, 0.25, impl="fused")
    (g,) = torch.autograd.grad(out, x, torch.ones_like(out))
    assert_close(g, (out != 0).float() / 0.75)


def test_deterministic_algorithms_mode_runs_and_repeats_bitwise():
    prev = torch.are_deterministic_algorithms_enabled()
    torch.use_deterministic_algorithms(True)
    try:
        results = []
        for _ in range(2):
            torch.manual_seed(0)
            block = sublayer.EncoderBlock(16, 2, 32, dropout=0.1)
            x = torch.randn(3, 70, 16, requires_grad=True)
            block(x).square().sum().backward()
            results.append([x.grad] + [p.grad for p in block.parameters()])
        for a, b in zip(*results):
            assert torch.equal(a, b)
    finally:
        torch.use_deterministic_algorithms(prev)


def test_kernel_reductions_do_not_depend_on_the_thread_count():
    threads = torch.get_num_threads()
    x, y = torch.randn(700, 9), torch.randn(700, 9)  # several fixed reduction chunks of rows
    w, b = torch.randn(9, requires_grad=True), torch.randn(9, requires_grad=True)
    g = torch.randn(700, 9)
    try:
        res = []
        for nt in (1, 2):
            torch.set_num_threads(nt)
            gen = torch.Generator().manual_seed(0)
            out = fused.add_norm(x, y, 9, w, b, dropout=0.2, impl="fused", generator=gen)
            res.append([out, *torch.autograd.grad(out, (w, b), g)])
        for a, c in zip(*res):
            assert torch.equal(a, c)
    finally:
        torch.set_num_threads(threads)


def test_reference_impl_is_torch_dropout():
    x = torch.randn(5, 5)
    torch.manual_seed(3)
    a = fused.dropout(x, 0.5, impl="reference")
    torch.manual_seed(3)
    assert torch.equal(a, torch.nn.functional.dropout(x, 0.5))
    with pytest.raises(ValueError, match="p must be in"):
        fused.dropout(x, 1.5)


@pytest.mark.parametrize("p", [0.999999, 1 - 2**-18, 1e-7])
def test_p_the_16_bit_threshold_cannot_express_is_refused_or_left_to_torch(p):
    """round(p · 2^16) of 0 or 2^16 would be clamped: a keep rate far from 1 - p. impl="fused" says so; "auto"
    takes F.dropout (here: mean of a large ones tensor within 5 sigma of 1; fused once gave 14.7 for p=0.999999)."""
    x = torch.ones(4096, 1024)
    with pytest.raises(ValueError, match=rf"p={p} is too close to [01] for the fused dropout's 16-bit keep threshold"):
        fused.dropout(x, p, impl="fused")
    with pytest.raises(ValueError, match=r"dropout=.* is too close to"):
        fused.add_norm(x, x, 1024, dropout=p, impl="fused")
    with pytest.raises(ValueError, match=r"output_dropout=.* is too close to"):
        fused.feed_forward(x[:2], torch.ones(3, 1024), None, torch.ones(5, 3), None, output_dropout=p, impl="fused")
    torch.manual_seed(0)
    mean = fused.dropout(x, p).double().mean().item()
    assert abs(mean - 1) < 5 * math.sqrt(p / (1 - p) / x.numel())


@pytest.mark.parametrize("p", [2**-17, 1 - 2**-17])
def test_the_bounds_themselves_are_refused_and_the_error_says_so(p):
    """round(0.5) and round(65535.5) round to even (0 and 2^16): the bounds 2^-17 and 1 - 2^-17 are outside what the
    threshold expresses, and the error states the rule as the strict inequality it is."""
    x = torch.ones(7, 5)
    with pytest.raises(ValueError, match=r"it needs 2\^-17 < p < 1 - 2\^-17 or p = 0"):
        fused.dropout(x, p, impl="fused")
    assert fused.keep_probability(2**-17 + 2**-30) < 1.0  # just inside the bound: expressible


@pytest.mark.parametrize("p", [0.3, 0.99, 0.9999])
def test_mean_is_unbiased_near_p_1(p):
    """Kept values are scaled by the real keep rate: E[dropout(1)] = 1 exactly in expectation (5 sigma)."""
    x = torch.ones(4096, 1024)
    out = fused.dropout(x, p, impl="fused", generator=torch.Generator().manual_seed(1))
    keep = fused.keep_probability(p)
    assert abs(out.double().mean().item() - 1) < 5 * math.sqrt((1 - keep) / keep / x.numel())
    assert_close(out[out != 0], torch.full_like(out[out != 0], 1 / keep))
