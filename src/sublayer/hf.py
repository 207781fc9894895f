"""``sublayer.hf``: speed up a live Hugging Face ``transformers`` model in place, on the CPU, with HF's numbers.

:func:`patch` swaps the ``forward`` of sub-layers inside the model for sublayer's fused CPU paths; parameters,
module tree, ``state_dict`` keys, ``save_pretrained``, optimizers and ``Trainer`` stay HF's::

    import sublayer
    report = sublayer.hf.patch(model)     # a transformers model, or a module holding one (sentence-transformers)
    print(report)                         # what was replaced, what was left alone and why
    sublayer.hf.unpatch(model)            # HF's forwards again
    with sublayer.hf.patched(model): ...  # patched inside the block only

What is replaced (each only where it is exactly HF's computation; anything else is left alone and reported):

===============================================  ======================================================================
HF module                                        replaced by
===============================================  ======================================================================
``BertLayer`` feed-forward (``BertIntermediate``  one fused FFN (bias + activation in one pass between the GEMMs, lean
+ ``BertOutput``)                                saved tensors) then fused dropout + residual + LayerNorm
``BertSelfOutput`` (and ``BertOutput`` alone)    ``dense`` then fused dropout + residual + LayerNorm
``GPT2MLP`` (Conv1D weights, ``(in, out)``)      the fused FFN (tanh GELU), output dropout fused
``LlamaMLP`` / ``Qwen2MLP``                      the fused SwiGLU FFN
``LlamaRMSNorm`` / ``Qwen2RMSNorm``              the fused RMSNorm kernel, with HF's cast order (``weight *
                                                 normed.to(input dtype)``)
``nn.LayerNorm`` inside ``GPT2Model``            the fused LayerNorm kernel
``GPT2LMHeadModel``, ``LlamaForCausalLM``,       with ``labels=`` in training mode: the fused linear + cross-entropy
``Qwen2ForCausalLM`` loss                        (:func:`sublayer.functional.linear_cross_entropy`; HF's shift,
                                                 ``ignore_index``, ``num_items_in_batch``, ``shift_labels``); no
                                                 (B, T, vocab) logits are made, and ``logits`` is None; under bf16
                                                 autocast HF's bf16 head and loss on the rows with a target
                                                 (GPT-2 with every target row a real token: the blocks run on the
                                                 real tokens only, ``past_key_values`` None)
``BertModel`` where no output reads its padded   the padding-free encoder: HF's embeddings, then the layers on the
positions (inside ``BertForSequenceClass...``,   packed real tokens (fused q|k|v, masked batch attention, the fused
``BertForMultipleChoice``, a pooling             sub-layers above; position 0 too when a pooler reads it), zeros at
sentence-transformers model; or                  padding; in eval mode without autograd a prepared inference path
``padding_free=True``)                           (the embeddings on the real tokens too, oneDNN GEMMs on weights
                                                 packed once, the fused attention kernel)
===============================================  ======================================================================

Task heads (``BertForSequenceClassification``, ...) and sentence-transformers models are covered through the
encoder inside them. Attention is HF's own outside the padding-free encoder; that encoder steps aside (HF's runs)
for a row of padding only, ``output_attentions`` / ``output_hidden_states``, hooks inside the encoder, decoders,
gradient checkpointing.

What changes and what does not:

* Outputs and gradients equal HF's to float32 rounding (bfloat16 autocast: to bfloat16 rounding).
* Dropout draws its masks from sublayer's counter-based stream (seeded from torch's generator, so
  ``torch.manual_seed`` reproduces a run): the same distribution as HF's dropout, not the same masks.
* Hidden states at padded positions are zeros where the padding-free encoder runs.
* The loss path returns ``logits=None`` only when it runs: ``labels`` given, ``model.training``, grad mode on
  and ``logits_to_keep`` left at 0 — what Liger-Kernel's patched models return in training. In ``eval()`` mode (HF's
  ``Trainer`` evaluation and ``generate`` included), without ``labels`` or with ``patch(model, loss=False)`` the
  logits are HF's. A batch whose targets are all ``ignore_index`` runs HF's loss (its NaN mean).
* A patched forward runs HF's own while a part it skips has a hook, one registered after patching included, and
  once a sub-module it reads was replaced after patching (a LoRA layer, another activation module).
* Modules with hooks, non-default activations (``gelu_python``, ``quick_gelu``, ...), float16 parameters, or
  sub-modules that are not the plain torch/transformers classes (LoRA/peft wrappers, quantized linears) are left
  alone and reported.
"""

from __future__ import annotations

import contextlib
import copy
import dataclasses
import functools
import types
import weakref
from collections.abc import Iterator

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from . import kernels
from .functional import fused
from .functional.cross_entropy import linear_cross_entropy
from .functional.packing import Packing, PackedBatch
from .nn.hooks import hooked
from .runtime.encoder import run_layers
from .runtime.linear import OneDNNLinear
from .runtime.rows import add_norm
from .runtime.weights import prepared

__all__ = ["PatchReport", "patch", "unpatch", "patched"]

_STATE = "_sublayer_hf_patch"  # attribute of the patched root: the records unpatch restores
_MARK = "_sublayer_hf"  # attribute of every replacement forward


class _Missing:
    """No instance attribute before patching (one object, kept by ``copy.deepcopy`` of a patched model)."""

    def __deepcopy__(self, memo: dict) -> _Missing:
        return self


_MISSING = _Missing()
_TREE = "_sublayer_hf_tree"  # attribute of every patched module: its :class:`_Tree`
_DTYPES = (torch.float32, torch.bfloat16)


@dataclasses.dataclass
class PatchReport:
    """What :func:`patch` did.

    Attributes:
        replaced: ``(module name, what it now runs)`` for every replaced forward.
        skipped: ``(module name, why it was left alone)``.
        notes: remarks on the whole call (e.g. the model was already patched).
    """

    replaced: list[tuple[str, str]] = dataclasses.field(default_factory=list)
    skipped: list[tuple[str, str]] = dataclasses.field(default_factory=list)
    notes: list[str] = dataclasses.field(default_factory=list)

    def __str__(self) -> str:
        lines = [f"sublayer.hf.patch: {len(self.replaced)} replaced, {len(self.skipped)} left alone"]
        lines += [f"  replaced {name or '(root)'}: {what}" for name, what in self.replaced]
        lines += [f"  skipped  {name or '(root)'}: {why}" for name, why in self.skipped]
        lines += [f"  note: {n}" for n in self.notes]
        return "\n".join(lines)


# ----------------------------------------------------------------------------------------------- checks
_hooked = functools.partial(hooked, backward=True)  # a patched forward would skip backward hooks too


def _activation(act: object) -> str | None:
    """sublayer's name for an HF activation module, or None if no fused kernel computes exactly it."""
    from transformers import activations as A

    t = type(act)
    if t is A.GELUActivation:
        return "gelu" if act.act is F.gelu else None
    if t is A.GELUTanh:
        tanh = isinstance(act.act, functools.partial) and act.act.keywords == {"approximate": "tanh"}
        return "gelu_tanh" if tanh else None
    return {A.NewGELUActivation: "gelu_tanh", nn.SiLU: "silu", A.SiLUActivation: "silu", nn.ReLU: "relu",
            A.ReLUSquaredActivation: "relu2"}.get(t)  # fmt: skip


def _why_not(mod: nn.Module, parts: dict[str, type | tuple[type, ...]]) -> str | None:
    """None if every named child has exactly the expected type, no hooks and a supported dtype; else why not."""
    for name, cls in parts.items():
        child = getattr(mod, name, None)
        classes = cls if isinstance(cls, tuple) else (cls,)
        if type(child) not in classes:
            return f"{name} is {type(child).__name__}, not {' / '.join(c.__name__ for c in classes)}"
    if _hooked(*(getattr(mod, n) for n in parts)):
        return "a sub-module has hooks (the fused path would skip them)"
    if "forward" in mod.__dict__:
        return "its forward was already replaced by something else"
    for p in mod.parameters():
        if p.dtype not in _DTYPES:
            return f"parameter dtype {p.dtype} (the fused kernels run float32 and bfloat16)"
        if p.device.type != "cpu":
            return f"parameters on {p.device} (the fused kernels are CPU kernels)"
    return None


# ----------------------------------------------------------------------------------------------- forwards
def _add_norm(ln: nn.LayerNorm, drop: nn.Dropout, residual: Tensor, y: Tensor) -> Tensor:
    """``ln(dropout(y) + residual)`` fused."""
    if torch.is_autocast_enabled("cpu"):  # autocast runs layer_norm in float32
        residual = residual.float()
    return fused.add_norm(
        residual, y, ln.normalized_shape, ln.weight, ln.bias, ln.eps, dropout=drop.p, training=drop.training
    )


def _bert_self_output(self, hidden_states: Tensor, input_tensor: Tensor) -> Tensor:
    return _add_norm(self.LayerNorm, self.dropout, input_tensor, self.dense(hidden_states))


def _bert_ffn(self, attention_output: Tensor) -> Tensor:
    inter, out = self.intermediate, self.output
    h = fused.feed_forward(
        attention_output, inter.dense.weight, inter.dense.bias, out.dense.weight, out.dense.bias,
        activation=self._sublayer_act, training=out.dropout.training,
    )  # fmt: skip
    return _add_norm(out.LayerNorm, out.dropout, attention_output, h)


def _gpt2_mlp(self, hidden_states: Tensor) -> Tensor:
    return fused.feed_forward(
        hidden_states, self.c_fc.weight.t(), self.c_fc.bias, self.c_proj.weight.t(), self.c_proj.bias,
        activation=self._sublayer_act, output_dropout=self.dropout.p, training=self.dropout.training,
    )  # fmt: skip


def _glu_mlp(self, x: Tensor) -> Tensor:
    g, u = self.gate_proj, self.up_proj
    b1 = torch.cat([g.bias, u.bias]) if g.bias is not None else None
    return fused.feed_forward(
        x, torch.cat([g.weight, u.weight]), b1, self.down_proj.weight, self.down_proj.bias, activation="swiglu"
    )


def _layer_norm(self, x: Tensor) -> Tensor:
    if torch.is_autocast_enabled("cpu"):  # autocast runs layer_norm in float32
        x = x.float()
    return fused.add_norm(x, torch.zeros_like(x), self.normalized_shape, self.weight, self.bias, self.eps)


def _rms_norm(self, hidden_states: Tensor) -> Tensor:
    w = self.weight
    fuse = w.dtype == hidden_states.dtype == torch.float32  # no rounding between norm and weight: fuse the weight
    normed = fused.add_norm(hidden_states, torch.zeros_like(hidden_states), w.shape[-1], w if fuse else None, None,
                            self.variance_epsilon, norm="rms")  # fmt: skip
    return normed if fuse else w * normed


def _lm_forward(self, *args, **kwargs):
    """The causal-LM forward with the fused linear + cross-entropy loss where it applies (see the module doc)."""
    original = type(self).forward.__get__(self)
    labels = kwargs.get("labels")
    head = self.lm_head
    if (
        labels is None
        or len(args) > self._sublayer_labels_at
        or not self.training
        or not torch.is_grad_enabled()
        or not isinstance(kwargs.get("logits_to_keep", 0), int)
        or kwargs.get("logits_to_keep", 0) != 0
        or _hooked(head)
        or type(head) is not nn.Linear  # (replaced after patching: e.g. a LoRA layer)
    ):
        return original(*args, **kwargs)
    ignore = kwargs.get("ignore_index", -100)
    shift = kwargs.get("shift_labels")
    if shift is None:  # HF's shift: position t predicts label t + 1, the last position predicts nothing
        shift = F.pad(labels, (0, 1), value=ignore)[..., 1:]
    target = shift.reshape(-1)
    n_items = kwargs.get("num_items_in_batch")
    if n_items is None and not bool((target != ignore).any()):
        return original(*args, **kwargs)  # HF's NaN mean over no targets
    kw = {k: v for k, v in kwargs.items() if k not in ("labels", "return_dict")}
    return_dict = kwargs.get("return_dict")
    return_dict = self.config.return_dict if return_dict is None else return_dict
    seen: list[Tensor] = []

    def keep_hidden(h: Tensor) -> Tensor:  # the head, asked for no logits: remember its input instead
        seen.append(h)
        return h.new_empty(0)

    packed = None if args else _gpt2_packed_hidden(self, kwargs, target, ignore)
    if packed is not None:  # the body on the real tokens only (every target row is one)
        from transformers.modeling_outputs import CausalLMOutputWithCrossAttentions

        out, seen = CausalLMOutputWithCrossAttentions(), [packed]
    else:
        head.forward = keep_hidden
        try:
            out = original(*args, return_dict=True, **kw)
        finally:
            del head.__dict__["forward"]
    (h,) = seen
    h = h.reshape(-1, h.shape[-1])
    target = target.to(h.device)
    reduction = "mean" if n_items is None else "sum"
    # (under bf16 autocast: autocast's bf16 head GEMMs, the loss in float32; see linear_cross_entropy)
    loss = linear_cross_entropy(h, head.weight, target, bias=head.bias, ignore_index=ignore, reduction=reduction,
                                grad_in_forward=True)  # fmt: skip
    if n_items is not None:
        loss = loss / (n_items.to(loss.device) if torch.is_tensor(n_items) else n_items)
    out = dataclasses.replace(out, loss=loss, logits=None)
    return out if return_dict else out.to_tuple()


# the packed training bodies' attention layout: the padded batch (one masked attention per layer) costs fewer
# dispatches and parallel regions, forward and backward, than one attention per sequence with dropout
_TRAIN_ATTENTION = "padded"

_GPT2_KWARGS = {"input_ids", "attention_mask", "labels", "num_items_in_batch", "ignore_index", "shift_labels",
                "return_dict", "use_cache", "logits_to_keep"}  # fmt: skip


def _gpt2_packed_hidden(model: nn.Module, kw: dict, target: Tensor, ignore: int) -> Tensor | None:
    """GPT-2's final hidden states (B, T, d) computed on the real tokens only (zeros at padding), or None where HF's
    body must run: no padding, a padded position with a target, other inputs, hooks, options that change attention."""
    if set(kw) - _GPT2_KWARGS or not _gpt2_body_ok(model) or _hooked(model.transformer):
        return None
    tr, ids, mask = model.transformer, kw.get("input_ids"), kw.get("attention_mask")
    if not torch.is_tensor(ids) or not torch.is_tensor(mask) or ids.dim() != 2 or mask.shape != ids.shape:
        return None
    real = mask != 0
    if bool(real.all()) or bool((target.view(ids.shape) != ignore)[~real].any()) or tr.gradient_checkpointing:
        return None
    if model.config._attn_implementation not in ("sdpa", "eager"):
        return None
    pk = PackedBatch(~real, attention=_TRAIN_ATTENTION)
    x = pk.pack(tr.wte(ids) + tr.wpe(torch.arange(ids.shape[1], device=ids.device))[None])
    x = fused.dropout(x, tr.drop.p, tr.drop.training)  # (sublayer's stream, on the real tokens only)
    for block in tr.h:
        a, n = block.attn, x.shape[0]
        q, k, v = a.c_attn(block.ln_1(x)).view(n, 3, a.num_heads, a.head_dim).unbind(1)
        ctx = pk.self_attention(q, k, v, causal=True, dropout=a.attn_dropout.p if a.training else 0.0)
        x = x + fused.dropout(a.c_proj(ctx.reshape(n, -1)), a.resid_dropout.p, a.resid_dropout.training)
        x = x + block.mlp(block.ln_2(x))
    return pk.unpack(tr.ln_f(x))


_BERT_ARGS = ("input_ids", "attention_mask", "token_type_ids", "position_ids", "inputs_embeds")
_BERT_NONE = ("encoder_hidden_states", "encoder_attention_mask", "past_key_values", "use_cache",
              "output_attentions", "output_hidden_states")  # fmt: skip


def _bert_model_forward(self, *args, **kwargs):
    """``BertModel.forward`` with the encoder on the real tokens only (see the module doc), else HF's."""
    original = type(self).forward.__get__(self)
    if len(args) > len(_BERT_ARGS) or any(k in kwargs for k in _BERT_ARGS[: len(args)]):
        return original(*args, **kwargs)
    kw = dict(zip(_BERT_ARGS, args), **kwargs)
    mask = kw.get("attention_mask")
    fast = _padding_free_applies(self, kw, mask)
    if not fast:
        return original(*args, **kwargs)
    pad = None if mask is None else mask == 0
    out = _bert_inference(self, kw, pad) if fast == "inference" else _bert_packed(self, _embeddings(self, kw), pad)
    from transformers.modeling_outputs import BaseModelOutputWithPoolingAndCrossAttentions as Output

    res = Output(last_hidden_state=out, pooler_output=self.pooler(out) if self.pooler is not None else None)
    return_dict = kw.get("return_dict")
    return res if (self.config.return_dict if return_dict is None else return_dict) else res.to_tuple()


def _bert_packed(model: nn.Module, emb: Tensor, pad: Tensor) -> Tensor:
    """HF's encoder layers on the rows that an output reads (real tokens; position 0 for the pooler), one
    attention per layer over the padded batch with padding masked; zeros at the other positions. Differentiable."""
    rows = ~pad
    if model.pooler is not None:  # the pooler reads position 0, padding or not (left padding)
        rows[:, 0] = True
    pk = PackedBatch(pad, rows=rows, attention=_TRAIN_ATTENTION)
    x = pk.pack(emb)
    for layer, (w, b) in zip(model.encoder.layer, _qkv_weights(model.encoder)):
        sa = layer.attention.self
        n, heads = x.shape[0], sa.num_attention_heads
        q, k, v = fused.linear(x, w, b).view(n, 3, heads, sa.attention_head_size).unbind(1)
        ctx = pk.self_attention(q, k, v, causal=False, dropout=sa.dropout.p if sa.training else 0.0)
        x = layer.attention.output(ctx.reshape(n, -1), x)
        x = layer.feed_forward_chunk(x)
    return pk.unpack(x)


def _embeddings(model: nn.Module, kw: dict) -> Tensor:
    return model.embeddings(input_ids=kw.get("input_ids"), token_type_ids=kw.get("token_type_ids"),
                            position_ids=kw.get("position_ids"), inputs_embeds=kw.get("inputs_embeds"))  # fmt: skip


def _bert_inference(model: nn.Module, kw: dict, pad: Tensor) -> Tensor:
    """The encoder in eval mode without autograd: the embeddings on the real tokens (:func:`_packed_embeddings`),
    the prepared encoder of :mod:`sublayer.runtime.encoder` on float32 weights packed once for oneDNN (GELU fused
    into fc1), the fused attention kernel; real tokens only, zeros at padding."""
    encoder = model.encoder
    b, t = pad.shape
    W = prepared(encoder, "hf.inference", _pack_bert_weights)
    pk = Packing(pad if bool(pad.any()) else None, batch=b, seq_len=t)
    x = _packed_embeddings(model.embeddings, kw, pk)
    a = encoder.layer[0].attention.self
    x = run_layers(pk.pack(_embeddings(model, kw)) if x is None else x, W, pad=pk.key_padding_mask, shape=(b, t),
                   heads=a.num_attention_heads, scale=a.scaling, activation=encoder.layer[0]._sublayer_act)  # fmt: skip
    return pk.unpack(x)


_EMBEDDING_PARTS = {"word_embeddings": nn.Embedding, "position_embeddings": nn.Embedding,
                    "token_type_embeddings": nn.Embedding, "LayerNorm": nn.LayerNorm,
                    "dropout": nn.Dropout}  # fmt: skip


def _packed_embeddings(emb: nn.Module, kw: dict, pk: Packing) -> Tensor | None:
    """HF's ``BertEmbeddings`` in eval mode on the real tokens only (the rows ``pk`` packs): the same gathers and
    adds in HF's order, the last add fused with the LayerNorm. None for anything but a plain float32
    ``BertEmbeddings`` on ``input_ids`` without hooks (HF's embeddings then run and are packed)."""
    from transformers.models.bert import modeling_bert as bert

    ids, pos, types = kw.get("input_ids"), kw.get("position_ids"), kw.get("token_type_ids")
    if type(emb) is not bert.BertEmbeddings or emb.training or ids is None or kw.get("inputs_embeds") is not None:
        return None
    if _why_not(emb, _EMBEDDING_PARTS) or _hooked(emb) or any("forward" in m.__dict__ for m in emb.children()):
        return None
    tables = (emb.word_embeddings, emb.token_type_embeddings, emb.position_embeddings)
    if any(e.max_norm is not None for e in tables) or any(p.dtype != torch.float32 for p in emb.parameters()):
        return None
    b, t = ids.shape
    if pos is None:
        pos = emb.position_ids[:, :t]
    if types is None:
        types = torch.gather(emb.token_type_ids.expand(pos.shape[0], -1), 1, pos) if hasattr(emb, "token_type_ids") \
            else torch.zeros_like(ids)  # fmt: skip
    if any(not torch.is_tensor(x) or x.dim() != 2 or x.shape[1] != t or x.shape[0] not in (1, b) for x in (pos, types)):
        return None
    ln = emb.LayerNorm
    if _affine(ln):
        return None
    x = F.embedding(pk.pack(ids), emb.word_embeddings.weight)
    x += F.embedding(pk.pack(types), emb.token_type_embeddings.weight)
    return add_norm(x, F.embedding(pk.pack(pos), emb.position_embeddings.weight), ln.weight, ln.bias, ln.eps,
                    want_sum=False)[0]  # fmt: skip


def _pack_bert_weights(encoder: nn.Module) -> list[dict]:
    norm = lambda ln: (ln.weight.detach(), ln.bias.detach(), ln.eps)  # noqa: E731
    dense = lambda m: OneDNNLinear(m.dense.weight, m.dense.bias)  # noqa: E731
    return [{"qkv": OneDNNLinear(*qkv), "out": dense(L.attention.output), "norm1": norm(L.attention.output.LayerNorm),
             "fc1": dense(L.intermediate), "fc2": dense(L.output), "norm2": norm(L.output.LayerNorm)}
            for L, qkv in zip(encoder.layer, _qkv_weights(encoder, cached=False))]  # fmt: skip


def _padding_free_applies(model: nn.Module, kw: dict, mask: object) -> bool:
    """The padding-free encoder computes exactly what HF's would on every position an output reads."""
    cfg = model.config
    if any(kw.get(k) for k in _BERT_NONE) or getattr(cfg, "output_attentions", False):
        return False
    if getattr(cfg, "output_hidden_states", False) or set(kw) - {*_BERT_ARGS, *_BERT_NONE, "return_dict"}:
        return False
    if not torch.is_tensor(mask) or mask.dim() != 2:
        return False
    ids = kw.get("input_ids") if kw.get("input_ids") is not None else kw.get("inputs_embeds")
    if ids is None or tuple(ids.shape[:2]) != tuple(mask.shape) or (model.training and model.gradient_checkpointing):
        return False
    if cfg._attn_implementation not in ("sdpa", "eager") or _hooked(model.encoder) or not _Tree.holds(model):
        return False
    real = mask != 0
    if not bool(real.any(1).all()):  # a row of padding only: HF's path
        return False
    inference = not model.training and not torch.is_grad_enabled() and not torch.is_autocast_enabled("cpu")
    if inference and kernels.enabled() and all(p.dtype == torch.float32 for p in model.encoder.parameters()):
        if model.pooler is None or bool(real[:, 0].all()):  # (its weights are packed from float32 ones)
            return "inference"  # (the attention kernel zeroes padded query rows: the pooler's position 0 must be real)
    return "train" if not bool(real.all()) else False


def _qkv_weights(encoder: nn.Module, cached: bool | None = None) -> list[tuple[Tensor, Tensor]]:
    """Each layer's q|k|v weight and bias, concatenated (differentiable); ``cached`` (None: when no gradient is
    recorded): kept while the weights stay the same (:func:`sublayer.runtime.weights.prepared`)."""
    if (not torch.is_grad_enabled()) if cached is None else cached:
        return prepared(encoder, "hf.qkv", functools.partial(_qkv_weights, cached=False))
    return [(torch.cat([a.query.weight, a.key.weight, a.value.weight]),
             torch.cat([a.query.bias, a.key.bias, a.value.bias])) for a in (L.attention.self for L in encoder.layer)]


# ----------------------------------------------------------------------------------------------- the patch
def _targets(loss: bool):
    """(HF class, check(module) -> why-not or None, replacement forward name, replacement, description) rows."""
    from transformers.models.bert import modeling_bert as bert
    from transformers.models.gpt2 import modeling_gpt2 as gpt2
    from transformers.models.llama import modeling_llama as llama
    from transformers.models.qwen2 import modeling_qwen2 as qwen2
    from transformers.pytorch_utils import Conv1D

    linear, ln, drop = nn.Linear, nn.LayerNorm, nn.Dropout

    def bert_layer(m):
        if type(m.intermediate) is not bert.BertIntermediate or type(m.output) is not bert.BertOutput:
            return "intermediate/output are not BertIntermediate/BertOutput"
        if "feed_forward_chunk" in m.__dict__ or _hooked(m.intermediate, m.output):
            return "feed_forward_chunk replaced or hooks present"
        return (add_norm(m.output) or _why_not(m.intermediate, {"dense": linear})
                or _set_act(m, m.intermediate.intermediate_act_fn))  # fmt: skip

    def add_norm(m):
        return _why_not(m, {"dense": linear, "LayerNorm": ln, "dropout": drop}) or _affine(m.LayerNorm)

    def gpt2_mlp(m):
        return _why_not(m, {"c_fc": Conv1D, "c_proj": Conv1D, "dropout": drop}) or _set_act(m, m.act)

    def glu_mlp(m):
        why = _why_not(m, {"gate_proj": linear, "up_proj": linear, "down_proj": linear})
        if why:
            return why
        if _activation(m.act_fn) != "silu":
            return f"activation {type(m.act_fn).__name__} is not SiLU (SwiGLU is what the fused FFN computes)"
        if (m.gate_proj.bias is None) != (m.up_proj.bias is None):
            return "gate_proj and up_proj differ in having a bias"
        return None

    def rms(m):
        return _why_not(m, {}) or (None if m.weight.dim() == 1 else "weight is not 1-D")

    def lm(m):
        why = _why_not(m, {"lm_head": linear})
        if why:
            return why
        if getattr(m.config, "final_logit_softcapping", None):
            return "final_logit_softcapping is set"
        from transformers.loss.loss_utils import ForCausalLMLoss

        if m.loss_function is not ForCausalLMLoss:
            return f"loss_function is {getattr(m.loss_function, '__name__', m.loss_function)}, not ForCausalLMLoss"
        import inspect

        names = list(inspect.signature(type(m).forward).parameters)[1:]
        m._sublayer_labels_at = names.index("labels")  # labels passed by position: HF's forward
        return None

    groups = [  # (HF classes, check, ...): one row per class; the loss's last (left out when loss is False)
        ((bert.BertLayer,), bert_layer, "feed_forward_chunk", _bert_ffn, "fused FFN ({act}) + fused add & LayerNorm"),
        ((bert.BertSelfOutput, bert.BertOutput), add_norm, "forward", _bert_self_output,
         "dense + fused dropout/add/LayerNorm"),
        ((gpt2.GPT2MLP,), gpt2_mlp, "forward", _gpt2_mlp, "fused FFN ({act}, Conv1D weights)"),
        ((llama.LlamaMLP, qwen2.Qwen2MLP), glu_mlp, "forward", _glu_mlp, "fused SwiGLU FFN"),
        ((llama.LlamaRMSNorm, qwen2.Qwen2RMSNorm), rms, "forward", _rms_norm, "fused RMSNorm (HF's cast order)"),
        ((gpt2.GPT2LMHeadModel, llama.LlamaForCausalLM, qwen2.Qwen2ForCausalLM), lm, "forward", _lm_forward,
         "fused linear + cross-entropy loss when labels are given in training"),
    ]
    rows = [(cls, *rest) for classes, *rest in groups[: None if loss else -1] for cls in classes]
    return rows, gpt2.GPT2Model


_PADS_UNREAD = ("BertForSequenceClassification", "BertForMultipleChoice")  # heads that read position 0 only
_ST_READERS = ("Pooling", "Normalize", "Dense")  # sentence-transformers modules that mask padding or follow pooling


def _bert_padding_free(m: nn.Module, parent: nn.Module | None, root: nn.Module, option: bool | None) -> str | None:
    """None if ``m`` (a BertModel) gets the padding-free encoder, else why not."""
    from transformers.models.bert import modeling_bert as bert

    if option is False:
        return "padding_free=False"
    if type(m.encoder) is not bert.BertEncoder or m.config.is_decoder or "forward" in m.__dict__:
        return "a decoder, or its encoder is not HF's BertEncoder"
    for i, layer in enumerate(m.encoder.layer):
        sa = layer.attention.self
        if not all(getattr(getattr(mod, a, None), _MARK, False) for mod, a in
                   ((layer, "feed_forward_chunk"), (layer.attention.output, "forward"))):  # fmt: skip
            return f"layer {i}'s feed-forward or attention output is not patched"
        if type(layer) is not bert.BertLayer or type(sa) is not bert.BertSelfAttention or "forward" in layer.__dict__:
            return f"layer {i} is not a plain BertLayer with BertSelfAttention"
        if _why_not(sa, {"query": nn.Linear, "key": nn.Linear, "value": nn.Linear}) or sa.query.bias is None:
            return f"layer {i}'s attention projections are not plain biased nn.Linear"
    if option:
        return None
    if type(parent).__name__ in _PADS_UNREAD and type(parent).__module__ == bert.__name__:
        return None
    if type(root).__module__.startswith("sentence_transformers") and parent is not root:
        if all(c is parent or type(c).__name__ in _ST_READERS for c in root.children()):
            return None
    return ("its hidden states at padded positions are an output here (pass padding_free=True to run the "
            "encoder on the real tokens only, zeros at padding)")  # fmt: skip


def _gpt2_body_ok(model: nn.Module) -> bool:
    """A GPT2LMHeadModel whose body is HF's plain blocks (self-attention scaled by 1/sqrt(head_dim), patched MLPs):
    the packed body computes exactly what they do."""
    from transformers.models.gpt2 import modeling_gpt2 as gpt2

    if type(model) is not gpt2.GPT2LMHeadModel:
        return False
    tr, cfg = model.transformer, model.config
    if type(tr) is not gpt2.GPT2Model or cfg.add_cross_attention or not cfg.scale_attn_weights:
        return False
    if type(tr.drop) is not nn.Dropout or any(type(b.attn.resid_dropout) is not nn.Dropout for b in tr.h):
        return False
    if cfg.scale_attn_by_inverse_layer_idx or cfg.reorder_and_upcast_attn:
        return False
    return all(
        type(b) is gpt2.GPT2Block and type(b.attn) is gpt2.GPT2Attention and getattr(b.mlp.forward, _MARK, False)
        and "forward" not in b.__dict__ and "forward" not in b.attn.__dict__
        for b in tr.h
    )  # fmt: skip


def _guarded(fn, original, parts: tuple[nn.Module, ...] | None):
    """``fn``, or HF's ``original`` for a call while ``parts`` (None: the module's children) have a hook or a
    sub-module was replaced after patching (:class:`_Tree`); with ``original``'s signature (HF's chunking reads it)."""

    @functools.wraps(original)
    def forward(self, *args, **kwargs):
        if _hooked(*(self.children() if parts is None else parts)) or not _Tree.holds(self):
            return original(self, *args, **kwargs)
        return fn(self, *args, **kwargs)

    return forward


class _Tree:
    """A patched module and its sub-modules (weakly) as :func:`patch` checked them, kept on the module: a patched
    forward steps aside for HF's once one was replaced (a LoRA layer, another activation). ``copy.deepcopy`` of a
    patched model maps them to the copies."""

    def __init__(self, m: nn.Module) -> None:
        self.refs = tuple(weakref.ref(x) for x in m.modules())

    @staticmethod
    def holds(m: nn.Module) -> bool:
        """Whether ``m``'s sub-modules are still the ones patching saw (none replaced, added or removed)."""
        tree = m.__dict__.get(_TREE)
        mods = list(m.modules())
        return tree is not None and len(mods) == len(tree.refs) and all(r() is x for r, x in zip(tree.refs, mods))

    def __deepcopy__(self, memo: dict) -> _Tree:
        new = _Tree.__new__(_Tree)
        new.refs = tuple(r if r() is None else weakref.ref(copy.deepcopy(r(), memo)) for r in self.refs)
        return new


def _set_act(m: nn.Module, act: object) -> str | None:
    name = _activation(act)
    if name is None:
        return f"activation {type(act).__name__} has no exact fused kernel"
    m._sublayer_act = name
    return None


def _affine(ln: nn.LayerNorm) -> str | None:
    if ln.weight is None or len(ln.normalized_shape) != 1:
        return "LayerNorm without elementwise affine or over more than one dim"
    return None


def _check_model(model: object) -> None:
    if not isinstance(model, nn.Module):
        raise TypeError(f"model must be a transformers model (a torch.nn.Module), got {type(model).__name__}")
    from transformers import PreTrainedModel

    if not any(isinstance(m, PreTrainedModel) for m in model.modules()):
        raise TypeError(
            f"model must be a transformers PreTrainedModel or a module holding one (e.g. a SentenceTransformer), "
            f"got {type(model).__name__} with none inside"
        )


def patch(model: nn.Module, *, loss: bool = True, padding_free: bool | None = None) -> PatchReport:
    """Replace, inside ``model``, the sub-layers sublayer runs faster with its fused CPU paths (see the module doc).

    Args:
        model: a ``transformers`` model (``BertModel`` and its task heads, ``GPT2LMHeadModel``, ``GPT2Model``,
            ``LlamaForCausalLM``, ``Qwen2ForCausalLM``, ...) or a module that holds one (a
            ``SentenceTransformer``). Patched in place.
        loss: also replace the causal-LM loss (``labels=`` in training runs the fused linear + cross-entropy and
            returns ``logits=None``); False keeps HF's logits and loss.
        padding_free: run BERT encoders on the real tokens only (their hidden states at padded positions are then
            zeros). None (default): only where no output reads those positions (a ``BertModel`` inside
            ``BertForSequenceClassification`` / ``BertForMultipleChoice`` or a sentence-transformers model that
            pools it); True: every ``BertModel``; False: none.

    Returns:
        A :class:`PatchReport`: what was replaced, what was left alone and why. Patching a patched model changes
        nothing and says so in ``notes``.

    Raises:
        TypeError: ``model`` is not an ``nn.Module`` or holds no ``transformers.PreTrainedModel``; ``loss`` is not
            a bool; ``padding_free`` is not None or a bool.
    """
    _check_model(model)
    if not isinstance(loss, bool):
        raise TypeError(f"loss must be a bool, got {loss!r}")
    if padding_free is not None and not isinstance(padding_free, bool):
        raise TypeError(f"padding_free must be None or a bool, got {padding_free!r}")
    report = PatchReport()
    if _STATE in model.__dict__:
        report.notes.append("already patched: nothing changed (call unpatch first to patch with other options)")
        return report
    rows, gpt2_model = _targets(loss)
    rows.append((nn.LayerNorm, lambda m: _why_not(m, {}) or _affine(m), "forward", _layer_norm, "fused LayerNorm kernel"))
    records: list[tuple[nn.Module, str, object]] = []
    covered: set[int] = set()  # BertOutput modules run by a patched BertLayer FFN (left alone)

    def swap(m: nn.Module, attr: str, fn) -> None:
        records.append((m, attr, m.__dict__.get(attr, _MISSING)))
        if fn in (_lm_forward, _bert_model_forward):  # keep HF's signature: Trainer and sentence-transformers read it
            fn = functools.update_wrapper(lambda self, *a, _fn=fn, **k: _fn(self, *a, **k), type(m).forward)
        else:  # HF's own forward while a part it skips has a hook (one registered after patching too)
            parts = (m.intermediate, m.output) if attr == "feed_forward_chunk" else None
            fn = _guarded(fn, getattr(type(m), attr), parts)
        setattr(fn, _MARK, True)
        setattr(m, attr, types.MethodType(fn, m))
        records.append((m, _TREE, m.__dict__.get(_TREE, _MISSING)))
        setattr(m, _TREE, _Tree(m))

    gpt2_norms = {id(n) for g in model.modules() if type(g) is gpt2_model for n in g.modules()}
    for name, m in model.named_modules():
        if any(getattr(v, _MARK, False) for v in m.__dict__.values() if isinstance(v, types.MethodType)):
            report.notes.append(f"{name}: already patched (by an earlier patch of a sub-module)")
            if "feed_forward_chunk" in m.__dict__:
                covered.add(id(m.output))
            continue
        for cls, check, attr, fn, what in rows:  # (a LayerNorm: only inside a GPT2Model)
            if type(m) is not cls or id(m) in covered or (cls is nn.LayerNorm and id(m) not in gpt2_norms):
                continue
            why = check(m)
            if why:
                report.skipped.append((name, f"{cls.__name__}: {why}"))
            else:
                swap(m, attr, fn)
                if attr == "feed_forward_chunk":
                    covered.add(id(m.output))
                report.replaced.append((name, f"{cls.__name__} -> " + what.format(act=getattr(m, "_sublayer_act", ""))))
            break
    parents = {id(c): m for m in model.modules() for c in m.children()}
    for name, m in model.named_modules():  # after the loop: the encoder's layers must be patched first
        if type(m).__name__ == "BertModel" and type(m).__module__ == "transformers.models.bert.modeling_bert":
            why = _bert_padding_free(m, parents.get(id(m)), model, padding_free)
            if why:
                report.notes.append(f"{name or '(root)'}: padding-free encoder not used: {why}")
            else:
                swap(m, "forward", _bert_model_forward)
                report.replaced.append((name, "BertModel -> padding-free encoder (real tokens only, zeros at padding)"))
    setattr(model, _STATE, records)
    return report


def unpatch(model: nn.Module) -> bool:
    """Restore the forwards :func:`patch` replaced in ``model``.

    Returns:
        True if ``model`` was patched (now restored), False if there was nothing to restore.

    Raises:
        TypeError: ``model`` is not an ``nn.Module``.
    """
    if not isinstance(model, nn.Module):
        raise TypeError(f"model must be a torch.nn.Module, got {type(model).__name__}")
    records = model.__dict__.pop(_STATE, None)
    if records is None:
        return False
    for m, attr, old in reversed(records):
        if old is _MISSING:
            m.__dict__.pop(attr, None)
        else:
            setattr(m, attr, old)
    return True


@contextlib.contextmanager
def patched(model: nn.Module, *, loss: bool = True, padding_free: bool | None = None) -> Iterator[PatchReport]:
    """``with patched(model) as report:`` — :func:`patch` for the block, :func:`unpatch` after it (a model that was
    already patched on entry stays patched)."""
    report = patch(model, loss=loss, padding_free=padding_free)
    fresh = not report.notes or not report.notes[0].startswith("already patched")
    try:
        yield report
    finally:
        if fresh:
            unpatch(model)

