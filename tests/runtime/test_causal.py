"""The decoder-only engine (sublayer.runtime.causal) on Llama-family models (RMSNorm, rotary, grouped-query
attention, gated FFN, biases on q/k/v or none), with no Llama-specific engine code: ``generate``'s fast step equal
to HF's greedy ``generate`` and to the reference loop (kernels on and off, AVX-512 switched off), the one-call C++
step equal to the per-op step, ``fast_inference`` fp32/bf16 and int8 against the model (packed documents too),
stale-weight, hook and ``inference_mode`` rules, and ``decode_attention`` over grouped-query caches."""

from __future__ import annotations

import copy
import math

import pytest
import torch
import torch.nn.functional as F
from torch.testing import assert_close

from sublayer import kernels
from sublayer.models import Llama
from sublayer.models import quantized as Q
from sublayer.models.fast import fast_inference
from sublayer.runtime import causal, kv_cache
from sublayer.runtime.kv_cache import StaticKVCache, decode_attention
from sublayer.runtime.linear import compact_kernels

from tests.conftest import reference_decoding
from tests.models.test_llama import PAD, VOCAB, _ids, make_hf

transformers = pytest.importorskip("transformers")

# every head layout and option: MQA untied, MHA tied with biases and llama3 scaling, GQA with 2 groups and an
# explicit head_dim, Qwen2 (q/k/v biases) with 1 kv head
LAYOUTS = ["mqa-untied", "mha-tied-bias-llama3", "gqa-2-groups-head_dim", "qwen2"]
layouts = pytest.mark.parametrize("case", LAYOUTS)


@pytest.fixture(params=["kernels", "reference"])
def kernels_mode(request):
    """Each test with the fused C++ kernels and on the pure-PyTorch reference path."""
    was = kernels.switched_on()
    kernels.set_enabled(request.param == "kernels")
    yield request.param
    kernels.set_enabled(was)


@pytest.fixture
def steps_taken(monkeypatch):
    """Counts the engine's decoding steps (proves the fast path ran)."""
    calls = []
    real = causal.step
    monkeypatch.setattr(causal, "step", lambda *a, **k: calls.append(1) or real(*a, **k))
    return calls


def _padded(seed: int = 11, b: int = 3, t: int = 6):
    x = _ids(b, t, seed=seed)
    mask = torch.ones_like(x)
    mask[0, :3] = 0
    mask[2, :1] = 0
    return x.masked_fill(mask == 0, PAD), mask


@layouts
def test_generate_fast_step_equals_hf_and_the_reference_loop(case, kernels_mode, steps_taken):
    """Left padding and an eos that ends one row early: HF greedy == fast step == reference loop."""
    hf = make_hf(case)
    model = Llama.from_hf(hf)
    x, mask = _padded()
    free = reference_decoding(lambda: model.generate(x, 9, attention_mask=mask))
    eos = int(free[1, 6 + 2])  # row 1 ends at its 3rd new token
    want = hf.generate(x, attention_mask=mask, max_new_tokens=9, do_sample=False, pad_token_id=PAD, eos_token_id=eos)
    steps_taken.clear()
    got = model.generate(x, 9, attention_mask=mask, eos_token_id=eos, pad_token_id=PAD)
    assert steps_taken, "the fast path did not run"
    ref = reference_decoding(lambda: model.generate(x, 9, attention_mask=mask, eos_token_id=eos, pad_token_id=PAD))
    assert got.tolist() == ref.tolist() == want.tolist()
    assert got[1, 6 + 3 :].eq(PAD).all()


@pytest.mark.skipif(not kernels.enabled(), reason="C++ kernels unavailable")
@pytest.mark.parametrize("panels", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("avx512", [True, False])
@layouts
def test_one_call_step_equals_the_per_op_step(case, avx512, panels):
    """causal_decode_layers (every block in C++: RMSNorm, rotary, GQA, gated FFN, optional biases) against the
    per-op step over the same packed weights, with a padding mask and per-row positions; both write the same
    keys/values (rotated) into caches of the key/value heads only (bfloat16 caches for bfloat16 panels)."""
    model = Llama.from_hf(make_hf(case))
    W = causal.packed_weights(model, panels)
    compact = panels == torch.bfloat16 and compact_kernels()  # 12-bit bf16 panels on AVX-512 + AVX512_BF16
    assert W.flat is not None and W.layers[0]["qkv"].packed.dtype == (torch.uint8 if compact else panels)
    assert W.cache_dtype == panels
    per_op = copy.copy(W)
    per_op.flat = None
    b, t = 3, 7
    cfg = model.config

    def caches():
        cs = [StaticKVCache(b, cfg.kv_heads, t + 1, cfg.attention_head_dim, dtype=panels) for _ in range(cfg.n_layers)]
        for i, c in enumerate(cs):
            c.k.copy_(torch.randn(c.k.shape, generator=torch.Generator().manual_seed(i)))
            c.v.copy_(torch.randn(c.v.shape, generator=torch.Generator().manual_seed(i + 7)))
            c.length = t
        return cs

    mask = torch.zeros(b, t + 1, dtype=torch.bool)
    mask[1, :2] = True
    tok = torch.randint(3, VOCAB, (b,), generator=torch.Generator().manual_seed(4))
    pos = torch.tensor([t, t - 2, t + 20])
    was = kernels.ops().decode_avx512(int(avx512))
    try:
        c1, c2 = caches(), caches()
        got = causal.step(W, tok, pos, c1, mask)
        want = causal.step(per_op, tok, pos, c2, mask)
    finally:
        kernels.ops().decode_avx512(int(was))
    assert_close(got, want)
    assert torch.isfinite(got).all()
    for a, r in zip(c1, c2):
        assert a.length == r.length == t + 1 and a.k.dtype == r.v.dtype == panels
        assert_close(a.k[:, :, : t + 1], r.k[:, :, : t + 1])
        assert_close(a.v[:, :, : t + 1], r.v[:, :, : t + 1])


@pytest.mark.skipif(not kernels.enabled(), reason="C++ kernels unavailable")
@pytest.mark.parametrize("case", ["mha-tied-bias-llama3", "gqa-2-groups-head_dim"])
def test_bfloat16_engine_generates_over_bfloat16_caches_as_its_reference_loop(case, monkeypatch, steps_taken):
    """fast_inference(dtype=bfloat16): the caches are bfloat16 and stay finite, and generate (one C++ call a step,
    decode_attention's kernel) gives the tokens of the per-op step over the same weights with the PyTorch attention
    (SDPA over the widened bfloat16 caches); left padding, an eos that ends one row early."""
    monkeypatch.setattr(kernels.cpu, "_native_bf16", True)  # as on an AVX512_BF16/AMX CPU
    model = Llama.from_hf(make_hf(case))
    x, mask = _padded(seed=5)
    caches = []
    real_cache = causal.StaticKVCache
    monkeypatch.setattr(causal, "StaticKVCache", lambda *a, **k: caches.append(real_cache(*a, **k)) or caches[-1])

    def run(m, eos=None):
        return fast_inference(m, dtype=torch.bfloat16).generate(x, 9, attention_mask=mask, eos_token_id=eos,
                                                                 pad_token_id=PAD)  # fmt: skip

    got = run(model)
    assert steps_taken and caches and all(c.k.dtype == c.v.dtype == torch.bfloat16 for c in caches)
    assert all(torch.isfinite(c.k[:, :, : c.length]).all() and torch.isfinite(c.v[:, :, : c.length]).all()
               for c in caches)  # fmt: skip
    eos = int(got[1, 6 + 2])  # row 1 ends at its 3rd new token
    got = run(model, eos)
    with monkeypatch.context() as mp:  # the reference: per-op steps, attention in PyTorch
        mp.setattr(causal, "flat_weights", lambda W, rows=1: None)
        mp.setattr(kv_cache, "kernels_on", lambda: False)
        ref = run(copy.deepcopy(model), eos)
    assert got.tolist() == ref.tolist()
    assert got[1, 6 + 3 :].eq(PAD).all()


@layouts
def test_fast_inference_float32_logits_equal_the_model(case, kernels_mode):
    model = Llama.from_hf(make_hf(case))
    fast = fast_inference(model, dtype=torch.float32)
    x, mask = _padded(seed=3)
    assert_close(fast(x), model(x))
    assert_close(fast(x, attention_mask=mask), model(x, attention_mask=mask))


def _cosine(a: torch.Tensor, b: torch.Tensor, mask: torch.Tensor) -> float:
    """The least cosine similarity over the real positions (padded ones are zeros in both)."""
    real = mask.bool()
    return float(F.cosine_similarity(a[real], b[real].detach(), dim=-1).min())


@pytest.mark.parametrize("case", ["gqa-2-groups-head_dim", "qwen2"])
def test_fast_inference_bfloat16_cosine(case, monkeypatch):
    """bf16 compute (forced: this CPU's answer does not decide what the test covers) keeps cosine >= 0.999."""
    monkeypatch.setattr(kernels, "native_bf16_gemm", lambda: True)
    model = Llama.from_hf(make_hf(case))
    fast = fast_inference(model, dtype=torch.bfloat16)
    assert fast.compute_dtype == torch.bfloat16
    x, mask = _padded(seed=5)
    assert _cosine(fast(x, attention_mask=mask), model(x, attention_mask=mask), mask) >= 0.999
    assert fast.generate(x, 4, attention_mask=mask).shape == (3, 10)


@layouts
def test_int8_logits_close_tokens_agree_and_fast_loop_equals_reference(case, kernels_mode):
    model = Llama.from_hf(make_hf(case))
    q = fast_inference(model, quantize="int8")
    x, mask = _padded(seed=7)
    with torch.no_grad():
        want = model(x, attention_mask=mask)
    got = q(x, attention_mask=mask)
    rel = float((got - want).norm() / want.norm())
    assert 0 < rel < 0.05, rel  # random weights of std 0.3: the int8 steps are a larger share than a trained model's
    assert_close(Q.quantize(model, keep_float=("layers.*", "head"))(x, attention_mask=mask), want)  # the same path
    agree = (got.argmax(-1) == want.argmax(-1))[mask.bool()].float().mean()
    assert agree >= 0.9, agree
    fast = q.generate(x, 8, attention_mask=mask)
    assert fast.tolist() == reference_decoding(lambda: q.generate(x, 8, attention_mask=mask)).tolist()


@pytest.mark.parametrize("kind", ["float32", "int8"])
def test_packed_documents_equal_each_document_alone(kind):
    model = Llama.from_hf(make_hf("gqa-2-groups-head_dim"))
    fast = fast_inference(model, dtype=torch.float32) if kind == "float32" else fast_inference(model, quantize="int8")
    a, b = _ids(1, 5, seed=1), _ids(1, 4, seed=2)
    packed = torch.cat([a, b], dim=1)
    pos = torch.cat([torch.arange(5), torch.arange(4)])[None]
    got = fast(packed, position_ids=pos)
    assert_close(got[:, :5], fast(a))
    assert_close(got[:, 5:], fast(b))
    if kind == "float32":
        assert_close(got, model(packed, position_ids=pos))


@pytest.mark.parametrize("kind", ["float32", "int8-all-float"])
def test_generate_prompt_with_right_and_middle_padding_equals_the_model(kind):
    # generate gives pads position 0: the prepared prompt must not read those zeros as packed documents' starts
    hf = make_hf("gqa-2-groups-head_dim")
    model = Llama.from_hf(hf)
    if kind == "float32":
        lm = fast_inference(model, dtype=torch.float32)
    else:  # every dense layer kept float: the int8 wrapper's engine computing the float model
        lm = Q.quantize(model, keep_float=("layers.*", "head"))
    x = _ids(3, 6, seed=3)
    mask = torch.ones_like(x)
    mask[1, 4:] = 0  # right padding
    mask[2, 2] = 0  # a pad in the middle
    x = x.masked_fill(mask == 0, PAD)
    kpm = mask == 0
    pos = (mask.cumsum(-1) - 1).masked_fill(kpm, 0)  # generate's positions
    want = model.hidden_states(x, pos, kpm, model.new_caches())
    assert_close(lm.hidden_states(x, pos, kpm, lm.new_caches()), want, atol=1e-5, rtol=1e-5)
    kw = {"attention_mask": mask, "eos_token_id": None}
    got = lm.generate(x, 5, **kw)
    assert got.tolist() == model.generate(x, 5, **kw).tolist()
    assert got.tolist() == reference_decoding(lambda: lm.generate(x, 5, **kw)).tolist()


def test_int8_save_load_round_trip(tmp_path):
    model = Llama.from_hf(make_hf("qwen2"))
    q = Q.quantize(model, keep_float=("layers.0.fc2",))
    q.save_pretrained(tmp_path)
    back = Q.load_quantized(tmp_path)
    assert isinstance(back, Q.QuantizedCausalLM) and back.config == model.config
    x = _ids(2, 5)
    assert torch.equal(back(x), q(x))
    assert torch.equal(back.generate(x, 5), q.generate(x, 5))


def test_fused_optimizer_step_then_generate_equals_a_fresh_model():
    hf = make_hf("gqa-2-groups-head_dim")
    model = Llama.from_hf(hf)
    x = _ids(2, 5, seed=9)
    model.generate(x, 6)  # prepares the packed weights
    opt = torch.optim.AdamW(model.parameters(), lr=0.05, fused=True)
    model.train()
    model.loss(x).backward()
    opt.step()
    model.eval()
    fresh = Llama(model.config)
    fresh.load_state_dict(model.state_dict())
    fresh.eval()
    assert model.generate(x, 6).tolist() == fresh.generate(x, 6).tolist()
    assert_close(fast_inference(model, dtype=torch.float32)(x), fresh(x))


def test_a_hook_makes_the_fast_path_step_aside(steps_taken):
    model = Llama.from_hf(make_hf("mqa-untied"))
    x = _ids(2, 4)
    plain = model.generate(x, 6)
    steps_taken.clear()
    handle = model.blocks[1].ffn.register_forward_hook(lambda m, args, out: out * 3.0)  # a steering hook
    try:
        steered = model.generate(x, 6)
        assert not steps_taken, "the fast path ran past a hook"
        assert torch.equal(steered, reference_decoding(lambda: model.generate(x, 6)))
    finally:
        handle.remove()
    assert not torch.equal(steered, plain)


def test_one_blocks_activation_set_after_the_first_call_is_that_blocks_only():
    """The engine reads each block's ffn.activation: a change to one block (seen by the weights cache) applies to
    that block, as in the model's own forward, in the prepared forward and in decoding."""
    from sublayer.models import GPT2, GPT2Config

    torch.manual_seed(0)
    model = GPT2(GPT2Config(vocab_size=37, max_positions=32, d_model=15, n_layers=2, n_heads=3)).eval()
    fast = fast_inference(model, dtype=torch.float32)
    x = torch.tensor([[3, 5, 7], [11, 13, 2]])
    fast(x), model.generate(x, 3)  # builds the prepared weights
    model.blocks[0].ffn.activation = "relu"  # block 1 keeps gelu_tanh
    assert_close(fast(x), model(x), atol=1e-5, rtol=1e-5)
    for n in (1, 2):  # the one-row step and the several-row step
        want = reference_decoding(lambda: model.generate(x[:n], 8, eos_token_id=None))
        assert torch.equal(model.generate(x[:n], 8, eos_token_id=None), want)


def test_generate_under_inference_mode_and_bfloat16_parameters(steps_taken):
    model = Llama.from_hf(make_hf("gqa-2-groups-head_dim"))
    x, mask = _padded(seed=13)
    want = model.generate(x, 6, attention_mask=mask)
    with torch.inference_mode():
        assert model.generate(x, 6, attention_mask=mask).tolist() == want.tolist()
    steps_taken.clear()
    half = copy.deepcopy(model).to(torch.bfloat16)
    got = half.generate(x, 6, attention_mask=mask)
    assert steps_taken, "bfloat16 parameters did not take the fast step"
    ref = reference_decoding(lambda: half.generate(x, 6, attention_mask=mask))
    assert got.shape == ref.shape == want.shape
    assert (got == ref).float().mean() >= 0.8  # fp32 steps over bf16 weights vs bf16 steps: same tokens mostly


@pytest.mark.parametrize("family", ["gpt2", "llama"])
def test_generate_under_autocast_runs_every_step_under_it(family, steps_taken):
    # as HF's generate: the prompt and each step through the modules under autocast (bf16 GEMMs), the reference loop
    from sublayer.models import GPT2, GPT2Config, LlamaConfig

    torch.manual_seed(2 if family == "gpt2" else 1)
    if family == "gpt2":
        model = GPT2(GPT2Config(vocab_size=37, d_model=21, n_layers=2, n_heads=3, d_ff=29, max_positions=41))
    else:
        model = Llama(LlamaConfig(vocab_size=37, d_model=18, n_layers=2, n_heads=3, n_kv_heads=1, d_ff=29,
                                  max_positions=41))  # fmt: skip
    with torch.no_grad():
        for p in model.parameters():
            p.mul_(4.0)  # sharp logits: bf16 products change the tokens
    model.eval()
    x = torch.randint(0, 37, (3, 6), generator=torch.Generator().manual_seed(1))
    mask = torch.ones_like(x)
    mask[0, :2] = 0
    with torch.autocast("cpu", dtype=torch.bfloat16):
        got = model.generate(x, 20, attention_mask=mask)
        want = reference_decoding(lambda: model.generate(x, 20, attention_mask=mask))
    assert not steps_taken, "the fast step ran under autocast"
    assert got.tolist() == want.tolist()
    assert not torch.equal(want, model.generate(x, 20, attention_mask=mask))  # autocast changed the tokens
    assert steps_taken  # and without it the fast step runs again


@pytest.mark.parametrize("rows", [False, True])
def test_decode_attention_grouped_query_equals_sdpa(kernels_mode, rows):
    """q (N, H·hd) against caches of H_kv heads (H = 6: 2 groups of 3, and 1 kv head) == SDPA over the
    repeat_interleave'd keys/values, the new key/value written first; with a row table too."""
    g = torch.Generator().manual_seed(0)
    b, h, hd, cap, length = 3, 6, 5, 11, 7
    for h_kv in (2, 1):
        k = torch.randn(b, h_kv, cap, hd, generator=g)
        v = torch.randn(b, h_kv, cap, hd, generator=g)
        q = torch.randn(b, h * hd, generator=g)
        nk, nv = torch.randn(b, h_kv * hd, generator=g), torch.randn(b, h_kv * hd, generator=g)
        mask = torch.zeros(b, cap, dtype=torch.bool)
        mask[2, :3] = True
        table = None
        if rows:
            table = torch.arange(b)[:, None].repeat(1, cap)
            table[0, :4] = 2  # row 0 reads its first keys from cache row 2
        want_k, want_v = k.clone(), v.clone()
        want_k[:, :, length - 1] = nk.view(b, h_kv, hd)
        want_v[:, :, length - 1] = nv.view(b, h_kv, hd)
        kk, vv = want_k[:, :, :length], want_v[:, :, :length]
        if rows:
            at = torch.arange(length)
            kk, vv = (t.transpose(1, 2)[table[:, :length], at].transpose(1, 2) for t in (kk, vv))
        kk, vv = kk.repeat_interleave(h // h_kv, 1), vv.repeat_interleave(h // h_kv, 1)
        ref = F.scaled_dot_product_attention(q.view(b, h, 1, hd), kk, vv, attn_mask=~mask[:, None, None, :length],
                                             scale=1 / math.sqrt(hd)).reshape(b, h * hd)  # fmt: skip
        got = decode_attention(q, k, v, length, mask=mask, new_k=nk, new_v=nv, rows=table)
        assert_close(got, ref)
        assert_close(k, want_k)
        assert_close(v, want_v)


def test_engine_tensor_names_cover_the_model():
    """named_tensors reads every parameter of the model (nothing left out that the engine would miss)."""
    model = Llama.from_hf(make_hf("mha-tied-bias-llama3"))
    t = causal.named_tensors(model)
    used = sum(v.numel() for k, v in t.items() if not k.startswith(("head.",)))
    assert used == sum(p.numel() for p in model.parameters())  # tied head: the embedding counted once
