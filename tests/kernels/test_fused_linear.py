"""fused.linear against F.linear: bf16 linears whose GEMMs run in fp32 on CPUs without native bf16 GEMMs, and float32
linears through oneDNN where torch's BLAS runs a generic path (AMD CPUs with AVX-512)."""

from __future__ import annotations

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st
import torch.nn.functional as F
from torch.autograd import gradcheck
from torch.testing import assert_close

import sublayer
from sublayer import kernels
from sublayer.functional import fused
from sublayer.kernels import onednn

from ._tol import as64, assert_fast_close, run


def _names(t: torch.Tensor) -> str:
    """Names of every autograd node behind ``t`` (which path produced it); fused.linear's node with the dtype its
    products ran in (BF16 or ONEDNN)."""
    seen, todo, names = set(), [t.grad_fn], []
    while todo:
        fn = todo.pop()
        if fn is None or fn in seen:
            continue
        seen.add(fn)
        name = type(fn).__name__
        names.append(f"{name}[{fn.saved_tensors[0].dtype}]" if name == "_LinearFnBackward" else name)
        todo.extend(n for n, _ in fn.next_functions)
    return " ".join(names)


BF16 = "_LinearFnBackward[torch.bfloat16]"  # the bf16 path: fp32 products of bf16 operands
ONEDNN = "_LinearFnBackward[torch.float32]"  # the float32 path through oneDNN


def _takes(path: str, t: torch.Tensor) -> bool:
    """Whether ``t`` came out of fused.linear's ``path`` exactly when the kernels are switched on: with them switched
    off (``SUBLAYER_KERNELS=0``, :func:`kernels.set_enabled`) fused.linear is F.linear itself, and every comparison
    with F.linear below must then hold exactly."""
    return (path in _names(t)) == kernels.switched_on()


@pytest.fixture
def slow_native_bf16(monkeypatch):
    monkeypatch.setattr(kernels.cpu, "_native_bf16", False)  # as on AVX2-only CPUs like this project's


@pytest.mark.parametrize("bias", [True, False])
@pytest.mark.parametrize("autocast", [True, False])  # fp32 weights under autocast, or bf16 tensors
def test_matches_f_linear_within_bf16_error(slow_native_bf16, autocast, bias):
    dt = torch.float32 if autocast else torch.bfloat16
    x = torch.randn(3, 7, 13).to(dt).requires_grad_()
    w = (torch.randn(11, 13) / 13**0.5).to(dt).requires_grad_()
    b = torch.randn(11).to(dt).requires_grad_() if bias else None
    ins = [x, w] + ([b] if bias else [])
    ctx = torch.autocast("cpu", dtype=torch.bfloat16) if autocast else torch.autocast("cpu", enabled=False)
    with ctx:
        fo, fg = run(lambda *a: fused.linear(*a), ins)
        ro, rg = run(lambda *a: F.linear(*a), ins)
        assert _takes(BF16, fused.linear(*ins))
    wo, wg = run(lambda *a: F.linear(*a), as64(ins))
    assert fo.dtype == ro.dtype == torch.bfloat16
    assert_fast_close(fo, ro, wo, what="out")
    for n, a, r, w64 in zip(["dx", "dw", "db"], fg, rg, wg):
        assert a.dtype == r.dtype == dt  # gradients come back in the leaves' dtypes, as with F.linear
        assert_fast_close(a, r, w64, what=n)
    if not kernels.switched_on():
        assert all(torch.equal(a, r) for a, r in zip([fo, *fg], [ro, *rg]))


@pytest.mark.parametrize("bias", [True, False])
def test_gradcheck_float64_of_the_bf16_linear_function(bias):
    # the autograd Function behind the bf16 path, on float64 operands (it keeps their dtype)
    kw = {"dtype": torch.float64, "requires_grad": True}
    x, w = torch.randn(6, 5, **kw), torch.randn(3, 5, **kw)
    b = torch.randn(3, **kw) if bias else None
    assert gradcheck(lambda x, w, b: fused._LinearFn.apply(x, w, b), (x, w, b))


def test_bf16_path_has_higher_order_gradients(slow_native_bf16):
    # a backward with create_graph=True runs torch's own (bf16) products, differentiable again
    g = torch.Generator().manual_seed(3)
    x = torch.randn(4, 6, generator=g).bfloat16().requires_grad_()
    w = torch.randn(5, 6, generator=g).bfloat16().requires_grad_()

    def hessian_term(lin):  # d/dw of sum(d/dx sum(lin(x, w)^2))
        (gx,) = torch.autograd.grad(lin(x, w).float().pow(2).sum(), x, create_graph=True)
        return torch.autograd.grad(gx.float().sum(), w)[0].float()

    assert _takes(BF16, fused.linear(x, w))
    got, want = hessian_term(fused.linear), hessian_term(F.linear)
    if not kernels.switched_on():
        assert torch.equal(got, want)
    assert_close(got, want, rtol=3e-2, atol=3e-2 * want.abs().max().item())


def test_everything_else_is_f_linear_itself(monkeypatch):
    x, w, b = torch.randn(4, 5), torch.randn(3, 5), torch.randn(3)
    assert torch.equal(fused.linear(x, w, b), F.linear(x, w, b))  # fp32, no autocast
    monkeypatch.setattr(kernels.cpu, "_native_bf16", True)  # a CPU with AMX / AVX512_BF16: oneDNN's own bf16 GEMM
    with torch.autocast("cpu", dtype=torch.bfloat16):
        x.requires_grad_()
        assert BF16 not in _names(fused.linear(x, w, b))
        assert torch.equal(fused.linear(x, w, b), F.linear(x, w, b))
    monkeypatch.setattr(kernels.cpu, "_native_bf16", False)
    kernels.set_enabled(False)  # the switch turns it off with the other fast paths
    try:
        with torch.autocast("cpu", dtype=torch.bfloat16):
            assert BF16 not in _names(fused.linear(x, w, b))
    finally:
        kernels.set_enabled(True)
    with pytest.raises(RuntimeError, match="shapes cannot be multiplied"):  # F.linear's own error
        fused.linear(torch.randn(2, 4).bfloat16(), w.bfloat16())


def test_attention_module_uses_it_under_autocast(slow_native_bf16):
    torch.manual_seed(0)
    mha = sublayer.MultiHeadAttention(12, 3)
    x = torch.randn(2, 5, 12, requires_grad=True)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        out, _ = mha(x)
        assert _takes(BF16, out)
        kernels.set_enabled(False)
        try:
            ref, _ = mha(x)
        finally:
            kernels.set_enabled(True)
    assert out.dtype == ref.dtype == torch.bfloat16
    assert_close(out, ref, rtol=2e-2, atol=2e-2)  # two paths, each with bf16 rounding of q/k/v and the output
    if not kernels.switched_on():
        assert torch.equal(out, ref)
    out.float().sum().backward()
    assert x.grad is not None and mha.q_proj.weight.grad.dtype == torch.float32


@pytest.fixture
def onednn_fp32(monkeypatch):
    if not onednn.available():
        pytest.skip("torch without oneDNN's linear ops")
    monkeypatch.setattr(kernels.cpu, "onednn_fp32_gemm", lambda: True)  # as on an AMD CPU with AVX-512


# (3, 29) rows x 389 -> 509: 2^24 multiply-adds and more, the smallest products the oneDNN path takes
_X, _N = (3, 29, 389), 509


@pytest.mark.parametrize("bias", [True, False])
def test_float32_onednn_path_matches_f_linear(onednn_fp32, bias):
    g = torch.Generator().manual_seed(5)
    x = torch.randn(*_X, generator=g).requires_grad_()
    w = (torch.randn(_N, _X[-1], generator=g) / _X[-1] ** 0.5).requires_grad_()
    b = torch.randn(_N, generator=g).requires_grad_() if bias else None
    ins = [x, w] + ([b] if bias else [])
    assert _takes(ONEDNN, fused.linear(*ins))
    fo, fg = run(lambda *a: fused.linear(*a), ins, g_dtype=torch.float32)
    ro, rg = run(lambda *a: F.linear(*a), ins, g_dtype=torch.float32)
    wo, wg = run(lambda *a: F.linear(*a), as64(ins), g_dtype=torch.float32)
    assert_fast_close(fo, ro, wo, what="out")
    for n, a, r, w64 in zip(["dx", "dw", "db"], fg, rg, wg):
        assert a.dtype == torch.float32
        assert_fast_close(a, r, w64, what=n)
    if not kernels.switched_on():
        assert all(torch.equal(a, r) for a, r in zip([fo, *fg], [ro, *rg]))


def test_float32_onednn_path_has_higher_order_gradients(onednn_fp32):
    g = torch.Generator().manual_seed(6)
    x = torch.randn(*_X, generator=g, dtype=torch.float64).float().requires_grad_()
    w = (torch.randn(_N, _X[-1], generator=g) / _X[-1] ** 0.5).requires_grad_()
    b = torch.randn(_N, generator=g).requires_grad_()

    def hessian_term(lin):  # d/dw of sum(d/dx sum(lin(x)^2))
        (gx,) = torch.autograd.grad(lin(x, w, b).pow(2).sum(), x, create_graph=True)
        return torch.autograd.grad(gx.sum(), (w, b))

    assert _takes(ONEDNN, fused.linear(x, w, b))
    for got, want in zip(hessian_term(fused.linear), hessian_term(F.linear)):
        assert_close(got, want, rtol=1e-4, atol=1e-4 * want.abs().max().item())
        assert kernels.switched_on() or torch.equal(got, want)


def test_float32_onednn_path_only_where_it_applies(onednn_fp32, monkeypatch):
    x, w = torch.randn(*_X, requires_grad=True), torch.randn(_N, _X[-1])
    assert _takes(ONEDNN, fused.linear(x, w))
    small = fused.linear(x[:, :1], w)  # 3 rows: fewer multiply-adds than repay oneDNN's per-call cost
    assert ONEDNN not in _names(small) and torch.equal(small, F.linear(x[:, :1], w))
    wt = torch.randn(_X[-1], _N).t()  # a weight that is not row-major
    assert ONEDNN not in _names(fused.linear(x, wt))
    strided_bias = torch.randn(2 * _N)[::2]
    assert_close(fused.linear(x, w, strided_bias), F.linear(x, w, strided_bias))
    assert ONEDNN not in _names(fused.linear(x.double(), w.double()))
    with torch.autocast("cpu", dtype=torch.bfloat16):
        assert ONEDNN not in _names(fused.linear(x, w))
    with pytest.raises(RuntimeError, match="shapes cannot be multiplied"):  # F.linear's own errors
        fused.linear(x, torch.randn(_N, 7))
    with pytest.raises(RuntimeError):
        fused.linear(x, w, torch.randn(_N + 1))
    kernels.set_enabled(False)
    try:
        assert torch.equal(fused.linear(x, w), F.linear(x, w))
    finally:
        kernels.set_enabled(True)
    monkeypatch.setattr(kernels.cpu, "onednn_fp32_gemm", lambda: False)  # Intel CPUs, AVX2-only CPUs
    assert torch.equal(fused.linear(x, w), F.linear(x, w))


def test_attention_module_uses_the_float32_onednn_path(onednn_fp32):
    torch.manual_seed(0)
    mha = sublayer.MultiHeadAttention(391, 17)  # 111 rows x 391 x 391: over 2^24 multiply-adds a projection
    x = torch.randn(3, 37, 391, requires_grad=True)
    out, _ = mha(x)
    assert _takes(ONEDNN, out)
    kernels.set_enabled(False)
    try:
        ref, _ = mha(x)
        (gref,) = torch.autograd.grad(ref.sum(), x)
    finally:
        kernels.set_enabled(True)
    (got,) = torch.autograd.grad(out.sum(), x)
    assert_close(out, ref, rtol=1e-4, atol=1e-5)
    assert_close(got, gref, rtol=1e-4, atol=1e-5)
    assert kernels.switched_on() or (torch.equal(out, ref) and torch.equal(got, gref))


@settings(max_examples=25, deadline=None)
@given(rows=st.integers(1, 300), k=st.integers(1, 400), n=st.integers(1, 600), bias=st.booleans(),
       seed=st.integers(0, 2**16))  # fmt: skip
def test_float32_path_matches_f_linear_at_any_shape(rows, k, n, bias, seed):
    """Property: whichever side of oneDNN's minimum product a shape falls, fused.linear (oneDNN forced on) gives
    F.linear's output and gradients within the reference's own float32 error."""
    if not onednn.available():
        return
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(rows, k, generator=g).requires_grad_()
    w = (torch.randn(n, k, generator=g) / k**0.5).requires_grad_()
    ins = [x, w] + ([torch.randn(n, generator=g).requires_grad_()] if bias else [])
    was = kernels.cpu.onednn_fp32_gemm
    kernels.cpu.onednn_fp32_gemm = lambda: True
    try:
        taken = ONEDNN in _names(fused.linear(*ins))
        fo, fg = run(lambda *a: fused.linear(*a), ins, g_dtype=torch.float32)
    finally:
        kernels.cpu.onednn_fp32_gemm = was
    assert taken == (kernels.switched_on() and rows * k * n >= onednn.MIN_MACS)  # switched off: F.linear itself
    ro, rg = run(lambda *a: F.linear(*a), ins, g_dtype=torch.float32)
    wo, wg = run(lambda *a: F.linear(*a), as64(ins), g_dtype=torch.float32)
    assert_fast_close(fo, ro, wo, what="out")
    for name, a, r, w64 in zip(["dx", "dw", "db"], fg, rg, wg):
        assert_fast_close(a, r, w64, what=name)
    assert taken or all(torch.equal(a, r) for a, r in zip([fo, *fg], [ro, *rg]))
