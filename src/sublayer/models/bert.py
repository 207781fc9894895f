"""BERT: a post-norm Transformer encoder made of the sub-layers, loadable from Hugging Face checkpoints.

Architecture (HF ``BertModel`` math): word + learned position + token-type embeddings, LayerNorm, dropout, then
``n_layers`` post-norm :class:`sublayer.nn.EncoderBlock` s (``x = LN(x + drop(attn(x)))``,
``x = LN(x + drop(ffn(x)))``), and an optional pooler ``tanh(dense(h[:, 0]))``.

Module structure: ``embeddings.{word,position,token_type}_embeddings``, ``embeddings.norm``,
``encoder.layers[i].self_attn.{q,k,v,out}_proj``, ``encoder.layers[i].ffn.{fc1,fc2}``,
``encoder.layers[i].attn_residual.norm`` / ``ffn_residual.norm``, ``pooler.dense``.
"""

from __future__ import annotations

import dataclasses
import os
from typing import Any

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from .. import checkpoints as ckpt
from .. import functional as SF
from .._checks import (
    check_attention_mask,
    check_choice,
    check_eps,
    check_input_ids,
    check_positive_int,
    check_probability,
)
from ..checkpoints import bert as keymap
from ..nn import EncoderBlock, LayerNorm, TransformerEncoder
from ..functional.packing import PackedBatch
from ..runtime import padding_free
from ..runtime.rows import eval_mode
from .config import ModelConfig, init_weights
from .outputs import BaseModelOutput

__all__ = ["BertConfig", "Bert", "BertEmbeddings", "BertPooler", "mean_pooled"]

# our field -> the HF config.json key, in HF's order
_HF_NAMES = (
    ("vocab_size", "vocab_size"), ("d_model", "hidden_size"), ("n_layers", "num_hidden_layers"),
    ("n_heads", "num_attention_heads"), ("d_ff", "intermediate_size"), ("activation", "hidden_act"),
    ("eps", "layer_norm_eps"), ("dropout", "hidden_dropout_prob"), ("attn_dropout", "attention_probs_dropout_prob"),
    ("max_positions", "max_position_embeddings"), ("type_vocab_size", "type_vocab_size"),
    ("pad_token_id", "pad_token_id"),
)  # fmt: skip


@dataclasses.dataclass
class BertConfig(ModelConfig):
    """BERT sizes and options (defaults: ``bert-base-uncased``).

    Args:
        vocab_size, max_positions (``max_position_embeddings``), type_vocab_size: embedding table sizes.
        d_model (``hidden_size``), n_layers (``num_hidden_layers``), n_heads (``num_attention_heads``),
        d_ff (``intermediate_size``): sizes; ``d_model % n_heads == 0``.
        activation (``hidden_act``): FFN activation; HF ``gelu`` is the erf GELU (ours ``gelu``).
        eps (``layer_norm_eps``): LayerNorm eps (1e-12).
        dropout (``hidden_dropout_prob``): embeddings and residual branches.
        attn_dropout (``attention_probs_dropout_prob``): attention weights.
        pad_token_id: the padding token (its embedding row gets no gradient), or None.

    Raises:
        ValueError/TypeError: bad sizes, probabilities, eps, activation.
    """

    vocab_size: int = 30522
    d_model: int = 768
    n_layers: int = 12
    n_heads: int = 12
    d_ff: int = 3072
    activation: str = "gelu"
    eps: float = 1e-12
    dropout: float = 0.1
    attn_dropout: float = 0.1
    max_positions: int = 512
    type_vocab_size: int = 2
    pad_token_id: int | None = 0

    def validate(self) -> None:
        for name in ("vocab_size", "d_model", "n_layers", "n_heads", "d_ff", "max_positions", "type_vocab_size"):
            check_positive_int(name, getattr(self, name))
        if self.d_model % self.n_heads != 0:
            raise ValueError(f"d_model ({self.d_model}) must be divisible by n_heads ({self.n_heads})")
        check_choice("activation", self.activation, [a for a in SF.ACTIVATIONS if a not in SF.GATED_ACTIVATIONS])
        check_eps("eps", self.eps)
        check_probability("dropout", self.dropout)
        check_probability("attn_dropout", self.attn_dropout)
        p = self.pad_token_id
        if p is not None and (isinstance(p, bool) or not isinstance(p, int) or not 0 <= p < self.vocab_size):
            raise ValueError(f"pad_token_id must be None or an int in [0, vocab_size={self.vocab_size}), got {p!r}")

    @classmethod
    def from_hf_dict(cls, d: dict[str, Any]) -> BertConfig:
        """Build from a Hugging Face BERT ``config.json`` dict.

        Fields read: ``vocab_size hidden_size num_hidden_layers num_attention_heads intermediate_size hidden_act
        layer_norm_eps hidden_dropout_prob attention_probs_dropout_prob max_position_embeddings type_vocab_size
        pad_token_id``. ``position_embedding_type`` must be ``absolute``; ``is_decoder``/``add_cross_attention``
        must be false. Other keys (bookkeeping such as ``initializer_range``, ``architectures``) are ignored.

        Raises:
            ValueError: ``model_type`` is not ``"bert"``, unsupported activation or options.
        """
        if not isinstance(d, dict):
            raise TypeError(f"BertConfig.from_hf_dict needs a dict, got {type(d).__name__}")
        if d.get("model_type") != "bert":
            raise ValueError(f"model_type must be 'bert' for BERT, got {d.get('model_type')!r}")
        if d.get("position_embedding_type", "absolute") != "absolute":
            raise ValueError(
                f"unsupported BERT option position_embedding_type={d['position_embedding_type']!r} "
                "(only 'absolute' is implemented)"
            )
        for key in ("is_decoder", "add_cross_attention"):
            if d.get(key, False):
                raise ValueError(f"unsupported BERT option {key}={d[key]!r} (an encoder only is implemented)")
        return cls._from_hf_names(d, _HF_NAMES, "hidden_act", "gelu")

    def to_hf_dict(self) -> dict[str, Any]:
        """The Hugging Face ``config.json`` dict (``BertModel``) for this config."""
        return {"model_type": "bert", "architectures": ["BertModel"], **self._to_hf_names(_HF_NAMES, "BERT"),
                "position_embedding_type": "absolute"}  # fmt: skip


def mean_pooled(h: Tensor, attention_mask: Tensor | None, *, normalize: bool = True) -> Tensor:
    """Hidden states (B, T, D) averaged over the real tokens (``attention_mask`` (B, T) 1; None: all), then
    L2-normalised when ``normalize``: sentence-transformers' mean pooling, (B, D).

    Raises:
        ValueError: a row with no token (attention_mask all 0).
    """
    if attention_mask is None:
        mean = h.mean(dim=1)
    else:
        w = attention_mask.to(h.dtype)[..., None]  # (B, T, 1)
        count = w.sum(dim=1)
        if bool((count == 0).any()):
            raise ValueError("attention_mask has a row with no token (all 0): nothing to average")
        mean = (h * w).sum(dim=1) / count
    return F.normalize(mean, p=2.0, dim=-1) if normalize else mean


class BertEmbeddings(nn.Module):
    """``dropout(LN(word[ids] + position[arange(T)] + token_type[type_ids]))``; (B, T) -> (B, T, d_model)."""

    def __init__(self, config: BertConfig, *, device=None, dtype=None) -> None:
        super().__init__()
        kw = {"device": device, "dtype": dtype}
        d = config.d_model
        self.word_embeddings = nn.Embedding(config.vocab_size, d, padding_idx=config.pad_token_id, **kw)
        self.position_embeddings = nn.Embedding(config.max_positions, d, **kw)
        self.token_type_embeddings = nn.Embedding(config.type_vocab_size, d, **kw)
        self.norm = LayerNorm(d, config.eps, **kw)
        self.dropout = config.dropout

    def forward(self, input_ids: Tensor, token_type_ids: Tensor, position_ids: Tensor | None = None) -> Tensor:
        """ids (B, T) or packed rows (N,); ``position_ids`` of the same shape, default ``arange(T)``."""
        pos = torch.arange(input_ids.shape[1], device=input_ids.device)[None] if position_ids is None else position_ids
        x = self.word_embeddings(input_ids) + self.position_embeddings(pos) + self.token_type_embeddings(token_type_ids)
        return F.dropout(self.norm(x), self.dropout, self.training)


class BertPooler(nn.Module):
    """``tanh(dense(h[:, 0]))``: the [CLS] vector (HF ``pooler_output``); (B, T, D) -> (B, D)."""

    def __init__(self, d_model: int, *, device=None, dtype=None) -> None:
        super().__init__()
        self.dense = nn.Linear(d_model, d_model, device=device, dtype=dtype)

    def forward(self, hidden: Tensor) -> Tensor:
        return torch.tanh(self.dense(hidden[:, 0]))


class Bert(nn.Module):
    """BERT encoder (HF ``BertModel`` math; fp32 hidden states equal to it).

    Args:
        config: a :class:`BertConfig`.
        pooler: build the pooler (HF ``add_pooling_layer``); checkpoints of ``BertForMaskedLM`` have none.
        device, dtype: factory kwargs.

    Forward:
        ``input_ids`` (B, T) ints; ``attention_mask`` (B, T) 1 = token, 0 = padding (HF convention), default
        all tokens; ``token_type_ids`` (B, T), default zeros. Returns ``last_hidden_state`` (B, T, d_model);
        ``return_dict=True``: a :class:`~sublayer.models.outputs.BaseModelOutput` (``.last_hidden_state``,
        ``.pooler_output``). No ``labels``: BERT's task heads are not part of this model.
        Padded positions get outputs too (queries are not masked, as in HF); only their keys are ignored.

    Raises:
        TypeError/ValueError: ids not integer (B, T), out of range, longer than max_positions, bad mask.
    """

    def __init__(self, config: BertConfig, *, pooler: bool = True, device=None, dtype=None) -> None:
        super().__init__()
        if not isinstance(config, BertConfig):
            raise TypeError(f"config must be a BertConfig, got {type(config).__name__}")
        self.config = config
        kw = {"device": device, "dtype": dtype}
        self.embeddings = BertEmbeddings(config, **kw)
        block = EncoderBlock(
            config.d_model, config.n_heads, config.d_ff, dropout=config.dropout, activation=config.activation,
            norm_first=False, eps=config.eps, **kw,
        )  # fmt: skip
        self.encoder = TransformerEncoder(block, config.n_layers)
        for layer in self.encoder.layers:
            # BERT's dropouts: attention_probs_dropout_prob on the weights, none on the FFN hidden.
            layer.self_attn.dropout = config.attn_dropout
            layer.ffn.dropout = 0.0
        self.pooler = BertPooler(config.d_model, **kw) if pooler else None
        self.reset_parameters()

    def reset_parameters(self) -> None:
        """BERT's init: N(0, 0.02) weights, zero biases, LayerNorm ones/zeros, zero padding embedding row."""
        init_weights(self, 0.02)

    def _prepare(
        self, input_ids: Tensor, attention_mask: Tensor | None, token_type_ids: Tensor | None
    ) -> tuple[Tensor | None, Tensor]:
        cfg = self.config
        check_input_ids("input_ids", input_ids, cfg.vocab_size, cfg.max_positions)
        kpm = None if attention_mask is None else check_attention_mask(attention_mask, tuple(input_ids.shape))
        if token_type_ids is None:
            token_type_ids = torch.zeros_like(input_ids)
        else:
            check_input_ids("token_type_ids", token_type_ids, cfg.type_vocab_size, limit_name="type_vocab_size")
            if token_type_ids.shape != input_ids.shape:
                raise ValueError(
                    f"token_type_ids must have the shape of input_ids {tuple(input_ids.shape)}, "
                    f"got {tuple(token_type_ids.shape)}"
                )
        return kpm, token_type_ids

    def forward(
        self,
        input_ids: Tensor,
        attention_mask: Tensor | None = None,
        token_type_ids: Tensor | None = None,
        *,
        return_dict: bool = False,
    ) -> Tensor | BaseModelOutput:
        """``last_hidden_state`` (B, T, d_model); ``return_dict``: a :class:`BaseModelOutput` holding it and HF's
        ``pooler_output`` (B, d_model) (None without pooler), as :meth:`pooled`."""
        kpm, token_type_ids = self._prepare(input_ids, attention_mask, token_type_ids)
        if not return_dict:
            return self._encode(input_ids, kpm, token_type_ids)
        if self.pooler is None:
            return BaseModelOutput(last_hidden_state=self._encode(input_ids, kpm, token_type_ids))
        run = None
        if kpm is not None:
            run = ~kpm
            run[:, 0] = True
        h = self._encode(input_ids, kpm, token_type_ids, run)  # position 0 runs, padding or not: the pooler's
        pooled = self.pooler(h)
        return BaseModelOutput(last_hidden_state=h if run is None else h.masked_fill(kpm[..., None], 0.0),
                               pooler_output=pooled)  # fmt: skip

    def _encode(self, input_ids: Tensor, kpm: Tensor | None, token_type_ids: Tensor, run: Tensor | None = None) -> Tensor:
        """Hidden states (B, T, d_model): those of the positions in ``run`` (default: the real tokens), zeros at
        the others. Padded positions in ``run`` attend as in HF (to the real tokens)."""
        kpm = kpm if kpm is not None and bool(kpm.any()) else None
        if padding_free.applies(self, kpm):  # the same encoder on packed rows
            pk = PackedBatch(kpm, rows=run)
            pos = pk.pack(torch.arange(input_ids.shape[1], device=input_ids.device)[None])
            x = self.embeddings(pk.pack(input_ids), pk.pack(token_type_ids), pos)
            return pk.unpack(self.encoder(x, packing=pk))
        h = self.encoder(self.embeddings(input_ids, token_type_ids), key_padding_mask=kpm)
        return h if kpm is None else h.masked_fill((kpm if run is None else ~run)[..., None], 0.0)

    def pooled(
        self, input_ids: Tensor, attention_mask: Tensor | None = None, token_type_ids: Tensor | None = None
    ) -> Tensor:
        """HF's ``pooler_output``: ``tanh(dense(h[:, 0]))``, (B, d_model).

        Raises:
            ValueError: the model was built without a pooler.
        """
        if self.pooler is None:
            raise ValueError("this Bert has no pooler (built with pooler=False or loaded from a file without one)")
        # the pooler reads position 0, padding or not (left padding), as HF does
        return self(input_ids, attention_mask, token_type_ids, return_dict=True).pooler_output

    def embed(
        self, input_ids: Tensor, attention_mask: Tensor | None = None, token_type_ids: Tensor | None = None
    ) -> Tensor:
        """Sentence vectors: the last hidden states averaged over real tokens (``attention_mask`` 1), then
        L2-normalised (sentence-transformers' mean pooling). Returns (B, d_model), rows of unit norm. Runs in
        eval mode whatever the module's mode (no dropout: the same text always gives the same vector).

        Raises:
            ValueError: as :meth:`forward`, or a row with no token (attention_mask all 0).
        """
        with eval_mode(self):
            return mean_pooled(self(input_ids, attention_mask, token_type_ids), attention_mask)

    @classmethod
    def from_pretrained(cls, folder: str | os.PathLike, *, device=None, dtype=None) -> Bert:
        """Load a Hugging Face BERT folder (``config.json`` + ``model.safetensors`` or ``pytorch_model.bin``), in
        eval mode (as HF's ``from_pretrained``).

        Key names are mapped by :mod:`sublayer.checkpoints.bert` (``bert.`` prefix, ``gamma``/``beta``,
        ignored ``position_ids`` buffer and ``cls.*`` heads). A file without any ``pooler.*`` key gives a
        model without pooler; otherwise loading is strict.

        Raises:
            FileNotFoundError: no folder, config or weights file. CheckpointError (a ValueError): bad JSON,
            unsupported config, unreadable file, or one message listing every missing/unexpected/wrong-shape key.
        """
        config, tensors, source = ckpt.read_hf_folder(folder, BertConfig.from_hf_dict)
        return cls._loaded(config, tensors, source, device, dtype).eval()  # as HF's: dropout off until .train()

    @classmethod
    def from_hf(cls, model: nn.Module, *, device=None, dtype=None) -> Bert:
        """Convert a live Hugging Face ``BertModel`` (or a task model's ``bert.`` part, ``cls.*`` heads ignored, as
        for folders): same hidden states and gradients. A model without pooler gives one without pooler.

        The copy lives on the HF model's device and dtype unless ``device``/``dtype`` say otherwise, in its
        train/eval mode.

        Raises:
            TypeError: not an HF model. CheckpointError (a ValueError): unsupported config, or one message listing
            every missing/unexpected/wrong-shape key.
        """
        config, tensors, source = ckpt.live.read_hf_model(model, BertConfig.from_hf_dict)
        where, dtype0 = ckpt.live.placement(model)
        return cls._loaded(config, tensors, source, device or where, dtype or dtype0).train(model.training)

    @classmethod
    def _loaded(cls, config: BertConfig, tensors: dict[str, Tensor], source, device, dtype) -> Bert:
        """A model with ``tensors`` (HF names) loaded strictly, built on the meta device (no random init); it has a
        pooler iff they hold one."""
        pooler = any((keymap.canonical(k) or "").startswith("pooler.") for k in tensors)
        model, n = cls(config, pooler=pooler, device="meta", dtype=dtype), config.n_layers
        return ckpt.live.load_checked(
            model, tensors, source, canonical=keymap.canonical, device=device,
            to_hf=lambda sd: keymap.to_hf(sd, n, pooler=pooler), from_hf=lambda sd: keymap.from_hf(sd, n, pooler=pooler),
        )  # fmt: skip

    def to_hf(self) -> nn.Module:
        """This model as a Hugging Face ``transformers.BertModel`` (weights copied; same device, dtype, train/eval
        mode; a pooler iff this model has one). Needs ``transformers``."""
        pooler = self.pooler is not None
        tensors = keymap.to_hf(self.state_dict(), self.config.n_layers, pooler=pooler)
        return ckpt.live.build_hf_model(
            "BertModel", self.config.to_hf_dict(), tensors, training=self.training, add_pooling_layer=pooler
        )

    def save_pretrained(self, folder: str | os.PathLike) -> None:
        """Write ``model.safetensors`` (``BertModel`` keys) and ``config.json`` that HF
        ``BertModel.from_pretrained`` loads. Files are written under a temporary name and renamed."""
        tensors = keymap.to_hf(self.state_dict(), self.config.n_layers, pooler=self.pooler is not None)
        ckpt.write_folder(folder, tensors, self.config.to_hf_dict())
