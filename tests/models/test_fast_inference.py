"""sublayer.models.fast: the inference fast path of Bert and GPT2 against the fp32 models themselves (which
test_bert.py / test_gpt2.py check against Hugging Face).

Both compute dtypes run here: float32, and bf16 forced with ``kernels._native_bf16 = True`` (on CPUs without native
bf16 GEMMs ``dtype=torch.bfloat16`` would otherwise compute in float32), each with the fused kernels on and off.
The bf16 bound is the one the issue sets: cosine similarity >= 0.999 to the fp32 model.
"""

from __future__ import annotations

import copy

import pytest
import torch
import torch.nn.functional as F
from torch.testing import assert_close

from sublayer import kernels
from sublayer.models import GPT2, Bert, BertConfig, GPT2Config, Llama, LlamaConfig
from sublayer.models import quantized as Q
from sublayer.models.fast import FastBert, FastGPT2, fast_inference

COS_MIN = 0.999  # issue 5: the bf16 fast path keeps cosine >= 0.999 to fp32


def _randomize(model: torch.nn.Module, seed: int = 7) -> torch.nn.Module:
    # random biases and LayerNorm gains (the default init has zeros/ones that would hide a wrong mapping)
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, p in model.named_parameters():
            gain = p.dim() == 1 and "norm" in name and name.endswith("weight")
            p.copy_(torch.randn(p.shape, generator=g) * (0.1 if gain else 0.2) + (1.0 if gain else 0.0))
    return model.eval()


def make_bert(pooler: bool = True) -> Bert:
    cfg = BertConfig(
        vocab_size=53, d_model=15, n_layers=2, n_heads=3, d_ff=23, max_positions=31, dropout=0.1, attn_dropout=0.1
    )
    return _randomize(Bert(cfg, pooler=pooler))


def make_gpt2() -> GPT2:
    cfg = GPT2Config(vocab_size=53, max_positions=31, d_model=15, n_layers=2, n_heads=3, d_ff=29)
    return _randomize(GPT2(cfg))


def _batch(b: int = 5, t: int = 11, vocab: int = 53):
    lens = torch.tensor([t, 7, 3, 1, 10][:b])
    mask = (torch.arange(t)[None] < lens[:, None]).long()
    ids = torch.randint(1, vocab, (b, t)) * mask
    return ids, mask


@pytest.fixture(params=[torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
def compute(request, monkeypatch):
    if request.param == torch.bfloat16:
        monkeypatch.setattr(kernels.cpu, "_native_bf16", True)  # as on an AVX512_BF16/AMX CPU
    return request.param


def _min_cos(a: torch.Tensor, b: torch.Tensor) -> float:
    return float(F.cosine_similarity(a.double(), b.double(), dim=-1).min())


def _check(out: torch.Tensor, ref: torch.Tensor, dtype: torch.dtype) -> None:
    assert out.dtype == torch.float32 and not out.requires_grad
    if dtype == torch.float32:
        torch.testing.assert_close(out, ref)
    else:
        assert _min_cos(out, ref) >= COS_MIN


def test_compute_dtype_follows_the_cpu(monkeypatch):
    m = make_bert()
    monkeypatch.setattr(kernels.cpu, "_native_bf16", False)
    assert fast_inference(m).compute_dtype == torch.float32  # AVX2: bf16 GEMMs would be ~8x slower
    monkeypatch.setattr(kernels.cpu, "_native_bf16", True)
    assert fast_inference(m).compute_dtype == torch.bfloat16
    assert fast_inference(m, dtype=torch.float32).compute_dtype == torch.float32


def test_bert_matches_fp32_with_padding(kernels_mode, compute):
    m = make_bert()
    ids, mask = _batch()
    types = torch.randint(0, 2, ids.shape)
    fast = fast_inference(m, dtype=compute)
    assert isinstance(fast, FastBert) and fast.compute_dtype == compute
    with torch.no_grad():
        ref = m(ids, mask, types)
        out = fast(ids, mask, types)
        real = mask.bool()
        _check(out[real], ref[real], compute)
        assert torch.equal(out[~real], torch.zeros_like(out[~real]))  # padded positions: zeros (documented)
        _check(fast.embed(ids, mask, types), m.embed(ids, mask, types), compute)
        _check(fast.pooled(ids, mask, types), m.pooled(ids, mask, types), compute)
        _check(fast(ids), m(ids), compute)  # no mask at all


@pytest.mark.parametrize("side", ["left", "right", "none"])
def test_bert_pooler_reads_position_0_padded_or_not(kernels_mode, compute, side):
    # as the model's pooled (and HF's pooler): position 0 runs even when it is padding (left padding)
    m = make_bert()
    ids, mask = _batch()
    if side == "left":
        mask = mask.flip(1)
    elif side == "none":
        mask = torch.ones_like(mask)
    fast = fast_inference(m, dtype=compute)
    with torch.no_grad():
        ref = m.pooled(ids, mask)
        out = fast(ids, mask, return_dict=True)
    _check(fast.pooled(ids, mask), ref, compute)
    _check(out.pooler_output, ref, compute)
    _check(out.last_hidden_state, fast(ids, mask), torch.float32)  # position 0 padded: still zeros there


def test_autocast_outside_changes_nothing():
    # the wrapper switches autocast off inside: its compute dtype, not the caller's autocast, decides the GEMMs
    m, g = make_bert(), make_gpt2()
    ids, mask = _batch()
    fb, fg = fast_inference(m, dtype=torch.float32), fast_inference(g, dtype=torch.float32)
    plain_b, plain_g, plain_gen = fb(ids, mask), fg(ids), fg.generate(ids[:, :4], 5)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        torch.testing.assert_close(fb(ids, mask), plain_b, rtol=0, atol=0)
        torch.testing.assert_close(fg(ids), plain_g, rtol=0, atol=0)
        assert torch.equal(fg.generate(ids[:, :4], 5), plain_gen)


def test_bert_padding_does_not_leak(kernels_mode, compute):
    m = make_bert()
    ids, mask = _batch()
    fast = fast_inference(m, dtype=compute)
    other = torch.where(mask.bool(), ids, torch.randint(1, 53, ids.shape))  # new tokens at padded positions
    a, b = fast(ids, mask), fast(other, mask)
    torch.testing.assert_close(a, b, rtol=0, atol=0)
    # a row alone, cut to its length, equals its row in the padded batch (rows do not interact)
    n = int(mask[1].sum())
    alone = fast(ids[1:2, :n])
    if compute == torch.float32:
        torch.testing.assert_close(alone[0], a[1, :n])
    else:
        assert _min_cos(alone[0], a[1, :n]) >= COS_MIN


def test_gpt2_logits_match_fp32(kernels_mode, compute):
    m = make_gpt2()
    ids = torch.randint(0, 53, (3, 13))
    fast = fast_inference(m, dtype=compute)
    assert isinstance(fast, FastGPT2)
    with torch.no_grad():
        _check(fast(ids), m(ids), compute)
        mask = torch.ones_like(ids)
        mask[0, :4] = 0  # left padding
        pos = (mask.cumsum(-1) - 1).clamp(min=0)
        real = mask.bool()
        out = fast(ids, attention_mask=mask, position_ids=pos)
        _check(out[real], m(ids, attention_mask=mask, position_ids=pos)[real], compute)


def test_gpt2_greedy_generate_equal(kernels_mode, compute):
    m = make_gpt2()
    fast = fast_inference(m, dtype=compute)
    ids = torch.randint(0, 53, (3, 5))
    assert torch.equal(fast.generate(ids, 9), m.generate(ids, 9))
    mask = torch.ones_like(ids)
    mask[1, :2] = 0
    assert torch.equal(fast.generate(ids, 7, attention_mask=mask), m.generate(ids, 7, attention_mask=mask))


def test_weights_are_never_stale_and_training_is_untouched():
    m = make_bert()
    twin = copy.deepcopy(m)
    fast = fast_inference(m, dtype=torch.float32)
    ids, mask = _batch()
    before = fast(ids, mask)
    # training the model after making the wrapper: the same gradients as a model that was never wrapped
    opt = torch.optim.SGD(m.parameters(), lr=0.1)
    grads = []
    for model in (m, twin):
        model.train()
        torch.manual_seed(3)  # same dropout masks
        model(ids, mask).square().mean().backward()
        grads.append([p.grad for p in model.parameters() if p.grad is not None])  # the pooler has none
        model.eval()
    assert len(grads[0]) == len(grads[1]) > 20
    for g1, g2 in zip(*grads, strict=True):
        torch.testing.assert_close(g1, g2, rtol=0, atol=0)
    opt.step()
    after = fast(ids, mask)
    assert not torch.allclose(after, before)
    with torch.no_grad():
        real = mask.bool()
        torch.testing.assert_close(after[real], m(ids, mask)[real])  # re-cached after the step
        m.load_state_dict(twin.state_dict())  # and after load_state_dict
        torch.testing.assert_close(fast(ids, mask), before)
        # writes through .data bypass the version counter: refresh() is the documented way
        q = m.encoder.layers[0].self_attn.q_proj.weight
        q.data.mul_(2.0)
        fast(ids, mask)
        fast.refresh()
        torch.testing.assert_close(fast(ids, mask)[real], m(ids, mask)[real])
    with pytest.raises(RuntimeError, match="inference-only wrapper; train the model itself"):
        fast.train()


def _make_llama() -> Llama:
    cfg = LlamaConfig(vocab_size=53, max_positions=31, d_model=14, n_layers=2, n_heads=7, n_kv_heads=1, d_ff=11)
    return _randomize(Llama(cfg))


@pytest.mark.parametrize("make", [make_bert, make_gpt2, _make_llama], ids=["bert", "gpt2", "llama"])
def test_int8_wrapper_follows_the_model_and_quantize_is_a_snapshot(make):
    m = make()
    twin = copy.deepcopy(m)
    ids = torch.randint(1, 53, (3, 7))
    int8, snapshot = fast_inference(m, quantize="int8"), Q.quantize(m)
    before = int8(ids)

    def same_as_fresh():  # the wrapper equals an int8 wrapper built now from the model's current weights
        torch.testing.assert_close(int8(ids), Q.quantize(m)(ids), rtol=0, atol=0)
        if not isinstance(m, Bert):
            assert torch.equal(int8.generate(ids[:, :3], 4), Q.quantize(m).generate(ids[:, :3], 4))

    opt = torch.optim.AdamW(m.parameters(), lr=5e-2, fused=True)  # fused steps leave the version counters alone
    for _ in range(2):
        (m(ids).square().mean() if isinstance(m, Bert) else m.loss(ids)).backward()
        opt.step()
        opt.zero_grad()
    assert not torch.allclose(int8(ids), before)
    same_as_fresh()
    next(p for p in m.parameters() if p.dim() == 2).data.mul_(1.5)  # a whole-weight write through .data
    same_as_fresh()
    m.load_state_dict(twin.state_dict())
    same_as_fresh()
    torch.testing.assert_close(int8(ids), before, rtol=0, atol=0)
    with torch.no_grad():  # quantize(model) keeps the weights it was built from, the embeddings included
        for p in m.parameters():
            p.add_(1.0)
    torch.testing.assert_close(snapshot(ids), before, rtol=0, atol=0)
    with pytest.raises(RuntimeError, match="train the model itself: it re-quantizes on the next call"):
        int8.train()
def test_causal_lm_forward_on_an_empty_batch(compute):
    m = make_gpt2()
    empty = torch.zeros(0, 5, dtype=torch.long)
    fast = fast_inference(m, dtype=compute)
    want = m(empty)
    assert want.shape == (0, 5, 53)
    for out in (fast(empty), fast(empty, attention_mask=torch.ones_like(empty), return_dict=True).logits):
        assert out.shape == want.shape and out.dtype == torch.float32


@pytest.mark.parametrize("hooked", [False, True])
def test_causal_lm_logits_of_a_bfloat16_model_are_float32_on_every_path(hooked):
    m = _make_llama().to(torch.bfloat16)
    ids = torch.randint(1, 53, (2, 5), generator=torch.Generator().manual_seed(3))
    fast = fast_inference(m)
    handle = m.norm.register_forward_hook(lambda mod, args, out: None) if hooked else None  # steps aside
    try:
        for out in (fast(ids), fast(ids, return_dict=True).logits):
            assert out.dtype == torch.float32
    finally:
        if handle is not None:
            handle.remove()


def test_bad_input():
    m = make_bert(pooler=False)
    with pytest.raises(TypeError, match="needs a sublayer Bert, GPT2 or Llama model, got Linear"):
        fast_inference(torch.nn.Linear(3, 5))
    with pytest.raises(ValueError, match=r"dtype must be torch.float32 or torch.bfloat16, got torch.float16"):
        fast_inference(m, dtype=torch.float16)
    with pytest.raises(ValueError, match=r"needs float32 CPU parameters; .* is torch.bfloat16"):
        fast_inference(copy.deepcopy(m).to(torch.bfloat16))
    fast = fast_inference(m)
    ids, mask = _batch()
    with pytest.raises(ValueError, match=r"input_ids must lie in \[0, vocab_size=53\)"):
        fast(ids + 53, mask)
    with pytest.raises(ValueError, match=r"attention_mask must have the shape of input_ids \(5, 11\), got \(5, 3\)"):
        fast(ids, mask[:, :3])
    with pytest.raises(TypeError, match="input_ids must hold integer token ids"):
        fast(ids.float())
    with pytest.raises(ValueError, match="has no pooler"):
        fast.pooled(ids, mask)
    g = fast_inference(make_gpt2())
    with pytest.raises(ValueError, match="max_new_tokens must be an int >= 0, got -1"):
        g.generate(ids, -1)
    with pytest.raises(ValueError, match=r"position_ids must have shape \(5 or 1, 11\)"):
        g(ids, position_ids=torch.zeros(2, 11, dtype=torch.long))


def test_weights_made_under_inference_mode(tmp_path):
    """A model built or loaded inside torch.inference_mode() (a serving function) has inference tensors, which
    have no version counter: the weight cache must not need one."""
    ids, mask = _batch()
    bert, gpt2 = make_bert(), make_gpt2()
    bert.save_pretrained(tmp_path / "bert")
    with torch.inference_mode():
        built = make_bert()
        loaded = Bert.from_pretrained(tmp_path / "bert")
        inf_gpt2 = make_gpt2()
    assert next(built.parameters()).is_inference() and next(loaded.parameters()).is_inference()
    want = fast_inference(bert, dtype=torch.float32)(ids, mask)
    for m in (built, loaded):
        torch.testing.assert_close(fast_inference(m, dtype=torch.float32)(ids, mask), want)
    prompt = ids[:1, :3].clamp(min=1)
    assert torch.equal(fast_inference(inf_gpt2).generate(prompt, 4), fast_inference(gpt2).generate(prompt, 4))


@pytest.mark.parametrize("quantize", [None, "int8"])
def test_packed_documents_equal_each_document_alone(quantize):
    """position_ids restarting at 0 mark packed documents: the fast and int8 paths attend block-diagonally, as
    GPT2 does, so each document's logits equal the document run alone."""
    from sublayer.models import GPT2, GPT2Config

    torch.manual_seed(0)
    model = GPT2(GPT2Config(vocab_size=53, max_positions=31, d_model=15, n_layers=2, n_heads=3, bos_token_id=0,
                            eos_token_id=None)).eval()  # fmt: skip
    fast = fast_inference(model, dtype=torch.float32, quantize=quantize)
    ids = torch.randint(0, 53, (2, 9), generator=torch.Generator().manual_seed(5))
    pos = torch.tensor([[0, 1, 2, 3, 0, 1, 2, 0, 1], [0, 1, 2, 3, 4, 5, 6, 7, 8]])
    packed = fast(ids, position_ids=pos)
    for a, b in ((0, 4), (4, 7), (7, 9)):
        assert_close(packed[0, a:b], fast(ids[:1, a:b])[0])
    assert_close(packed[1], fast(ids[1:])[0])
    if quantize is None:
        assert_close(packed, model(ids, position_ids=pos))


def test_bert_norm_eps_set_after_the_first_call_is_used():
    """The prepared BERT's norms use each module's eps (as the model's own forward does), set after preparation
    too: the float wrapper equals the model, the int8 one that follows it stays close."""
    model = make_bert()
    ids, mask = _batch()
    fast, int8 = fast_inference(model, dtype=torch.float32), fast_inference(model, quantize="int8")
    fast(ids, mask), int8(ids, mask)
    for m in model.modules():
        if hasattr(m, "eps"):
            m.eps = 10.0
    want = model(ids, mask)
    assert_close(fast(ids, mask), want)
    real = mask.bool()
    assert F.cosine_similarity(int8(ids, mask)[real], want[real]).min() > 0.99


def test_bert_ffn_activation_set_after_the_first_call_is_used():
    """The prepared BERT reads each block's ffn.activation (as the model's own forward does), not the config's: a
    change to one block after preparation reaches the float wrapper exactly and the int8 one that follows it."""
    model = make_bert()
    ids, mask = _batch()
    fast, int8 = fast_inference(model, dtype=torch.float32), fast_inference(model, quantize="int8")
    fast(ids, mask), int8(ids, mask)
    model.encoder.layers[-1].ffn.activation = "relu"  # the other blocks keep the config's gelu
    want = model(ids, mask)
    assert_close(fast(ids, mask), want)
    real = mask.bool()
    assert F.cosine_similarity(int8(ids, mask)[real], want[real]).min() > 0.99


@pytest.mark.parametrize("convert", ["half", "double"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
def test_a_wrapper_whose_model_changed_to_a_dtype_it_refuses_raises_as_a_new_one(convert, dtype):
    ids, mask = _batch()
    for model, call in ((make_bert(), lambda f: f(ids, mask)), (make_gpt2(), lambda f: f(ids, attention_mask=mask)),
                        (make_gpt2(), lambda f: f.generate(ids[:1, :3], 2))):  # fmt: skip
        fast = fast_inference(model, dtype=dtype)
        call(fast)
        getattr(model, convert)()
        with pytest.raises(ValueError, match=f"CPU parameters; .* is torch.float{16 if convert == 'half' else 64}"):
            call(fast)
        model.float()  # back to float32: it runs again
        call(fast)
