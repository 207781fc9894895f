"""sublayer.runtime.encoder: the one prepared BERT encoder, run by FastBert (float32 / bf16), QuantizedBert (int8 on
either GEMM) and ``sublayer.hf``'s patched ``BertModel``, against the references: ``Bert.forward`` and HF's
``BertModel``; right and left padding, a row of padding only, no padding; prepared weights after optimizer steps
and ``.data`` writes."""

from __future__ import annotations

import contextlib

import pytest
import torch
import torch.nn.functional as F
from torch.testing import assert_close

from sublayer import hf, kernels
from sublayer.models import Bert, BertConfig
from sublayer.models import quantized as Q
from sublayer.models.fast import FastBert, PreparedBert, fast_inference
from sublayer.runtime import encoder
from sublayer.runtime.linear import DenseLinear, OneDNNLinear

PADDINGS = ["right", "left", "empty_row", "none"]


@contextlib.contextmanager
def kernels_switched(flag: bool):
    was = kernels.switched_on()
    kernels.set_enabled(flag)
    try:
        yield
    finally:
        kernels.set_enabled(was)


def _bert(pooler: bool = True) -> Bert:
    cfg = BertConfig(vocab_size=53, d_model=15, n_layers=2, n_heads=3, d_ff=23, max_positions=31)
    m = Bert(cfg, pooler=pooler)
    g = torch.Generator().manual_seed(5)
    with torch.no_grad():
        for name, p in m.named_parameters():
            gain = p.dim() == 1 and "norm" in name and name.endswith("weight")
            p.copy_(torch.randn(p.shape, generator=g) * (0.1 if gain else 0.2) + (1.0 if gain else 0.0))
    return m.eval()


def _batch(padding: str, b: int = 5, t: int = 11):
    lens = torch.tensor([t, 7, 3, 1, 10][:b])
    if padding == "none":
        lens = torch.full((b,), t)
    if padding == "empty_row":
        lens[2] = 0
    mask = (torch.arange(t)[None] < lens[:, None]).long()
    if padding == "left":
        mask = mask.flip(1)
    ids = torch.randint(1, 53, (b, t), generator=torch.Generator().manual_seed(1)) * mask
    return ids, mask


def _cos(a, b) -> float:
    return float(F.cosine_similarity(a.double(), b.double(), dim=-1).min())


@pytest.mark.parametrize("padding", PADDINGS)
@pytest.mark.parametrize("kernels_on", [True, False], ids=["kernels", "reference"])
def test_fast_bert_equals_bert(padding, kernels_on, monkeypatch):
    m = _bert()
    ids, mask = _batch(padding)
    real = mask.bool()
    with kernels_switched(kernels_on), torch.no_grad():
        ref = m(ids, mask)
        out = fast_inference(m, dtype=torch.float32)(ids, mask)
        assert isinstance(fast_inference(m, dtype=torch.float32), PreparedBert)
        assert_close(out[real], ref[real])
        assert bool((out[~real] == 0).all())
        monkeypatch.setattr(kernels.cpu, "_native_bf16", True)  # bf16 compute, as on an AVX512_BF16 CPU
        bf = fast_inference(m, dtype=torch.bfloat16)
        assert bf.compute_dtype == torch.bfloat16
        out = bf(ids, mask)
        assert out.dtype == torch.float32 and bool((out[~real] == 0).all())
        assert _cos(out[real], ref[real]) >= 0.999


@pytest.mark.parametrize("padding", PADDINGS)
@pytest.mark.parametrize("own_gemm", [True, False], ids=["int8_linear", "linear_dynamic"])
def test_int8_on_either_gemm_follows_the_float_model(padding, own_gemm):
    m = _bert()
    ids, mask = _batch(padding)
    real = mask.bool()
    q = Q.QuantizedBert.from_model(m, (), own_gemm=own_gemm)
    assert isinstance(q, PreparedBert)
    with torch.no_grad():
        ref = m(ids, mask)
    out = q(ids, mask)
    assert bool((out[~real] == 0).all()) and bool(torch.isfinite(out).all())
    assert _cos(out[real], ref[real]) >= 0.99
    with kernels_switched(False):  # the int8 layers' PyTorch references through the same encoder
        assert _cos(q(ids, mask)[real], out[real]) >= 0.999


@pytest.mark.parametrize("padding", PADDINGS)
def test_packed_attention_equals_masked_sdpa(padding):
    # per run of equal-length sequences on the packed rows == SDPA on the padded layout with the padding mask
    _, mask = _batch(padding)
    mask[0] = mask[1] = mask[4]  # a run of three sequences of one length (with "left": at the other end)
    pad = mask == 0
    (B, T), H, hd = pad.shape, 3, 5
    full = torch.randn(B * T, 3 * H * hd, generator=torch.Generator().manual_seed(0))
    index = (~pad).reshape(-1).nonzero().squeeze(1)
    q, k, v = full.view(B, T, 3, H, hd).permute(2, 0, 3, 1, 4)
    want = F.scaled_dot_product_attention(q, k, v, attn_mask=(~pad)[:, None, None, :], scale=0.3)
    want = want.transpose(1, 2).reshape(B * T, H * hd)[index]
    segments = encoder.runs(pad if bool(pad.any()) else None, (B, T))
    assert sum(c * n for _, c, n in segments) == index.numel() and len(segments) < B
    for on in (True, False):
        with kernels_switched(on):
            assert_close(encoder.attention(full[index], segments, H, 0.3), want)
    half = encoder.attention(full[index], segments, H, 0.3, dtype=torch.bfloat16)
    assert half.dtype == torch.float32 and _cos(half, want) >= 0.999


def test_linear_formats_share_the_call():
    g = torch.Generator().manual_seed(0)
    w, b, x = torch.randn(7, 13, generator=g), torch.randn(7, generator=g), torch.randn(5, 13, generator=g)
    for lin in (OneDNNLinear(w, b), DenseLinear(w, b, torch.float32)):
        assert_close(lin(x), F.linear(x, w, b))
        assert_close(lin(x, "gelu"), F.gelu(F.linear(x, w, b)))
        assert_close(lin(x, "gelu_tanh"), F.gelu(F.linear(x, w, b), approximate="tanh"))
        assert_close(lin(x, "relu"), F.relu(F.linear(x, w, b)))
    # bf16 panels: bf16 weight, bias and x, float32 sums, bf16 out (GELU fused before the rounding)
    lin, (xb, wb, bb) = OneDNNLinear(w, b, dtype=torch.bfloat16), (t.bfloat16().double() for t in (x, w, b))
    want = xb @ wb.t() + bb
    assert lin.packed is None or lin.weight is None  # the packed weight only: no second copy
    tanh = ("gelu_tanh", lambda t: F.gelu(t, approximate="tanh"))
    for act, fn in ((None, lambda t: t), ("gelu", F.gelu), tanh, ("relu", F.relu)):
        got = lin(x, act)
        assert got.dtype == torch.bfloat16
        assert_close(got.double(), fn(want), rtol=2e-2, atol=2e-2)
    with pytest.raises(ValueError, match="dtype must be torch.float32 or torch.bfloat16"):
        OneDNNLinear(w, b, dtype=torch.float16)


@pytest.mark.skipif(not kernels.enabled(), reason="C++ kernels switched off or unavailable")
@pytest.mark.parametrize("padding", PADDINGS + ["all"])
def test_bf16_attention_kernel_on_either_path_follows_bert(padding, monkeypatch):
    # FastBert bf16 and QuantizedBert run packed_self_attention (vdpbf16ps kernel, then its portable loop)
    m = _bert()
    ids, mask = _batch(padding)
    if padding == "all":
        mask = torch.zeros_like(mask)
    real = mask.bool()
    monkeypatch.setattr(kernels.cpu, "_native_bf16", True)  # bf16 compute, as on an AVX512_BF16 CPU
    fast, q = fast_inference(m, dtype=torch.bfloat16), Q.QuantizedBert.from_model(m, ())
    assert q.attention_dtype == torch.bfloat16
    with torch.no_grad():
        ref = m(ids, mask)
    was = kernels.ops().packed_attention_avx512(-1)
    outs = []
    try:
        for on in (1, 0):
            kernels.ops().packed_attention_avx512(on)
            out, out8 = fast(ids, mask), q(ids, mask)
            for o in (out, out8):
                assert o.dtype == torch.float32 and bool(torch.isfinite(o).all()) and bool((o[~real] == 0).all())
            if padding != "all":
                assert _cos(out[real], ref[real]) >= 0.999 and _cos(out8[real], ref[real]) >= 0.99
            outs.append(out)
    finally:
        kernels.ops().packed_attention_avx512(int(was))
    assert_close(outs[0], outs[1], rtol=2e-2, atol=2e-2)
    with kernels_switched(False):
        assert Q.QuantizedBert.from_model(m, ()).attention_dtype is None


def test_prepared_weights_follow_training():
    m = _bert()
    ids, mask = _batch("right")
    real = mask.bool()
    fast = fast_inference(m, dtype=torch.float32)
    for opt in (torch.optim.AdamW(m.parameters(), lr=0.05, fused=True), torch.optim.AdamW(m.parameters(), lr=0.05)):
        before = fast(ids, mask)
        m.train()
        m(ids, mask).square().mean().backward()
        opt.step()
        opt.zero_grad()
        m.eval()
        after = fast(ids, mask)
        assert not torch.allclose(after[real], before[real])
        with torch.no_grad():
            assert_close(after[real], m(ids, mask)[real])
    with torch.no_grad():
        m.encoder.layers[1].ffn.fc2.weight.data.mul_(0.5)  # a whole-weight write through .data
        assert_close(fast(ids, mask)[real], m(ids, mask)[real])


@pytest.mark.parametrize("padding", PADDINGS)
def test_hf_patched_bert_model_equals_hf(padding):
    transformers = pytest.importorskip("transformers")
    cfg = transformers.BertConfig(vocab_size=53, hidden_size=15, num_hidden_layers=2, num_attention_heads=3,
                                  intermediate_size=23, max_position_embeddings=31)  # fmt: skip
    torch.manual_seed(0)
    ref = transformers.BertModel(cfg, add_pooling_layer=False).eval()
    ids, mask = _batch(padding)
    real = mask.bool()
    with torch.no_grad():
        want = ref(input_ids=ids, attention_mask=mask).last_hidden_state
        with hf.patched(ref, padding_free=True) as report:
            assert any("padding-free" in what for _, what in report.replaced)
            got = ref(input_ids=ids, attention_mask=mask).last_hidden_state
    assert_close(got[real], want[real])
    if padding in ("right", "left"):  # zeros at padding: the prepared encoder ran (a row of padding only: HF's)
        assert bool((got[~real] == 0).all())


def test_fast_bert_is_the_one_prepared_bert():
    assert issubclass(FastBert, PreparedBert) and issubclass(Q.QuantizedBert, PreparedBert)
    assert FastBert.forward is PreparedBert.forward and Q.QuantizedBert.forward is PreparedBert.forward
