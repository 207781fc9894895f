"""The fast decoding path (sublayer.models.decoding) against the reference loops and HF ``generate``: greedy and
sampled GPT-2 generation (left padding, eos), FastGPT2, Transformer.translate greedy and beam, with and without
the C++ kernels; the static cache; edge cases."""

from __future__ import annotations

import copy

import pytest
import torch

from sublayer import kernels
from sublayer.runtime.rows import kernels_on
from sublayer.models import GPT2, Transformer, decoding, fast_encode
from sublayer.runtime import causal
from sublayer.models.fast import fast_inference

from tests.conftest import reference_decoding

from .conftest import EOS, MAX_POS, PAD, VOCAB

transformers = pytest.importorskip("transformers")


@pytest.fixture(scope="module")
def ours(gpt2_folder) -> GPT2:
    return GPT2.from_pretrained(gpt2_folder).eval()


@pytest.fixture
def steps_taken(monkeypatch):
    """Counts the fast path's GPT-2 steps (proves the fast path ran)."""
    calls = []
    real = causal.step
    monkeypatch.setattr(causal, "step", lambda *a, **k: calls.append(1) or real(*a, **k))
    return calls


def _per_op(W):
    """``W`` without the one-call step's tensors: :func:`causal.step` runs its per-op loop."""
    W = copy.copy(W)
    W.flat = None
    return W


def _padded_batch(seed: int = 11):
    x = torch.randint(3, VOCAB, (3, 6), generator=torch.Generator().manual_seed(seed))
    mask = torch.ones_like(x)
    mask[0, :3] = 0
    mask[2, :1] = 0
    return x.masked_fill(mask == 0, PAD), mask


def test_greedy_left_padded_with_eos_equals_reference_and_hf(ours, hf_gpt2, kernels_mode, steps_taken):
    x, mask = _padded_batch()
    free = ours.generate(x, 9, attention_mask=mask)
    eos = int(free[1, 6 + 2])  # row 1 ends at its 3rd new token, the others later or never
    want = hf_gpt2.generate(
        x, attention_mask=mask, max_new_tokens=9, do_sample=False, pad_token_id=PAD, eos_token_id=eos
    )
    steps_taken.clear()
    got = ours.generate(x, 9, attention_mask=mask, eos_token_id=eos, pad_token_id=PAD)
    assert steps_taken, "the fast path did not run"
    ref = reference_decoding(lambda: ours.generate(x, 9, attention_mask=mask, eos_token_id=eos, pad_token_id=PAD))
    assert got.tolist() == ref.tolist() == want.tolist()
    assert got[1, 6 + 3 :].eq(PAD).all()


def test_fast_inference_generate_takes_the_fast_path(ours, hf_gpt2, steps_taken):
    x, mask = _padded_batch(seed=4)
    want = hf_gpt2.generate(x, attention_mask=mask, max_new_tokens=7, do_sample=False, pad_token_id=PAD)
    fast = fast_inference(ours, dtype=torch.float32)
    got = fast.generate(x, 7, attention_mask=mask, eos_token_id=EOS, pad_token_id=PAD)
    assert steps_taken and got.tolist() == want.tolist()


@pytest.mark.parametrize(
    "kw", [{"temperature": 0.7}, {"top_k": 5}, {"top_p": 0.8, "temperature": 1.3}, {"top_k": 7, "top_p": 0.9}]
)
def test_sampling_with_a_generator_equals_the_reference(ours, kw, steps_taken):
    x, mask = _padded_batch(seed=2)

    def run():
        g = torch.Generator().manual_seed(123)
        return ours.generate(x, 8, attention_mask=mask, do_sample=True, generator=g, eos_token_id=EOS, **kw)

    got = run()
    assert steps_taken
    assert got.tolist() == reference_decoding(run).tolist()


def test_cache_is_allocated_once_per_call(ours, monkeypatch):
    made = []
    real = decoding.StaticKVCache.__init__

    def spy(self, *a, **k):
        made.append(a)
        real(self, *a, **k)

    monkeypatch.setattr(decoding.StaticKVCache, "__init__", spy)
    x = torch.randint(3, VOCAB, (2, 4), generator=torch.Generator().manual_seed(1))
    ours.generate(x, 6)
    n_layers = ours.config.n_layers
    assert len(made) == n_layers and all(a == (2, ours.config.n_heads, 4 + 6, 5) for a in made)


def test_packed_weights_follow_parameter_updates(gpt2_folder):
    model = GPT2.from_pretrained(gpt2_folder).eval()
    x = torch.randint(3, VOCAB, (2, 4), generator=torch.Generator().manual_seed(9))
    model.generate(x, 5)  # packs
    with torch.no_grad():
        model.blocks[0].ffn.fc1.weight.mul_(-2.0)  # an in-place update bumps the version counter
        model.wte.weight.add_(0.1)
    assert model.generate(x, 5).tolist() == reference_decoding(lambda: model.generate(x, 5)).tolist()


def test_zero_new_tokens_and_position_limit(ours):
    x = torch.randint(3, VOCAB, (2, MAX_POS), generator=torch.Generator().manual_seed(0))
    assert torch.equal(ours.generate(x, 0), x)  # HF: the prompt back
    too_long = rf"prompt length {MAX_POS} \+ max_new_tokens 1 exceeds max_positions={MAX_POS}"
    with pytest.raises(ValueError, match=too_long):
        ours.generate(x, 1)
    out = ours.generate(x[:, 1:], 1)  # the last position exactly
    assert out.shape == (2, MAX_POS) and out.tolist() == reference_decoding(lambda: ours.generate(x[:, 1:], 1)).tolist()


def test_empty_prompt_is_a_clear_error(ours):
    with pytest.raises(ValueError, match=r"seq_len >= 1, got \(2, 0\)"):
        ours.generate(torch.zeros(2, 0, dtype=torch.long), 3)
    with pytest.raises(ValueError, match="attention_mask has a row with no token"):
        ours.generate(torch.ones(2, 3, dtype=torch.long), 3, attention_mask=torch.tensor([[1, 1, 1], [0, 0, 0]]))


# ---- Transformer.translate ------------------------------------------------------------------------------------


def _tiny_transformer(norm_first: bool) -> Transformer:
    torch.manual_seed(3)
    m = Transformer(11, 13, d_model=14, n_heads=2, d_ff=22, n_layers=2, dropout=0.0, max_len=23, norm_first=norm_first)
    with torch.no_grad():  # sharper logits than the init: longer, more varied outputs
        m.out_proj.weight.mul_(4.0)
    return m.eval()


@pytest.mark.parametrize("norm_first", [False, True])
@pytest.mark.parametrize("beam_size", [1, 3])
def test_translate_equals_the_reference_steps(norm_first, beam_size, kernels_mode, monkeypatch):
    m = _tiny_transformer(norm_first)
    src = torch.randint(3, 11, (3, 5), generator=torch.Generator().manual_seed(5))
    mask = torch.zeros(3, 5, dtype=torch.bool)
    mask[1, 3:] = True  # padding in the source
    fast_steps = []
    real = decoding.transformer_stepper

    def spy(*a, **k):
        out = real(*a, **k)
        fast_steps.append(out is not None)
        return out

    monkeypatch.setattr(decoding, "transformer_stepper", spy)
    kw = {"bos": 1, "eos": 2, "src_key_padding_mask": mask, "beam_size": beam_size}
    got = m.translate(src, 9, **kw)
    assert fast_steps == [True]
    assert got.tolist() == reference_decoding(lambda: m.translate(src, 9, **kw)).tolist()


@pytest.mark.parametrize("beam_size", [1, 3])
def test_translate_of_an_empty_source_equals_the_reference(beam_size, kernels_mode):
    """A source of no tokens (S = 0) encodes to an empty memory (cross-attention reads nothing) on both paths."""
    m = _tiny_transformer(True)
    src = torch.zeros(2, 0, dtype=torch.long)
    kw = {"bos": 1, "eos": 2, "beam_size": beam_size}
    want = reference_decoding(lambda: m.translate(src, 5, **kw))
    assert want.shape[0] == 2 and m.translate(src, 5, **kw).tolist() == want.tolist()


@pytest.mark.parametrize("beam_size", [1, 3])
def test_translate_under_autocast_runs_every_forward_under_it(beam_size, monkeypatch):
    from sublayer.models import fast_encode

    torch.manual_seed(0)
    m = Transformer(37, 37, d_model=21, n_heads=3, d_ff=29, n_layers=2, max_len=31).eval()
    with torch.no_grad():
        for p in m.parameters():
            p.mul_(3.0)  # sharp logits: bf16 products change the tokens
    src = torch.randint(3, 37, (3, 9), generator=torch.Generator().manual_seed(0))
    mask = torch.zeros(3, 9, dtype=torch.bool)
    mask[2, 5:] = True
    fast = []
    for name, mod in (("transformer_stepper", decoding), ("encode", fast_encode)):
        real = getattr(mod, name)
        monkeypatch.setattr(mod, name, lambda *a, _real=real, **k: fast.append(r := _real(*a, **k)) or r)
    kw = {"bos": 1, "eos": 2, "src_key_padding_mask": mask, "beam_size": beam_size}
    with torch.autocast("cpu", dtype=torch.bfloat16):
        got = m.translate(src, 20, **kw)
        want = reference_decoding(lambda: m.translate(src, 20, **kw))
    assert fast and all(r is None for r in fast), "a fast path ran under autocast"
    assert got.tolist() == want.tolist()


@pytest.mark.parametrize("activation", ["swiglu", "geglu"])
@pytest.mark.parametrize("beam_size", [1, 3])
def test_translate_with_a_gated_ffn_equals_the_reference(activation, beam_size, kernels_mode):
    torch.manual_seed(4)
    m = Transformer(11, 13, d_model=14, n_heads=2, d_ff=22, n_layers=2, dropout=0.0, max_len=23,
                    activation=activation).eval()  # fmt: skip
    src = torch.randint(3, 11, (3, 5), generator=torch.Generator().manual_seed(6))
    kw = {"bos": 1, "eos": 2, "beam_size": beam_size}
    assert m.translate(src, 7, **kw).tolist() == reference_decoding(lambda: m.translate(src, 7, **kw)).tolist()


@pytest.mark.parametrize("norm_first", [False, True])
def test_greedy_rows_that_ended_leave_the_batch(norm_first, kernels_mode, monkeypatch):
    """Rows that emitted eos are dropped from the batch (both paths): each row's tokens equal its translation alone."""
    m = _tiny_transformer(norm_first)
    src = torch.randint(3, 11, (7, 5), generator=torch.Generator().manual_seed(12))
    mask = torch.zeros(7, 5, dtype=torch.bool)
    mask[2, 3:] = True
    kept = []
    real = decoding.StaticKVCache.reorder
    monkeypatch.setattr(decoding.StaticKVCache, "reorder", lambda c, rows: kept.append(rows.numel()) or real(c, rows))
    for fast in (True, False):
        run = (lambda f: f()) if fast else reference_decoding
        got = run(lambda: m.translate(src, 12, bos=1, eos=2, pad=0, src_key_padding_mask=mask))
        ends = [row.index(2) if 2 in row else None for row in got.tolist()]
        assert len({e for e in ends if e is not None}) > 1  # rows end at different steps: the batch shrinks
        for i in range(7):
            alone = run(lambda: m.translate(src[i : i + 1], 12, bos=1, eos=2, pad=0,
                                            src_key_padding_mask=mask[i : i + 1]))  # fmt: skip
            row = got[i, : alone.shape[1]].tolist()
            assert row == alone[0].tolist() and all(t == 0 for t in got[i, alone.shape[1] :].tolist())
    assert kept and min(kept) < 7  # the fast path's caches shrank


def test_reorder_moves_the_row_table_not_the_caches(kernels_mode):
    g = torch.Generator().manual_seed(2)
    b, h, cap, hd = 4, 2, 6, 8
    cache = decoding.StaticKVCache(b, h, cap, hd)
    copied = decoding.StaticKVCache(b, h, cap, hd)  # reordered by copying, as the reference caches are
    q = torch.randn(b, h * hd, generator=g)
    for t, parents in enumerate([[1, 1, 0, 3], [2, 0, 0, 1], [3, 3, 2, 2]]):
        kv = torch.randn(2, b, h * hd, generator=g)
        outs = []
        for c in (cache, copied):
            outs.append(decoding.decode_attention(q, c.k, c.v, t + 1, new_k=kv[0], new_v=kv[1], rows=c.rows))
            c.length = t + 1
        torch.testing.assert_close(outs[0], outs[1])
        k_before = cache.k[:, :, : t + 1].clone()  # the filled positions (the rest is uninitialised, maybe NaN)
        cache.reorder(torch.tensor(parents))
        assert torch.equal(cache.k[:, :, : t + 1], k_before)  # nothing copied
        rows = torch.tensor(parents)
        copied.k[:, :, : t + 1] = copied.k[:, :, : t + 1][rows].clone()
        copied.v[:, :, : t + 1] = copied.v[:, :, : t + 1][rows].clone()
    out = [decoding.decode_attention(q, c.k, c.v, 3, rows=c.rows) for c in (cache, copied)]
    torch.testing.assert_close(out[0], out[1])


def _step_inputs(m: Transformer, sentences: int, s: int, *, seed: int):
    """``(memory, mask, W, g)``: a random memory (sentences, s, d_model), the second sentence's second half
    padding, m's prepared weights (with the one-call step's tensors) and the generator, for more draws."""
    g = torch.Generator().manual_seed(seed)
    memory = torch.randn(sentences, s, m.config.d_model, generator=g)
    mask = torch.zeros(sentences, s, dtype=torch.bool)
    mask[1, s // 2 :] = True
    W = decoding.prepared_weights(m, decoding._build_transformer)
    assert W["flat"] is not None
    return memory, mask, W, g


@pytest.mark.skipif(not kernels_on(), reason="C++ kernels unavailable")
@pytest.mark.parametrize("norm_first", [False, True])
@pytest.mark.parametrize("sentences,beams", [(3, 1), (2, 3), (41, 1)])  # 41 rows: torch's GEMM inside the call
def test_one_call_translate_step_equals_the_per_op_step(norm_first, sentences, beams, monkeypatch):
    m = _tiny_transformer(norm_first)
    memory, mask, W, g = _step_inputs(m, sentences, 5, seed=8)
    fast = decoding.transformer_stepper(m, memory, mask, 6, beams=beams)
    monkeypatch.setitem(W, "flat", None)
    per_op = decoding.transformer_stepper(m, memory, mask, 6, beams=beams)
    n = sentences * beams
    tok = torch.randint(0, 13, (n, 1), generator=g)
    for t in range(4):
        a, b = fast[0](tok), per_op[0](tok)
        torch.testing.assert_close(a, b)
        tok = a.argmax(-1, keepdim=True)
        if beams > 1:  # beams swap histories inside their sentence
            parents = torch.arange(n).view(sentences, beams).flip(1).reshape(-1) if t % 2 else torch.arange(n)
            fast[1](parents)
            per_op[1](parents)


@pytest.mark.skipif(not kernels_on(), reason="C++ kernels unavailable")
@pytest.mark.parametrize("avx512", [True, False])
@pytest.mark.parametrize("norm_first", [False, True])
@pytest.mark.parametrize("sentences,beams", [(2, 3), (67, 2)])  # 134 rows: torch's GEMM in blocks of rows
def test_one_call_translate_step_on_two_threads_equals_one_thread(sentences, beams, norm_first, avx512, monkeypatch):
    """transformer_decode_layers with its linears, attentions and norms split into several chunks each (d 256,
    71 source positions), shared by a team of two threads: the same hidden states, bit for bit, as on one thread,
    step after step with the beams reordered; and close to the per-op step's."""
    torch.manual_seed(6)
    m = Transformer(11, 13, d_model=256, n_heads=4, d_ff=263, n_layers=2, dropout=0.0, max_len=7,
                    norm_first=norm_first).eval()  # fmt: skip
    memory, mask, W, g = _step_inputs(m, sentences, 71, seed=9)

    class Hidden:  # in place of the head: the steps return the decoder's hidden states
        max_rows = W["head"].max_rows

        def __call__(self, h):
            return h

    monkeypatch.setitem(W, "head", Hidden())
    n = sentences * beams
    toks = torch.randint(0, 13, (4, n, 1), generator=g)
    parents = torch.arange(n).view(sentences, beams).flip(1).reshape(-1)
    threads, was = torch.get_num_threads(), kernels.ops().decode_avx512(int(avx512))
    runs = []
    try:
        for threads_here, flat in ((2, W["flat"]), (1, W["flat"]), (2, None)):
            torch.set_num_threads(threads_here)
            monkeypatch.setitem(W, "flat", flat)
            step, reorder = decoding.transformer_stepper(m, memory, mask, 6, beams=beams)[:2]
            hs = []
            for tok in toks:
                hs.append(step(tok))
                reorder(parents)
            runs.append(torch.stack(hs))
    finally:
        torch.set_num_threads(threads)
        kernels.ops().decode_avx512(int(was))
    two, one, per_op = runs
    assert torch.equal(two, one)
    torch.testing.assert_close(two, per_op)


@pytest.mark.skipif(not kernels_on(), reason="C++ kernels unavailable")
@pytest.mark.parametrize("rows", [5, 40])  # 40: above the head's row limit, the float32 logits' argmax
def test_translate_next_ids_equal_the_logits_argmax(rows, monkeypatch):
    m = _tiny_transformer(True)
    memory = torch.randn(rows, 4, 14, generator=torch.Generator().manual_seed(rows))
    screened = []
    real = decoding.GreedyHead.__call__
    monkeypatch.setattr(decoding.GreedyHead, "__call__", lambda h, x: screened.append(1) or real(h, x))
    a = decoding.transformer_stepper(m, memory, None, 7)
    b = decoding.transformer_stepper(m, memory, None, 7)
    tok = torch.full((rows, 1), 1)
    for _ in range(6):
        ids = a[2](tok)
        assert ids.tolist() == b[0](tok).argmax(-1).tolist()
        tok = ids[:, None]
    assert bool(screened) == (rows <= decoding.skinny_max_rows())


@pytest.mark.parametrize("activation", ["gelu", "relu", "silu"])  # erf-GELU and SiLU: a pass after the kernel
def test_other_activations_equal_the_reference(activation, kernels_mode, steps_taken):
    from sublayer.models import GPT2Config

    torch.manual_seed(0)
    cfg = GPT2Config(vocab_size=29, max_positions=19, d_model=15, n_layers=2, n_heads=3, d_ff=11,
                     activation=activation, dropout=0.0, embd_dropout=0.0, attn_dropout=0.0)  # fmt: skip
    model = GPT2(cfg).eval()
    x = torch.randint(0, 29, (2, 5), generator=torch.Generator().manual_seed(1))
    got = model.generate(x, 9)
    assert steps_taken and got.tolist() == reference_decoding(lambda: model.generate(x, 9)).tolist()


def _filled_caches(cfg, b: int, t: int, hd: int) -> list:
    """One static KV cache per layer of room t + 1, its first t positions filled with fixed random keys/values."""
    cs = [decoding.StaticKVCache(b, cfg.n_heads, t + 1, hd) for _ in range(cfg.n_layers)]
    for c in cs:
        c.k.copy_(torch.randn(c.k.shape, generator=torch.Generator().manual_seed(1)))
        c.v.copy_(torch.randn(c.v.shape, generator=torch.Generator().manual_seed(2)))
        c.length = t
    return cs


@pytest.mark.skipif(not kernels_on(), reason="C++ kernels unavailable")
@pytest.mark.parametrize("panels", [torch.float32, torch.bfloat16])
def test_one_call_step_on_two_threads_equals_one_thread(panels):
    """causal_decode_layers with its linears and attentions split into several chunks each (d 256, 67 cached
    positions), shared by a team of two threads: the same hidden states and caches, bit for bit, as on one thread;
    and close to the per-op step's."""
    from torch.testing import assert_close

    from sublayer.models import GPT2Config

    torch.manual_seed(0)
    cfg = GPT2Config(vocab_size=31, max_positions=97, d_model=256, n_layers=2, n_heads=4, dropout=0.0,
                     embd_dropout=0.0, attn_dropout=0.0)  # fmt: skip
    W = causal.packed_weights(GPT2(cfg).eval(), panels)
    assert W.flat is not None
    b, t, hd = 3, 67, 64

    mask = torch.zeros(b, t + 1, dtype=torch.bool)
    mask[1, :5] = True
    tok = torch.randint(0, 31, (b,), generator=torch.Generator().manual_seed(4))
    pos = torch.tensor([t, t - 5, t + 20])
    threads = torch.get_num_threads()
    runs = []
    try:
        for n, w in ((2, W), (1, W), (2, _per_op(W))):
            torch.set_num_threads(n)
            cs = _filled_caches(cfg, b, t, hd)
            runs.append((causal.step(w, tok, pos, cs, mask), cs))
    finally:
        torch.set_num_threads(threads)
    (two, c2), (one, c1), (per_op, c3) = runs
    assert torch.equal(two, one)
    assert all(torch.equal(a.k, r.k) and torch.equal(a.v, r.v) for a, r in zip(c2, c1))
    assert_close(two, per_op)
    for a, r in zip(c2, c3):
        assert_close(a.k[:, :, : t + 1], r.k[:, :, : t + 1])
        assert_close(a.v[:, :, : t + 1], r.v[:, :, : t + 1])


@pytest.mark.skipif(not kernels_on(), reason="C++ kernels unavailable")
def test_one_call_step_equals_the_per_op_step(ours):
    """causal_decode_layers (every block in C++) against causal.step's per-op path over the same packed weights, with
    a padding mask; both append the same keys/values to their caches."""
    from torch.testing import assert_close

    W = causal.packed_weights(ours)
    assert W.flat is not None
    cfg = ours.config
    b, t = 3, 7
    g = torch.Generator().manual_seed(4)
    hd = cfg.d_model // cfg.n_heads

    mask = torch.zeros(b, t + 1, dtype=torch.bool)
    mask[1, :2] = True
    tok = torch.randint(3, VOCAB, (b,), generator=g)
    pos = torch.tensor([t, t - 2, t])
    c1, c2 = _filled_caches(cfg, b, t, hd), _filled_caches(cfg, b, t, hd)
    got = causal.step(W, tok, pos, c1, mask)
    want = causal.step(_per_op(W), tok, pos, c2, mask)
    assert_close(got, want)
    for a, r in zip(c1, c2):
        assert a.length == r.length == t + 1
        assert_close(a.k[:, :, : t + 1], r.k[:, :, : t + 1])
        assert_close(a.v[:, :, : t + 1], r.v[:, :, : t + 1])


def test_translate_with_float32_products_on_onednn_equals_the_reference_steps(monkeypatch):
    """Where torch's BLAS runs a generic path (AMD CPUs with AVX-512), steps of more rows than the decoding kernels
    take (and the cross-attention's keys and values) multiply on oneDNN: the tokens of the reference steps."""
    from sublayer.kernels import onednn

    if not (kernels_on() and onednn.available()):
        pytest.skip("needs the kernels and oneDNN")
    torch.manual_seed(2)
    m = Transformer(131, 137, d_model=128, n_heads=4, d_ff=263, n_layers=1, dropout=0.0, max_len=11).eval()
    with torch.no_grad():
        m.out_proj.weight.mul_(4.0)
    src = torch.randint(3, 131, (349, 5), generator=torch.Generator().manual_seed(5))  # 349 rows a step
    monkeypatch.setattr(kernels.cpu, "onednn_fp32_gemm", lambda: True)
    calls, real = [], onednn.linear
    monkeypatch.setattr(onednn, "linear", lambda *a, **k: calls.append(a[0].shape[0]) or real(*a, **k))
    got = m.translate(src, 7, bos=1, eos=2)
    assert calls and max(calls) >= 349
    assert got.tolist() == reference_decoding(lambda: m.translate(src, 7, bos=1, eos=2)).tolist()


def test_translate_reads_each_layers_activation_set_after_the_first_call():
    """The fast encoder and decoder steps read each FFN's own activation (as the modules' forwards do), not the
    config's: set on every layer (the one-call step) or on one layer (the per-layer step), the tokens stay the
    reference's, greedy and beam."""
    torch.manual_seed(0)
    m = Transformer(23, 29, d_model=15, n_heads=3, d_ff=21, n_layers=2, max_len=16, dropout=0.0).eval()
    with torch.no_grad():
        m.out_proj.weight.mul_(8.0)  # confident logits: an activation's change shows in the tokens
    src = torch.randint(3, 23, (3, 7), generator=torch.Generator().manual_seed(1))
    kw = dict(bos=1, eos=2)
    m.translate(src, 9, **kw)  # builds the prepared weights
    ffns = [mod for mod in m.modules() if type(mod).__name__ == "PositionWiseFFN"]
    for change in ("all", "one"):
        if change == "all":
            for f in ffns:
                f.activation = "gelu"
        else:
            ffns[0].activation, ffns[-1].activation = "silu", "relu2"
        for beam in (1, 3):
            want = reference_decoding(lambda: m.translate(src, 9, beam_size=beam, **kw))
            assert m.translate(src, 9, beam_size=beam, **kw).tolist() == want.tolist(), (change, beam)
        fast = fast_encode.encode(m, src)
        assert fast is not None
        torch.testing.assert_close(fast, m.encode(src), atol=1e-5, rtol=1e-5)
