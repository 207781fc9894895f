"""sublayer.d2l against a transcription of the book's reference classes (d2l.ai 1.x, "The Transformer
Architecture", PyTorch tab, and d2l.torch's MultiHeadAttention / DotProductAttention / masked_softmax /
PositionalEncoding), written here from the book's math: the book's state dicts load, and forward and backward
agree with copied weights; the chapter's cells give the book's shapes."""

from __future__ import annotations

import math

import pytest
import torch
from torch import nn

import sublayer
from sublayer import d2l

# ---- the book's reference classes (transcribed) ---------------------------------------------------------------


def masked_softmax(X, valid_lens):
    """Softmax on the last axis with keys beyond ``valid_lens`` filled with -1e6 (1-D: per row; 2-D: per query)."""
    if valid_lens is None:
        return nn.functional.softmax(X, dim=-1)
    shape = X.shape
    if valid_lens.dim() == 1:
        valid_lens = torch.repeat_interleave(valid_lens, shape[1])
    else:
        valid_lens = valid_lens.reshape(-1)
    X = X.reshape(-1, shape[-1])
    mask = torch.arange(shape[-1], dtype=torch.float32)[None, :] < valid_lens[:, None]
    X = X.masked_fill(~mask, -1e6)
    return nn.functional.softmax(X.reshape(shape), dim=-1)


class BookDotProductAttention(nn.Module):
    def __init__(self, dropout):
        super().__init__()
        self.dropout = nn.Dropout(dropout)

    def forward(self, queries, keys, values, valid_lens=None):
        d = queries.shape[-1]
        scores = torch.bmm(queries, keys.transpose(1, 2)) / math.sqrt(d)
        self.attention_weights = masked_softmax(scores, valid_lens)
        return torch.bmm(self.dropout(self.attention_weights), values)


class BookMultiHeadAttention(nn.Module):
    def __init__(self, num_hiddens, num_heads, dropout, bias=False):
        super().__init__()
        self.num_heads = num_heads
        self.attention = BookDotProductAttention(dropout)
        self.W_q = nn.LazyLinear(num_hiddens, bias=bias)
        self.W_k = nn.LazyLinear(num_hiddens, bias=bias)
        self.W_v = nn.LazyLinear(num_hiddens, bias=bias)
        self.W_o = nn.LazyLinear(num_hiddens, bias=bias)

    def transpose_qkv(self, X):  # (B, T, H·d) -> (B·H, T, d)
        X = X.reshape(X.shape[0], X.shape[1], self.num_heads, -1).permute(0, 2, 1, 3)
        return X.reshape(-1, X.shape[2], X.shape[3])

    def transpose_output(self, X):  # (B·H, T, d) -> (B, T, H·d)
        X = X.reshape(-1, self.num_heads, X.shape[1], X.shape[2]).permute(0, 2, 1, 3)
        return X.reshape(X.shape[0], X.shape[1], -1)

    def forward(self, queries, keys, values, valid_lens):
        queries = self.transpose_qkv(self.W_q(queries))
        keys = self.transpose_qkv(self.W_k(keys))
        values = self.transpose_qkv(self.W_v(values))
        if valid_lens is not None:
            valid_lens = torch.repeat_interleave(valid_lens, repeats=self.num_heads, dim=0)
        output = self.attention(queries, keys, values, valid_lens)
        return self.W_o(self.transpose_output(output))


class BookPositionalEncoding(nn.Module):
    def __init__(self, num_hiddens, dropout, max_len=1000):
        super().__init__()
        self.dropout = nn.Dropout(dropout)
        self.P = torch.zeros((1, max_len, num_hiddens))
        X = torch.arange(max_len, dtype=torch.float32).reshape(-1, 1) / torch.pow(
            10000, torch.arange(0, num_hiddens, 2, dtype=torch.float32) / num_hiddens
        )
        self.P[:, :, 0::2] = torch.sin(X)
        self.P[:, :, 1::2] = torch.cos(X)

    def forward(self, X):
        return self.dropout(X + self.P[:, : X.shape[1], :])


class BookPositionWiseFFN(nn.Module):
    def __init__(self, ffn_num_hiddens, ffn_num_outputs):
        super().__init__()
        self.dense1 = nn.LazyLinear(ffn_num_hiddens)
        self.relu = nn.ReLU()
        self.dense2 = nn.LazyLinear(ffn_num_outputs)

    def forward(self, X):
        return self.dense2(self.relu(self.dense1(X)))


class BookAddNorm(nn.Module):
    def __init__(self, norm_shape, dropout):
        super().__init__()
        self.dropout = nn.Dropout(dropout)
        self.ln = nn.LayerNorm(norm_shape)

    def forward(self, X, Y):
        return self.ln(self.dropout(Y) + X)


class BookEncoderBlock(nn.Module):
    def __init__(self, num_hiddens, ffn_num_hiddens, num_heads, dropout, use_bias=False):
        super().__init__()
        self.attention = BookMultiHeadAttention(num_hiddens, num_heads, dropout, use_bias)
        self.addnorm1 = BookAddNorm(num_hiddens, dropout)
        self.ffn = BookPositionWiseFFN(ffn_num_hiddens, num_hiddens)
        self.addnorm2 = BookAddNorm(num_hiddens, dropout)

    def forward(self, X, valid_lens):
        Y = self.addnorm1(X, self.attention(X, X, X, valid_lens))
        return self.addnorm2(Y, self.ffn(Y))


class BookEncoder(nn.Module):
    def __init__(self, vocab_size, num_hiddens, ffn_num_hiddens, num_heads, num_blks, dropout, use_bias=False):
        super().__init__()
        self.num_hiddens = num_hiddens
        self.embedding = nn.Embedding(vocab_size, num_hiddens)
        self.pos_encoding = BookPositionalEncoding(num_hiddens, dropout)
        self.blks = nn.Sequential()
        for i in range(num_blks):
            self.blks.add_module(
                "block" + str(i), BookEncoderBlock(num_hiddens, ffn_num_hiddens, num_heads, dropout, use_bias)
            )

    def forward(self, X, valid_lens):
        X = self.pos_encoding(self.embedding(X) * math.sqrt(self.num_hiddens))
        self.attention_weights = [None] * len(self.blks)
        for i, blk in enumerate(self.blks):
            X = blk(X, valid_lens)
            self.attention_weights[i] = blk.attention.attention.attention_weights
        return X


class BookDecoderBlock(nn.Module):
    def __init__(self, num_hiddens, ffn_num_hiddens, num_heads, dropout, i):
        super().__init__()
        self.i = i
        self.attention1 = BookMultiHeadAttention(num_hiddens, num_heads, dropout)
        self.addnorm1 = BookAddNorm(num_hiddens, dropout)
        self.attention2 = BookMultiHeadAttention(num_hiddens, num_heads, dropout)
        self.addnorm2 = BookAddNorm(num_hiddens, dropout)
        self.ffn = BookPositionWiseFFN(ffn_num_hiddens, num_hiddens)
        self.addnorm3 = BookAddNorm(num_hiddens, dropout)

    def forward(self, X, state):
        enc_outputs, enc_valid_lens = state[0], state[1]
        key_values = X if state[2][self.i] is None else torch.cat((state[2][self.i], X), dim=1)
        state[2][self.i] = key_values
        if self.training:
            batch_size, num_steps, _ = X.shape
            dec_valid_lens = torch.arange(1, num_steps + 1).repeat(batch_size, 1)
        else:
            dec_valid_lens = None
        Y = self.addnorm1(X, self.attention1(X, key_values, key_values, dec_valid_lens))
        Z = self.addnorm2(Y, self.attention2(Y, enc_outputs, enc_outputs, enc_valid_lens))
        return self.addnorm3(Z, self.ffn(Z)), state


class BookDecoder(nn.Module):
    def __init__(self, vocab_size, num_hiddens, ffn_num_hiddens, num_heads, num_blks, dropout):
        super().__init__()
        self.num_hiddens = num_hiddens
        self.num_blks = num_blks
        self.embedding = nn.Embedding(vocab_size, num_hiddens)
        self.pos_encoding = BookPositionalEncoding(num_hiddens, dropout)
        self.blks = nn.Sequential()
        for i in range(num_blks):
            self.blks.add_module("block" + str(i), BookDecoderBlock(num_hiddens, ffn_num_hiddens, num_heads, dropout, i))
        self.dense = nn.LazyLinear(vocab_size)

    def init_state(self, enc_outputs, enc_valid_lens):
        return [enc_outputs, enc_valid_lens, [None] * self.num_blks]

    def forward(self, X, state):
        X = self.pos_encoding(self.embedding(X) * math.sqrt(self.num_hiddens))
        self.attention_weights = [[None] * len(self.blks) for _ in range(2)]
        for i, blk in enumerate(self.blks):
            X, state = blk(X, state)
            self.attention_weights[0][i] = blk.attention1.attention.attention_weights
            self.attention_weights[1][i] = blk.attention2.attention.attention_weights
        return self.dense(X), state


# ---- helpers --------------------------------------------------------------------------------------------------

D, F, H, V, NB = 14, 5, 2, 11, 2  # num_hiddens (even: the book's encoding needs it), ffn, heads, vocab, blocks
B, T, S = 3, 6, 5


def randomize_(module):
    with torch.no_grad():
        for p in module.parameters():
            p.normal_(0.0, 0.4)
    return module


def copy_from_book(ours, book):
    """Load the book model's state dict into ours (the book's names are renamed on load); check it is exact."""
    ours.load_state_dict(book.state_dict())
    pairs = list(zip(ours.named_parameters(), book.named_parameters(), strict=True))
    for (n1, p1), (n2, p2) in pairs:
        assert p1.shape == p2.shape and torch.equal(p1, p2), (n1, n2)
    return [(p1, p2) for (_, p1), (_, p2) in pairs]


def assert_grads_close(pairs):
    for ours, ref in pairs:
        torch.testing.assert_close(ours.grad, ref.grad)


# ---- the chapter's cells --------------------------------------------------------------------------------------


def test_chapter_cells_print_the_books_shapes():
    ffn = d2l.PositionWiseFFN(4, 8)
    ffn.eval()
    out = ffn(d2l.ones((2, 3, 4)))[0]
    assert out.shape == (3, 8)
    assert torch.equal(out[0], out[1]) and torch.equal(out[1], out[2])  # same MLP at every position

    ln = sublayer.LayerNorm(2)  # the LayerNorm-vs-BatchNorm cell with sublayer's LayerNorm
    bn = nn.LazyBatchNorm1d()
    X = d2l.tensor([[1, 2], [2, 3]], dtype=torch.float32)
    torch.testing.assert_close(ln(X), nn.LayerNorm(2)(X))
    # the book prints [[-1.0000, 1.0000], ...]: 0.5 / sqrt(0.25 + eps) = 0.99998
    torch.testing.assert_close(ln(X), torch.tensor([[-1.0, 1.0], [-1.0, 1.0]]), atol=3e-5, rtol=0)
    assert bn(X).shape == (2, 2)

    add_norm = d2l.AddNorm(4, 0.5)
    shape = (2, 3, 4)
    d2l.check_shape(add_norm(d2l.ones(shape), d2l.ones(shape)), shape)

    X = d2l.ones((2, 100, 24))
    valid_lens = d2l.tensor([3, 2])
    encoder_blk = d2l.TransformerEncoderBlock(24, 48, 8, 0.5)
    encoder_blk.eval()
    d2l.check_shape(encoder_blk(X, valid_lens), X.shape)

    encoder = d2l.TransformerEncoder(200, 24, 48, 8, 2, 0.5)
    d2l.check_shape(encoder(d2l.ones((2, 100), dtype=torch.long), valid_lens), (2, 100, 24))

    decoder_blk = d2l.TransformerDecoderBlock(24, 48, 8, 0.5, 0)
    X = d2l.ones((2, 100, 24))
    state = [encoder_blk(X, valid_lens), valid_lens, [None]]
    d2l.check_shape(decoder_blk(X, state)[0], X.shape)

    with pytest.raises(ValueError, match=r"tensor's shape \(2, 100, 24\) != expected shape \(2, 100\)"):
        d2l.check_shape(X, (2, 100))


def test_ffn_and_addnorm_match_the_book():
    book_ffn, ours_ffn = BookPositionWiseFFN(F, 5), d2l.PositionWiseFFN(F, 5)
    x = torch.randn(B, T, D)
    book_ffn(x)  # materialise the lazy layers
    pairs = copy_from_book(ours_ffn, book_ffn)
    assert ours_ffn.dense1 is ours_ffn.fc1 and ours_ffn.dense2 is ours_ffn.fc2
    xa, xb = x.clone().requires_grad_(), x.clone().requires_grad_()
    ya, yb = ours_ffn(xa), book_ffn(xb)
    torch.testing.assert_close(ya, yb)
    g = torch.randn_like(ya)
    ya.backward(g), yb.backward(g)
    torch.testing.assert_close(xa.grad, xb.grad)
    assert_grads_close(pairs)

    book_an, ours_an = randomize_(BookAddNorm(D, 0.0)), d2l.AddNorm(D, 0.0)
    copy_from_book(ours_an, book_an)
    assert ours_an.ln is ours_an.norm
    y = torch.randn(B, T, D)
    torch.testing.assert_close(ours_an(x, y), book_an(x, y))


@pytest.mark.parametrize("valid_lens", [None, "1d", "2d"])
@pytest.mark.parametrize("use_bias", [False, True])
def test_encoder_matches_the_book(valid_lens, use_bias):
    book = BookEncoder(V, D, F, H, NB, 0.0, use_bias)
    ids = torch.randint(0, V, (B, T))
    vl = {None: None, "1d": torch.tensor([T, 4, 1]), "2d": torch.randint(1, T + 1, (B, T))}[valid_lens]
    book(ids, vl)
    randomize_(book)
    ours = d2l.TransformerEncoder(V, D, F, H, NB, 0.0, use_bias)
    pairs = copy_from_book(ours, book)
    out, ref = ours(ids, vl), book(ids, vl)
    torch.testing.assert_close(out, ref)
    for w, w_ref in zip(ours.attention_weights, book.attention_weights, strict=True):
        assert w.shape == (B * H, T, T)
        torch.testing.assert_close(w, w_ref)
    g = torch.randn_like(out)
    out.backward(g), ref.backward(g)
    assert_grads_close(pairs)


def test_decoder_training_and_token_by_token_prediction_match_the_book():
    book_enc, book_dec = BookEncoder(V, D, F, H, NB, 0.0), BookDecoder(V, D, F, H, NB, 0.0)
    src, tgt = torch.randint(0, V, (B, S)), torch.randint(0, V, (B, T))
    enc_vl = torch.tensor([S, 3, 1])
    book_dec(tgt, book_dec.init_state(book_enc(src, enc_vl), enc_vl))
    randomize_(book_enc), randomize_(book_dec)
    enc, dec = d2l.TransformerEncoder(V, D, F, H, NB, 0.0), d2l.TransformerDecoder(V, D, F, H, NB, 0.0)
    pairs = copy_from_book(enc, book_enc) + copy_from_book(dec, book_dec)

    # training (teacher forcing): causal dec_valid_lens
    out, state = dec(tgt, dec.init_state(enc(src, enc_vl), enc_vl))
    ref, ref_state = book_dec(tgt, book_dec.init_state(book_enc(src, enc_vl), enc_vl))
    assert out.shape == (B, T, V) and len(state[2]) == NB
    torch.testing.assert_close(out, ref)
    for kind in range(2):
        for w, w_ref in zip(dec.attention_weights[kind], book_dec.attention_weights[kind], strict=True):
            torch.testing.assert_close(w, w_ref)
    g = torch.randn_like(out)
    out.backward(g), ref.backward(g)
    assert_grads_close(pairs)

    # prediction in eval: one token at a time, key_values concatenated in the state
    for m in (enc, dec, book_enc, book_dec):
        m.eval()
    with torch.no_grad():
        state = dec.init_state(enc(src, enc_vl), enc_vl)
        ref_state = book_dec.init_state(book_enc(src, enc_vl), enc_vl)
        for t in range(3):
            step, state = dec(tgt[:, t : t + 1], state)
            ref_step, ref_state = book_dec(tgt[:, t : t + 1], ref_state)
            torch.testing.assert_close(step, ref_step)
            assert state[2][0].shape == (B, t + 1, D)
            torch.testing.assert_close(state[2][1], ref_state[2][1])
        assert dec.attention_weights[0][0].shape == (B * H, 1, 3)


def test_positional_encoding_is_the_books_table():
    ours, book = d2l.PositionalEncoding(D, 0.0), BookPositionalEncoding(D, 0.0)
    assert d2l.PositionalEncoding(D + 1, 0.0).P.shape == (1, 1000, D + 1)  # odd sizes work here (not in the book)
    assert torch.equal(ours.P, book.P)
    assert "P" not in ours.state_dict()
    with pytest.raises(ValueError, match="more than max_len"):
        d2l.PositionalEncoding(4, 0.0, max_len=3)(torch.zeros(1, 5, 4))


def test_valid_lens_errors_and_zero_length_rows():
    mha = d2l.MultiHeadAttention(D, H, 0.0)
    x = torch.randn(B, T, D)
    with pytest.raises(ValueError, match=r"valid_lens \(1-D\) must have shape \(3,\), got \(2,\)"):
        mha(x, x, x, torch.tensor([1, 2]))
    with pytest.raises(ValueError, match=r"valid_lens \(2-D\) must have shape \(batch, queries\) = \(3, 6\)"):
        mha(x, x, x, torch.ones(B, T + 1))
    with pytest.raises(ValueError, match="1-D .* or 2-D"):
        mha(x, x, x, torch.ones(B, T, 1))
    with pytest.raises(TypeError, match="valid_lens"):
        mha(x, x, x, [1, 2, 3])
    out = mha(x, x, x, torch.tensor([0, 2, 3]))  # a sequence with no valid key: zeros, finite (documented)
    assert torch.isfinite(out).all() and (mha.attention_weights[:H] == 0).all()


def test_masked_softmax_with_valid_lens_needs_3d_scores():
    """The book's masked_softmax masks (batch, queries, keys) scores; another rank is named, not a TypeError from
    inside."""
    with pytest.raises(ValueError, match=r"X must be 3-D \(batch, queries, keys\) with valid_lens, got shape \(2, 2,"):
        d2l.masked_softmax(torch.rand(2, 2, 2, 4), torch.tensor([2, 3]))
    with pytest.raises(ValueError, match=r"X must be 3-D .*got shape \(2, 4\)"):
        d2l.masked_softmax(torch.rand(2, 4), torch.tensor([2, 3]))
    assert d2l.masked_softmax(torch.rand(2, 4), None).shape == (2, 4)  # without valid_lens: a plain softmax


def test_multi_head_attention_names_a_feature_size_other_than_num_hiddens():
    mha = d2l.MultiHeadAttention(D, H, 0.0)
    x, other = torch.randn(B, T, D), torch.randn(B, T, D + 1)
    for args, name in (((other, x, x), "queries"), ((x, other, x), "keys"), ((x, x, other), "values")):
        want = rf"{name} must have last dim num_hiddens={D}, got shape \({B}, {T}, {D + 1}\)"
        with pytest.raises(ValueError, match=want):
            mha(*args)


def test_gradcheck_encoder_block_float64_with_per_query_valid_lens():
    blk = randomize_(d2l.TransformerEncoderBlock(6, 5, 2, 0.0, use_bias=True)).double()
    assert not isinstance(blk.ffn.fc1, nn.LazyLinear)  # the block knows its input size: nothing lazy
    x = torch.randn(2, 3, 6, dtype=torch.float64, requires_grad=True)
    vl = torch.tensor([[1, 2, 3], [3, 1, 2]])
    assert torch.autograd.gradcheck(lambda t: blk(t, vl), (x,), eps=1e-6, atol=1e-5, rtol=1e-3)


# ---- the chapter's cells typed against sublayer.d2l -----------------------------------------------------------


def type_the_books_cells():
    """The chapter's cells as the book writes them (11.5 multi-head attention, 11.7 the Transformer), with ``d2l``
    = sublayer.d2l; returns their classes."""

    class MultiHeadAttention(d2l.Module):
        def __init__(self, num_hiddens, num_heads, dropout, bias=False, **kwargs):
            super().__init__()
            self.num_heads = num_heads
            self.attention = d2l.DotProductAttention(dropout)
            self.W_q = nn.LazyLinear(num_hiddens, bias=bias)
            self.W_k = nn.LazyLinear(num_hiddens, bias=bias)
            self.W_v = nn.LazyLinear(num_hiddens, bias=bias)
            self.W_o = nn.LazyLinear(num_hiddens, bias=bias)

        def forward(self, queries, keys, values, valid_lens):
            queries = self.transpose_qkv(self.W_q(queries))
            keys = self.transpose_qkv(self.W_k(keys))
            values = self.transpose_qkv(self.W_v(values))
            if valid_lens is not None:
                valid_lens = torch.repeat_interleave(valid_lens, repeats=self.num_heads, dim=0)
            output = self.attention(queries, keys, values, valid_lens)
            output_concat = self.transpose_output(output)
            return self.W_o(output_concat)

    @d2l.add_to_class(MultiHeadAttention)
    def transpose_qkv(self, X):
        X = X.reshape(X.shape[0], X.shape[1], self.num_heads, -1)
        X = X.permute(0, 2, 1, 3)
        return X.reshape(-1, X.shape[2], X.shape[3])

    @d2l.add_to_class(MultiHeadAttention)
    def transpose_output(self, X):
        X = X.reshape(-1, self.num_heads, X.shape[1], X.shape[2])
        X = X.permute(0, 2, 1, 3)
        return X.reshape(X.shape[0], X.shape[1], -1)

    class PositionWiseFFN(nn.Module):
        def __init__(self, ffn_num_hiddens, ffn_num_outputs):
            super().__init__()
            self.dense1 = nn.LazyLinear(ffn_num_hiddens)
            self.relu = nn.ReLU()
            self.dense2 = nn.LazyLinear(ffn_num_outputs)

        def forward(self, X):
            return self.dense2(self.relu(self.dense1(X)))

    class AddNorm(nn.Module):
        def __init__(self, norm_shape, dropout):
            super().__init__()
            self.dropout = nn.Dropout(dropout)
            self.ln = nn.LayerNorm(norm_shape)

        def forward(self, X, Y):
            return self.ln(self.dropout(Y) + X)

    class TransformerEncoderBlock(nn.Module):
        def __init__(self, num_hiddens, ffn_num_hiddens, num_heads, dropout, use_bias=False):
            super().__init__()
            self.attention = d2l.MultiHeadAttention(num_hiddens, num_heads, dropout, use_bias)
            self.addnorm1 = AddNorm(num_hiddens, dropout)
            self.ffn = PositionWiseFFN(ffn_num_hiddens, num_hiddens)
            self.addnorm2 = AddNorm(num_hiddens, dropout)

        def forward(self, X, valid_lens):
            Y = self.addnorm1(X, self.attention(X, X, X, valid_lens))
            return self.addnorm2(Y, self.ffn(Y))

    class TransformerEncoder(d2l.Encoder):
        def __init__(self, vocab_size, num_hiddens, ffn_num_hiddens, num_heads, num_blks, dropout, use_bias=False):
            super().__init__()
            self.num_hiddens = num_hiddens
            self.embedding = nn.Embedding(vocab_size, num_hiddens)
            self.pos_encoding = d2l.PositionalEncoding(num_hiddens, dropout)
            self.blks = nn.Sequential()
            for i in range(num_blks):
                self.blks.add_module("block" + str(i), TransformerEncoderBlock(
                    num_hiddens, ffn_num_hiddens, num_heads, dropout, use_bias))  # fmt: skip

        def forward(self, X, valid_lens):
            X = self.pos_encoding(self.embedding(X) * math.sqrt(self.num_hiddens))
            self.attention_weights = [None] * len(self.blks)
            for i, blk in enumerate(self.blks):
                X = blk(X, valid_lens)
                self.attention_weights[i] = blk.attention.attention.attention_weights
            return X

    class TransformerDecoderBlock(nn.Module):
        def __init__(self, num_hiddens, ffn_num_hiddens, num_heads, dropout, i):
            super().__init__()
            self.i = i
            self.attention1 = d2l.MultiHeadAttention(num_hiddens, num_heads, dropout)
            self.addnorm1 = AddNorm(num_hiddens, dropout)
            self.attention2 = d2l.MultiHeadAttention(num_hiddens, num_heads, dropout)
            self.addnorm2 = AddNorm(num_hiddens, dropout)
            self.ffn = PositionWiseFFN(ffn_num_hiddens, num_hiddens)
            self.addnorm3 = AddNorm(num_hiddens, dropout)

        def forward(self, X, state):
            enc_outputs, enc_valid_lens = state[0], state[1]
            if state[2][self.i] is None:
                key_values = X
            else:
                key_values = torch.cat((state[2][self.i], X), dim=1)
            state[2][self.i] = key_values
            if self.training:
                batch_size, num_steps, _ = X.shape
                dec_valid_lens = torch.arange(1, num_steps + 1, device=X.device).repeat(batch_size, 1)
            else:
                dec_valid_lens = None
            X2 = self.attention1(X, key_values, key_values, dec_valid_lens)
            Y = self.addnorm1(X, X2)
            Y2 = self.attention2(Y, enc_outputs, enc_outputs, enc_valid_lens)
            Z = self.addnorm2(Y, Y2)
            return self.addnorm3(Z, self.ffn(Z)), state

    class TransformerDecoder(d2l.AttentionDecoder):
        def __init__(self, vocab_size, num_hiddens, ffn_num_hiddens, num_heads, num_blks, dropout):
            super().__init__()
            self.num_hiddens = num_hiddens
            self.num_blks = num_blks
            self.embedding = nn.Embedding(vocab_size, num_hiddens)
            self.pos_encoding = d2l.PositionalEncoding(num_hiddens, dropout)
            self.blks = nn.Sequential()
            for i in range(num_blks):
                self.blks.add_module("block" + str(i), TransformerDecoderBlock(
                    num_hiddens, ffn_num_hiddens, num_heads, dropout, i))  # fmt: skip
            self.dense = nn.LazyLinear(vocab_size)

        def init_state(self, enc_outputs, enc_valid_lens):
            return [enc_outputs, enc_valid_lens, [None] * self.num_blks]

        def forward(self, X, state):
            X = self.pos_encoding(self.embedding(X) * math.sqrt(self.num_hiddens))
            self._attention_weights = [[None] * len(self.blks) for _ in range(2)]
            for i, blk in enumerate(self.blks):
                X, state = blk(X, state)
                self._attention_weights[0][i] = blk.attention1.attention.attention_weights
                self._attention_weights[1][i] = blk.attention2.attention.attention_weights
            return self.dense(X), state

        @property
        def attention_weights(self):
            return self._attention_weights

    return MultiHeadAttention, TransformerEncoder, TransformerDecoder


def test_the_books_attention_cells_run_and_give_the_books_numbers():
    X, vl = torch.rand(2, 2, 4), torch.tensor([2, 3])  # 11.3's masked_softmax cells
    torch.testing.assert_close(d2l.masked_softmax(X, vl), masked_softmax(X, vl))
    vl2 = torch.tensor([[1, 3], [2, 4]])
    torch.testing.assert_close(d2l.masked_softmax(X, vl2), masked_softmax(X, vl2))
    assert (d2l.masked_softmax(X, torch.tensor([0, 3]))[0] == 0).all()  # no valid key: zeros (documented)

    queries = d2l.normal(0, 1, (2, 1, 2))  # 11.3's DotProductAttention cell
    keys = d2l.normal(0, 1, (2, 10, 2))
    values = d2l.normal(0, 1, (2, 10, 4))
    valid_lens = d2l.tensor([2, 6])
    attention, book = d2l.DotProductAttention(dropout=0.5), BookDotProductAttention(0.5)
    attention.eval(), book.eval()
    d2l.check_shape(attention(queries, keys, values, valid_lens), (2, 1, 4))
    torch.testing.assert_close(attention(queries, keys, values, valid_lens), book(queries, keys, values, valid_lens))
    torch.testing.assert_close(attention.attention_weights, book.attention_weights)

    MultiHeadAttention, _, _ = type_the_books_cells()  # 11.5's cells
    num_hiddens, num_heads = 100, 5
    attention = MultiHeadAttention(num_hiddens, num_heads, 0.5)
    batch_size, num_queries, num_kvpairs = 2, 4, 6
    valid_lens = d2l.tensor([3, 2])
    X = d2l.ones((batch_size, num_queries, num_hiddens))
    Y = d2l.ones((batch_size, num_kvpairs, num_hiddens))
    d2l.check_shape(attention(X, Y, Y, valid_lens), (batch_size, num_queries, num_hiddens))
    ours = d2l.MultiHeadAttention(num_hiddens, num_heads, 0.5)
    copy_from_book(ours, randomize_(attention))
    attention.eval(), ours.eval()
    X, Y = torch.randn(X.shape), torch.randn(Y.shape)
    torch.testing.assert_close(ours(X, Y, Y, valid_lens), attention(X, Y, Y, valid_lens))
    torch.testing.assert_close(ours.attention_weights, attention.attention.attention_weights)


def test_the_books_transformer_cells_run_on_sublayer_d2l_and_match_its_classes():
    _, TransformerEncoder, TransformerDecoder = type_the_books_cells()  # 11.7's cells
    valid_lens = d2l.tensor([3, 2])
    encoder = TransformerEncoder(200, 24, 48, 8, 2, 0.5)
    d2l.check_shape(encoder(d2l.ones((2, 100), dtype=torch.long), valid_lens), (2, 100, 24))
    decoder = TransformerDecoder(200, 24, 48, 8, 2, 0.5)
    src, tgt = torch.randint(0, 200, (2, 7)), torch.randint(0, 200, (2, 5))
    decoder(tgt, decoder.init_state(encoder(src, valid_lens), valid_lens))  # materialise the lazy layers

    enc, dec = d2l.TransformerEncoder(200, 24, 48, 8, 2, 0.5), d2l.TransformerDecoder(200, 24, 48, 8, 2, 0.5)
    copy_from_book(enc, randomize_(encoder)), copy_from_book(dec, randomize_(decoder))
    for m in (encoder, decoder, enc, dec):
        m.eval()
    ref, _ = decoder(tgt, decoder.init_state(encoder(src, valid_lens), valid_lens))
    out, _ = dec(tgt, dec.init_state(enc(src, valid_lens), valid_lens))
    torch.testing.assert_close(out, ref)
    for w, w_ref in zip(enc.attention_weights, encoder.attention_weights, strict=True):
        torch.testing.assert_close(w, w_ref)
    torch.testing.assert_close(dec.attention_weights[1][1], decoder.attention_weights[1][1])


def test_multi_head_attention_has_the_books_attention_and_transposes():
    mha, book = d2l.MultiHeadAttention(D, H, 0.0), BookMultiHeadAttention(D, H, 0.0)
    assert isinstance(mha.attention, d2l.DotProductAttention)
    assert isinstance(d2l.PositionWiseFFN(4, 8).relu, nn.ReLU)
    X = torch.randn(B, T, D)
    heads = mha.transpose_qkv(X)
    assert heads.shape == (B * H, T, D // H)
    torch.testing.assert_close(heads, book.transpose_qkv(X))
    assert torch.equal(heads[1], X[0, :, D // H :])  # batch 0, head 1: the second slice of the features
    assert torch.equal(mha.transpose_output(heads), X)
    mha(X, X, X, torch.tensor([T, 2, 4]))
    assert mha.attention_weights is mha.attention.attention_weights


def test_train_mode_attention_weights_are_recorded_before_dropout():
    x, vl = torch.randn(B, T, D), torch.tensor([T, 2, 4])
    book = BookMultiHeadAttention(D, H, 0.5)
    book(x, x, x, vl)
    mha = d2l.MultiHeadAttention(D, H, 0.5)
    copy_from_book(mha, book)
    torch.manual_seed(0)
    out = mha(x, x, x, vl)
    torch.manual_seed(0)
    ref = book(x, x, x, vl)
    sums = mha.attention_weights.sum(-1)
    torch.testing.assert_close(sums, torch.ones_like(sums))  # the weights, not the dropped-out ones
    torch.testing.assert_close(mha.attention_weights, book.attention.attention_weights)
    torch.testing.assert_close(out, ref)  # the same dropout mask as the book's, drawn in its order


def test_grouped_query_and_float16_heads():
    """``n_kv_heads`` (passed on to sublayer's attention) repeats each key/value head for its query heads, as
    sublayer.MultiHeadAttention does; float16 scores take float16's most negative value at masked keys."""
    torch.manual_seed(0)
    mha = d2l.MultiHeadAttention(12, 6, 0.0, n_kv_heads=2).eval()
    ref = sublayer.MultiHeadAttention(12, 6, n_kv_heads=2, bias=False).eval()
    ref.load_state_dict(mha.state_dict())
    x = torch.randn(2, 5, 12)
    lens = torch.tensor([5, 3])
    pad = torch.arange(5)[None] >= lens[:, None]
    torch.testing.assert_close(mha(x, x, x, lens), ref(x, key_padding_mask=pad)[0])
    half = d2l.MultiHeadAttention(8, 2, 0.0).eval().half()
    out = half(x[..., :8].half(), x[..., :8].half(), x[..., :8].half(), lens)
    assert out.dtype == torch.float16 and bool(out.isfinite().all())
