"""The encoder–decoder Transformer: parity with torch.nn.Transformer, decoding with caches, beam search,
padding, checkpoints, argument errors and a short convergence run."""

from __future__ import annotations

import itertools
import json
import math
import re

import pytest
import torch
from torch import nn
from torch.testing import assert_close

from sublayer.checkpoints import CheckpointError
from sublayer.models import Transformer, TransformerConfig
from sublayer.models.transformer import sinusoidal_positional_encoding
from tests.conftest import LossForward

SRC_V, TGT_V = 11, 13
BOS, EOS = 1, 2


def tiny(**kw) -> Transformer:
    torch.manual_seed(kw.pop("seed", 0))
    args = {"d_model": 14, "n_heads": 2, "d_ff": 22, "n_layers": 2, "dropout": 0.0, "max_len": 23, **kw}
    return Transformer(SRC_V, TGT_V, **args).eval()


def ids(*shape, vocab=SRC_V, low=3, seed=1):
    g = torch.Generator().manual_seed(seed)
    return torch.randint(low, vocab, shape, generator=g)


# ---- shapes and the live reference ---------------------------------------------------------------------------


@pytest.mark.parametrize("norm_first", [False, True])
def test_forward_shapes(norm_first):
    m = tiny(norm_first=norm_first)
    out = m(ids(3, 5), ids(3, 7, vocab=TGT_V))
    assert out.shape == (3, 7, TGT_V)
    assert m.encode(ids(3, 5)).shape == (3, 5, 14)


def _copy_mha(ours, ref: nn.MultiheadAttention) -> None:
    q, k, v = ref.in_proj_weight.chunk(3)
    qb, kb, vb = ref.in_proj_bias.chunk(3)
    for lin, w, b in ((ours.q_proj, q, qb), (ours.k_proj, k, kb), (ours.v_proj, v, vb)):
        lin.weight.copy_(w)
        lin.bias.copy_(b)
    ours.out_proj.weight.copy_(ref.out_proj.weight)
    ours.out_proj.bias.copy_(ref.out_proj.bias)


def _copy_norm(ours, ref: nn.LayerNorm) -> None:
    ours.weight.copy_(ref.weight)
    ours.bias.copy_(ref.bias)


@pytest.mark.parametrize("norm_first", [False, True])
def test_matches_torch_transformer(norm_first):
    """Our model = embeddings·√d + PE -> nn.Transformer (weights copied) -> projection, forward and backward.
    nn.Transformer always adds a final norm to both stacks; for post-norm we remove it (ours has none, as in
    the paper: pytorch#24930)."""
    m = tiny(norm_first=norm_first)
    torch.manual_seed(3)
    ref = nn.Transformer(14, 2, 2, 2, 22, dropout=0.0, batch_first=True, norm_first=norm_first).eval()
    if not norm_first:
        ref.encoder.norm, ref.decoder.norm = nn.Identity(), nn.Identity()
    with torch.no_grad():
        for ol, rl in zip(m.encoder.layers, ref.encoder.layers):
            _copy_mha(ol.self_attn, rl.self_attn)
            ol.ffn.fc1.load_state_dict(rl.linear1.state_dict())
            ol.ffn.fc2.load_state_dict(rl.linear2.state_dict())
            _copy_norm(ol.attn_residual.norm, rl.norm1)
            _copy_norm(ol.ffn_residual.norm, rl.norm2)
        for ol, rl in zip(m.decoder.layers, ref.decoder.layers):
            _copy_mha(ol.self_attn, rl.self_attn)
            _copy_mha(ol.cross_attn, rl.multihead_attn)
            ol.ffn.fc1.load_state_dict(rl.linear1.state_dict())
            ol.ffn.fc2.load_state_dict(rl.linear2.state_dict())
            _copy_norm(ol.self_attn_residual.norm, rl.norm1)
            _copy_norm(ol.cross_attn_residual.norm, rl.norm2)
            _copy_norm(ol.ffn_residual.norm, rl.norm3)
        if norm_first:
            _copy_norm(m.encoder.norm, ref.encoder.norm)
            _copy_norm(m.decoder.norm, ref.decoder.norm)
    src, tgt = ids(3, 5), ids(3, 7, vocab=TGT_V)
    src_mask = torch.zeros(3, 5, dtype=torch.bool)
    src_mask[1, 3:] = True
    ours = m(src, tgt, src_key_padding_mask=src_mask)
    pe = sinusoidal_positional_encoding(23, 14)
    x = m.src_embed(src) * math.sqrt(14) + pe[:5]
    y = m.tgt_embed(tgt) * math.sqrt(14) + pe[:7]
    causal = nn.Transformer.generate_square_subsequent_mask(7).isinf()
    h = ref(x, y, tgt_mask=causal, src_key_padding_mask=src_mask, memory_key_padding_mask=src_mask)
    expected = m.out_proj(h)
    assert_close(ours, expected)
    g = torch.randn_like(ours)
    (ours * g).sum().backward()
    m_emb_grad = m.src_embed.weight.grad.clone()
    m.zero_grad()
    (expected * g).sum().backward()  # through the reference stacks, into the same embeddings
    assert_close(m_emb_grad, m.src_embed.weight.grad)


def test_positional_encoding_is_the_papers_and_not_saved():
    pe = sinusoidal_positional_encoding(7, 6)
    t, i = 5, 1
    assert_close(pe[t, 2 * i], torch.tensor(math.sin(t / 10000 ** (2 * i / 6))))
    assert_close(pe[t, 2 * i + 1], torch.tensor(math.cos(t / 10000 ** (2 * i / 6))))
    assert sinusoidal_positional_encoding(4, 5).shape == (4, 5)  # odd width
    m = tiny()
    assert "pos_encoding" not in m.state_dict()
    assert_close(m.pos_encoding, sinusoidal_positional_encoding(23, 14))


# ---- decoding --------------------------------------------------------------------------------------------------


def greedy_uncached(m: Transformer, src, max_len, src_mask=None):
    """Recompute the whole decoder at every step."""
    tgt = torch.full((src.shape[0], 1), BOS)
    done = torch.zeros(src.shape[0], dtype=torch.bool)
    out = []
    for _ in range(max_len):
        nxt = m(src, tgt, src_key_padding_mask=src_mask)[:, -1].argmax(-1)
        nxt = torch.where(done, torch.full_like(nxt, EOS), nxt)
        out.append(nxt)
        done |= nxt == EOS
        tgt = torch.cat([tgt, nxt[:, None]], 1)
        if done.all():
            break
    return torch.stack(out, 1)


@pytest.mark.parametrize("norm_first", [False, True])
def test_cached_greedy_equals_uncached(norm_first):
    m = tiny(norm_first=norm_first, seed=5)
    src = ids(4, 6)
    mask = torch.zeros(4, 6, dtype=torch.bool)
    mask[2, 4:] = True
    got = m.translate(src, 9, bos=BOS, eos=EOS, src_key_padding_mask=mask)
    want = greedy_uncached(m, src, 9, mask)
    assert got.shape[1] >= 2  # a real multi-step decode, not a stop at once
    assert torch.equal(got, want)


def test_cached_decode_logits_match_full_decode():
    m = tiny(seed=7)
    src, tgt = ids(2, 5), ids(2, 6, vocab=TGT_V)
    memory = m.encode(src)
    full = m.decode(tgt, memory)
    caches = m.decoder.new_caches()
    steps = [m.decode(tgt[:, i : i + 1], memory, caches=caches) for i in range(6)]
    assert_close(torch.cat(steps, 1), full)


def test_translate_restores_training_mode_and_stops_at_eos():
    m = tiny(seed=2).train()
    out = m.translate(ids(3, 4), 6, bos=BOS, eos=EOS, pad=0)
    assert m.training
    for row in out.tolist():
        if EOS in row:
            assert all(t == 0 for t in row[row.index(EOS) + 1 :])


def test_beam_size_one_is_greedy():
    m = tiny(seed=4)
    src = ids(3, 5)
    assert torch.equal(m.translate(src, 8, bos=BOS, eos=EOS, beam_size=1), m.translate(src, 8, bos=BOS, eos=EOS))


@pytest.mark.parametrize("beam_size", [1, 3])
def test_translate_on_an_empty_batch_gives_an_empty_result(beam_size):
    m = tiny()
    for mask in (None, torch.zeros(0, 5, dtype=torch.bool)):
        out = m.translate(ids(0, 5), 7, bos=BOS, eos=EOS, beam_size=beam_size, src_key_padding_mask=mask)
        assert out.shape == (0, 7) and out.dtype == torch.long


@torch.no_grad()
def _seq_logprob(m, src, seq):
    tgt = torch.tensor([[BOS, *seq[:-1]]])
    logp = m(src, tgt).log_softmax(-1)[0]
    return float(sum(logp[i, t] for i, t in enumerate(seq)))


def test_beam_search_exhaustive_finds_the_best_sequence():
    """With as many beams as hypotheses, beam search is exact: compare with enumerating every sequence."""
    torch.manual_seed(0)
    m = Transformer(5, 4, d_model=8, n_heads=2, d_ff=8, n_layers=1, dropout=0.0, max_len=8).eval()
    eos, max_len = 3, 3
    src = torch.tensor([[1, 4, 2]])
    cands = []
    for n in range(1, max_len + 1):
        for body in itertools.product(range(4), repeat=n):
            if eos in body[:-1] or (n < max_len and body[-1] != eos):
                continue  # a finished hypothesis ends at its first eos, or runs to max_len
            cands.append((_seq_logprob(m, src, list(body)), list(body)))
    best = max(cands)[1]
    got = m.translate(src, max_len, bos=0, eos=eos, beam_size=64, length_penalty=0.0)[0].tolist()
    if eos in got:
        got = got[: got.index(eos) + 1]
    assert got == best


# ---- padding ---------------------------------------------------------------------------------------------------


@pytest.mark.parametrize("norm_first", [False, True])
def test_source_padding_invariance(norm_first):
    """A padded row gives the same logits as the row alone, whatever the padded ids hold."""
    m = tiny(norm_first=norm_first, seed=8)
    src, tgt = ids(3, 7), ids(3, 5, vocab=TGT_V)
    mask = torch.zeros(3, 7, dtype=torch.bool)
    mask[0, 4:] = True
    mask[2, 6:] = True
    out = m(src, tgt, src_key_padding_mask=mask)
    noisy = src.masked_fill(mask, 9)
    assert_close(m(noisy, tgt, src_key_padding_mask=mask), out)
    assert_close(m(src[:1, :4], tgt[:1]), out[:1])
    assert_close(m(src[2:, :6], tgt[2:]), out[2:])


# ---- checkpoints -----------------------------------------------------------------------------------------------


def test_save_load_round_trip(tmp_path):
    m = tiny(norm_first=True, seed=9)
    m.save_pretrained(tmp_path / "ckpt")
    assert sorted(p.name for p in (tmp_path / "ckpt").iterdir()) == ["config.json", "model.safetensors"]
    m2 = Transformer.from_pretrained(tmp_path / "ckpt").eval()
    assert m2.config == m.config
    for k, v in m.state_dict().items():
        assert torch.equal(v, m2.state_dict()[k]), k
    src, tgt = ids(2, 5), ids(2, 4, vocab=TGT_V)
    assert torch.equal(m(src, tgt), m2(src, tgt))


def test_load_errors_name_the_problem(tmp_path):
    with pytest.raises(FileNotFoundError, match="checkpoint folder not found"):
        Transformer.from_pretrained(tmp_path / "nope")
    tiny().save_pretrained(tmp_path)
    from safetensors.torch import load_file, save_file

    state = load_file(tmp_path / "model.safetensors")
    state.pop("out_proj.bias")
    state["extra.weight"] = torch.zeros(1)
    state["src_embed.weight"] = torch.zeros(3, 14)
    save_file(state, tmp_path / "model.safetensors")
    with pytest.raises(ValueError, match=r"missing keys \(1\): out_proj\.bias; unexpected keys \(1\): "
                                         r"extra\.weight; wrong shapes \(1\): src_embed\.weight: expected "
                                         r"\(11, 14\), got \(3, 14\)"):  # fmt: skip
        Transformer.from_pretrained(tmp_path)
    (tmp_path / "model.safetensors").write_bytes(b"\x10\x00\x00\x00\x00\x00\x00\x00{")
    with pytest.raises(ValueError, match="cannot read weights file .*model.safetensors"):
        Transformer.from_pretrained(tmp_path)
    (tmp_path / "model.safetensors").unlink()
    with pytest.raises(FileNotFoundError, match="weights file not found"):
        Transformer.from_pretrained(tmp_path)


def test_config_rejects_unknown_keys_and_round_trips(tmp_path):
    cfg = TransformerConfig(src_vocab_size=5, tgt_vocab_size=7, d_model=6, n_heads=3, d_ff=11, n_layers=1)
    with pytest.raises(ValueError, match="unknown TransformerConfig keys: d_modle"):
        TransformerConfig.from_dict({**cfg.to_dict(), "d_modle": 3})
    cfg.save(tmp_path / "c.json")
    assert TransformerConfig.load(tmp_path / "c.json") == cfg
    assert json.loads((tmp_path / "c.json").read_text())["d_ff"] == 11
    m = Transformer.from_config(cfg)
    assert m.config == cfg and m.out_proj.out_features == 7


def test_config_file_missing_a_key_is_an_error(tmp_path):
    """A config.json without a field (a damaged folder) names the key rather than loading the field's default: an
    activation left to its default would give a model with the saved weights but another function."""
    m = Transformer(11, 13, d_model=15, n_heads=3, d_ff=23, n_layers=1, max_len=16, activation="gelu")
    m.save_pretrained(tmp_path)
    d = json.loads((tmp_path / "config.json").read_text())
    del d["activation"]
    (tmp_path / "config.json").write_text(json.dumps(d))
    with pytest.raises(CheckpointError, match=r"config.json: missing TransformerConfig keys: activation"):
        Transformer.from_pretrained(tmp_path)


# ---- bad input -------------------------------------------------------------------------------------------------


def test_bad_construction():
    with pytest.raises(ValueError, match=r"d_model \(10\) must be divisible by n_heads \(3\)"):
        Transformer(5, 5, d_model=10, n_heads=3)
    with pytest.raises(ValueError, match="n_layers must be a positive int, got 0"):
        Transformer(5, 5, d_model=6, n_heads=2, n_layers=0)
    with pytest.raises(TypeError, match="src_vocab_size must be a positive int"):
        Transformer(5.0, 5)
    with pytest.raises(ValueError, match=r"dropout must be in \[0, 1\), got 1.5"):
        Transformer(5, 5, dropout=1.5)
    with pytest.raises(ValueError, match="unknown activation 'tanh'"):
        TransformerConfig(src_vocab_size=5, tgt_vocab_size=5, activation="tanh")
    with pytest.raises(TypeError, match="config must be a TransformerConfig, got dict"):
        Transformer.from_config({"src_vocab_size": 5})


def test_bad_inputs():
    m = tiny()
    src, tgt = ids(2, 5), ids(2, 4, vocab=TGT_V)
    with pytest.raises(ValueError, match=r"src must be 2-D token ids \(batch, seq\), got shape \(5,\)"):
        m(src[0], tgt)
    with pytest.raises(TypeError, match="src must hold integer token ids, got dtype torch.float32"):
        m(src.float(), tgt)
    with pytest.raises(TypeError, match=r"tgt must hold integer token ids, got dtype torch.uint8 \(int64 or int32"):
        m(src, tgt.to(torch.uint8))  # uint8 would index as a mask inside torch
    with pytest.raises(ValueError, match=r"tgt ids must lie in \[0, 13\), got min 13, max 13"):
        m(src, torch.full((2, 4), 13))
    with pytest.raises(ValueError, match="src length 24 exceeds max_len 23"):
        m(ids(2, 24), tgt)
    with pytest.raises(ValueError, match=r"src and tgt must share the batch size, got \(2, 5\) and \(3, 4\)"):
        m(src, ids(3, 4, vocab=TGT_V))
    with pytest.raises(ValueError, match=r"src_key_padding_mask must have the shape of src \(2, 5\), got \(2, 4\)"):
        m(src, tgt, src_key_padding_mask=torch.zeros(2, 4, dtype=torch.bool))
    with pytest.raises(TypeError, match="src_key_padding_mask must be bool"):
        m(src, tgt, src_key_padding_mask=torch.zeros(2, 5, dtype=torch.long))
    with pytest.raises(ValueError, match=r"max_len \(30\) exceeds the model's max_len \(23\)"):
        m.translate(src, 30, bos=BOS, eos=EOS)
    with pytest.raises(ValueError, match=r"eos must be a target id in \[0, 13\), got 13"):
        m.translate(src, 5, bos=BOS, eos=13)
    with pytest.raises(ValueError, match="beam_size must be a positive int, got 0"):
        m.translate(src, 5, bos=BOS, eos=EOS, beam_size=0)
    for bad in (float("nan"), float("inf")):  # checked up front, before any decoding
        with pytest.raises(ValueError, match=f"length_penalty must be a finite float, got {bad}"):
            m.translate(src, 5, bos=BOS, eos=EOS, beam_size=2, length_penalty=bad)
    with pytest.raises(TypeError, match=r"length_penalty must be a finite float, got 'a' \(str\)"):
        m.translate(src, 5, bos=BOS, eos=EOS, beam_size=2, length_penalty="a")



@pytest.mark.parametrize("caches", [False, True])
def test_decode_names_a_bad_memory_key_padding_mask(caches):
    """On every path (padding-free or padded, with or without caches), not as the attention's key_padding_mask."""
    m = tiny()
    tgt, memory = ids(2, 4, vocab=TGT_V), torch.randn(2, 5, 14)
    kw = {"caches": m.decoder.new_caches()} if caches else {}
    for mask in (torch.zeros(2, 4, dtype=torch.bool), torch.ones(2, 6, dtype=torch.bool)):
        with pytest.raises(ValueError, match=r"memory_key_padding_mask must have shape \(batch, src_len\) = "
                                             rf"\(2, 5\), got {re.escape(str(tuple(mask.shape)))}"):  # fmt: skip
            m.decode(tgt, memory, memory_key_padding_mask=mask, **kw)
    with pytest.raises(TypeError, match="memory_key_padding_mask must be a torch.Tensor, got list"):
        m.decode(tgt, memory, memory_key_padding_mask=[[False] * 5] * 2, **kw)



def test_decode_names_a_memory_of_another_dtype():
    m = tiny()
    with pytest.raises(TypeError, match=r"memory must have the model's dtype torch.float32, got torch.float64"):
        m.decode(ids(2, 4, vocab=TGT_V), torch.randn(2, 5, 14, dtype=torch.float64))


# ---- attention maps and training -------------------------------------------------------------------------------


def test_cross_attention_weights():
    m = tiny(seed=11)
    src, tgt = ids(2, 5), ids(2, 3, vocab=TGT_V)
    mask = torch.zeros(2, 5, dtype=torch.bool)
    mask[1, 3:] = True
    w = m.cross_attention_weights(src, tgt, src_key_padding_mask=mask)
    assert len(w) == 2 and w[0].shape == (2, 2, 3, 5)
    assert_close(w[1].sum(-1), torch.ones(2, 2, 3))
    assert (w[0][1, :, :, 3:] == 0).all()
    assert not any(layer.cross_attn._forward_hooks for layer in m.decoder.layers)  # hooks removed


def test_converges_on_reversal():
    """A short run on reversing sequences: the loss falls well below its start (op tests can all pass while
    training diverges)."""
    torch.manual_seed(0)
    m = Transformer(8, 8, d_model=32, n_heads=4, d_ff=64, n_layers=1, dropout=0.0, max_len=8, norm_first=True)
    opt = torch.optim.Adam(m.parameters(), lr=3e-3)
    losses = []
    for _ in range(150):
        src = torch.randint(2, 8, (32, 5))
        tgt_out = src.flip(1)
        tgt_in = torch.cat([torch.full((32, 1), 1), tgt_out[:, :-1]], 1)
        loss = nn.functional.cross_entropy(m(src, tgt_in).flatten(0, 1), tgt_out.flatten())
        opt.zero_grad()
        loss.backward()
        opt.step()
        losses.append(loss.item())
    start, end = sum(losses[:5]) / 5, sum(losses[-10:]) / 10
    assert start > 1.5  # ≈ ln 6 at the start
    assert end < 0.2 * start, (start, end)
    m.eval()
    src = torch.randint(2, 8, (16, 5))
    out = m.translate(src, 5, bos=1, eos=0)
    assert (out == src.flip(1)).float().mean() > 0.9


def test_from_pretrained_is_in_eval_mode(tmp_path):
    tiny(norm_first=True, seed=9).train().save_pretrained(tmp_path)
    assert not any(m.training for m in Transformer.from_pretrained(tmp_path).modules())


@pytest.mark.parametrize("norm_first", [False, True])
def test_gradcheck_float64_forward_and_loss_with_padding(norm_first):
    torch.manual_seed(0)
    model = Transformer(11, 13, d_model=6, n_heads=3, d_ff=5, n_layers=1, dropout=0.0, max_len=7,
                        norm_first=norm_first, dtype=torch.float64)  # fmt: skip
    names, params = zip(*model.named_parameters())
    flat = torch.cat([p.detach().flatten() for p in params]).requires_grad_(True)  # one input: few forward calls
    src = torch.tensor([[1, 4, 7, 2], [3, 3, 9, 0]])
    tgt = torch.tensor([[1, 5, 12], [1, 8, 0]])
    skpm, tkpm = src == 0, tgt == 0  # right padding: the padding-free path runs
    kw = {"src_key_padding_mask": skpm, "tgt_key_padding_mask": tkpm}
    tgt_out = torch.tensor([[5, 12, 2], [8, 2, -100]])

    def f(v):
        state = dict(zip(names, (t.view_as(p) for t, p in zip(v.split([p.numel() for p in params]), params))))
        logits = torch.func.functional_call(model, state, (src, tgt), kw)[~tkpm]
        state = {"model." + n: t for n, t in state.items()}
        smoothed = kw | {"label_smoothing": 0.1}
        loss = torch.func.functional_call(LossForward(model), state, (src, tgt, tgt_out), smoothed)
        return logits, loss

    assert torch.autograd.gradcheck(f, (flat,), fast_mode=True)


def test_positional_table_is_rebuilt_after_to_empty_and_dtype_round_trips():
    torch.manual_seed(0)
    kw = dict(d_model=15, n_heads=3, d_ff=23, n_layers=1, dropout=0.0, max_len=31)
    model = Transformer(37, 41, **kw).eval()
    built = Transformer(37, 41, device="meta", **kw).to_empty(device="cpu")  # the table is not in the state dict
    built.load_state_dict(model.state_dict())
    assert torch.equal(built.pos_encoding, model.pos_encoding)
    ids = torch.randint(1, 37, (2, 7))
    assert torch.equal(built.eval()(ids, ids), model(ids, ids))
    exact = sinusoidal_positional_encoding(31, 15, dtype=torch.float64)
    assert torch.equal(Transformer(37, 41, **kw).to(torch.bfloat16).double().pos_encoding, exact)
