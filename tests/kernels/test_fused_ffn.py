"""Fused FFN (sublayer.functional.fused.feed_forward) against the reference sublayer.functional.feed_forward."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from torch import nn
from torch.autograd import gradcheck
from torch.testing import assert_close

import sublayer
import sublayer.functional as SF
from sublayer import kernels
from sublayer.bench.harness import saved_bytes as _saved_activation_bytes  # bytes autograd saves, parameters excluded
from sublayer.functional import fused

from ._tol import as64, assert_fast_close, graph_names, run

pytestmark = pytest.mark.skipif(not kernels.available(), reason="C++ kernels failed to build (see test_loader)")

ACTS = list(fused.FUSED_ACTIVATIONS)
assert {"swiglu", "geglu", "reglu"} <= set(ACTS)  # gated FFNs are fused too


def _params(d, f, d_out, dtype, bias=True, act="relu"):
    f1 = 2 * f if act in SF.GATED_ACTIVATIONS else f  # gated: fc1 packs [gate; up]
    w1 = (torch.randn(f1, d) / d**0.5).to(dtype).requires_grad_()
    b1 = (0.3 * torch.randn(f1)).to(dtype).requires_grad_(bias)
    w2 = (torch.randn(d_out, f) / f**0.5).to(dtype).requires_grad_()
    b2 = (0.3 * torch.randn(d_out)).to(dtype).requires_grad_(bias)
    return w1, b1, w2, b2


def _compare(fast, ref, ins, names=("dx", "dw1", "db1", "dw2", "db2")):
    fo, fg = run(fast, ins)
    ro, rg = run(ref, ins)
    wo, wg = run(ref, as64(ins))
    assert_fast_close(fo, ro, wo, what="out")
    for n, a, r, w in zip(names, fg, rg, wg):
        if r is not None:
            assert_fast_close(a, r, w, what=n)
    return fo, fg


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("act", ACTS)
def test_matches_reference_forward_and_grads(dtype, act):
    x = (2 * torch.randn(3, 5, 13)).to(dtype).requires_grad_()
    ins = [x, *_params(13, 37, 11, dtype, act=act)]

    def f(impl):
        return lambda x, w1, b1, w2, b2: fused.feed_forward(x, w1, b1, w2, b2, activation=act, impl=impl)

    _compare(f("fused"), f("reference"), ins)


@pytest.mark.parametrize("act", ["relu", "gelu", "swiglu"])
def test_recompute_gives_the_same_results_and_saves_only_the_input(act):
    # recompute=True: fc1 (and the activation, with the same dropout mask) runs again in backward; every number
    # equals the default path's bit for bit (same kernels, same seeds), and autograd keeps the input alone.
    x = torch.randn(3, 5, 13, requires_grad=True)
    ins = [x, *_params(13, 37, 11, torch.float32, act=act)]

    def f(recompute):
        gen = torch.Generator().manual_seed(2)
        return lambda *a: fused.feed_forward(
            *a, activation=act, dropout=0.3, output_dropout=0.1, recompute=recompute, impl="fused", generator=gen
        )

    (ao, ag), (bo, bg) = run(f(False), ins), run(f(True), ins)
    assert torch.equal(ao, bo)
    for a, b in zip(ag, bg):
        assert torch.equal(a, b)
    saved = _saved_activation_bytes(lambda: f(True)(*ins), ins[1:])
    assert saved == x.numel() * 4, saved
    # and the reference path checkpoints: same numbers as without recompute, input saved only
    ref = [run(lambda *a, r=r: SF.feed_forward(*a, activation=act), ins) for r in (False,)][0]
    chk = run(lambda *a: fused.feed_forward(*a, activation=act, recompute=True, impl="reference"), ins)
    assert_close(chk[0], ref[0])
    for a, b in zip(chk[1], ref[1]):
        assert_close(a, b)


def test_module_recompute_option():
    ffn = sublayer.PositionWiseFFN(6, 10, activation="geglu", dropout=0.2, recompute=True)
    assert "recompute=True" in repr(ffn)
    x = torch.randn(4, 6, requires_grad=True)
    assert _saved_activation_bytes(lambda: ffn(x), list(ffn.parameters())) == x.numel() * 4
    with pytest.raises(TypeError, match="recompute must be a bool, got 'yes'"):
        sublayer.PositionWiseFFN(6, 10, recompute="yes")


@pytest.mark.parametrize("act", ["relu", "gelu"])
def test_dropout_matches_reference_with_the_same_masks(act):
    # Seeds are drawn in order: the hidden dropout's, then the output dropout's. Rebuild both masks with
    # fused.dropout on ones of the same shapes and compare with the reference applied to masked tensors.
    p, p_out, n, d, f = 0.3, 0.2, 15, 7, 29
    gen = torch.Generator().manual_seed(4)
    m1 = fused.dropout(torch.ones(n, f), p, generator=gen, impl="fused")
    m2 = fused.dropout(torch.ones(n, d), p_out, generator=gen, impl="fused")
    ins = [torch.randn(n, d, requires_grad=True), *_params(d, f, d, torch.float32)]

    def fast(x, w1, b1, w2, b2):
        return fused.feed_forward(
            x, w1, b1, w2, b2, activation=act, dropout=p, output_dropout=p_out, impl="fused",
            generator=torch.Generator().manual_seed(4),
        )  # fmt: skip

    def ref(x, w1, b1, w2, b2):
        h = SF.activation_fn(act)(F.linear(x, w1, b1)) * m1.to(x.dtype)
        return F.linear(h, w2, b2) * m2.to(x.dtype)

    _compare(fast, ref, ins)


@pytest.mark.parametrize("act", ACTS)
def test_gradcheck_float64(act):
    kw = {"dtype": torch.float64, "requires_grad": True}
    x = torch.randn(4, 5, **kw)
    f1 = 14 if act in SF.GATED_ACTIVATIONS else 7
    w1, b1, w2, b2 = torch.randn(f1, 5, **kw), torch.randn(f1, **kw), torch.randn(3, 7, **kw), torch.randn(3, **kw)
    if act in ("relu", "relu2", "reglu"):  # keep pre-activations away from the kink at 0, where finite differences fail
        with torch.no_grad():
            b1 += torch.sign(b1) * 0.5

    def f(x, w1, b1, w2, b2):
        g = torch.Generator().manual_seed(1)
        return fused.feed_forward(
            x, w1, b1, w2, b2, activation=act, dropout=0.25, output_dropout=0.1, impl="fused", generator=g
        )

    assert gradcheck(f, (x, w1, b1, w2, b2), eps=1e-6, atol=1e-5, rtol=1e-3)


@pytest.mark.parametrize("native_bf16", [True, False])  # bf16 GEMMs native, or in fp32 rounded to bf16
@pytest.mark.parametrize("act", ["relu", "gelu_tanh", "swiglu"])
def test_autocast_bf16_with_fp32_weights(act, native_bf16, monkeypatch):
    monkeypatch.setattr(kernels.cpu, "_native_bf16", native_bf16)
    ffn = sublayer.PositionWiseFFN(16, 32, activation=act)
    x = torch.randn(2, 9, 16, requires_grad=True)

    def f(x, w1, b1, w2, b2):
        return fused.feed_forward(x, w1, b1, w2, b2, activation=act)

    params = [ffn.fc1.weight, ffn.fc1.bias, ffn.fc2.weight, ffn.fc2.bias]
    with torch.autocast("cpu", dtype=torch.bfloat16):
        fo, fg = run(lambda *a: fused.feed_forward(*a, activation=act, impl="fused"), [x, *params])
        ro, rg = run(lambda *a: SF.feed_forward(*a, activation=act), [x, *params])
    wo, wg = run(lambda *a: SF.feed_forward(*a, activation=act), as64([x, *params]))
    assert fo.dtype == ro.dtype == torch.bfloat16
    assert all(g.dtype == torch.float32 for g in fg)
    assert_fast_close(fo, ro, wo.to(torch.float64), what="out")
    for n, a, r, w in zip(["dx", "dw1", "db1", "dw2", "db2"], fg, rg, wg):
        assert_fast_close(a, r, w, what=n)
    with torch.autocast("cpu", dtype=torch.bfloat16):  # and the module takes the fused path under autocast
        assert "FFNFn" in graph_names(ffn(x))


@pytest.mark.parametrize("act", ["relu", "gelu", "swiglu"])
def test_saves_at_most_60_percent_of_eager(act):
    d, f = 16, 64
    ours = sublayer.PositionWiseFFN(d, f, activation=act, dropout=0.1)
    x = torch.randn(32, 8, d, requires_grad=True)
    if act == "swiglu":  # eager SwiGLU as users write it (HF LlamaMLP plus dropout)
        w = ours.fc1.weight

        def eager_fn():
            gate, up = F.linear(x, w, ours.fc1.bias).chunk(2, dim=-1)
            return ours.fc2(F.dropout(F.silu(gate) * up, 0.1))

        e = _saved_activation_bytes(eager_fn, list(ours.parameters()))
    else:
        eager = nn.Sequential(nn.Linear(d, f), nn.ReLU() if act == "relu" else nn.GELU(), nn.Dropout(0.1), nn.Linear(f, d))
        e = _saved_activation_bytes(lambda: eager(x), list(eager.parameters()))
    o = _saved_activation_bytes(lambda: ours(x), list(ours.parameters()))
    assert o <= 0.6 * e, (o, e)
    hidden = 2 * f if act == "swiglu" else f  # the input and one (N, f) tensor — (N, 2f) packed when gated; no mask
    assert o == (1 + hidden / d) * x.numel() * 4


def test_odd_shapes_and_layouts():
    for x in (torch.randn(5), torch.randn(0, 4, 5), torch.randn(5, 6, 4).transpose(0, 2), 1e4 * torch.randn(3, 5)):
        for act in ACTS:
            w1, b1, w2, b2 = (t.detach() for t in _params(5, 7, 3, torch.float32, act=act))
            got = fused.feed_forward(x, w1, b1, w2, b2, activation=act, impl="fused")
            want = SF.feed_forward(x, w1, b1, w2, b2, activation=act)
            assert got.shape == want.shape == (*x.shape[:-1], 3)
            assert_close(got, want, rtol=1e-4, atol=1e-5 * max(1.0, x.abs().amax().item() if x.numel() else 0.0))  # |x|=1e4: sums of 1e4s
    for act in ("relu", "swiglu"):  # no biases
        w1, _, w2, _ = (t.detach() for t in _params(5, 7, 3, torch.float32, act=act))
        x = torch.randn(3, 5)
        got = fused.feed_forward(x, w1, None, w2, None, activation=act, impl="fused")
        assert_close(got, SF.feed_forward(x, w1, None, w2, None, activation=act))


@pytest.mark.parametrize("onednn", [True, False])  # float32 GEMMs through oneDNN, or torch's BLAS
@pytest.mark.parametrize("act", ["relu", "swiglu"])
@pytest.mark.parametrize("rows", [0, 1, 257])  # 257 rows: products above oneDNN's minimum size
def test_float32_gemms_through_onednn_or_blas_match_the_reference(act, onednn, rows, monkeypatch):
    if onednn and not (torch.backends.mkldnn.is_available() and hasattr(torch.ops.mkldnn, "_linear_pointwise")):
        pytest.skip("torch built without oneDNN")
    monkeypatch.setattr(kernels.cpu, "onednn_fp32_gemm", lambda: onednn)
    for recompute in (False, True):
        x = (2 * torch.randn(rows, 131)).requires_grad_()
        ins = [x, *_params(131, 523, 137, torch.float32, act=act)]
        assert rows < 257 or rows * 131 * 523 >= kernels.onednn.MIN_MACS

        def f(impl, recompute=recompute):
            return lambda *t: fused.feed_forward(*t, activation=act, impl=impl, recompute=recompute)

        _compare(f("fused"), f("reference"), ins)


def test_batch_zero_backward():
    ffn = sublayer.PositionWiseFFN(5, 7, dropout=0.1)
    x = torch.randn(0, 5, requires_grad=True)
    ffn(x).sum().backward()
    assert x.grad.shape == (0, 5) and ffn.fc1.bias.grad.abs().sum() == 0


def test_dispatch_rules():
    ffn = sublayer.PositionWiseFFN(6, 8, dropout=0.2)
    x = torch.randn(3, 6, requires_grad=True)
    assert "FFNFn" in graph_names(ffn(x))
    gated = sublayer.PositionWiseFFN(6, 8, activation="swiglu")
    assert "FFNFn" in graph_names(gated(x))  # gated activations take the fused path too
    assert_close(gated(x), SF.feed_forward(x, gated.fc1.weight, gated.fc1.bias, gated.fc2.weight, gated.fc2.bias,
                                            activation="swiglu"))
    kernels.set_enabled(False)
    try:
        assert "FFNFn" not in graph_names(ffn(x))
    finally:
        kernels.set_enabled(True)
    ffn.eval()
    assert_close(ffn(x), SF.feed_forward(x, ffn.fc1.weight, ffn.fc1.bias, ffn.fc2.weight, ffn.fc2.bias))


def test_bad_input_errors_match_reference():
    w1, b1, w2, b2 = (t.detach() for t in _params(5, 7, 3, torch.float32))
    with pytest.raises(ValueError, match="d_model=5"):
        fused.feed_forward(torch.randn(2, 4), w1, b1, w2, b2)
    with pytest.raises(ValueError, match="unknown activation"):
        fused.feed_forward(torch.randn(2, 5), w1, b1, w2, b2, activation="tanh")
    with pytest.raises(TypeError, match="dtype"):
        fused.feed_forward(torch.randn(2, 5, dtype=torch.float64), w1, b1, w2, b2)
    with pytest.raises(ValueError, match="impl"):
        fused.feed_forward(torch.randn(2, 5), w1, b1, w2, b2, impl="nope")


def test_double_backward_is_refused_clearly():
    ffn = sublayer.PositionWiseFFN(4, 6)
    x = torch.randn(2, 4, requires_grad=True)
    with pytest.raises(RuntimeError, match="double backward"):  # never a silently detached gradient
        torch.autograd.grad(ffn(x).sum(), x, create_graph=True)
    an = sublayer.AddNorm(4)
    with pytest.raises(RuntimeError, match="double backward"):
        torch.autograd.grad(an(x, x).sum(), x, create_graph=True)



@pytest.mark.parametrize("act", ACTS)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_activations_at_nan_and_infinities_are_torchs(act, dtype):
    # NaN stays NaN (ReLU's z > 0 ? z : 0 made it 0); z * sigmoid(z) at z = -inf is -inf * 0 = NaN as in torch, not
    # -inf (the clamped exp left sigmoid(-inf) a tiny positive number); huge negatives give 0 (GELU at +inf is +inf,
    # its limit, where torch's float32 GELU gives NaN: docs/performance.md)
    z = torch.tensor([float("nan"), -float("inf"), -1e30, -100.0, -3.0, 0.0, 2.0, 1e30] * 3, dtype=dtype)
    gated = act in SF.GATED_ACTIVATIONS
    if gated:  # [gate | up], up = 2
        got = kernels.ops().glu_fwd(torch.cat([z, torch.full_like(z, 2.0)])[None].repeat(5, 1), None, fused.GLU_IDS[act], 0.0, 0)
    else:
        got = kernels.ops().act_fwd(z[None].repeat(5, 1), None, fused.ACT_IDS[act], 0.0, 0, True)
    want = SF.activation_fn(act)(z.float()) * (2 if gated else 1)
    for row in got.float():
        assert torch.equal(row.isnan(), want.isnan()), (row, want)
        assert_close(row[~want.isnan()], want[~want.isnan()], atol=1e-6, rtol=1e-2)
