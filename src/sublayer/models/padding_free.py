"""Padding-free forwards of :class:`~sublayer.models.Bert`, :class:`~sublayer.models.GPT2` and
:class:`~sublayer.models.Transformer`, training and inference.

When a padding mask marks padding, the models call these functions instead of their padded path: the embeddings,
the q/k/v/out projections, the FFNs, every Add & Norm and the LM head run on the packed real tokens
(:class:`sublayer.functional.packing.Packing`, one gather index per forward shared by every layer); only attention
scatters q/k/v back into the padded (B, H, T, d_head) layout, with the padded path's masks (built once per forward
for all layers): ``F.scaled_dot_product_attention`` in inference, and in training with attention dropout an
explicit softmax with the fused Philox dropout (:func:`sublayer.functional.fused.dropout`) on the weights, because
eager SDPA then takes its math path and ``bernoulli_``, several times slower on the CPU. The
modules are the models' own (same parameters, same dropout placement and probabilities), so with dropout 0 the
outputs and every gradient equal the padded path's at the real tokens; with dropout the masks are drawn over the
real tokens only (the same distribution, not the same stream).

Outputs keep their shapes; **positions at padding hold zeros** (hidden states and logits), as in
:func:`~sublayer.models.fast_inference`. A batch without padding takes the plain path (no overhead), and so do
incremental decoding with a KV cache and sharded models (DTensor parameters: tensor parallel, FSDP2). The path
calls the sub-layers' parameters directly: forward hooks on the attention modules and their projections do not
fire inside it (switch it off to use them).

GPT-2 also takes packed documents: ``position_ids`` that restart at 0 inside a row (Hugging Face's
``DataCollatorWithFlattening``) give block-diagonal causal attention, so each document sees only itself — equal,
document by document, to running each alone.

``set_enabled(False)`` (or ``with padding_free.disabled():``) switches the whole mechanism off: the models then
compute every padded position as before (the reference the tests compare with).
"""

from __future__ import annotations

import contextlib
import math
from collections.abc import Callable, Iterator

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from .. import functional as SF
from ..functional import fused
from ..functional.packing import Packing, document_mask
from ..nn import MultiHeadAttention

__all__ = ["enabled", "set_enabled", "disabled", "applies", "bert_forward", "gpt2_hidden", "gpt2_logits"]

_enabled = True


def enabled() -> bool:
    """Whether the models take the padding-free path when a mask marks padding."""
    return _enabled


def set_enabled(flag: bool) -> None:
    """Switch the padding-free path on or off for every model (on by default).

    Raises:
        TypeError: ``flag`` is not a bool.
    """
    global _enabled
    if not isinstance(flag, bool):
        raise TypeError(f"flag must be a bool, got {flag!r}")
    _enabled = flag


@contextlib.contextmanager
def disabled() -> Iterator[None]:
    """Run the block with the padded path (restores the previous setting afterwards)."""
    old = _enabled
    set_enabled(False)
    try:
        yield
    finally:
        set_enabled(old)


def plain_model(model: nn.Module) -> bool:
    """Not sharded: tensor-parallel / FSDP2 models (DTensor parameters, redistributing hooks) keep the padded path."""
    if not torch.distributed.is_available():
        return True
    from torch.distributed.tensor import DTensor

    return not any(isinstance(p, DTensor) for p in model.parameters())


def _attention_hooked(model: nn.Module) -> bool:
    """Some attention module has forward hooks (e.g. :func:`sublayer.record_attention`): the padding-free path
    does not call the modules' own forwards, so such a model keeps the padded path and its hooks fire."""
    return any(
        m._forward_hooks or m._forward_pre_hooks for m in model.modules() if isinstance(m, MultiHeadAttention)
    )


def applies(model: nn.Module, *key_padding_masks: Tensor | None) -> bool:
    """True when the path is on, ``model`` is not sharded (no DTensor parameters) and one of the bool masks
    (True = padding) marks at least one padded position."""
    return (
        _enabled
        and any(m is not None and m.dtype == torch.bool and m.numel() > 0 and bool(m.any()) for m in key_padding_masks)
        and plain_model(model)
        and not _attention_hooked(model)
    )


def _padding(mask: Tensor | None) -> Tensor | None:
    """The mask if it marks padding, else None (an all-False mask is no mask)."""
    return mask if mask is not None and bool(mask.any()) else None


# ---------------------------------------------------------------------------------------------- attention
class AttentionMask:
    """The mask of one attention kind, built once per forward and shared by every layer.

    Args:
        packing_q, packing_k: the packings of queries and keys (the keys' mask, True = padding).
        causal: query i sees keys j <= i (T_q == T_k here). docs: (B|1, 1, T, T) bool, True = other document.
        device: where the causal mask is made.

    Attributes:
        allowed: (B|1, 1, T_q|1, T_k) bool, True = may attend, with rows that see no key opened (they are zeroed
        after attention, as :func:`sublayer.functional.attention` does); ``blocked`` = ``~allowed``;
        dead: (B|1, 1, T_q|1, 1) bool query rows without any key, or None when there is none.
    """

    def __init__(
        self,
        packing_q: Packing,
        packing_k: Packing,
        *,
        causal: bool = False,
        docs: Tensor | None = None,
        device: torch.device | None = None,
    ) -> None:
        self.packing_k = packing_k
        key_padding_mask, t_q, t_k = packing_k.key_padding_mask, packing_q.seq_len, packing_k.seq_len
        allowed = None if key_padding_mask is None else ~key_padding_mask[:, None, None, :]
        if causal:
            c = SF.causal_mask(t_q, t_k, device=device)[None, None]
            allowed = c if allowed is None else allowed & c
        if docs is not None:
            allowed = ~docs if allowed is None else allowed & ~docs
        self.dead = None
        if allowed is not None:
            dead = ~allowed.any(dim=-1, keepdim=True)
            if bool(dead.any()):
                self.dead, allowed = dead, allowed | dead
        self.allowed = allowed
        self.blocked = None if allowed is None else ~allowed


def _heads(x: Tensor, attn: nn.Module) -> Tensor:
    """(B, T, D) -> (B, H, T, d_head)."""
    b, t = x.shape[:2]
    return x.view(b, t, attn.n_heads, attn.head_dim).transpose(1, 2)


class Segments:
    """Varlen attention: the packed rows as consecutive segments (one per sequence, or per packed document) that
    attend only inside themselves; no padded layout, no mask but the causal one.

    Args:
        q_lengths: rows of each query segment, summing to N_q. k_lengths: rows of the matching key segments
            (None: the same as the queries). causal: query i of a segment sees its keys j <= i.
    """

    def __init__(
        self, q_lengths: list[int], k_lengths: list[int] | None = None, *, causal: bool = False, device=None
    ) -> None:
        self.q_lengths = q_lengths
        self.k_lengths = q_lengths if k_lengths is None else k_lengths
        self.causal = causal
        t = max(self.q_lengths, default=0)
        self.blocked = ~SF.causal_mask(t, t, device=device) if causal else None


# "varlen" (one attention per sequence on the packed rows), "padded" (scatter into (B, H, T, d_head) and mask) or
# "auto": varlen for batches of at most VARLEN_MAX_ROWS rows, else padded — each per-sequence attention costs a few
# dispatches forward and backward, which a batch of many short rows (the demo: 96 rows of ~15 tokens) does not
# repay. Measured in sublayer.bench_models (training steps) and the demo: see the README.
ATTENTION = "auto"
VARLEN_MAX_ROWS = 32


def _varlen(pk: Packing) -> bool:
    return ATTENTION == "varlen" or (ATTENTION == "auto" and pk.batch <= VARLEN_MAX_ROWS)


def _core(q: Tensor, k: Tensor, v: Tensor, p: float, blocked: Tensor | None) -> Tensor:
    """softmax(q k^T / sqrt(d) masked) v over the last two dims; Philox dropout p on the weights."""
    if p > 0:  # explicit: eager SDPA with dropout takes its math path and bernoulli_, several times slower here
        s = torch.matmul(q * (1.0 / math.sqrt(q.shape[-1])), k.transpose(-2, -1))
        if blocked is not None:
            s = s.masked_fill(blocked, float("-inf"))
        return torch.matmul(fused.dropout(s.softmax(dim=-1), p, True), v)
    return F.scaled_dot_product_attention(q, k, v, attn_mask=None if blocked is None else ~blocked)


def _attend_varlen(attn: nn.Module, q: Tensor, k: Tensor, v: Tensor, seg: Segments) -> Tensor:
    """q (N_q, H, d), k/v (N_k, H, d) packed -> (N_q, H, d), one attention per segment."""
    p = attn.dropout if attn.training else 0.0
    outs = []
    pieces = zip(q.split(seg.q_lengths), k.split(seg.k_lengths), v.split(seg.k_lengths))
    for qb, kb, vb in pieces:
        lq, lk = qb.shape[0], kb.shape[0]
        if lq == 0:
            continue
        if lk == 0:  # no key to attend to: zeros, as the padded path's dead rows
            outs.append(qb.new_zeros(qb.shape))
            continue
        blocked = None if seg.blocked is None else seg.blocked[:lq, :lk]
        if p == 0 and seg.causal:
            ob = F.scaled_dot_product_attention(qb.transpose(0, 1), kb.transpose(0, 1), vb.transpose(0, 1), is_causal=True)
        else:
            ob = _core(qb.transpose(0, 1), kb.transpose(0, 1), vb.transpose(0, 1), p, blocked)
        outs.append(ob.transpose(0, 1))
    return torch.cat(outs, 0) if outs else q.new_zeros(q.shape)


def _attend(attn: nn.Module, q: Tensor, k: Tensor, v: Tensor, pk_q: Packing, mask: AttentionMask | Segments) -> Tensor:
    """Attention on packed projections q (N_q, D), k/v (N_k, D) -> out_proj, (N_q, D).

    ``Segments``: per sequence on the packed rows. ``AttentionMask``: scattered into the padded (B, H, T, d_head)
    layout with the padded path's masks, packed back after.
    """
    h, d = attn.n_heads, attn.head_dim
    if isinstance(mask, Segments):
        out = _attend_varlen(attn, q.view(-1, h, d), k.view(-1, h, d), v.view(-1, h, d), mask)
    else:
        pk_k = mask.packing_k
        q, k, v = _heads(pk_q.unpack(q), attn), _heads(pk_k.unpack(k), attn), _heads(pk_k.unpack(v), attn)
        out = _core(q, k, v, attn.dropout if attn.training else 0.0, mask.blocked)
        if mask.dead is not None:
            out = out.masked_fill(mask.dead, 0.0)
        out = pk_q.pack(out.transpose(1, 2))  # (B, T, H, d_head) -> (N, H, d_head)
    return fused.linear(out.reshape(out.shape[0], -1), attn.out_proj.weight, attn.out_proj.bias)


def self_attention(attn: nn.Module, x: Tensor, pk: Packing, mask: AttentionMask | Segments) -> Tensor:
    """A :class:`sublayer.nn.MultiHeadAttention`'s self-attention on packed rows x (N, D) -> (N, D)."""
    q, k, v = (fused.linear(x, lin.weight, lin.bias) for lin in (attn.q_proj, attn.k_proj, attn.v_proj))
    return _attend(attn, q, k, v, pk, mask)


def cross_attention(
    attn: nn.Module, x: Tensor, pk_q: Packing, memory: Tensor, mask: AttentionMask | Segments
) -> Tensor:
    """Cross-attention of packed queries x (N_q, D) on packed memory rows (N_m, kdim) -> (N_q, D)."""
    q = fused.linear(x, attn.q_proj.weight, attn.q_proj.bias)
    k, v = (fused.linear(memory, lin.weight, lin.bias) for lin in (attn.k_proj, attn.v_proj))
    return _attend(attn, q, k, v, pk_q, mask)


def _self_mask(pk: Packing, device, *, causal: bool = False, docs: Tensor | None = None, doc_lengths=None):
    if _varlen(pk):
        return Segments(pk.row_lengths() if doc_lengths is None else doc_lengths, causal=causal, device=device)
    return AttentionMask(pk, pk, causal=causal, docs=docs, device=device)


def _sublayer(block: nn.Module, residual: nn.Module, x: Tensor, fn: Callable[[Tensor], Tensor]) -> Tensor:
    # as the blocks' own wiring: post-norm norm(x + drop(fn(x))), pre-norm x + drop(fn(norm(x)))
    return residual(x, fn) if block.norm_first else residual(x, fn(x))


def encoder_stack(encoder: nn.Module, x: Tensor, pk: Packing) -> Tensor:
    """A :class:`sublayer.nn.TransformerEncoder` on packed rows (N, D) -> (N, D), final norm included."""
    mask = _self_mask(pk, x.device)
    for layer in encoder.layers:
        x = _sublayer(layer, layer.attn_residual, x, lambda h, a=layer.self_attn: self_attention(a, h, pk, mask))
        x = _sublayer(layer, layer.ffn_residual, x, layer.ffn)
    return x if encoder.norm is None else encoder.norm(x)


def decoder_stack(decoder: nn.Module, x: Tensor, pk: Packing, memory: Tensor, pk_m: Packing) -> Tensor:
    """A :class:`sublayer.nn.TransformerDecoder` (causal) on packed rows x (N, D), memory (N_m, D) -> (N, D)."""
    self_mask = _self_mask(pk, x.device, causal=True)
    if _varlen(pk):
        cross_mask = Segments(pk.row_lengths(), pk_m.row_lengths())
    else:
        cross_mask = AttentionMask(pk, pk_m)
    for layer in decoder.layers:
        x = _sublayer(
            layer, layer.self_attn_residual, x, lambda h, a=layer.self_attn: self_attention(a, h, pk, self_mask)
        )
        x = _sublayer(
            layer,
            layer.cross_attn_residual,
            x,
            lambda h, a=layer.cross_attn: cross_attention(a, h, pk, memory, cross_mask),
        )
        x = _sublayer(layer, layer.ffn_residual, x, layer.ffn)
    return x if decoder.norm is None else decoder.norm(x)


def _positions(b: int, t: int, device) -> Tensor:
    return torch.arange(t, device=device)[None].expand(b, t)


# ---------------------------------------------------------------------------------------------- BERT
def bert_forward(model: nn.Module, input_ids: Tensor, token_type_ids: Tensor, key_padding_mask: Tensor) -> Tensor:
    """:meth:`Bert.forward` without the padded rows: (B, T) ids -> (B, T, d_model), zeros at padding.

    ``input_ids`` / ``token_type_ids`` are checked by the caller; ``key_padding_mask`` (B, T) bool, True = pad.
    """
    pk = Packing(key_padding_mask)
    e = model.embeddings
    b, t = input_ids.shape
    x = (
        e.word_embeddings(pk.pack(input_ids))
        + e.position_embeddings(pk.pack(_positions(b, t, input_ids.device)))
        + e.token_type_embeddings(pk.pack(token_type_ids))
    )
    x = F.dropout(e.norm(x), e.dropout, e.training)
    return pk.unpack(encoder_stack(model.encoder, x, pk))


# ---------------------------------------------------------------------------------------------- GPT-2
def gpt2_applies(model: nn.Module, key_padding_mask: Tensor | None, position_ids: Tensor) -> bool:
    """GPT-2 takes this path when the mask marks padding or ``position_ids`` restart at 0 (packed documents)."""
    return applies(model, key_padding_mask) or (
        _enabled and document_mask(position_ids) is not None and plain_model(model)
    )


def gpt2_hidden(
    model: nn.Module, input_ids: Tensor, position_ids: Tensor, key_padding_mask: Tensor | None
) -> tuple[Tensor, Packing]:
    """GPT-2's final hidden states (after ``ln_f``) at the real tokens only.

    Args:
        model: a :class:`~sublayer.models.GPT2`. input_ids: (B, T), checked by the caller.
        position_ids: (B, T) or (1, T); a restart at 0 inside a row starts a new document (block-diagonal causal
            attention). key_padding_mask: (B, T) bool, True = padding, or None.

    Returns:
        ``(h, packing)``: h (N, d_model) in the order of ``packing.index`` (row-major real tokens);
        ``packing.unpack`` puts rows back into (B, T, ...). A loss can read the targets with
        ``packing.pack(labels)`` and run the LM head on ``h`` directly (no padded logits).
    """
    b, t = input_ids.shape
    pk = Packing(_padding(key_padding_mask), batch=b, seq_len=t)
    docs = document_mask(position_ids)
    doc_lengths = None
    if docs is not None and _varlen(pk):  # segments: (row, document) runs of the packed tokens
        doc = (position_ids == 0).cumsum(-1) + torch.arange(b, device=input_ids.device)[:, None] * (t + 1)
        doc_lengths = torch.unique_consecutive(pk.pack(doc), return_counts=True)[1].tolist()
    mask = _self_mask(pk, input_ids.device, causal=True, docs=docs, doc_lengths=doc_lengths)
    x = model.wte(pk.pack(input_ids)) + model.wpe(pk.pack(position_ids))
    x = F.dropout(x, model.config.embd_dropout, model.training)
    for block in model.blocks:
        attn = block.self_attn
        x = block.attn_residual(x, lambda h, a=attn: self_attention(a, h, pk, mask))
        x = block.ffn_residual(x, block.ffn)
    return model.ln_f(x), pk


def gpt2_logits(
    model: nn.Module, input_ids: Tensor, position_ids: Tensor, key_padding_mask: Tensor | None
) -> Tensor:
    """:meth:`GPT2.forward` without the padded rows: logits (B, T, vocab), zeros at padding."""
    h, pk = gpt2_hidden(model, input_ids, position_ids, key_padding_mask)
    return pk.unpack(model.lm_head(h))


# ---------------------------------------------------------------------------------------------- Transformer
def _embed(model: nn.Module, emb: nn.Embedding, ids: Tensor, pk: Packing) -> Tensor:
    pos = pk.pack(_positions(*ids.shape, ids.device))
    x = emb(pk.pack(ids)) * math.sqrt(model.config.d_model) + model.pos_encoding[pos]
    return F.dropout(x, model.config.dropout, model.training)


def transformer_encode(model: nn.Module, src: Tensor, src_key_padding_mask: Tensor) -> Tensor:
    """:meth:`Transformer.encode` without the padded rows: memory (B, S, d_model), zeros at padding."""
    pk = Packing(src_key_padding_mask)
    return pk.unpack(encoder_stack(model.encoder, _embed(model, model.src_embed, src, pk), pk))


def transformer_decode(
    model: nn.Module,
    tgt: Tensor,
    memory: Tensor,
    memory_key_padding_mask: Tensor | None,
    tgt_key_padding_mask: Tensor | None,
) -> Tensor:
    """:meth:`Transformer.decode` (teacher forcing, no cache) without the padded rows of target and memory:
    logits (B, T, tgt_vocab), zeros at padded target positions.

    Raises:
        ValueError: ``memory_key_padding_mask`` is not (B, S).
    """
    b, t = tgt.shape
    if memory_key_padding_mask is not None and tuple(memory_key_padding_mask.shape) != tuple(memory.shape[:2]):
        raise ValueError(
            f"memory_key_padding_mask must have shape (batch, src_len) = {tuple(memory.shape[:2])}, "
            f"got {tuple(memory_key_padding_mask.shape)}"
        )
    pk_t = Packing(_padding(tgt_key_padding_mask), batch=b, seq_len=t)
    pk_m = Packing(_padding(memory_key_padding_mask), batch=memory.shape[0], seq_len=memory.shape[1])
    h = decoder_stack(model.decoder, _embed(model, model.tgt_embed, tgt, pk_t), pk_t, pk_m.pack(memory), pk_m)
    return pk_t.unpack(model.out_proj(h))
