"""Fused linear + cross-entropy: parity with ``F.cross_entropy(F.linear(...))`` forward and backward, gradcheck,
double backward, chunk-size independence, ignored rows, label smoothing, bf16, saved bytes, argument errors."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from torch.testing import assert_close

from sublayer.bench.harness import saved_bytes as _saved_bytes
from sublayer.functional import linear_cross_entropy

N, D, V = 11, 7, 13
MODES = [False, True]  # grad_in_forward


def _inputs(n=N, d=D, v=V, *, bias=True, dtype=torch.float32, seed=0, ignore=(1, 4)):
    g = torch.Generator().manual_seed(seed)
    h = torch.randn(n, d, generator=g, dtype=torch.float64).to(dtype).requires_grad_()
    w = (torch.randn(v, d, generator=g, dtype=torch.float64) * 0.7).to(dtype).requires_grad_()
    b = (torch.randn(v, generator=g, dtype=torch.float64) * 0.3).to(dtype).requires_grad_() if bias else None
    t = torch.randint(0, v, (n,), generator=g)
    t[list(ignore)] = -100
    return h, w, b, t


def _params(h, w, b):
    return [x for x in (h, w, b) if x is not None]


def _ref(h, w, b, t, **kw):
    return F.cross_entropy(F.linear(h, w, b), t, **kw)


@pytest.mark.parametrize("grad_in_forward", MODES)
@pytest.mark.parametrize("bias", [False, True])
@pytest.mark.parametrize("kw", [{}, {"label_smoothing": 0.2}, {"reduction": "sum"}, {"ignore_index": 5}])
def test_forward_backward_equal_eager(grad_in_forward, bias, kw):
    h, w, b, t = _inputs(bias=bias)
    if "ignore_index" in kw:
        t = t.masked_fill(t == -100, 5)
    want = _ref(h, w, b, t, **kw)
    got = linear_cross_entropy(h, w, t, bias=b, chunk_size=3 * V, grad_in_forward=grad_in_forward, **kw)
    assert got.dtype == torch.float32
    assert_close(got, want)
    for g, r in zip(torch.autograd.grad(got, _params(h, w, b)), torch.autograd.grad(want, _params(h, w, b))):
        assert_close(g, r)


@pytest.mark.parametrize("grad_in_forward", MODES)
@pytest.mark.parametrize("smoothing", [0.0, 0.3])
def test_gradcheck_float64(grad_in_forward, smoothing):
    h, w, b, t = _inputs(5, 3, 7, dtype=torch.float64, ignore=(2,))

    def f(h, w, b):
        return linear_cross_entropy(
            h, w, t, bias=b, label_smoothing=smoothing, chunk_size=10, grad_in_forward=grad_in_forward
        )

    assert torch.autograd.gradcheck(f, (h, w, b))


@pytest.mark.parametrize("grad_in_forward", MODES)
@pytest.mark.parametrize("kw", [{}, {"label_smoothing": 0.2, "reduction": "sum"}])
def test_double_backward_gradient_penalty_equals_eager(grad_in_forward, kw):
    """A gradient penalty (create_graph=True) reaches h, weight and bias as through the eager composition."""
    h, w, b, t = _inputs()

    def penalized(loss_fn):
        loss = loss_fn(h, w, b, t)
        (gh,) = torch.autograd.grad(loss, h, create_graph=True)
        assert gh.requires_grad
        return torch.autograd.grad(loss + 3.0 * gh.square().sum(), _params(h, w, b))

    got = penalized(lambda *a: linear_cross_entropy(*a[:2], a[3], bias=a[2], grad_in_forward=grad_in_forward, **kw))
    for g, r in zip(got, penalized(lambda *a: _ref(*a, **kw))):
        assert_close(g, r)


@pytest.mark.parametrize("grad_in_forward", MODES)
def test_gradgradcheck_float64(grad_in_forward):
    h, w, b, t = _inputs(5, 3, 7, dtype=torch.float64, ignore=(2,))

    def f(h, w, b):
        return linear_cross_entropy(h, w, t, bias=b, label_smoothing=0.1, grad_in_forward=grad_in_forward)

    assert torch.autograd.gradgradcheck(f, (h, w, b))


@pytest.mark.parametrize("grad_in_forward", MODES)
def test_chunk_size_does_not_change_the_result(grad_in_forward):
    h, w, b, t = _inputs(17, 5, 11)
    results = []
    for chunk in (1, 7, 11 * 3, 11 * 17, 10_000):
        loss = linear_cross_entropy(h, w, t, bias=b, chunk_size=chunk, grad_in_forward=grad_in_forward)
        results.append((loss, *torch.autograd.grad(loss, (h, w, b))))
    for r in results[1:]:
        for a, c in zip(r, results[0]):
            assert_close(a, c)


@pytest.mark.parametrize("grad_in_forward", MODES)
@pytest.mark.parametrize("bias", [False, True])
def test_many_rows_packed_weight_equal_eager(grad_in_forward, bias):
    """From PACKED_MIN_ROWS rows the forward's logits GEMMs run on a weight packed for oneDNN: the same loss and
    gradients as the eager expression, chunked or not."""
    from sublayer.functional import cross_entropy

    from sublayer import kernels

    h, w, b, t = _inputs(cross_entropy.PACKED_MIN_ROWS + 5, 13, 29, bias=bias)
    packs = torch.backends.mkldnn.is_available() and kernels.switched_on()  # switched off: torch's GEMMs throughout
    assert (cross_entropy._packed_weight(w.detach(), h.shape[0]) is not None) == packs
    want = _ref(h, w, b, t)
    want_g = torch.autograd.grad(want, _params(h, w, b))
    for chunk in (29 * 37, None):
        got = linear_cross_entropy(h, w, t, bias=b, chunk_size=chunk, grad_in_forward=grad_in_forward)
        assert_close(got, want)
        for g, r in zip(torch.autograd.grad(got, _params(h, w, b)), want_g):
            assert_close(g, r)


def test_ignored_rows_get_zero_gradient_and_their_values_do_not_matter():
    h, w, b, t = _inputs()
    loss = linear_cross_entropy(h, w, t, bias=b)
    (gh,) = torch.autograd.grad(loss, h)
    assert (gh[t == -100] == 0).all() and (gh[t != -100] != 0).any()
    h2 = h.detach().clone()
    h2[t == -100] = 1e4  # would overflow a softmax if the row were computed
    assert_close(linear_cross_entropy(h2, w, t, bias=b), loss)


def test_all_targets_ignored():
    h, w, b, t = _inputs()
    t = torch.full_like(t, -100)
    with pytest.raises(ValueError, match="every target is ignore_index=-100.*undefined"):
        linear_cross_entropy(h, w, t, bias=b)
    assert torch.isnan(_ref(h, w, b, t))  # the reason: torch's mean over zero targets
    for mode in MODES:  # a sum over zero targets is 0, with zero gradients, as torch
        loss = linear_cross_entropy(h, w, t, bias=b, reduction="sum", grad_in_forward=mode)
        assert_close(loss, _ref(h, w, b, t, reduction="sum"))
        for g in torch.autograd.grad(loss, (h, w, b)):
            assert (g == 0).all()


def test_one_row_and_no_grad():
    h, w, b, t = _inputs(1, ignore=())
    assert_close(linear_cross_entropy(h, w, t, bias=b), _ref(h, w, b, t))
    with torch.no_grad():
        assert_close(linear_cross_entropy(h, w, t, grad_in_forward=True), _ref(h, w, None, t))


def test_bfloat16_computes_in_float32():
    h, w, b, t = _inputs(bias=True, dtype=torch.bfloat16)
    got = linear_cross_entropy(h, w, t, bias=b)
    grads = torch.autograd.grad(got, (h, w, b))
    # the same math on the exact fp32 upcast of the bf16 values; gradients rounded to bf16 once
    h32, w32, b32 = (x.detach().float().requires_grad_() for x in (h, w, b))
    want = _ref(h32, w32, b32, t)
    assert got.dtype == torch.float32
    assert_close(got, want)
    for g, r in zip(grads, torch.autograd.grad(want, (h32, w32, b32))):
        assert g.dtype == torch.bfloat16
        assert_close(g, r.to(torch.bfloat16))


def test_bfloat16_rows_with_float32_weight_as_under_autocast():
    h, w, b, t = _inputs()
    hb = h.detach().bfloat16().requires_grad_()
    got = linear_cross_entropy(hb, w, t, bias=b)
    h32 = hb.detach().float().requires_grad_()
    want = _ref(h32, w, b, t)
    assert_close(got, want)
    gh, gw = torch.autograd.grad(got, (hb, w))
    rh, rw = torch.autograd.grad(want, (h32, w))
    assert gh.dtype == torch.bfloat16 and gw.dtype == torch.float32
    assert_close(gh, rh.bfloat16())
    assert_close(gw, rw)


def _autocast_ref(h, w, b, t, **kw):
    """Autocast's eager composition: bf16 logits, float32 loss."""
    with torch.autocast("cpu", dtype=torch.bfloat16):
        return F.cross_entropy(F.linear(h, w, b).float(), t, **kw)


@pytest.mark.parametrize("bias", [False, True])
@pytest.mark.parametrize("kw", [{}, {"label_smoothing": 0.2}, {"reduction": "sum"}, {"ignore_index": 5}])
@pytest.mark.parametrize("upstream", [1.0, 0.37])
def test_bf16_autocast_equals_autocast_eager(bias, kw, upstream):
    """Under bf16 autocast: autocast's bf16 GEMMs and float32 loss, to bf16 rounding; float32 gradients for float32
    inputs, bf16 for bf16 rows; an upstream gradient other than 1 (num_items_in_batch) scales every gradient."""
    h, w, b, t = _inputs(n=29, d=17, v=53, bias=bias, ignore=(1, 4, 23))
    ignore = kw.get("ignore_index", -100)
    if ignore != -100:
        t[t == -100] = ignore
    hb = h.detach().bfloat16().requires_grad_()
    for rows in (h, hb):
        with torch.autocast("cpu", dtype=torch.bfloat16):
            got = linear_cross_entropy(rows, w, t, bias=b, **kw)
        want = _autocast_ref(rows, w, b, t, **kw)
        assert got.dtype == torch.float32
        assert_close(got, want, rtol=1e-5, atol=1e-5)
        params = _params(rows, w, b)
        for g, r in zip(torch.autograd.grad(got * upstream, params), torch.autograd.grad(want * upstream, params)):
            assert g.dtype == r.dtype
            assert_close(g, r, rtol=2e-2, atol=2e-2 * r.abs().max().item())


def test_bf16_autocast_target_far_below_the_max():
    """A target whose probability underflows float32 still gets its finite loss (log-sum-exp minus its logit)."""
    h, w, _, t = _inputs(n=5, d=3, v=7, bias=False, ignore=())
    w = torch.zeros(7, 3)
    w[0, 0], w[1, 0] = 40.0, -40.0
    h = torch.zeros(5, 3)
    h[:, 0] = 3.0  # logit 120 for class 0, -120 for class 1: p(class 1) = e^-240
    t = torch.tensor([1, 0, 1, 2, 1])
    with torch.autocast("cpu", dtype=torch.bfloat16):
        got = linear_cross_entropy(h, w, t, reduction="sum")
    want = _autocast_ref(h, w, None, t, reduction="sum")
    assert torch.isfinite(got) and got > 600
    assert_close(got, want)


def test_bf16_autocast_edge_cases():
    h, w, b, t = _inputs(n=7, d=5, v=11)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        none = linear_cross_entropy(h, w, torch.full((7,), -100), bias=b, reduction="sum")
        loss = linear_cross_entropy(h, w, t, bias=b)
    assert none.item() == 0.0
    grads = torch.autograd.grad(none, (h, w, b))
    assert all(not bool(g.any()) for g in grads)
    with pytest.raises(RuntimeError, match="no double backward"):
        torch.autograd.grad(loss, h, create_graph=True)
    with torch.autocast("cpu", dtype=torch.bfloat16), torch.no_grad():  # no grad: nothing saved, same loss
        assert_close(linear_cross_entropy(h, w, t, bias=b), loss.detach())


@pytest.mark.parametrize("grad_in_forward", MODES)
def test_frozen_weight_and_bias(grad_in_forward):
    h, w, b, t = _inputs()
    w, b = w.detach(), b.detach()
    got = linear_cross_entropy(h, w, t, bias=b, grad_in_forward=grad_in_forward)
    got.backward()
    want = _ref(h, w, b, t)
    assert_close(h.grad, torch.autograd.grad(want, h)[0])
    assert w.grad is None and b.grad is None


def test_retained_graph_backward_twice():
    h, w, b, t = _inputs()
    for mode in MODES:
        loss = linear_cross_entropy(h, w, t, bias=b, grad_in_forward=mode)
        g1 = torch.autograd.grad(loss, h, retain_graph=True)[0]
        g2 = torch.autograd.grad(loss * 2, h)[0]
        assert_close(g2, 2 * g1)


def test_saves_no_logits_for_backward():
    n, d, v = 64, 16, 512
    h, w, b, t = _inputs(n, d, v, bias=False, ignore=())
    eager = _saved_bytes(lambda: _ref(h, w, None, t), [w])
    fused = _saved_bytes(lambda: linear_cross_entropy(h, w, t), [w])
    assert eager >= n * v * 4  # the log-probabilities
    assert fused <= n * d * 4 + 2 * n * 8  # h rows, one log-sum-exp per row (and the targets)


def test_bad_inputs():
    h, w, b, t = _inputs()
    with pytest.raises(TypeError, match="h must be a torch.Tensor"):
        linear_cross_entropy(h.tolist(), w, t)
    with pytest.raises(ValueError, match=r"weight must have shape \(vocab_size, D=7\), got \(13, 6\)"):
        linear_cross_entropy(h, w[:, :6], t)
    with pytest.raises(ValueError, match=r"h must have shape \(N, D\)"):
        linear_cross_entropy(h[None], w, t)
    with pytest.raises(TypeError, match="weight must be a floating-point tensor, got dtype torch.int64"):
        linear_cross_entropy(h, w.long(), t)
    with pytest.raises(ValueError, match=r"bias must have shape \(vocab_size=13,\), got \(12,\)"):
        linear_cross_entropy(h, w, t, bias=b[:12])
    with pytest.raises(ValueError, match=r"target must have shape \(N=11,\), got \(10,\)"):
        linear_cross_entropy(h, w, t[:10])
    with pytest.raises(TypeError, match="target must hold integer class ids"):
        linear_cross_entropy(h, w, t.float())
    with pytest.raises(ValueError, match=r"target must lie in \[0, vocab_size=13\) or equal ignore_index=-100, got 13"):
        linear_cross_entropy(h, w, t.masked_fill(t == 0, 13))
    with pytest.raises(ValueError, match="label_smoothing must be in \\[0, 1\\], got 1.5"):
        linear_cross_entropy(h, w, t, label_smoothing=1.5)
    with pytest.raises(ValueError, match="unknown reduction 'none'"):
        linear_cross_entropy(h, w, t, reduction="none")
    with pytest.raises(ValueError, match="chunk_size must be a positive int, got 0"):
        linear_cross_entropy(h, w, t, chunk_size=0)
    with pytest.raises(TypeError, match="ignore_index must be an int"):
        linear_cross_entropy(h, w, t, ignore_index=None)
    with pytest.raises(TypeError, match="grad_in_forward must be a bool"):
        linear_cross_entropy(h, w, t, grad_in_forward="yes")
    with pytest.raises(TypeError, match="h must be a floating-point tensor"):
        linear_cross_entropy(t[:, None].expand(N, D), w, t)


@pytest.mark.parametrize("grad_in_forward", MODES)
@pytest.mark.parametrize("bias", [False, True])
def test_input_gradient_through_onednn_equal_eager(grad_in_forward, bias, monkeypatch):
    """Where torch's BLAS runs a generic path (AMD CPUs with AVX-512) the logits (forward, and recomputed in
    backward) and the input gradient's (n, V) @ (V, D) product run on oneDNN: the same loss and gradients as the
    eager expression."""
    from sublayer import kernels
    from sublayer.kernels import onednn

    if not onednn.available():
        pytest.skip("torch without oneDNN's linear ops")
    monkeypatch.setattr(kernels.cpu, "onednn_fp32_gemm", lambda: True)
    calls, mm, linear = [], onednn.mm, onednn.linear
    monkeypatch.setattr(onednn, "mm", lambda a, b: calls.append(a.shape[0] * a.shape[1] * b.shape[1]) or mm(a, b))
    logits = []  # the logits GEMMs on oneDNN (onednn.mm calls onednn.linear too: counted apart by the weight)
    monkeypatch.setattr(onednn, "linear", lambda a, w, *r, **k: logits.append(w.shape) or linear(a, w, *r, **k))
    h, w, b, t = _inputs(67, 257, 1031, bias=bias)  # 67 x 1031 x 257: over oneDNN's minimum product
    want = _ref(h, w, b, t, label_smoothing=0.1)
    got = linear_cross_entropy(h, w, t, bias=b, label_smoothing=0.1, grad_in_forward=grad_in_forward)
    assert_close(got, want)
    for g, r in zip(torch.autograd.grad(got, _params(h, w, b)), torch.autograd.grad(want, _params(h, w, b))):
        assert_close(g, r)
    if not kernels.switched_on():  # SUBLAYER_KERNELS=0: torch's GEMMs throughout
        assert not calls and not logits
        return
    assert calls and min(calls) >= onednn.MIN_MACS
    assert logits.count((1031, 257)) == (1 if grad_in_forward else 2)  # the forward's, and the backward's again


@pytest.mark.parametrize("grad_in_forward", MODES)
@pytest.mark.parametrize("rows", [100, 300])  # oneDNN on the weight as it is, and on the packed weight
@pytest.mark.parametrize("kind", ["strided", "expanded"])
def test_bias_with_any_strides_equals_eager(grad_in_forward, rows, kind, monkeypatch):
    """oneDNN reads a bias as a dense vector: a strided or expanded bias must be made contiguous first."""
    from sublayer import kernels

    monkeypatch.setattr(kernels.cpu, "onednn_fp32_gemm", lambda: True)
    h, w, _, t = _inputs(rows, 257, 1031, bias=False)
    b = (torch.randn(2 * 1031, dtype=torch.float64)[::2] if kind == "strided" else torch.tensor(0.3).expand(1031))
    b = b.float().requires_grad_() if kind == "strided" else b
    want = _ref(h, w, b, t)
    got = linear_cross_entropy(h, w, t, bias=b, grad_in_forward=grad_in_forward)
    assert_close(got, want)
    params = [h, w] + ([b] if b.requires_grad else [])
    for g, r in zip(torch.autograd.grad(got, params), torch.autograd.grad(want, params)):
        assert_close(g, r)


@pytest.mark.parametrize("rows", [67, 300])
def test_kernels_switched_off_run_no_onednn(rows, monkeypatch):
    """``sublayer.kernels.set_enabled(False)`` gives the reference products everywhere, the loss's included."""
    from sublayer import kernels
    from sublayer.kernels import onednn

    monkeypatch.setattr(kernels.cpu, "onednn_fp32_gemm", lambda: True)
    calls, linear = [], onednn.linear
    monkeypatch.setattr(onednn, "linear", lambda *a, **k: calls.append(1) or linear(*a, **k))
    h, w, b, t = _inputs(rows, 257, 1031)
    kernels.set_enabled(False)
    try:
        got = linear_cross_entropy(h, w, t, bias=b)
        grads = torch.autograd.grad(got, [h, w, b])
    finally:
        kernels.set_enabled(True)
    assert not calls
    want = _ref(h, w, b, t)
    assert_close(got, want)
    for g, r in zip(grads, torch.autograd.grad(want, [h, w, b])):
        assert_close(g, r)


def test_uint8_targets_mean_their_values_as_in_torch():
    """torch takes uint8 class ids; ignore_index is compared with their values, never wrapped to 8 bits (-100 is
    156 as a uint8, and 258 is 2)."""
    g = torch.Generator().manual_seed(3)
    h = torch.randn(5, 7, generator=g, requires_grad=True)
    w = torch.randn(257, 7, generator=g, requires_grad=True)
    t = torch.tensor([156, 2, 255, 0, 156], dtype=torch.uint8)
    for kw in ({}, {"ignore_index": 258}, {"ignore_index": 2, "label_smoothing": 0.1}):
        got = linear_cross_entropy(h, w, t, **kw)
        want = _ref(h, w, None, t, **kw)
        assert_close(got, want)
        assert_close(torch.autograd.grad(got, (h, w)), torch.autograd.grad(want, (h, w)))
    with pytest.raises(ValueError, match=r"target must lie in \[0, vocab_size=200\) or equal ignore_index=-100, got 255"):
        linear_cross_entropy(h, w[:200], t)
