"""LayerNorm / RMSNorm modules vs nn.LayerNorm, nn.RMSNorm and HF LlamaRMSNorm (forward and backward)."""

from __future__ import annotations

import copy

import pytest
import torch
import torch.nn.functional as F
from torch import nn
from torch.testing import assert_close
from transformers.models.llama.modeling_llama import LlamaRMSNorm

import sublayer
from sublayer import LayerNorm, RMSNorm
from sublayer.nn import make_norm

DTYPES = [torch.float64, torch.float32, torch.bfloat16]


def _randomize(*modules: nn.Module) -> None:
    """Non-trivial affine parameters (not the ones/zeros init), same values in every module given."""
    for m in modules[1:]:
        m.load_state_dict(modules[0].state_dict())
    with torch.no_grad():
        for p in modules[0].parameters():
            p.copy_(torch.randn_like(p))
    for m in modules[1:]:
        m.load_state_dict(modules[0].state_dict())


def _fwd_bwd(module: nn.Module, x: torch.Tensor, gy: torch.Tensor):
    x = x.detach().clone().requires_grad_(True)
    y = module(x)
    y.backward(gy)
    return y, x.grad, [p.grad for p in module.parameters()]


def _assert_parity(ours: nn.Module, ref: nn.Module, x: torch.Tensor) -> None:
    """Forward and backward of ``ours`` vs ``ref`` (same parameters) on ``x``.

    fp32/fp64: ``assert_close`` with the dtype's default tolerances. bf16: outputs the same way, but gradients of a
    norm are differences of nearly equal terms, so a bf16 reference (torch's or HF's) itself is off by several ulp
    where they cancel. Following PyTorch's "fused tolerances" convention, our gradient error vs an fp64 run of the
    same module on the same (rounded) inputs must be at most 2x the reference's error plus one bf16 ulp of the
    largest gradient. (Measured: ours 0.6-1.0x the reference's error.)
    """
    gy = torch.randn_like(x)
    y1, gx1, gp1 = _fwd_bwd(ours, x, gy)
    y2, gx2, gp2 = _fwd_bwd(ref, x, gy)
    assert y1.dtype == y2.dtype == x.dtype
    assert len(gp1) == len(gp2)
    assert_close(y1, y2)
    if x.dtype != torch.bfloat16:
        assert_close(gx1, gx2)
        for a, b in zip(gp1, gp2):
            assert_close(a, b)
        return
    ours64 = copy.deepcopy(ours).double()
    _, gx64, gp64 = _fwd_bwd(ours64, x.double(), gy.double())
    ulp = torch.finfo(x.dtype).eps
    for a, b, truth in zip([gx1, *gp1], [gx2, *gp2], [gx64, *gp64]):
        err_ours = (a.double() - truth).abs().max().item()
        err_ref = (b.double() - truth).abs().max().item()
        assert err_ours <= 2 * err_ref + ulp * truth.abs().max().item(), (err_ours, err_ref)


# --------------------------------------------------------------------------------------------------------------
# LayerNorm vs nn.LayerNorm
# --------------------------------------------------------------------------------------------------------------
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize(
    "kwargs",
    [{}, {"elementwise_affine": False}, {"bias": False}],
    ids=["affine", "no_affine", "no_bias"],
)
@pytest.mark.parametrize("shape", [(7,), (3, 5)], ids=["1d", "2d"])
def test_layer_norm_matches_nn_layer_norm(dtype, kwargs, shape):
    ours = LayerNorm(shape, 1e-5, dtype=dtype, **kwargs)
    ref = nn.LayerNorm(shape, 1e-5, dtype=dtype, **kwargs)
    # Same parameter names as nn.LayerNorm (so state dicts and HF key maps transfer): strict load both ways.
    assert ours.state_dict().keys() == ref.state_dict().keys()
    _randomize(ref, ours)
    _assert_parity(ours, ref, torch.randn(2, 11, *shape, dtype=dtype))


@pytest.mark.parametrize("eps", [1e-5, 1e-12, 0.1])
def test_layer_norm_eps_matches(eps):
    ours, ref = LayerNorm(5, eps, dtype=torch.float64), nn.LayerNorm(5, eps, dtype=torch.float64)
    x = 1e-2 * torch.randn(3, 5, dtype=torch.float64)  # small variance so eps matters
    assert_close(ours(x), ref(x))


def test_layer_norm_d2l_example():
    # d2l: LayerNorm(3) on [[1, 2, 3], [4, 6, 8]] (both rows are evenly spaced) gives ±1.2247 and 0.
    x = torch.tensor([[1.0, 2.0, 3.0], [4.0, 6.0, 8.0]])
    got = LayerNorm(3)(x)
    assert_close(got, nn.LayerNorm(3)(x))
    row = torch.tensor([-1.2247, 0.0, 1.2247])
    assert_close(got, torch.stack([row, row]), rtol=0, atol=1e-4)


def test_layer_norm_defaults_and_init():
    ln = LayerNorm(5)
    assert ln.eps == 1e-5 and ln.normalized_shape == (5,)
    assert torch.equal(ln.weight, torch.ones(5)) and torch.equal(ln.bias, torch.zeros(5))
    ln = LayerNorm(torch.Size([3, 5]), elementwise_affine=False)
    assert ln.normalized_shape == (3, 5) and ln.weight is None and ln.bias is None
    assert list(ln.parameters()) == []


@pytest.mark.parametrize(
    "dtype, autocast, reference",
    [(torch.float32, False, False), (torch.float64, False, False), (torch.float32, True, False),
     (torch.float64, True, False), (torch.bfloat16, False, True), (torch.bfloat16, True, True)],
)  # fmt: skip
def test_layer_norm_paths_match_functional_reference(monkeypatch, dtype, autocast, reference):
    # float32/float64 run torch's F.layer_norm (autocast keeps both); half inputs the functional reference.
    # Either way: the reference's numbers and dtype, forward and backward (copied parameters).
    calls = []
    real = sublayer.functional.layer_norm
    monkeypatch.setattr(sublayer.functional, "layer_norm", lambda *a, **k: calls.append(1) or real(*a, **k))
    ln = LayerNorm(13, dtype=dtype)
    with torch.no_grad():
        ln.weight.copy_(torch.randn(13)), ln.bias.copy_(torch.randn(13))
    x0 = (3.0 + torch.randn(5, 7, 13, dtype=torch.float64)).to(dtype)
    gy = torch.randn(5, 7, 13, dtype=torch.float64).to(dtype)
    xo, x, w, b = (t.detach().clone().requires_grad_(True) for t in (x0, x0, ln.weight, ln.bias))
    with torch.autocast("cpu", dtype=torch.bfloat16, enabled=autocast):
        got = ln(xo)
        assert calls == ([1] if reference else [])
        want = real(x, 13, w, b, 1e-5)
    assert got.dtype == want.dtype == dtype
    got.backward(gy)
    want.backward(gy)
    check = (lambda u, v: torch.equal(u, v)) if reference else (lambda u, v: assert_close(u, v) or True)
    for ours, ref in ((got, want), (xo.grad, x.grad), (ln.weight.grad, w.grad), (ln.bias.grad, b.grad)):
        assert check(ours, ref)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_layer_norm_module_half_statistics(dtype):
    # Rows near +400 and -400 (spread ~3) in half precision; reference in fp64 on the same rounded input.
    x = (torch.tensor([[400.0], [-400.0]]) + 3.0 * torch.randn(2, 7)).to(dtype)
    ln = LayerNorm(7, dtype=dtype)
    assert_close(ln(x), F.layer_norm(x.double(), (7,)).to(dtype))


# --------------------------------------------------------------------------------------------------------------
# RMSNorm vs nn.RMSNorm (same explicit eps) and HF LlamaRMSNorm
# --------------------------------------------------------------------------------------------------------------
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("affine", [True, False])
@pytest.mark.parametrize("shape", [(7,), (3, 5)], ids=["1d", "2d"])
def test_rms_norm_matches_nn_rms_norm(dtype, affine, shape):
    # eps given explicitly to both: nn.RMSNorm(eps=None) would use finfo(dtype).eps instead.
    ours = RMSNorm(shape, 1e-6, elementwise_affine=affine, dtype=dtype)
    ref = nn.RMSNorm(shape, 1e-6, elementwise_affine=affine, dtype=dtype)
    assert ours.state_dict().keys() == ref.state_dict().keys()
    _randomize(ref, ours)
    _assert_parity(ours, ref, torch.randn(2, 11, *shape, dtype=dtype))


# No float64 here: LlamaRMSNorm always computes in float32 (``.to(torch.float32)``), even for fp64 inputs.
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_rms_norm_matches_llama_rms_norm(dtype):
    ref = LlamaRMSNorm(7, eps=1e-6).to(dtype)
    ours = RMSNorm(7, dtype=dtype)  # default eps 1e-6 = HF's
    assert ours.eps == ref.variance_epsilon == 1e-6
    _randomize(ref, ours)
    # HF rounds the normalised value to the input dtype before multiplying by weight; we round once at the end.
    # In bf16 that is one extra rounding (≤ 2 ulp in all), inside bf16's default rtol (1.6e-2 ≈ 4 ulp).
    assert ours.state_dict().keys() == ref.state_dict().keys()
    _assert_parity(ours, ref, torch.randn(3, 11, 7, dtype=dtype))


def test_rms_norm_defaults():
    n = RMSNorm(5)
    assert n.eps == 1e-6 and torch.equal(n.weight, torch.ones(5))
    assert RMSNorm(5, elementwise_affine=False).weight is None


def test_rms_norm_uses_functional_reference(monkeypatch):
    calls = []
    real = sublayer.functional.rms_norm
    monkeypatch.setattr(sublayer.functional, "rms_norm", lambda *a, **k: calls.append(1) or real(*a, **k))
    RMSNorm(5)(torch.randn(2, 5))
    assert calls == [1]


@pytest.mark.parametrize(("name", "cls", "eps"), [("layer", LayerNorm, 1e-5), ("rms", RMSNorm, 1e-6)])
def test_make_norm(name, cls, eps):
    n = make_norm(name, 5)
    assert type(n) is cls and n.eps == eps
    assert make_norm(name, 5, 1e-3).eps == 1e-3


# --------------------------------------------------------------------------------------------------------------
# device / dtype kwargs, bad input
# --------------------------------------------------------------------------------------------------------------
@pytest.mark.parametrize("cls", [LayerNorm, RMSNorm])
def test_norm_dtype_and_meta_device(cls):
    n = cls(5, dtype=torch.float64)
    assert all(p.dtype == torch.float64 for p in n.parameters())
    m = cls(5, device="meta")
    assert all(p.is_meta for p in m.parameters())


@pytest.mark.parametrize("cls", [LayerNorm, RMSNorm])
@pytest.mark.parametrize("shape", [0, -2, (5, 0)])
def test_norm_non_positive_shape(cls, shape):
    with pytest.raises(ValueError, match=r"normalized_shape entry must be a positive int, got"):
        cls(shape)


@pytest.mark.parametrize("cls", [LayerNorm, RMSNorm])
@pytest.mark.parametrize("shape", [True, "5", (5, 2.0)])
def test_norm_bad_shape_type(cls, shape):
    with pytest.raises(TypeError, match="normalized_shape"):
        cls(shape)


@pytest.mark.parametrize("cls", [LayerNorm, RMSNorm])
@pytest.mark.parametrize("eps", [0.0, -1e-5])
def test_norm_non_positive_eps(cls, eps):
    with pytest.raises(ValueError, match=r"eps must be > 0, got"):
        cls(5, eps)


@pytest.mark.parametrize("cls", [LayerNorm, RMSNorm])
def test_norm_wrong_last_dim_names_expected_and_got(cls):
    with pytest.raises(ValueError, match=r"must end with dims \(5,\).*got shape \(2, 3, 4\)"):
        cls(5)(torch.randn(2, 3, 4))


def test_make_norm_unknown_name():
    with pytest.raises(ValueError, match=r"unknown norm 'batch'; choose one of: layer, rms"):
        make_norm("batch", 5)
