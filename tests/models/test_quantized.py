"""int8 inference (sublayer.models.quantized): per-layer error bounds derived from the quantization steps, a
tiny BERT built with outlier channels (where plain int8 loses accuracy and the calibrated smoothing keeps it),
kernel vs reference epilogues, save/load, and refusals."""

from __future__ import annotations

import json

import pytest
import torch
import torch.nn.functional as F
from torch.testing import assert_close

from sublayer import kernels
from sublayer.checkpoints import CheckpointError
from sublayer.models import Bert, BertConfig
from sublayer.models import quantized as Q
from sublayer.models.fast import fast_inference
from sublayer.models.int8 import int8_tensors

pytest.importorskip("safetensors")

CFG = dict(vocab_size=61, d_model=33, n_layers=2, n_heads=3, d_ff=47, max_positions=37, dropout=0.0, attn_dropout=0.0)


def _outlier_bert(scale: float = 40.0) -> Bert:
    """A tiny BERT whose activations look like a trained model's: one residual channel with a LayerNorm gain
    ``scale`` x the others (every LN output, i.e. every q|k|v and FFN input, carries it) and one FFN hidden unit
    whose GELU output is ``scale`` x larger (the FFN output's input)."""
    torch.manual_seed(0)
    m = Bert(BertConfig(**CFG)).eval()
    with torch.no_grad():
        for p in m.parameters():
            p.normal_(0.0, 0.2) if p.dim() == 2 else p.normal_(0.0, 0.05)
        norms = [m.embeddings.norm] + [n for blk in m.encoder.layers for n in (blk.attn_residual.norm, blk.ffn_residual.norm)]
        for n in norms:
            n.weight.fill_(1.0)
            n.weight[5] = scale
        for blk in m.encoder.layers:
            blk.ffn.fc1.weight[7] *= scale / 4
            blk.ffn.fc1.bias[7] = scale
    return m


def _ids(b: int = 5, t: int = 23):
    g = torch.Generator().manual_seed(1)
    ids = torch.randint(1, CFG["vocab_size"], (b, t), generator=g)
    mask = torch.ones(b, t, dtype=torch.long)
    mask[1, 17:] = 0
    mask[3, 4:] = 0
    return ids * mask, mask


def _min_cos(a, b, mask):
    real = mask.bool()
    return float(F.cosine_similarity(a[real], b[real], dim=-1).min())


# ---------------------------------------------------------------------------------------------- one layer
def test_quantize_weight_error_is_at_most_half_a_step():
    w = torch.randn(7, 11) * torch.logspace(-3, 1, 7)[:, None]
    w[3] = 0.0
    q, s = Q.quantize_weight(w)
    assert q.dtype == torch.int8 and int(q.abs().max()) == 127
    assert (q[3] == 0).all() and s[3] == 1.0
    err = (w - q.float() * s[:, None]).abs()
    assert (err <= s[:, None] / 2 * (1 + 1e-6)).all()
    assert (q.abs().amax(1)[torch.arange(7) != 3] == 127).all()  # the grid is used fully (symmetric, per row)


def _linear_bound(x, w, smooth):
    """|y - x @ w.T| elementwise bound of one int8 linear, from its quantization steps: with xn = x / smooth / r
    (r the per-token max, so |xn| <= 1) quantized with step sx = (max xn - min xn)/255 (error <= sx/2) and
    W' = w * smooth quantized per row with step s_j (error <= s_j/2):
    |dy_ij| <= r_i (sum_k |xn_ik| s_j/2 + sx/2 sum_k |W'_jk| + K sx s_j/4)."""
    smooth = torch.ones(x.shape[1]) if smooth is None else smooth
    xs = x.double() / smooth.double()
    r = xs.abs().amax(1, keepdim=True)
    xn = xs / r
    sx = (xn.max().clamp_min(0) - xn.min().clamp_max(0)) / 255
    wp = w.double() * smooth.double()
    sj = wp.abs().amax(1) / 127
    K = x.shape[1]
    return r * (xn.abs().sum(1, keepdim=True) * sj / 2 + sx / 2 * wp.abs().sum(1) + K * sx * sj / 4)


@pytest.mark.parametrize("smoothed", [False, True])
@pytest.mark.parametrize("engine", [True, False])  # the int8 engine (fbgemm / oneDNN), or the reference
def test_int8_linear_within_derived_bound(smoothed, engine, monkeypatch):
    if engine and not Q._fbgemm():
        pytest.skip("no int8 engine in this torch build")
    monkeypatch.setattr(Q, "_fbgemm", lambda: engine)
    g = torch.Generator().manual_seed(0)
    x = torch.randn(13, 29, generator=g)
    x[:, 4] *= 30  # an outlier input channel
    x[2] *= 50  # and an outlier token
    w, b = torch.randn(17, 29, generator=g) * 0.1, torch.randn(17, generator=g)
    smooth = Q.smooth_factors(x.abs().amax(0), w) if smoothed else None
    smooth_of = {"head": smooth} if smoothed else None
    tensors = int8_tensors({"head.weight": w, "head.bias": b}, (), copy=False, smooth=smooth_of)
    lin = Q._make_linear(tensors, "head")
    assert (lin._packed is not None) == engine
    y = lin(x)
    exact = (x.double() @ w.double().t() + b.double())
    err = (y.double() - exact).abs()
    bound = _linear_bound(x, w, smooth)
    assert (err <= bound * (1 + 1e-3) + 1e-4).all(), float((err / bound).max())
    assert float(err.max()) > 0  # it did quantize
    assert float(bound.max()) < 0.1 * float(exact.abs().max())  # and the bound is far from vacuous


def test_int8_engine_matches_the_reference_linear():
    if not Q._fbgemm():
        pytest.skip("no fbgemm engine in this torch build")
    g = torch.Generator().manual_seed(2)
    x, w, b = torch.randn(11, 37, generator=g), torch.randn(19, 37, generator=g), torch.randn(19, generator=g)
    lin = Q._make_linear(int8_tensors({"head.weight": w, "head.bias": b}, (), copy=False), "head")
    xs, r = lin.prepare(x)
    ref = Q.int8_linear_reference(x, lin.q, lin.scale, b)
    # same quantized operands; at most a few activations round to the neighbouring level (ties, fp32 scaling)
    step = r * (2 / 255) * (lin.q.float().abs() * lin.scale[:, None]).amax(1)
    assert ((lin(x) - ref).abs() <= 2 * step + 1e-5).all()


# ---------------------------------------------------------------------------------------------- whole model
def test_outlier_model_accuracy_needs_the_smoothing():
    # on linear_dynamic's grid (one scale per call over tokens of max 1); int8_linear's per-token zero points keep
    # this model's plain int8 close too (test_own_gemm_model_close_to_float)
    m = _outlier_bert()
    ids, mask = _ids()
    with torch.no_grad():
        ref = m(ids, mask)
    smooth = Q.QuantizedBert.from_model(m, (), own_gemm=False)(ids, mask)
    plain = Q.QuantizedBert.from_model(m, (), calibration=False, own_gemm=False)(ids, mask)
    c_smooth, c_plain = _min_cos(smooth, ref, mask), _min_cos(plain, ref, mask)
    assert c_smooth >= 0.99, c_smooth
    assert c_plain < 0.99  # the outlier channels do break plain per-token int8 on this model
    with torch.no_grad():
        sent_q, sent_ref = Q.QuantizedBert.from_model(m, (), own_gemm=False).embed(ids, mask), m.embed(ids, mask)
    assert float((sent_q * sent_ref).sum(-1).min()) >= 0.995


def test_random_model_close_to_float_and_padding_zero():
    torch.manual_seed(0)
    m = Bert(BertConfig(**CFG)).eval()
    ids, mask = _ids()
    q = fast_inference(m, quantize="int8")
    assert isinstance(q, Q.QuantizedBert)
    h = q(ids, mask)
    with torch.no_grad():
        ref = m(ids, mask)
    assert _min_cos(h, ref, mask) >= 0.99
    assert (h[~mask.bool()] == 0).all()
    with torch.no_grad():
        assert_close(q.pooled(ids, mask), m.pooled(ids, mask), atol=0.05, rtol=0)
    assert h.dtype == torch.float32 and not h.requires_grad


def test_pooled_with_left_padding_reads_position_0():
    # as the model's pooled (and HF's pooler): position 0 runs even when it is padding
    torch.manual_seed(0)
    m = Bert(BertConfig(**CFG)).eval()
    ids, mask = _ids()
    mask[2, :7] = 0
    mask[4] = 0  # a row of padding only
    q = fast_inference(m, quantize="int8")
    with torch.no_grad():
        ref = m.pooled(ids, mask)
    assert_close(q.pooled(ids, mask), ref, atol=0.05, rtol=0)
    assert_close(q(ids, mask, return_dict=True).pooler_output, ref, atol=0.05, rtol=0)


needs_kernels = pytest.mark.skipif(not kernels.available(), reason="no C++ kernels here")


def _two_sided_ids():
    """Padding on the right (rows 1, 3), on the left (row 2) and on both sides (row 4)."""
    ids, mask = _ids()
    mask[2, :6] = 0
    mask[4, :3] = 0
    mask[4, 19:] = 0
    return ids * mask, mask


@pytest.mark.parametrize("own_gemm", [True, False])
@pytest.mark.parametrize("keep_float", [(), ("layers.[01].fc2",), ("*.fc1", "*.out"), ("*",)])
def test_kernel_epilogues_match_reference(keep_float, own_gemm, monkeypatch):
    # own_gemm: Int8Linear (int8_linear kernel) == the same quantization in PyTorch (int8_linear_reference, kernels
    # off), and the portable loop (AVX-512 off) == the VNNI one exactly (the same integer sums); the attention in
    # float32 on both sides (its bf16 kernel is checked in tests/runtime/test_encoder.py)
    if not kernels.available():
        pytest.skip("no C++ kernels here")
    monkeypatch.setattr(Q.QuantizedBert, "attention_dtype", None)
    m = _outlier_bert()
    ids, mask = _two_sided_ids()
    q = Q.QuantizedBert.from_model(m, keep_float, own_gemm=own_gemm)
    assert q.own_gemm == own_gemm and ("gemm=int8_linear" in repr(q)) == own_gemm
    fast = q(ids, mask)
    if own_gemm and keep_float != ("*",):
        assert q.layers[1]["qkv"].inv_smooth is not None
        was = kernels.ops().decode_avx512(0)
        try:
            assert torch.equal(q(ids, mask), fast)
        finally:
            kernels.ops().decode_avx512(int(was))
    assert (fast[~mask.bool()] == 0).all()
    kernels.set_enabled(False)
    try:
        ref = q(ids, mask)
    finally:
        kernels.set_enabled(True)
    assert_close(fast, ref, atol=1e-4, rtol=1e-4)
    if keep_float == ("*",):  # nothing quantized: the float model's numbers
        with torch.no_grad():
            assert_close(fast[mask.bool()], m(ids, mask)[mask.bool()], atol=1e-4, rtol=1e-4)


@needs_kernels
@pytest.mark.parametrize("calibration", [None, False])
def test_own_gemm_model_close_to_float(calibration):
    for m in (_outlier_bert(), Bert(BertConfig(**CFG)).eval()):
        q = Q.QuantizedBert.from_model(m, calibration=calibration, own_gemm=True)
        assert q.keep_float == Q.DEFAULT_KEEP_FLOAT_OWN_GEMM
        ids, mask = _two_sided_ids()
        with torch.no_grad():
            ref = m(ids, mask)
        assert _min_cos(q(ids, mask), ref, mask) >= 0.99


@needs_kernels
@pytest.mark.parametrize("own_gemm", [True, False])
def test_all_padding_batch_is_finite_and_zero(own_gemm):
    q = Q.QuantizedBert.from_model(_outlier_bert(), own_gemm=own_gemm)
    ids, mask = _ids()
    mask[:] = 0
    h = q(ids * 0, mask)
    assert h.shape == (*ids.shape, CFG["d_model"]) and torch.isfinite(h).all() and (h == 0).all()
    with pytest.raises(ValueError, match="row with no token"):  # as Bert.embed
        q.embed(ids * 0, mask)


@needs_kernels
def test_folder_saved_for_either_gemm_loads_for_the_other(tmp_path):
    # the stored tensors do not depend on the GEMM: a folder keeps its keep_float, the loader picks the GEMM
    m = _outlier_bert()
    ids, mask = _two_sided_ids()
    for own in (False, True):
        q = Q.QuantizedBert.from_model(m, own_gemm=own)
        q.save_pretrained(tmp_path / str(own))
        back = Q.load_quantized(tmp_path / str(own))
        assert back.keep_float == Q.default_keep_float(own) and back.own_gemm == Q.own_int8_gemm()
        same = Q.QuantizedBert(back.config, back.tensors, back.keep_float, own_gemm=own)
        other = Q.QuantizedBert(back.config, back.tensors, back.keep_float, own_gemm=not own)
        assert torch.equal(same(ids, mask), q(ids, mask))
        assert _min_cos(other(ids, mask), q(ids, mask), mask) >= 0.99


def test_keep_float_patterns_select_layers():
    q = Q.quantize(_outlier_bert(), keep_float=("layers.1.fc2", "layers.0.q*"))
    kinds = {f"{i}.{k}": type(lin).__name__ for i, L in enumerate(q.layers) for k, lin in L.items()}
    assert kinds["1.fc2"] == kinds["0.qkv"] == "FloatLinear"
    assert kinds["0.fc2"] == kinds["1.qkv"] == "Int8Linear"


# ---------------------------------------------------------------------------------------------- save / load
def test_save_load_round_trip(tmp_path):
    from safetensors import safe_open

    q = Q.quantize(_outlier_bert(), keep_float=Q.DEFAULT_KEEP_FLOAT)
    q.save_pretrained(tmp_path)
    with safe_open(str(tmp_path / "model.safetensors"), "pt") as f:
        assert f.get_tensor("layers.0.qkv.qweight").dtype == torch.int8
        assert "layers.0.fc2.weight" in f.keys()  # kept float
    back = Q.load_quantized(tmp_path)
    assert Q.is_quantized_folder(tmp_path)
    assert back.keep_float == q.keep_float
    ids, mask = _ids()
    assert torch.equal(back(ids, mask), q(ids, mask))
    with pytest.raises(CheckpointError, match="quantized weights.*load_quantized"):
        Bert.from_pretrained(tmp_path)


def test_load_quantized_checks_shapes_dtypes_and_the_pooler(tmp_path):
    from safetensors.torch import load_file, save_file

    Q.quantize(_outlier_bert(), keep_float=Q.DEFAULT_KEEP_FLOAT).save_pretrained(tmp_path)
    t = load_file(str(tmp_path / "model.safetensors"))
    del t["pooler.dense.bias"], t["layers.1.norm2.weight"]
    t["embeddings.position"] = t["embeddings.position"][:-1].clone()
    t["layers.0.fc2.weight"] = t["layers.0.fc2.weight"].double()  # kept float
    save_file(t, str(tmp_path / "model.safetensors"))
    with pytest.raises(CheckpointError) as e:
        Q.load_quantized(tmp_path)
    msg = str(e.value)
    assert "missing keys (2): layers.1.norm2.weight, pooler.dense.bias" in msg
    assert "wrong shapes (1): embeddings.position: expected" in msg
    assert "wrong dtypes (1): layers.0.fc2.weight: expected torch.float32, got torch.float64" in msg


def test_keep_float_pattern_matching_no_layer_is_an_error():
    with pytest.raises(ValueError, match=r"keep_float pattern\(s\) 'layer\.0\.fc2' match no layer; the layers are "
                       r"layers\.\{i\}\.\{qkv,out,fc1,fc2\} for i in 0\.\.1 \(e\.g\. 'layers\.0\.qkv'\)"):
        Q.quantize(_outlier_bert(), keep_float=("layer.0.fc2",))


def test_load_quantized_refuses_float_folder(tmp_path):
    Bert(BertConfig(**CFG)).save_pretrained(tmp_path)
    assert not Q.is_quantized_folder(tmp_path)
    with pytest.raises(CheckpointError, match="not a sublayer int8 folder"):
        Q.load_quantized(tmp_path)


def test_load_quantized_names_the_config_of_a_bad_size(tmp_path):
    Q.quantize(Bert(BertConfig(**CFG)).eval()).save_pretrained(tmp_path)
    cfg = json.loads((tmp_path / "config.json").read_text())
    (tmp_path / "config.json").write_text(json.dumps({**cfg, "num_attention_heads": 0}))
    with pytest.raises(CheckpointError, match=r"config file .*config\.json: n_heads must be a positive int"):
        Q.load_quantized(tmp_path)


# ---------------------------------------------------------------------------------------------- refusals
def test_refusals():
    m = Bert(BertConfig(**CFG)).eval()
    with pytest.raises(ValueError, match=r"quantize must be None or one of 'int8', got 'int4'"):
        fast_inference(m, quantize="int4")
    with pytest.raises(ValueError, match=r"float32 parameters.*float16"):
        fast_inference(Bert(BertConfig(**CFG)).half(), quantize="int8")
    with pytest.raises(ValueError, match="CPU only.*meta"):
        Q.quantize(Bert(BertConfig(**CFG), device="meta"))
    with pytest.raises(TypeError, match="needs a sublayer Bert, GPT2 or Llama model, got Linear"):
        Q.quantize(torch.nn.Linear(3, 5))
    with pytest.raises(TypeError, match="keep_float must be a sequence"):
        Q.quantize(m, keep_float="layers.0.fc2")
    with pytest.raises(RuntimeError, match="inference-only"):
        Q.quantize(m).train()
