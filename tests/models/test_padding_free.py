"""Padding-free execution inside Bert, GPT2 and Transformer: equal to HF and to the padded path at the real tokens
(forward and every parameter gradient), zeros at padding, packed GPT-2 documents equal to each document alone,
padding invariance (hypothesis) and the edge cases (fully padded row, no padding, one token)."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from hypothesis import given
from hypothesis import settings as hsettings
from hypothesis import strategies as st
from torch.testing import assert_close

from sublayer.checkpoints import bert as bert_keys
from sublayer.checkpoints import gpt2 as gpt2_keys
from sublayer.functional import packing
from sublayer.models import GPT2, Bert, Transformer, decoding, padding_free

from .conftest import N_LAYERS, VOCAB, make_hf_bert, make_hf_gpt2

transformers = pytest.importorskip("transformers")


def _mask(lengths: list[int], t: int, *, left: tuple[int, ...] = ()) -> torch.Tensor:
    """(B, T) HF mask, 1 = token; right padding, or left padding for the rows in ``left``."""
    m = torch.zeros(len(lengths), t, dtype=torch.long)
    for i, n in enumerate(lengths):
        if i in left:
            m[i, t - n :] = 1
        else:
            m[i, :n] = 1
    return m


def _ids(b: int, t: int, seed: int = 3) -> torch.Tensor:
    return torch.randint(3, VOCAB, (b, t), generator=torch.Generator().manual_seed(seed))


@pytest.fixture(params=["varlen", "padded"])
def attention_layout(request, monkeypatch):
    """Both attention layouts of the padding-free path: one attention per sequence, or scattered and masked."""
    monkeypatch.setattr(packing, "ATTENTION", request.param)
    return request.param


def _grads(model: torch.nn.Module) -> dict[str, torch.Tensor]:
    return {k: p.grad.clone() for k, p in model.named_parameters() if p.grad is not None}


def _close_grads(got: dict, want: dict) -> None:
    assert set(got) == set(want)
    for k, g in got.items():
        # gradients summed over many tokens (embedding rows, biases) are added in another order when padding
        # rows are dropped: the fp32 defaults, scaled by the gradient's own size
        atol = 1e-5 * max(1.0, float(want[k].abs().max()))
        assert_close(g, want[k], atol=atol, rtol=1.3e-6, msg=lambda m, k=k: f"{k}: {m}")


# ------------------------------------------------------------------------------------------------ BERT
@pytest.fixture(scope="module")
def bert(bert_folder) -> Bert:
    return Bert.from_pretrained(bert_folder).eval()


def _bert_batch():
    mask = _mask([7, 4, 1, 6], 7)
    return _ids(4, 7).masked_fill(mask == 0, 0), mask, torch.randint(0, 2, (4, 7), generator=torch.Generator())


def test_bert_forward_and_gradients_equal_hf_and_padded_path(bert_folder, attention_layout):
    ids, mask, types = _bert_batch()
    real = mask.bool()
    w = torch.randn(4, 7, 15, generator=torch.Generator().manual_seed(0)) * mask[..., None]
    hf = make_hf_bert()
    hf_h = hf(ids, attention_mask=mask, token_type_ids=types).last_hidden_state
    (hf_h * w).sum().backward()
    want = {k: p.grad for k, p in hf.named_parameters() if p.grad is not None}  # the pooler is not used

    outs, grads = {}, {}
    for free in (True, False):
        model = Bert.from_pretrained(bert_folder).eval()
        padding_free.set_enabled(free)
        try:
            outs[free] = model(ids, mask, types)
        finally:
            padding_free.set_enabled(True)
        (outs[free] * w).sum().backward()
        grads[free] = _grads(model)
    assert_close(outs[True][real], hf_h[real].detach())
    assert_close(outs[True][real], outs[False][real].detach())
    assert_close(outs[True][~real], torch.zeros_like(outs[True][~real]))  # documented: zeros at padding
    _close_grads(bert_keys.to_hf(grads[True], N_LAYERS, pooler=False), want)
    _close_grads(grads[True], grads[False])


def test_bert_takes_the_plain_path_without_padding(bert, monkeypatch):
    def boom(*a, **k):
        raise AssertionError("padding-free path taken without padding")

    monkeypatch.setattr(packing.PackedBatch, "__init__", boom)
    ids, _, types = _bert_batch()
    with torch.no_grad():
        assert bert(ids, torch.ones(4, 7, dtype=torch.long), types).shape == (4, 7, 15)
        bert(ids, None, types)


def test_bert_fully_padded_row_and_one_token(bert, attention_layout):
    ids, mask, types = _bert_batch()
    mask[1] = 0
    x = bert(ids, mask, types)
    assert torch.isfinite(x).all() and not x[1].any()
    assert_close(x[0], bert(ids[:1], mask[:1], types[:1])[0])
    x.square().sum().backward()  # finite gradients
    assert all(torch.isfinite(p.grad).all() for p in bert.parameters() if p.grad is not None)
    bert.zero_grad(set_to_none=True)
    with torch.no_grad():  # one token: T = 1, a real row and a padded one
        one = bert(ids[:2, :1], torch.tensor([[1], [0]]), types[:2, :1])
        assert_close(one[0], bert(ids[:1, :1])[0])
        assert not one[1].any()


_small = hsettings(max_examples=8, deadline=None)


@_small
@given(st.lists(st.integers(1, 6), min_size=1, max_size=3), st.integers(0, 3), st.integers(0, 2**16))
def test_bert_real_outputs_do_not_depend_on_padding(bert, lengths, extra, seed):
    # changing the padded tokens, or adding more padding columns, leaves every real output unchanged
    t = max(lengths) + extra
    mask = _mask(lengths, t)
    g = torch.Generator().manual_seed(seed)
    ids = torch.randint(3, VOCAB, (len(lengths), t), generator=g)
    noisy = torch.where(mask.bool(), ids, torch.randint(0, VOCAB, ids.shape, generator=g))
    wider = torch.cat([ids, torch.zeros(len(lengths), 2, dtype=ids.dtype)], 1)
    with torch.no_grad():
        a = bert(ids, mask)
        b = bert(noisy, mask)
        c = bert(wider, torch.cat([mask, torch.zeros(len(lengths), 2, dtype=mask.dtype)], 1))[:, :t]
    real = mask.bool()
    assert_close(b[real], a[real])
    assert_close(c[real], a[real])


# ------------------------------------------------------------------------------------------------ GPT-2
def _labels(ids: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    # no target at padding, nor at a real token that follows padding (a left-padded row's first token: its
    # prediction would come from a padded position, whose output is not defined)
    prev = F.pad(mask, (1, 0))[:, :-1]
    return ids.masked_fill((mask == 0) | (prev == 0), -100)


def _lm_loss(logits: torch.Tensor, ids: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    labels = _labels(ids, mask)
    return F.cross_entropy(logits[:, :-1].reshape(-1, logits.shape[-1]), labels[:, 1:].reshape(-1))


def _as_hf(grads: dict) -> dict:
    return gpt2_keys.to_hf(grads | {"lm_head.weight": None}, N_LAYERS)


def test_gpt2_loss_and_gradients_equal_hf_and_padded_path(gpt2_folder, attention_layout):
    mask = _mask([7, 3, 5, 1], 7, left=(2,))  # right padding, and one left-padded row (generation prompts)
    ids = _ids(4, 7)
    real = mask.bool()
    hf = make_hf_gpt2()
    out = hf(ids, attention_mask=mask, labels=_labels(ids, mask))
    out.loss.backward()
    want = {k.removeprefix("transformer."): p.grad for k, p in hf.named_parameters()}
    logits, grads, losses = {}, {}, {}
    for free in (True, False):
        model = GPT2.from_pretrained(gpt2_folder).eval()
        padding_free.set_enabled(free)
        try:
            logits[free] = model(ids, attention_mask=mask)
        finally:
            padding_free.set_enabled(True)
        losses[free] = _lm_loss(logits[free], ids, mask)
        losses[free].backward()
        grads[free] = _grads(model)
    # the left-padded row's first real token has positions 0.. in HF's forward too (arange): compare as is
    assert_close(logits[True][real], out.logits[real].detach())
    assert_close(logits[True][real], logits[False][real].detach())
    assert not logits[True][~real].any()
    assert_close(losses[True], out.loss.detach(), rtol=1e-4, atol=0)
    _close_grads(_as_hf(grads[True]), want)
    _close_grads(grads[True], grads[False])


def test_packed_documents_equal_each_document_alone(gpt2_folder, attention_layout):
    model = GPT2.from_pretrained(gpt2_folder).eval()
    docs = [_ids(1, n, seed=n) for n in (4, 3, 5, 2)]
    pad = torch.zeros(1, 2, dtype=torch.long)
    # row 0: documents 0 and 1, row 1: documents 2 and 3; each row then 2 padding positions
    ids = torch.cat([torch.cat([docs[0], docs[1], pad], 1), torch.cat([docs[2], docs[3], pad], 1)])
    pos = torch.tensor([[0, 1, 2, 3, 0, 1, 2, 0, 0], [0, 1, 2, 3, 4, 0, 1, 0, 0]])
    mask = torch.tensor([[1] * 7 + [0, 0]] * 2)
    packed = model(ids, attention_mask=mask, position_ids=pos)
    spans = [(0, 0, 4), (0, 4, 7), (1, 0, 5), (1, 5, 7)]
    packed_loss = sum(_lm_loss(packed[r : r + 1, a:b], ids[r : r + 1, a:b], mask[r : r + 1, a:b]) for r, a, b in spans)
    packed_loss.backward()
    g_packed = _grads(model)
    model.zero_grad(set_to_none=True)
    alone_loss = 0.0
    for (r, a, b), doc in zip(spans, docs):
        alone = model(doc)
        assert_close(packed[r, a:b], alone[0].detach())
        alone_loss = alone_loss + _lm_loss(alone, doc, torch.ones_like(doc))
    alone_loss.backward()
    _close_grads(g_packed, _grads(model))
    # without padding too (documents filling the row): the mask alone triggers nothing, the positions do
    full = model(ids[1:, :7], position_ids=pos[1:, :7])
    assert_close(full[0, :5], model(docs[2])[0])


def test_gpt2_no_padding_is_the_plain_path_and_one_token_works(gpt2_folder, attention_layout, monkeypatch):
    model = GPT2.from_pretrained(gpt2_folder).eval()
    ids = _ids(2, 5)
    with torch.no_grad():
        plain = model(ids)
        one = model(ids[:, :1], attention_mask=torch.tensor([[1], [0]]))
        assert_close(one[0], plain[0, :1])
        assert not one[1].any()
        fully = model(ids, attention_mask=torch.tensor([[1, 1, 1, 0, 0], [0, 0, 0, 0, 0]]))
        assert torch.isfinite(fully).all() and not fully[1].any()
        assert_close(fully[0, :3], plain[0, :3])

    def boom(*a, **k):
        raise AssertionError("padding-free path taken without padding")

    monkeypatch.setattr(packing.PackedBatch, "__init__", boom)
    with torch.no_grad():
        assert_close(model(ids, attention_mask=torch.ones(2, 5, dtype=torch.long)), plain)


def test_dropout_draws_over_real_tokens_only(gpt2_folder):
    # training mode with dropout: padded positions stay zero, real ones are perturbed, seeded runs repeat
    model = GPT2.from_pretrained(gpt2_folder)
    for m in model.modules():
        for name in ("dropout",):
            if isinstance(getattr(m, name, None), float):
                setattr(m, name, 0.3)
    model.config.embd_dropout = 0.3
    ids, mask = _ids(2, 6), _mask([6, 3], 6)
    with torch.no_grad():
        ref = model.eval()(ids, attention_mask=mask)
        model.train()
        torch.manual_seed(0)
        a = model(ids, attention_mask=mask)
        torch.manual_seed(0)
        b = model(ids, attention_mask=mask)
    assert_close(a, b)
    assert not a[1, 3:].any() and not torch.allclose(a[mask.bool()], ref[mask.bool()])


# ------------------------------------------------------------------------------------------------ Transformer
@pytest.mark.parametrize("norm_first", [False, True])
def test_transformer_equals_padded_path(norm_first, attention_layout):
    torch.manual_seed(0)
    m = Transformer(11, 13, d_model=14, n_heads=2, d_ff=22, n_layers=2, dropout=0.0, max_len=23, norm_first=norm_first)
    src, tgt = _ids(3, 5) % 11, _ids(3, 6, seed=4) % 13
    src_kpm = _mask([5, 0, 3], 5) == 0  # a source with no token: its cross-attention gives zeros
    tgt_kpm = _mask([4, 6, 1], 6) == 0
    outs, grads = {}, {}
    for free in (True, False):
        m.zero_grad(set_to_none=True)
        padding_free.set_enabled(free)
        try:
            outs[free] = m(src, tgt, src_key_padding_mask=src_kpm, tgt_key_padding_mask=tgt_kpm)
            mem = m.encode(src, src_key_padding_mask=src_kpm)
        finally:
            padding_free.set_enabled(True)
        (outs[free] * ~tgt_kpm[..., None]).square().sum().backward()
        grads[free] = _grads(m)
    real = ~tgt_kpm
    assert_close(outs[True][real], outs[False][real].detach())
    assert not outs[True][tgt_kpm].any()
    _close_grads(grads[True], grads[False])
    with torch.no_grad():
        assert not m.encode(src, src_key_padding_mask=src_kpm)[src_kpm].any()
        assert_close(m.encode(src, src_key_padding_mask=src_kpm)[~src_kpm], mem[~src_kpm])


def test_set_enabled_checks_its_flag():
    with pytest.raises(TypeError, match="flag must be a bool, got 1"):
        padding_free.set_enabled(1)
    with padding_free.disabled():
        assert not padding_free.enabled()
    assert padding_free.enabled()


def test_training_attention_core_equals_sdpa_when_dropout_draws_nothing(gpt2_folder, attention_layout, monkeypatch):
    # with attention dropout > 0 in training, the packed path takes an explicit softmax + Philox dropout; with
    # the dropout made the identity it must equal the inference core (SDPA), dead rows (left padding, a fully
    # padded row) included, forward and backward
    model = GPT2.from_pretrained(gpt2_folder)
    ids, mask = _ids(3, 6), _mask([6, 3, 0], 6, left=(1,))
    outs, grads = {}, {}
    for training in (False, True):
        model.zero_grad(set_to_none=True)
        model.train(training)
        for blk in model.blocks:
            blk.self_attn.dropout = 0.5 if training else 0.0
        with monkeypatch.context() as mp:
            mp.setattr(packing, "fused_dropout", lambda x, p, training: x)
            outs[training] = model(ids, attention_mask=mask)
        outs[training].square().sum().backward()
        grads[training] = _grads(model)
    assert torch.isfinite(outs[True]).all()
    assert_close(outs[True], outs[False])
    _close_grads(grads[True], grads[False])


def test_auto_layout_picks_per_sequence_attention_for_few_rows_only(monkeypatch):
    """ATTENTION = "auto" (the default): per-sequence attention for at most VARLEN_MAX_ROWS rows, the padded
    layout above (many short rows: per-sequence dispatches cost more than the padding); same numbers either way."""
    assert packing.ATTENTION == "auto"
    monkeypatch.setattr(packing, "VARLEN_MAX_ROWS", 2)
    few, many = (packing.PackedBatch(_mask([3] * b, 4) == 0) for b in (2, 3))
    assert few.varlen() and not many.varlen()
    with torch.autocast("cpu", dtype=torch.bfloat16):  # bf16 attention: the padded layout at any batch
        assert not few.varlen()
    with torch.autocast("cpu", dtype=torch.bfloat16), monkeypatch.context() as m:
        m.setattr(packing, "ATTENTION", "varlen")  # an explicit layout is kept
        assert few.varlen()
    torch.manual_seed(0)
    m = Transformer(11, 13, d_model=14, n_heads=2, d_ff=22, n_layers=1, dropout=0.0, max_len=23).eval()
    src, tgt = _ids(3, 5) % 11, _ids(3, 6, seed=4) % 13
    src_kpm, tgt_kpm = _mask([5, 2, 3], 5) == 0, _mask([4, 6, 1], 6) == 0
    with torch.no_grad():
        auto = m(src, tgt, src_key_padding_mask=src_kpm, tgt_key_padding_mask=tgt_kpm)
        monkeypatch.setattr(packing, "ATTENTION", "varlen")
        varlen = m(src, tgt, src_key_padding_mask=src_kpm, tgt_key_padding_mask=tgt_kpm)
    assert_close(auto, varlen)



def test_packed_batch_attention_option_overrides_the_module_layout(monkeypatch):
    """``PackedBatch(attention=...)`` picks the layout for that batch whatever ATTENTION says; both layouts give
    the same attention, causal and not, forward and backward; a bad name is a ValueError naming the argument."""
    monkeypatch.setattr(packing, "ATTENTION", "varlen")
    pad = _mask([5, 2, 3], 5) == 0
    assert packing.PackedBatch(pad).varlen() and not packing.PackedBatch(pad, attention="padded").varlen()
    monkeypatch.setattr(packing, "ATTENTION", "padded")
    assert packing.PackedBatch(pad, attention="varlen").varlen() and packing.PackedBatch(pad, attention="auto").varlen()
    g = torch.Generator().manual_seed(3)
    q, k, v = (torch.randn(10, 2, 7, generator=g, requires_grad=True) for _ in range(3))
    for causal in (False, True):
        outs, grads = [], []
        for layout in ("varlen", "padded"):
            out = packing.PackedBatch(pad, attention=layout).self_attention(q, k, v, causal=causal)
            outs.append(out)
            grads.append(torch.autograd.grad(out.square().sum(), (q, k, v)))
        assert_close(outs[0], outs[1])
        for a, b in zip(*grads):
            assert_close(a, b)
    with pytest.raises(ValueError, match="attention"):
        packing.PackedBatch(pad, attention="flash")


# ------------------------------------------------------------------------------------------------ the path is speed only
@pytest.mark.parametrize("labels_kind", ["input_ids", "masked"])
def test_gpt2_loss_with_left_padding_equals_hf_in_both_paths(gpt2_folder, attention_layout, labels_kind):
    """Targets follow the padded layout: with left padding the last pad position predicts the first token, and
    with labels=input_ids padded positions carry labels; HF's labels= loss and gradients in both paths."""
    ids, mask = _ids(3, 7), _mask([7, 4, 2], 7, left=(1,))
    labels = ids if labels_kind == "input_ids" else ids.masked_fill(mask == 0, -100)
    hf = make_hf_gpt2()
    want = hf(ids, attention_mask=mask, labels=labels).loss
    want.backward()
    want_grads = {k.removeprefix("transformer."): p.grad for k, p in hf.named_parameters()}
    for free in (True, False):
        model = GPT2.from_pretrained(gpt2_folder).eval()
        padding_free.set_enabled(free)
        try:
            loss = model.loss(ids, attention_mask=mask, labels=labels)
        finally:
            padding_free.set_enabled(True)
        assert_close(loss, want.detach(), msg=lambda m: f"padding_free={free}: {m}")
        loss.backward()
        _close_grads(_as_hf(_grads(model)), want_grads)


def test_bert_pooled_with_left_padding_equals_hf(bert_folder, attention_layout):
    ids, mask = _ids(3, 6), _mask([6, 4, 2], 6, left=(1, 2))
    want = make_hf_bert()(ids, attention_mask=mask).pooler_output
    model = Bert.from_pretrained(bert_folder)
    for free in (True, False):
        padding_free.set_enabled(free)
        try:
            assert_close(model.pooled(ids, mask), want.detach(), msg=lambda m: f"padding_free={free}: {m}")
        finally:
            padding_free.set_enabled(True)


def test_all_padding_batch_gives_finite_zeros_or_a_clear_error(bert_folder, gpt2_folder, attention_layout):
    ids, none = _ids(2, 5), torch.zeros(2, 5, dtype=torch.long)
    for free in (True, False):
        padding_free.set_enabled(free)
        try:
            bert = Bert.from_pretrained(bert_folder)
            h = bert(ids, none)
            assert h.shape == (2, 5, 15) and not h.any()
            gpt2 = GPT2.from_pretrained(gpt2_folder)
            logits = gpt2(ids, attention_mask=none)
            assert logits.shape == (2, 5, VOCAB) and not logits.any()
            with pytest.raises(ValueError, match="no position has a target"):
                gpt2.loss(ids, attention_mask=none)
            torch.manual_seed(0)
            m = Transformer(11, 13, d_model=14, n_heads=2, d_ff=22, n_layers=1, dropout=0.0, max_len=23).eval()
            src, tgt, pad_s, pad_t = ids % 11, ids % 13, torch.ones(2, 5, dtype=torch.bool), torch.ones(2, 5, dtype=torch.bool)
            memory = m.encode(src, src_key_padding_mask=pad_s)
            assert not memory.any()
            out = m(src, tgt, src_key_padding_mask=pad_s, tgt_key_padding_mask=pad_t)
            assert torch.isfinite(out).all() and not out.any()
            with pytest.raises(ValueError, match="no target position"):
                m.loss(src, tgt, tgt, src_key_padding_mask=pad_s, tgt_key_padding_mask=pad_t)
            assert m.translate(src, 4, bos=1, eos=2, src_key_padding_mask=pad_s).shape[0] == 2
            decoding.set_enabled(False)  # the reference steps too
            try:
                assert m.translate(src, 4, bos=1, eos=2, src_key_padding_mask=pad_s).shape[0] == 2
            finally:
                decoding.set_enabled(True)
        finally:
            padding_free.set_enabled(True)


def test_hooks_on_blocks_fire_in_padding_free_forward_and_loss(bert_folder, gpt2_folder):
    """One rule for every fast path: a hook on any module the path would replace sends the call to the padded
    path, where it fires with the padded layout (a steering hook changes the result there)."""
    ids, mask = _ids(2, 6), _mask([6, 3], 6)
    gpt2 = GPT2.from_pretrained(gpt2_folder)
    bert = Bert.from_pretrained(bert_folder)
    seen = []

    def steer(mod, args, out):
        seen.append(tuple(out.shape))
        return out + 0.1 * torch.arange(out.shape[-1], dtype=out.dtype)  # not a constant shift (a LayerNorm would undo it)

    for model, blocks, call in (
        (gpt2, gpt2.blocks, lambda: gpt2.loss(ids, attention_mask=mask)),
        (gpt2, gpt2.blocks, lambda: gpt2(ids, attention_mask=mask)),
        (bert, bert.encoder.layers, lambda: bert(ids, mask)),
    ):
        plain = call()
        handle = blocks[0].register_forward_hook(steer)
        try:
            seen.clear()
            steered = call()
        finally:
            handle.remove()
        assert seen == [(2, 6, 15)]  # the padded layout, once
        assert not torch.equal(plain, steered)
        with padding_free.disabled(), torch.no_grad():
            handle = blocks[0].register_forward_hook(steer)
            try:
                assert_close(call(), steered.detach())
            finally:
                handle.remove()


def test_packed_documents_in_the_padded_path_equal_the_padding_free_path(gpt2_folder):
    model = GPT2.from_pretrained(gpt2_folder).eval()
    ids = _ids(2, 8)
    pos = torch.tensor([[0, 1, 2, 0, 1, 2, 3, 0], [0, 1, 2, 3, 4, 5, 6, 7]])
    with torch.no_grad():
        free = model(ids, position_ids=pos)
        with padding_free.disabled():
            padded = model(ids, position_ids=pos)
        alone = model(ids[:1, 3:7])  # the second document of row 0 alone
    assert_close(padded, free)
    assert_close(free[0, 3:7], alone[0])
