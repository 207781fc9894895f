"""AddNorm, ResidualConnection and PreNormResidual vs their written formulas with torch.nn modules."""

from __future__ import annotations

import copy

import pytest
import torch
import torch.nn.functional as F
from hypothesis import given
from hypothesis import strategies as st
from torch import nn
from torch.testing import assert_close

from sublayer import AddNorm, LayerNorm, PreNormResidual, ResidualConnection, RMSNorm

D = 7


def _leaf(t: torch.Tensor) -> torch.Tensor:
    return t.detach().clone().requires_grad_(True)


def _randomize_(module: nn.Module) -> nn.Module:
    with torch.no_grad():
        for p in module.parameters():
            p.copy_(torch.randn_like(p))
    return module


# --------------------------------------------------------------------------------------------------------------
# AddNorm
# --------------------------------------------------------------------------------------------------------------
def _addnorm_run(m, x, y, gy):
    x, y = _leaf(x), _leaf(y)
    out = m(x, y)
    out.backward(gy)
    return [out.detach(), x.grad, y.grad] + [p.grad for p in m.parameters()]


@pytest.mark.parametrize("dtype", [torch.float64, torch.float32])
@pytest.mark.parametrize("norm", ["layer", "rms"])
def test_add_norm_matches_norm_of_sum(norm, dtype):
    an = _randomize_(AddNorm(D, norm=norm, dtype=dtype))
    ref = (nn.LayerNorm(D, 1e-5, dtype=dtype) if norm == "layer" else nn.RMSNorm(D, 1e-6, dtype=dtype))
    ref.load_state_dict(an.norm.state_dict())  # same parameter names as torch's norms
    x, y = torch.randn(2, 3, D, dtype=dtype), torch.randn(2, 3, D, dtype=dtype)
    gy = torch.randn_like(x)
    got = _addnorm_run(an, x, y, gy)
    xr, yr = _leaf(x), _leaf(y)
    want = ref(xr + yr)
    want.backward(gy)
    for a, b in zip(got, [want.detach(), xr.grad, yr.grad] + [p.grad for p in ref.parameters()]):
        assert_close(a, b)


@pytest.mark.parametrize("norm", ["layer", "rms"])
def test_add_norm_bf16_within_reference_error(norm):
    # bf16: our error vs an fp64 run of the same module on the same rounded inputs is at most 2x the error of
    # torch's bf16 norm(x + y) (PyTorch's "fused tolerances" convention) plus one bf16 ulp of the largest value.
    an = _randomize_(AddNorm(D, norm=norm, dtype=torch.bfloat16))
    ref = (nn.LayerNorm(D) if norm == "layer" else nn.RMSNorm(D, 1e-6)).to(torch.bfloat16)
    ref.load_state_dict(an.norm.state_dict())
    x, y = torch.randn(4, 5, D, dtype=torch.bfloat16), torch.randn(4, 5, D, dtype=torch.bfloat16)
    gy = torch.randn_like(x)
    ours = _addnorm_run(an, x, y, gy)
    truth = _addnorm_run(copy.deepcopy(an).double(), x.double(), y.double(), gy.double())
    xr, yr = _leaf(x), _leaf(y)
    want = ref(xr + yr)
    want.backward(gy)
    theirs = [want.detach(), xr.grad, yr.grad] + [p.grad for p in ref.parameters()]
    ulp = torch.finfo(torch.bfloat16).eps
    for a, b, t in zip(ours, theirs, truth):
        assert a.dtype == torch.bfloat16
        err_ours, err_ref = (a.double() - t).abs().max().item(), (b.double() - t).abs().max().item()
        assert err_ours <= 2 * err_ref + ulp * t.abs().max().item(), (err_ours, err_ref)


def test_add_norm_d2l_example():
    # d2l: AddNorm([3, 4], 0.5) on (2, 3, 4) keeps the shape; in eval it is layer_norm(x + y) over (3, 4).
    an = AddNorm([3, 4], 0.5).eval()
    x, y = torch.ones(2, 3, 4), torch.randn(2, 3, 4)
    out = an(x, y)
    assert out.shape == (2, 3, 4)
    assert_close(out, F.layer_norm(x + y, (3, 4)))
    assert_close(out, nn.LayerNorm([3, 4]).eval()(x + y))


def test_add_norm_defaults_and_eps():
    an = AddNorm(D)
    assert isinstance(an.norm, LayerNorm) and an.norm.eps == 1e-5 and an.dropout == 0.0
    rms = AddNorm(D, norm="rms")
    assert isinstance(rms.norm, RMSNorm) and rms.norm.eps == 1e-6
    an = AddNorm(D, eps=0.5)
    x, y = 0.1 * torch.randn(3, D), 0.1 * torch.randn(3, D)  # small variance: eps = 0.5 dominates
    assert_close(an(x, y), F.layer_norm(x + y, (D,), eps=0.5))


def test_add_norm_dropout_eval_identity_and_p0_exact():
    x, y = torch.randn(3, 4, D), torch.randn(3, 4, D)
    assert_close(AddNorm(D, 0.5).eval()(x, y), F.layer_norm(x + y, (D,)))
    assert_close(AddNorm(D, 0.0).train()(x, y), F.layer_norm(x + y, (D,)))


@pytest.mark.parametrize("p", [0.25, 0.5])
def test_add_norm_dropout_statistics(p):
    # Rows x = [0, 1, 0], y = [1-p, 0, 0]: where y's first element is kept, x + y/(1-p) = [1, 1, 0]; where it is
    # dropped, [0, 1, 0] (y's zeros drop to zeros). Any other scale than 1/(1-p) gives a third pattern.
    n = 20000
    an = AddNorm(3, p, eps=1e-12).train()
    x = torch.tensor([0.0, 1.0, 0.0]).expand(n, 3)
    y = torch.tensor([1.0 - p, 0.0, 0.0]).expand(n, 3)
    out = an(x, y)
    kept_pattern = F.layer_norm(torch.tensor([1.0, 1.0, 0.0]), (3,), eps=1e-12)
    dropped_pattern = F.layer_norm(torch.tensor([0.0, 1.0, 0.0]), (3,), eps=1e-12)
    is_kept = torch.isclose(out, kept_pattern, atol=1e-5).all(-1)
    is_dropped = torch.isclose(out, dropped_pattern, atol=1e-5).all(-1)
    assert (is_kept | is_dropped).all()
    assert abs(is_kept.float().mean().item() - (1 - p)) < 5 * (p * (1 - p) / n) ** 0.5


def test_add_norm_dropout_same_seed_same_output():
    an = AddNorm(D, 0.5).train()
    x, y = torch.randn(3, 4, D), torch.randn(3, 4, D)
    torch.manual_seed(11)
    a = an(x, y)
    torch.manual_seed(11)
    b = an(x, y)
    assert torch.equal(a, b)
    assert not torch.allclose(a, an.eval()(x, y))


@given(batch=st.integers(1, 5), row=st.integers(0, 4), norm=st.sampled_from(["layer", "rms"]))
def test_add_norm_batch_row_equals_row_alone(batch, row, norm):
    row %= batch
    torch.manual_seed(batch)
    an = _randomize_(AddNorm(D, norm=norm))
    x, y = torch.randn(batch, 3, D), torch.randn(batch, 3, D)
    assert_close(an(x, y)[row], an(x[row], y[row]))


# --------------------------------------------------------------------------------------------------------------
# ResidualConnection and PreNormResidual
# --------------------------------------------------------------------------------------------------------------
def test_residual_connection_formula_fwd_bwd():
    lin = nn.Linear(D, D)
    x = torch.randn(2, 3, D)
    x1, x2 = _leaf(x), _leaf(x)
    out = ResidualConnection()(x1, lin)
    assert_close(out, x + lin(x))
    out.sum().backward()
    w1 = lin.weight.grad.clone()
    lin.zero_grad()
    (x2 + lin(x2)).sum().backward()
    assert_close(x1.grad, x2.grad)
    assert_close(w1, lin.weight.grad)


@pytest.mark.parametrize("norm", ["layer", "rms"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
def test_pre_norm_residual_formula_fwd_bwd(norm, dtype):
    pre = _randomize_(PreNormResidual(D, norm=norm, dtype=dtype))
    ref_norm = nn.LayerNorm(D, 1e-5, dtype=dtype) if norm == "layer" else nn.RMSNorm(D, 1e-6, dtype=dtype)
    ref_norm.load_state_dict(pre.norm.state_dict())
    sub = nn.Sequential(nn.Linear(D, 11, dtype=dtype), nn.GELU(), nn.Linear(11, D, dtype=dtype))
    x = torch.randn(2, 3, D, dtype=dtype)
    x1, x2 = _leaf(x), _leaf(x)
    out = pre(x1, sub)
    out.backward(torch.ones_like(out))
    g_sub = [p.grad.clone() for p in sub.parameters()]
    sub.zero_grad()
    want = x2 + sub(ref_norm(x2))  # x + dropout(sublayer(norm(x))), dropout 0
    want.backward(torch.ones_like(want))
    assert_close(out, want)
    assert_close(x1.grad, x2.grad)
    for a, b in zip(pre.norm.parameters(), ref_norm.parameters()):
        assert_close(a.grad, b.grad)
    for a, b in zip(g_sub, sub.parameters()):
        assert_close(a, b.grad)


def test_pre_norm_residual_defaults():
    pre = PreNormResidual((3, D))
    assert isinstance(pre.norm, LayerNorm) and pre.norm.normalized_shape == (3, D) and pre.norm.eps == 1e-5
    assert PreNormResidual(D, norm="rms", eps=1e-3).norm.eps == 1e-3
    assert PreNormResidual(D, dtype=torch.float64).norm.weight.dtype == torch.float64


@pytest.mark.parametrize("cls", ["residual", "prenorm"])
@pytest.mark.parametrize("p", [0.2, 0.5])
def test_residual_dropout_statistics(cls, p):
    # sublayer → ones: out - x is 0 where dropped and 1/(1-p) where kept.
    m = ResidualConnection(p) if cls == "residual" else PreNormResidual(D, p)
    m.train()
    x = torch.randn(2000, 10, D)
    delta = m(x, torch.ones_like) - x
    kept = delta.abs() > 0.5 / (1 - p)
    assert_close(delta[kept], torch.full_like(delta[kept], 1 / (1 - p)))
    assert_close(delta[~kept], torch.zeros_like(delta[~kept]), rtol=0, atol=1e-6)
    n = delta.numel()
    assert abs(kept.float().mean().item() - (1 - p)) < 5 * (p * (1 - p) / n) ** 0.5


@pytest.mark.parametrize("cls", ["residual", "prenorm"])
def test_residual_dropout_is_the_fused_philox_dropout_with_its_gradient(cls):
    # On the CPU the residual's dropout is sublayer's Philox dropout (seeded from torch's generator): the same mask
    # fused.dropout draws from the same seed, forward and backward.
    from sublayer.functional import fused

    m = ResidualConnection(0.4) if cls == "residual" else PreNormResidual(D, 0.4)
    lin = _randomize_(nn.Linear(D, D))
    norm = (lambda t: t) if cls == "residual" else m.norm
    x = torch.randn(5, 3, D, requires_grad=True)
    torch.manual_seed(11)
    out = m(x, lin)
    torch.manual_seed(11)
    mask = fused.dropout(torch.ones(5, 3, D), 0.4)  # 0 or 1/(1-p)
    assert 0 < (mask == 0).sum() < mask.numel()
    xr = _leaf(x)
    ref = xr + lin(norm(xr)) * mask
    assert_close(out, ref)
    g = torch.randn_like(out)
    (gx,) = torch.autograd.grad(out, x, g)
    (gr,) = torch.autograd.grad(ref, xr, g)
    assert_close(gx, gr)


@pytest.mark.parametrize("cls", ["residual", "prenorm"])
def test_residual_dropout_eval_identity(cls):
    m = (ResidualConnection(0.5) if cls == "residual" else PreNormResidual(D, 0.5)).eval()
    lin = nn.Linear(D, D)
    x = torch.randn(3, D)
    norm = (lambda t: t) if cls == "residual" else m.norm
    assert_close(m(x, lin), x + lin(norm(x)))


# --------------------------------------------------------------------------------------------------------------
# bad input
# --------------------------------------------------------------------------------------------------------------
@pytest.mark.parametrize("make", [lambda n: AddNorm(D, norm=n), lambda n: PreNormResidual(D, norm=n)])
def test_unknown_norm_name(make):
    with pytest.raises(ValueError, match=r"unknown norm 'batchnorm'; choose one of: layer, rms"):
        make("batchnorm")


@pytest.mark.parametrize(
    "make", [lambda p: AddNorm(D, p), lambda p: PreNormResidual(D, p), lambda p: ResidualConnection(p)]
)
@pytest.mark.parametrize("p", [-0.2, 1.0, 3])
def test_dropout_outside_range(make, p):
    with pytest.raises(ValueError, match=rf"dropout must be in \[0, 1\), got {p}"):
        make(p)


@pytest.mark.parametrize("make", [lambda: AddNorm(D, "0.1"), lambda: ResidualConnection(True)])
def test_dropout_wrong_type(make):
    with pytest.raises(TypeError, match=r"dropout must be a float in \[0, 1\)"):
        make()


@pytest.mark.parametrize("shape", [0, -4, (3, 0)])
def test_add_norm_non_positive_shape(shape):
    with pytest.raises(ValueError, match=r"normalized_shape entry must be a positive int"):
        AddNorm(shape)


@pytest.mark.parametrize("shape", [True, "7"])
def test_pre_norm_bad_shape_type(shape):
    with pytest.raises(TypeError, match=r"normalized_shape"):
        PreNormResidual(shape)


def test_add_norm_shape_mismatch_names_both():
    with pytest.raises(ValueError, match=rf"x and y must have the same shape, got \(2, 3, {D}\) and \(2, 1, {D}\)"):
        AddNorm(D)(torch.randn(2, 3, D), torch.randn(2, 1, D))


def test_add_norm_wrong_trailing_dims():
    with pytest.raises(ValueError, match=rf"must end with dims \({D},\).*got shape \(2, 3, 4\)"):
        AddNorm(D)(torch.randn(2, 3, 4), torch.randn(2, 3, 4))


def test_pre_norm_wrong_trailing_dims():
    with pytest.raises(ValueError, match=rf"must end with dims \({D},\).*got shape \(2, 4\)"):
        PreNormResidual(D)(torch.randn(2, 4), lambda t: t)
