"""int8 GPT-2 (sublayer.models.quantized_gpt2): per-layer error bounds from the quantization steps (weight-only),
int8 activations for several rows against their reference, logits and greedy tokens close to the float model, the
fast decoding loop (one-call step with either format) equal to the wrapper's reference loop (kernels on and off),
save/load, and refusals."""

from __future__ import annotations

import copy

import pytest
import torch
import torch.nn.functional as F

from sublayer import kernels
from sublayer.checkpoints import CheckpointError, GenerationConfig
from sublayer.models import GPT2, GPT2Config, decoding
from sublayer.models import quantized as Q
from sublayer.models.fast import fast_inference
from sublayer.models import quantized_gpt2
from sublayer.models.quantized_gpt2 import QuantizedGPT2, WeightInt8Linear
from sublayer.runtime import causal
from sublayer.runtime.kv_cache import StaticKVCache
from sublayer.runtime.linear import int8_linear_reference
from sublayer.runtime.rows import kernels_on

pytest.importorskip("safetensors")

CFG = dict(vocab_size=61, d_model=15, n_layers=2, n_heads=3, max_positions=37, dropout=0.0, embd_dropout=0.0,
           attn_dropout=0.0)  # fmt: skip


def _gpt2(**kw) -> GPT2:
    """A tiny GPT-2 with weights of std 0.3 (peaked next-token distributions, as a trained model's)."""
    torch.manual_seed(0)
    m = GPT2(GPT2Config(**(CFG | kw))).eval()
    with torch.no_grad():
        for name, p in m.named_parameters():
            if p.dim() == 2:
                p.normal_(0.0, 0.3)
            elif not name.endswith("norm.weight") and "ln" not in name:
                p.normal_(0.0, 0.05)
    return m


def _ids(b: int = 3, t: int = 7) -> torch.Tensor:
    return torch.randint(0, CFG["vocab_size"], (b, t), generator=torch.Generator().manual_seed(1))


def test_forward_on_an_empty_batch_as_the_model():
    m = _gpt2()
    empty = torch.zeros(0, 5, dtype=torch.long)
    q = fast_inference(m, quantize="int8")
    out = q(empty, attention_mask=torch.ones_like(empty))
    assert out.shape == m(empty).shape == (0, 5, CFG["vocab_size"]) and out.dtype == torch.float32


# ---------------------------------------------------------------------------------------------- one layer
@pytest.mark.parametrize("activation", [None, "gelu_tanh"])
def test_weight_int8_linear_within_derived_bound(activation, kernels_mode):
    """|y - x W^T| <= sum_k |x_ik| s_j / 2 (weights rounded to the nearest of steps s_j; activations exact), plus
    fp32 rounding; the activation (1-Lipschitz here up to 1.13 for tanh-GELU) is applied after."""
    g = torch.Generator().manual_seed(3)
    w = torch.randn(29, 41, generator=g) * torch.logspace(-2, 0, 29)[:, None]
    b = torch.randn(29, generator=g)
    q, s = Q.quantize_weight(w)
    lin = WeightInt8Linear(q, s, b)
    for rows in (1, 5, 23):
        x = torch.randn(rows, 41, generator=g)
        y = lin(x, activation)
        pre = x.double() @ w.double().t() + b.double()
        ref = pre if activation is None else F.gelu(pre, approximate="tanh")
        bound = (x.double().abs().sum(1, keepdim=True) * s.double() / 2) * (1.13 if activation else 1.0)
        bound += 1e-5 * (1 + ref.abs())
        assert ((y.double() - ref).abs() <= bound).all()
        assert (y.double() - ref).abs().max() > 1e-4  # the weights are rounded (a float path would pass anyway)


@pytest.mark.parametrize("activation", [None, "gelu_tanh"])
def test_int8_rows_several_rows_quantize_activations_one_row_at_24_bits(activation, kernels_mode):
    """int8_rows: more than one row equals int8_linear_reference (per-row uint8 activations), one row the same at
    24 bits (single_row_bits=24), within float32 rounding of the weight-only layer; flat_quads gives int8_linear's operands
    only then (and with the kernels)."""
    g = torch.Generator().manual_seed(5)
    w, b = torch.randn(29, 41, generator=g), torch.randn(29, generator=g)
    q, s = Q.quantize_weight(w)
    lin, plain = WeightInt8Linear(q, s, b, int8_rows=True), WeightInt8Linear(q, s, b)
    assert plain.flat_quads() is None

    def act(y):
        return y if activation is None else F.gelu(y, approximate="tanh")

    for rows in (2, 7, 13):
        x = torch.randn(rows, 41, generator=g)
        torch.testing.assert_close(lin(x, activation), act(int8_linear_reference(x, q, s, b)), rtol=1e-5, atol=1e-5)
        assert not torch.allclose(lin(x, activation), plain(x, activation), rtol=1e-4, atol=1e-4)
    x1 = torch.randn(1, 41, generator=g) * 5
    y1 = lin(x1, activation)
    torch.testing.assert_close(y1, act(int8_linear_reference(x1, q, s, b, bits=24)), rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(y1, plain(x1, activation), rtol=1e-5, atol=2e-5)
    assert not torch.allclose(y1, act(int8_linear_reference(x1, q, s, b)), rtol=1e-4, atol=1e-4)  # not 8 bits
    quads = lin.flat_quads()
    if kernels_on():
        assert quads[0].dim() == 4 and quads[3].dtype == torch.int32 and torch.equal(quads[3], q.sum(1, dtype=torch.int32))
    else:
        assert quads is None


@pytest.mark.skipif(not kernels.enabled(), reason="C++ kernels unavailable")
@pytest.mark.parametrize("avx512", [True, False])
def test_one_call_step_with_int8_rows_equals_the_per_op_step(avx512, monkeypatch):
    """causal_decode_layers over int8_linear's quads (several rows at 8 bits, one row at 24) against causal.step's
    per-op loop on the same int8 weights, with a padding mask."""
    monkeypatch.setattr(quantized_gpt2, "own_int8_gemm", lambda: True)  # int8_linear's portable loop without VNNI
    W = causal.build(_gpt2(), lambda name, t: quantized_gpt2.int8_linear(name, _quantized(t)), greedy=False)
    assert W.flat is not None and W.flat[2].dim() == 4
    per_op = copy.copy(W)
    per_op.flat = None
    t, hd = 7, CFG["d_model"] // CFG["n_heads"]

    def caches(b):
        cs = [StaticKVCache(b, CFG["n_heads"], t + 1, hd) for _ in range(CFG["n_layers"])]
        for i, c in enumerate(cs):
            c.k.copy_(torch.randn(c.k.shape, generator=torch.Generator().manual_seed(i)))
            c.v.copy_(torch.randn(c.v.shape, generator=torch.Generator().manual_seed(i + 7)))
            c.length = t
        return cs

    was = kernels.ops().decode_avx512(int(avx512))
    try:
        for b in (1, 3):
            mask = torch.zeros(b, t + 1, dtype=torch.bool)
            mask[-1, :2] = True
            tok = torch.randint(0, CFG["vocab_size"], (b,), generator=torch.Generator().manual_seed(b))
            pos = torch.tensor([t, t - 2, t + 20][:b])
            c1, c2 = caches(b), caches(b)
            got = causal.step(W, tok, pos, c1, mask)
            want = causal.step(per_op, tok, pos, c2, mask)
            torch.testing.assert_close(got, want, rtol=1e-4, atol=1e-4)
            for a, r in zip(c1, c2):
                torch.testing.assert_close(a.k[:, :, : t + 1], r.k[:, :, : t + 1], rtol=1e-4, atol=1e-4)
    finally:
        kernels.ops().decode_avx512(int(was))


def _quantized(t: dict) -> dict:
    """The engine tensors with every dense weight as qweight + scale (what QuantizedCausalLM holds)."""
    out = {}
    for name, v in t.items():
        if name.endswith(".weight") and v.dim() == 2 and name != "wte" and name != "wpe":
            layer = name.rsplit(".", 1)[0]
            out[f"{layer}.qweight"], out[f"{layer}.scale"] = Q.quantize_weight(v)
        else:
            out[name] = v
    return out


def test_every_linear_is_int8_and_within_its_bound():
    m = _gpt2()
    qm = Q.quantize(m)
    W = qm.weights()
    lins = [L[k] for L in W.layers for k in ("qkv", "out", "fc1", "fc2")] + [W.head]
    assert all(isinstance(lin, WeightInt8Linear) for lin in lins) and len(lins) == 4 * CFG["n_layers"] + 1
    a = m.blocks[1].self_attn
    w = torch.cat([a.q_proj.weight, a.k_proj.weight, a.v_proj.weight]).detach()
    for lin, weight in ((W.layers[1]["qkv"], w), (W.head, m.lm_head.weight.detach())):
        err = (lin.q.float() * lin.scale[:, None] - weight).abs()
        assert (err <= lin.scale[:, None] / 2 * (1 + 1e-6)).all()


# ---------------------------------------------------------------------------------------------- whole model
def test_logits_close_and_greedy_tokens_agree_with_float(kernels_mode):
    m = _gpt2()
    qm = fast_inference(m, quantize="int8")
    assert isinstance(qm, QuantizedGPT2)
    ids = _ids(5, 17)
    with torch.no_grad():
        lf, lq = m(ids), qm(ids)
    assert lq.shape == lf.shape and lq.dtype == torch.float32
    rel = float((lq - lf).norm() / lf.norm())
    assert 0 < rel < 0.02, rel
    assert float((lq.argmax(-1) == lf.argmax(-1)).float().mean()) >= 0.95  # teacher-forced next tokens
    new = qm.generate(ids[:, :5], 12)[:, 5:]
    same = float((new == m.generate(ids[:, :5], 12)[:, 5:]).float().mean())
    assert same >= 0.8, same


def test_head_kept_float_only_changes_the_head():
    m = _gpt2()
    q_all, q_head = Q.quantize(m), Q.quantize(m, keep_float=("head",))
    W = q_head.weights()
    assert not isinstance(W.head, WeightInt8Linear) and isinstance(W.layers[0]["fc2"], WeightInt8Linear)
    ids = _ids()
    h = q_all._hidden(ids, torch.arange(7)[None], None, None)
    assert torch.allclose(q_head(ids), F.linear(h, m.lm_head.weight), atol=1e-5)
    assert not torch.equal(q_all(ids), q_head(ids))


@pytest.mark.parametrize("padded", [False, True])
def test_generate_fast_loop_equals_reference_loop(padded, kernels_mode, monkeypatch):
    """causal.decode over the int8 weights vs GPT2.generate's reference loop on the wrapper (and
    greedy vs seeded sampling), with the kernels on and off (kernels_mode)."""
    qm = Q.quantize(_gpt2(), keep_float=("layers.1.fc1",))
    calls = []
    real = causal.decode

    def spy(model, *args, weights=None, **kw):
        calls.append(model is qm and weights is qm.weights())
        return real(model, *args, weights=weights, **kw)

    monkeypatch.setattr(causal, "decode", spy)
    ids = _ids(3, 7)
    mask = torch.ones_like(ids)
    if padded:
        mask[0, :3] = 0
    kw = dict(attention_mask=mask if padded else None)

    def run(on: bool, **extra):
        decoding.set_enabled(on)
        try:
            return qm.generate(ids, 9, **kw, **extra)
        finally:
            decoding.set_enabled(True)

    assert torch.equal(run(True), run(False))
    assert calls == [True]  # the fast loop ran once, on the int8 weights; the reference loop without it
    s = dict(do_sample=True, top_k=5)
    assert torch.equal(
        run(True, **s, generator=torch.Generator().manual_seed(2)), run(False, **s, generator=torch.Generator().manual_seed(2))
    )
    out = run(True, eos_token_id=int(run(True)[1, 8]))  # stops a row at its own 2nd new token
    assert out.shape[1] <= 16


def test_kernels_and_reference_give_the_same_tokens():
    qm = Q.quantize(_gpt2())
    ids = _ids(2, 5)
    was = kernels.switched_on()
    try:
        outs = []
        for on in (True, False):
            kernels.set_enabled(on)
            outs.append((qm.generate(ids, 10), qm(ids)))
    finally:
        kernels.set_enabled(was)
    assert torch.equal(outs[0][0], outs[1][0])
    torch.testing.assert_close(outs[0][1], outs[1][1], rtol=1e-4, atol=1e-4)  # fp32 sums in another order


# ---------------------------------------------------------------------------------------------- save / load
@pytest.mark.parametrize("keep_float", [(), ("head", "layers.0.fc2")])
@pytest.mark.parametrize("tied", [True, False])
def test_save_load_round_trip(tmp_path, keep_float, tied):
    from safetensors import safe_open

    qm = Q.quantize(_gpt2(tie_word_embeddings=tied), keep_float=keep_float)
    qm.save_pretrained(tmp_path)
    with safe_open(str(tmp_path / "model.safetensors"), "pt") as f:
        assert f.get_tensor("layers.0.qkv.qweight").dtype == torch.int8
        assert ("head.qweight" in f.keys()) == (not keep_float)
    assert Q.is_quantized_folder(tmp_path)
    back = Q.load_quantized(tmp_path)
    assert isinstance(back, QuantizedGPT2) and back.keep_float == keep_float
    ids = _ids()
    assert torch.equal(back(ids), qm(ids))
    assert torch.equal(back.generate(ids, 5), qm.generate(ids, 5))
    with pytest.raises(CheckpointError, match="quantized weights.*load_quantized"):
        GPT2.from_pretrained(tmp_path)


def test_load_quantized_lists_every_bad_tensor(tmp_path):
    """Missing (a LayerNorm too), unexpected, wrong-shape and wrong-dtype tensors: one error at load, all named."""
    from safetensors.torch import load_file, save_file

    Q.quantize(_gpt2()).save_pretrained(tmp_path)
    t = load_file(str(tmp_path / "model.safetensors"))
    del t["layers.1.fc2.scale"], t["head.qweight"], t["layers.0.ln2.bias"]
    t["layers.0.fc1.bias"] = t["layers.0.fc1.bias"][:-1].clone()
    t["layers.1.qkv.qweight"] = t["layers.1.qkv.qweight"].float()
    t["extra"] = torch.zeros(3)
    save_file(t, str(tmp_path / "model.safetensors"))
    with pytest.raises(CheckpointError) as e:
        Q.load_quantized(tmp_path)
    msg = str(e.value)
    assert "missing keys (3): head.qweight, layers.0.ln2.bias, layers.1.fc2.scale" in msg
    assert "unexpected keys (1): extra" in msg
    d_ff = 4 * CFG["d_model"]
    assert f"wrong shapes (1): layers.0.fc1.bias: expected ({d_ff},), got ({d_ff - 1},)" in msg
    assert "wrong dtypes (1): layers.1.qkv.qweight: expected torch.int8, got torch.float32" in msg


def test_keep_float_pattern_matching_no_layer_is_an_error():
    m = _gpt2()
    for pattern in ("layer.0.fc2", "lm_head"):
        with pytest.raises(ValueError, match=rf"keep_float pattern\(s\) '{pattern}' match no layer; the layers are "
                           r"layers\.\{i\}\.\{qkv,out,fc1,fc2\} for i in 0\.\.1, head"):
            Q.quantize(m, keep_float=(pattern, "head"))


# ---------------------------------------------------------------------------------------------- refusals
def test_refusals():
    m = _gpt2()
    with pytest.raises(ValueError, match=r"quantize must be None or one of 'int8', got 'int4'"):
        fast_inference(m, quantize="int4")
    with pytest.raises(ValueError, match=r"float32 parameters.*float16"):
        fast_inference(_gpt2().half(), quantize="int8")
    with pytest.raises(ValueError, match="CPU only.*meta"):
        Q.quantize(GPT2(GPT2Config(**CFG), device="meta"))
    with pytest.raises(ValueError, match="GPT2's int8 has no smoothing.*calibration must be None, got Tensor"):
        Q.quantize(m, calibration=_ids())
    with pytest.raises(TypeError, match="keep_float must be a sequence"):
        Q.quantize(m, keep_float="head")
    qm = Q.quantize(m)
    with pytest.raises(RuntimeError, match="inference-only"):
        qm.train()
    with pytest.raises(ValueError, match="max_new_tokens must be an int >= 0, got -1"):
        qm.generate(_ids(), -1)
    with pytest.raises(ValueError, match="exceeds max_positions=37"):
        qm.generate(_ids(), 31)
    with pytest.raises(ValueError, match="input_ids"):
        qm(torch.full((1, 3), CFG["vocab_size"]))


def test_int8_engine_attends_over_bf16_keys_and_values():
    """The int8 engine's KV caches are bfloat16, and its forward attends over the same rounded keys and values:
    equal to a float32-cache engine over the rounded q|k|v output, not to the unrounded one."""
    qm = Q.quantize(_gpt2())
    assert qm.weights().cache_dtype == torch.bfloat16
    assert Q.quantize(_gpt2(), keep_float=("layers.*", "head")).weights().cache_dtype == torch.float32
    ids = _ids(2, 9)
    W = qm.weights()
    exact = causal.CausalWeights(**{**W.__dict__, "cache_dtype": torch.float32})
    pos = torch.arange(9)[None]
    got = causal.hidden(W, ids, pos, None, None)
    assert not torch.equal(got, causal.hidden(exact, ids, pos, None, None))
    real = [L["qkv"] for L in W.layers]
    try:  # round k and v (not q) of every layer's q|k|v output by hand, on the float32-cache weights
        d = W.n_heads * W.head_dim
        for L, lin in zip(W.layers, real):
            L["qkv"] = lambda x, act=None, lin=lin: torch.cat(
                [(y := lin(x, act))[:, :d], y[:, d:].to(torch.bfloat16).float()], 1
            )
        want = causal.hidden(exact, ids, pos, None, None)
    finally:
        for L, lin in zip(W.layers, real):
            L["qkv"] = lin
    torch.testing.assert_close(got, want, rtol=0, atol=0)


def test_the_following_wrapper_reads_the_models_generation_config_and_a_snapshot_keeps_its_own():
    model = _gpt2()
    follow, snapshot = fast_inference(model, quantize="int8"), Q.quantize(model)
    before = model.generation_config
    model.generation_config = GenerationConfig(max_new_tokens=2, eos_token_id=None)
    ids = _ids(2, 3)
    assert follow.generation_config is model.generation_config
    assert follow.generate(ids).shape == model.generate(ids).shape == (2, 5)
    assert snapshot.generation_config is before
    with pytest.raises(AttributeError, match="follows its model's generation_config: set the model's"):
        follow.generation_config = before
    snapshot.generation_config = model.generation_config
    assert snapshot.generate(ids).shape == (2, 5)


def test_the_following_wrapper_reads_the_models_norm_eps_set_after_construction():
    model = _gpt2()
    follow, ids = fast_inference(model, quantize="int8"), _ids(2, 5)
    follow(ids)
    for m in model.modules():
        if isinstance(getattr(m, "eps", None), float):
            m.eps = 0.5
    fresh = _gpt2(eps=0.5)  # the same weights, built with that eps
    torch.testing.assert_close(follow(ids), fast_inference(fresh, quantize="int8")(ids), rtol=0, atol=0)
