"""The prepared BERT: :class:`PreparedBert`, BERT's one inference forward over the prepared encoder of
:mod:`sublayer.runtime.encoder`, whatever format its layers hold (float32 / bf16 in :class:`~.fast.FastBert`, int8
in :class:`~.quantized.QuantizedBert`), and the names its tensors go by (:func:`bert_tensors`, :func:`bert_layers`)."""

from __future__ import annotations

import math
from collections import defaultdict

import torch
import torch.nn.functional as F
from torch import Tensor

from ..runtime.encoder import run_layers
from ..runtime.rows import InferenceOnly, eval_mode, inference, layer_norm
from .bert import Bert, BertConfig, mean_pooled
from .outputs import BaseModelOutput

__all__ = ["PreparedBert", "bert_activations", "bert_eps", "bert_layers", "bert_tensors"]


def bert_tensors(model: Bert) -> dict[str, Tensor]:
    """A :class:`Bert`'s float32 tensors under the names of the prepared BERT (and of the int8 folder format):
    ``embeddings.{word,position,token_type}``, ``embeddings.norm.{weight,bias}``, per layer ``layers.{i}.{qkv,out,
    fc1,fc2}.{weight,bias}`` (q|k|v concatenated) and ``layers.{i}.norm{1,2}.{weight,bias}``, the pooler's
    ``pooler.dense.{weight,bias}`` when there is one. Detached views of the parameters (q|k|v: a new tensor)."""
    e, t = model.embeddings, {}
    for n in ("word", "position", "token_type"):
        t[f"embeddings.{n}"] = getattr(e, f"{n}_embeddings").weight.detach()
    t["embeddings.norm.weight"], t["embeddings.norm.bias"] = e.norm.weight.detach(), e.norm.bias.detach()
    for i, blk in enumerate(model.encoder.layers):
        a, f, p = blk.self_attn, blk.ffn, f"layers.{i}"
        t[f"{p}.qkv.weight"] = torch.cat([a.q_proj.weight, a.k_proj.weight, a.v_proj.weight], 0).detach()
        t[f"{p}.qkv.bias"] = torch.cat([a.q_proj.bias, a.k_proj.bias, a.v_proj.bias], 0).detach()
        for k, lin in (("out", a.out_proj), ("fc1", f.fc1), ("fc2", f.fc2)):
            t[f"{p}.{k}.weight"], t[f"{p}.{k}.bias"] = lin.weight.detach(), lin.bias.detach()
        for j, norm in ((1, blk.attn_residual.norm), (2, blk.ffn_residual.norm)):
            t[f"{p}.norm{j}.weight"], t[f"{p}.norm{j}.bias"] = norm.weight.detach(), norm.bias.detach()
    if model.pooler is not None:
        t["pooler.dense.weight"] = model.pooler.dense.weight.detach()
        t["pooler.dense.bias"] = model.pooler.dense.bias.detach()
    return t


def bert_eps(model: Bert | None, config: BertConfig) -> dict[str, float]:
    """Each block norm's eps under its :func:`bert_tensors` name (``layers.{i}.norm{1,2}``): the ``model``'s modules'
    own (as its forward reads them, set after construction too); without one, ``config.eps``."""
    if model is None:
        return defaultdict(lambda: config.eps)
    return {f"layers.{i}.norm{j}": r.norm.eps for i, blk in enumerate(model.encoder.layers)
            for j, r in ((1, blk.attn_residual), (2, blk.ffn_residual))}  # fmt: skip


def bert_activations(model: Bert | None, config: BertConfig) -> list[str]:
    """Each block's FFN activation: the ``model``'s modules' own (as its forward reads them, set after construction
    too); without one, ``config.activation``."""
    if model is None:
        return [config.activation] * config.n_layers
    return [blk.ffn.activation for blk in model.encoder.layers]


def bert_layers(
    t: dict[str, Tensor], config: BertConfig, linear, eps: dict[str, float], activations: list[str]
) -> list[dict]:
    """The layers of :func:`sublayer.runtime.encoder.run_layers` from :func:`bert_tensors`' names, each dense layer
    made by ``linear(t, name)`` (its format), the norms' eps from ``eps`` (:func:`bert_eps`), each FFN's
    activation from ``activations`` (:func:`bert_activations`)."""
    return [
        {**{k: linear(t, f"layers.{i}.{k}") for k in ("qkv", "out", "fc1", "fc2")}, "act": activations[i],
         **{f"norm{j}": (t[f"layers.{i}.norm{j}.weight"], t[f"layers.{i}.norm{j}.bias"], eps[f"layers.{i}.norm{j}"])
            for j in (1, 2)}}
        for i in range(config.n_layers)
    ]  # fmt: skip


class PreparedBert(InferenceOnly):
    """A :class:`Bert` on prepared layers: the one inference forward of BERT whatever its layers' format
    (:class:`FastBert`: float32 / bf16; :class:`~sublayer.models.quantized.QuantizedBert`: int8).

    Subclasses give ``config``, ``compute_dtype``, ``_check`` (:meth:`Bert._prepare`'s checks) and ``_parts()``:
    ``(tensors, layers)``, the :func:`bert_tensors` names (embeddings, norms, pooler) and the layers of
    :func:`sublayer.runtime.encoder.run_layers`. ``attention_dtype``: the attention's (None: the compute dtype);
    ``split_probs``: bf16 attention's probabilities in two bf16 parts (see :func:`sublayer.runtime.encoder.attention`).

    Forward: as :meth:`Bert.forward` (``input_ids``, ``attention_mask`` 1 = token, ``token_type_ids``,
    ``return_dict``) -> float32 (B, T, d_model); hidden states at padded positions are zeros. ``embed`` and
    ``pooled`` as the model's.
    """

    attention_dtype: torch.dtype | None = None
    split_probs: bool = True

    @inference
    def forward(
        self,
        input_ids: Tensor,
        attention_mask: Tensor | None = None,
        token_type_ids: Tensor | None = None,
        *,
        return_dict: bool = False,
    ) -> Tensor | BaseModelOutput:
        if (ref := self._reference()) is not None:
            with eval_mode(ref):
                return ref(input_ids, attention_mask, token_type_ids, return_dict=return_dict)
        kpm, token_type_ids = self._check(input_ids, attention_mask, token_type_ids)
        t, layers = self._parts()
        cfg = self.config
        B, T = input_ids.shape
        d = cfg.d_model
        ids, types = input_ids.reshape(-1), token_type_ids.reshape(-1)
        index = pad = first = None
        pooler = return_dict and "pooler.dense.weight" in t
        if kpm is not None and bool(kpm.any()):  # the real tokens only, from the embeddings on
            pad = kpm.contiguous()
            index = (~pad).reshape(-1).nonzero().squeeze(1)
            if pooler and bool(pad[:, 0].any()):  # the pooler reads position 0, padding or not, as HF does:
                first = pad[:, 0].nonzero().squeeze(1)  # it runs as a query-only row after the real tokens
                index = torch.cat([index, first * T])
            ids, types, pos = ids.index_select(0, index), types.index_select(0, index), index % T
        else:
            pos = torch.arange(T).repeat(B)
        x = t["embeddings.word"][ids] + t["embeddings.position"][pos] + t["embeddings.token_type"][types]
        eps = cfg.eps if self.model is None else self.model.embeddings.norm.eps  # a followed model's, as its layers'
        x = layer_norm(x, t["embeddings.norm.weight"], t["embeddings.norm.bias"], eps).to(self.compute_dtype)
        x = run_layers(x, layers, pad=pad, shape=(B, T), heads=cfg.n_heads,
                       scale=1.0 / math.sqrt(d // cfg.n_heads), activation=cfg.activation, queries=first,
                       attention_dtype=self.attention_dtype, split_probs=self.split_probs).float()  # fmt: skip
        if first is not None:
            index, x, x0 = index[: -first.numel()], x[: -first.numel()], x[-first.numel() :]
        if index is not None:
            x = x.new_zeros(B * T, d).index_copy_(0, index, x)
        h = x.view(B, T, d)
        if not return_dict:
            return h
        pool = None
        if pooler:
            h0 = h[:, 0] if first is None else h[:, 0].index_copy(0, first, x0)
            pool = torch.tanh(F.linear(h0, t["pooler.dense.weight"], t["pooler.dense.bias"]))
        return BaseModelOutput(last_hidden_state=h, pooler_output=pool)

    @inference
    def pooled(
        self, input_ids: Tensor, attention_mask: Tensor | None = None, token_type_ids: Tensor | None = None
    ) -> Tensor:
        """As :meth:`Bert.pooled`: ``tanh(dense(h[:, 0]))`` (B, d_model), float32.

        Raises:
            ValueError: the model has no pooler.
        """
        if "pooler.dense.weight" not in self._parts()[0]:
            raise ValueError("this Bert has no pooler (built with pooler=False or loaded from a file without one)")
        return self(input_ids, attention_mask, token_type_ids, return_dict=True).pooler_output

    @inference
    def embed(
        self, input_ids: Tensor, attention_mask: Tensor | None = None, token_type_ids: Tensor | None = None
    ) -> Tensor:
        """As :meth:`Bert.embed`: mean over real tokens, L2-normalised, (B, d_model) float32.

        Raises:
            ValueError: as :meth:`forward`, or a row with no token.
        """
        return mean_pooled(self(input_ids, attention_mask, token_type_ids), attention_mask)
