"""runtime.linear's prepared formats against F.linear: PackedLinear in float32 and bfloat16, below and above
skinny_max_rows() rows, with and without the kernels."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from torch.testing import assert_close

from sublayer import kernels
from sublayer.runtime.linear import PackedLinear, compact_kernels, skinny_max_rows


def _case(seed: int, rows: int, n: int = 37, k: int = 29):
    g = torch.Generator().manual_seed(seed)
    return torch.randn(rows, k, generator=g), torch.randn(n, k, generator=g), torch.randn(n, generator=g)


def _bf16_reference(x, w, b, activation=None, *, given_bf16=False):
    """What PackedLinear(dtype=bf16) computes: the bf16 weight in the kernel (x rounded to bf16 too for several rows
    on the vdpbf16ps kernel); above skinny_max_rows() torch's GEMM, in bf16 on a native-bf16 CPU, elsewhere on the
    float32 weight as given (``given_bf16``: the bf16 one widened); with the kernels switched off (or unbuilt) torch's
    GEMM for every row count."""
    wb = w.bfloat16()
    if x.shape[0] > skinny_max_rows() or not kernels.enabled():
        if kernels.native_bf16_gemm():
            y = torch.mm(x.bfloat16(), wb.t()).float() + b
        else:
            y = F.linear(x, wb.float() if given_bf16 else w, b)
    else:
        if x.shape[0] > 1 and kernels.ops().decode_bf16_dot(-1):
            x = x.bfloat16().float()
        y = F.linear(x, wb.float(), b)
    return y if activation is None else F.gelu(y, approximate="tanh")


@pytest.mark.parametrize("rows", [1, 5, skinny_max_rows(), skinny_max_rows() + 1, 53])
@pytest.mark.parametrize("activation", [None, "gelu_tanh"])
def test_bf16_packed_linear_matches_the_bf16_weight(rows, activation):
    x, w, b = _case(rows, rows)
    lin = PackedLinear(w, b, dtype=torch.bfloat16)
    assert lin.bias.dtype == torch.float32
    got = lin(x, activation)
    want = _bf16_reference(x, w, b, activation)
    above = rows > lin.max_rows and lin.weight.dtype == torch.bfloat16  # bf16 output rounding of torch's GEMM
    assert_close(got, want, rtol=2**-7 if above else 1e-5, atol=2**-7 if above else 1e-5)


@pytest.mark.parametrize("onednn_fp32", [False, True])  # large products through oneDNN (AMD CPUs with AVX-512)
def test_float32_packed_linear_matches_f_linear(onednn_fp32, monkeypatch):
    from sublayer.kernels import onednn

    if onednn_fp32 and not onednn.available():
        pytest.skip("torch without oneDNN's linear ops")
    monkeypatch.setattr(kernels.cpu, "onednn_fp32_gemm", lambda: onednn_fp32)
    calls, real = [], onednn.linear
    monkeypatch.setattr(onednn, "linear", lambda *a, **k: calls.append(1) or real(*a, **k))
    for rows, n, k in ((1, 37, 29), (7, 37, 29), (skinny_max_rows() + 2, 37, 29), (89, 509, 389)):
        x, w, b = _case(rows, rows, n, k)
        assert_close(PackedLinear(w, b)(x), F.linear(x, w, b), rtol=1e-5, atol=1e-6 * k)  # sums of k products
    # 89 x 389 x 509: over oneDNN's minimum product; with the kernels switched off, F.linear throughout
    assert len(calls) == (onednn_fp32 and kernels.switched_on())


def test_bf16_packed_linear_takes_bf16_weights_and_flat_gives_its_panels():
    x, w, b = _case(3, 4)
    lin = PackedLinear(w.bfloat16(), b, dtype=torch.bfloat16)
    assert_close(lin(x), _bf16_reference(x, w, b, given_bf16=True), rtol=1e-5, atol=1e-5)
    assert (lin.flat() is not None) == kernels.enabled()
    if kernels.enabled():
        packed, scale, bias = lin.flat()
        compact = compact_kernels()  # 12-bit bf16 panels on AVX-512 + AVX512_BF16 CPUs
        assert packed.dtype == (torch.uint8 if compact else torch.bfloat16) and scale.numel() == 0 and bias is lin.bias
        assert_close(kernels.ops().skinny_linear(x, packed, bias, 37), lin(x))


def test_bf16_packed_linear_without_kernels_uses_torch(monkeypatch):
    monkeypatch.setattr(kernels, "_enabled", False)
    x, w, b = _case(4, 3)
    lin = PackedLinear(w, b, dtype=torch.bfloat16)
    assert lin.packed is None and lin.flat() is None
    if kernels.native_bf16_gemm():
        want = torch.mm(x.bfloat16(), w.bfloat16().t()).float() + b
    else:
        want = F.linear(x, w, b)  # the float32 weight as given
    assert_close(lin(x), want)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_packed_linear_without_kernels_takes_an_empty_x(dtype, monkeypatch):
    monkeypatch.setattr(kernels, "_enabled", False)
    x, w, b = _case(5, 0)
    lin = PackedLinear(w, b, dtype=dtype)
    for activation in (None, "gelu_tanh"):
        y = lin(x, activation)
        assert y.shape == (0, 37) and y.dtype == torch.float32


def test_packed_linear_rejects_other_dtypes():
    with pytest.raises(ValueError, match="dtype must be torch.float32 or torch.bfloat16, got torch.float16"):
        PackedLinear(torch.randn(3, 2), dtype=torch.float16)
