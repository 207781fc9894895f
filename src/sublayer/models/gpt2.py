"""GPT-2: a decoder-only language model made of the sub-layers, loadable from Hugging Face checkpoints.

Architecture (HF ``GPT2LMHeadModel`` math): token + learned position embeddings, dropout, ``n_layers`` pre-norm
blocks ``x = x + drop(attn(ln_1(x)))`` (causal), ``x = x + drop(ffn(ln_2(x)))``, a final LayerNorm ``ln_f`` and
an LM head tied to the token embedding. Attention is scaled by 1/sqrt(head_dim).

Module structure (what tensor-parallel plans address): ``blocks[i].self_attn.{q,k,v,out}_proj`` (separate
``nn.Linear``; the checkpoint's fused ``c_attn`` is split on load), ``blocks[i].ffn.{fc1,fc2}``,
``blocks[i].attn_residual.norm`` / ``blocks[i].ffn_residual.norm`` (ln_1 / ln_2), ``ln_f``, ``wte``, ``wpe``,
``lm_head`` (its weight *is* ``wte.weight`` when tied).
"""

from __future__ import annotations

import dataclasses
import math
from typing import Any

from torch import Tensor, nn

from .. import functional as SF
from .._checks import (
    check_choice,
    check_eps,
    check_positive_int,
    check_probability,
)
from ..checkpoints import gpt2 as keymap
from ..functional import fused
from ..nn import LayerNorm, MultiHeadAttention, PositionWiseFFN, PreNormResidual
from ..runtime.generation import check_token_id
from ..runtime.causal import CausalParts
from .causal_lm import CausalBlock, CausalLM
from .config import ModelConfig, init_weights

__all__ = ["GPT2Config", "GPT2", "GPT2Block"]

# HF config fields that change the math; only these values are implemented.
_HF_FIXED = {
    "scale_attn_weights": True,
    "scale_attn_by_inverse_layer_idx": False,
    "reorder_and_upcast_attn": False,
    "add_cross_attention": False,
}

# our field -> the HF config.json key, in HF's order
_HF_NAMES = (
    ("vocab_size", "vocab_size"), ("max_positions", "n_positions"), ("d_model", "n_embd"), ("n_layers", "n_layer"),
    ("n_heads", "n_head"), ("d_ff", "n_inner"), ("activation", "activation_function"), ("eps", "layer_norm_epsilon"),
    ("dropout", "resid_pdrop"), ("embd_dropout", "embd_pdrop"), ("attn_dropout", "attn_pdrop"),
    ("tie_word_embeddings", "tie_word_embeddings"), ("bos_token_id", "bos_token_id"),
    ("eos_token_id", "eos_token_id"), ("pad_token_id", "pad_token_id"),
)  # fmt: skip


@dataclasses.dataclass
class GPT2Config(ModelConfig):
    """GPT-2 sizes and options (defaults: the 124M ``gpt2`` checkpoint).

    Args:
        vocab_size: tokens. max_positions: learned positions (HF ``n_positions``).
        d_model (``n_embd``), n_layers (``n_layer``), n_heads (``n_head``): sizes; ``d_model % n_heads == 0``.
        d_ff (``n_inner``): FFN hidden size; None -> 4·d_model.
        activation: FFN activation (ours: ``gelu_tanh`` is HF ``gelu_new``).
        eps (``layer_norm_epsilon``): LayerNorm eps.
        dropout (``resid_pdrop``): on each residual branch. embd_dropout (``embd_pdrop``): on the embeddings.
        attn_dropout (``attn_pdrop``): on the attention weights.
        tie_word_embeddings: the LM head shares the token embedding.
        bos_token_id, eos_token_id, pad_token_id: special tokens: None or an id of the vocabulary; a negative id
            counts from its end, as a Python index (the default -1 is the last id, GPT-2's ``<|endoftext|>``:
            50256 for the default vocabulary). Stored resolved (``>= 0``).

    Raises:
        ValueError/TypeError: bad sizes, probabilities, eps, activation, token ids (outside the vocabulary).
    """

    vocab_size: int = 50257
    max_positions: int = 1024
    d_model: int = 768
    n_layers: int = 12
    n_heads: int = 12
    d_ff: int | None = None
    activation: str = "gelu_tanh"
    eps: float = 1e-5
    dropout: float = 0.1
    embd_dropout: float = 0.1
    attn_dropout: float = 0.1
    tie_word_embeddings: bool = True
    bos_token_id: int | None = -1
    eos_token_id: int | None = -1
    pad_token_id: int | None = None

    def validate(self) -> None:
        for name in ("vocab_size", "max_positions", "d_model", "n_layers", "n_heads"):
            check_positive_int(name, getattr(self, name))
        check_positive_int("d_ff", self.d_ff, allow_none=True)
        if self.d_model % self.n_heads != 0:
            raise ValueError(f"d_model ({self.d_model}) must be divisible by n_heads ({self.n_heads})")
        check_choice("activation", self.activation, [a for a in SF.ACTIVATIONS if a not in SF.GATED_ACTIVATIONS])
        check_eps("eps", self.eps)
        for name in ("dropout", "embd_dropout", "attn_dropout"):
            check_probability(name, getattr(self, name))
        if not isinstance(self.tie_word_embeddings, bool):
            raise TypeError(f"tie_word_embeddings must be a bool, got {self.tie_word_embeddings!r}")
        for name in ("bos_token_id", "eos_token_id", "pad_token_id"):
            value = getattr(self, name)
            check_token_id(name, value, self.vocab_size, negative=True)
            if value is not None and value < 0:
                setattr(self, name, value + self.vocab_size)

    @property
    def hidden_size(self) -> int:
        return self.d_ff if self.d_ff is not None else 4 * self.d_model

    @classmethod
    def from_hf_dict(cls, d: dict[str, Any]) -> GPT2Config:
        """Build from a Hugging Face GPT-2 ``config.json`` dict.

        Fields read: ``vocab_size n_positions n_embd n_layer n_head n_inner activation_function
        layer_norm_epsilon resid_pdrop embd_pdrop attn_pdrop tie_word_embeddings bos/eos/pad_token_id``.
        Fields that would change the math (``scale_attn_weights``, ``scale_attn_by_inverse_layer_idx``,
        ``reorder_and_upcast_attn``, ``add_cross_attention``) must have GPT-2's values. Other keys (training and
        bookkeeping metadata such as ``initializer_range``, ``summary_*``, ``use_cache``, ``architectures``) are
        ignored: real checkpoints carry many of them.

        Raises:
            ValueError: ``model_type`` is not ``"gpt2"``, unsupported activation or option values.
        """
        if not isinstance(d, dict):
            raise TypeError(f"GPT2Config.from_hf_dict needs a dict, got {type(d).__name__}")
        if d.get("model_type") != "gpt2":
            raise ValueError(f"model_type must be 'gpt2' for GPT-2, got {d.get('model_type')!r}")
        for key, want in _HF_FIXED.items():
            if key in d and d[key] != want:
                raise ValueError(f"unsupported GPT-2 option {key}={d[key]!r} (only {want!r} is implemented)")
        for key in ("bos_token_id", "eos_token_id", "pad_token_id"):
            if isinstance(d.get(key), list):
                raise ValueError(f"{key} must be a single id, got the list {d[key]!r}")
        # an absent key: the default (HF's: bos/eos 50256 for the default vocabulary)
        return cls._from_hf_names(d, _HF_NAMES, "activation_function", "gelu_new")

    def to_hf_dict(self) -> dict[str, Any]:
        """The Hugging Face ``config.json`` dict (``GPT2LMHeadModel``) for this config."""
        return {"model_type": "gpt2", "architectures": ["GPT2LMHeadModel"], **self._to_hf_names(_HF_NAMES, "GPT-2"),
                **_HF_FIXED}  # fmt: skip


class GPT2Block(CausalBlock):
    """One GPT-2 block: ``x + drop(attn(ln_1(x)))`` (causal) then ``x + drop(ffn(ln_2(x)))``.

    Attributes (the names of :class:`sublayer.nn.EncoderBlock`): ``self_attn``, ``ffn``, ``attn_residual``,
    ``ffn_residual`` (pre-norm residuals; ``.norm`` is ln_1 / ln_2).

    Shape:
        x (B, T, d_model); key_padding_mask (B, T_k) True = padding, covering cached keys too; attn_mask (B|1, 1,
        T, T_k) bool True = masked (other documents) -> (B, T, d_model). With ``packing``
        (:class:`sublayer.functional.packing.PackedBatch`): packed rows (N, d_model) -> (N, d_model).
    """

    def __init__(self, config: GPT2Config, *, device=None, dtype=None) -> None:
        super().__init__()
        kw = {"device": device, "dtype": dtype}
        d = config.d_model
        self.attn_residual = PreNormResidual(d, config.dropout, eps=config.eps, **kw)
        self.self_attn = MultiHeadAttention(d, config.n_heads, dropout=config.attn_dropout, **kw)
        self.ffn_residual = PreNormResidual(d, config.dropout, eps=config.eps, **kw)
        self.ffn = PositionWiseFFN(d, config.hidden_size, activation=config.activation, **kw)


class GPT2(CausalLM):
    """GPT-2 language model (HF ``GPT2LMHeadModel`` math, fp32 logits equal to it).

    Args:
        config: a :class:`GPT2Config`.
        device, dtype: factory kwargs.

    Attributes:
        generation_config: :meth:`generate`'s defaults (a :class:`sublayer.checkpoints.GenerationConfig`): the
            config's special ids; :meth:`from_pretrained` reads a folder's ``generation_config.json`` (as HF),
            :meth:`from_hf` takes the HF model's, :meth:`save_pretrained` writes it.

    Forward:
        ``input_ids`` (B, T) ints; ``attention_mask`` (B, T) 1 = token, 0 = padding (HF convention), optional;
        ``position_ids`` (B, T) or (1, T), default ``arange(T)`` as HF's forward; positions that restart at 0
        inside a row mark packed documents (HF's ``DataCollatorWithFlattening``): attention is block-diagonal
        causal, each document sees only itself.
        Returns logits (B, T, vocab_size), zeros at padded positions (every path); ``labels=`` (HF's meaning) or
        ``return_dict=True``: a :class:`~sublayer.models.outputs.CausalLMOutput` (see :meth:`CausalLM.forward`).
        When ``attention_mask`` marks padding or documents are packed, the layers run on the real tokens only
        (:mod:`sublayer.runtime.padding_free`).

    Raises:
        TypeError/ValueError: ids not integer (B, T), out of the vocabulary, longer than max_positions, bad mask.
    """

    config_class, keymap, embedding, final_norm = GPT2Config, keymap, "wte", "ln_f"

    def __init__(self, config: GPT2Config, *, device=None, dtype=None) -> None:
        super().__init__(config)
        kw = {"device": device, "dtype": dtype}
        self.wte = nn.Embedding(config.vocab_size, config.d_model, **kw)
        self.wpe = nn.Embedding(config.max_positions, config.d_model, **kw)
        self.blocks = nn.ModuleList([GPT2Block(config, **kw) for _ in range(config.n_layers)])
        self.ln_f = LayerNorm(config.d_model, config.eps, **kw)
        self.lm_head = nn.Linear(config.d_model, config.vocab_size, bias=False, **kw)
        self._tie_weights()
        self.reset_parameters()

    def reset_parameters(self) -> None:
        """GPT-2's init: N(0, 0.02) weights, zero biases, residual output projections scaled by 1/sqrt(2·n_layers)."""
        init_weights(self, 0.02)
        for block in self.blocks:
            for lin in (block.self_attn.out_proj, block.ffn.fc2):
                nn.init.normal_(lin.weight, 0.0, 0.02 / math.sqrt(2 * self.config.n_layers))

    def _embed(self, input_ids: Tensor, position_ids: Tensor) -> tuple[Tensor, None]:
        """Token + learned position embeddings, dropout (the Philox dropout of the blocks); no rotary."""
        x = self.wte(input_ids) + self.wpe(position_ids)
        return fused.dropout(x, self.config.embd_dropout, self.training), None

    def causal_parts(self) -> CausalParts:
        return CausalParts(embed=self.wte.weight, positions=self.wpe.weight, rotary=None, norm=self.ln_f,
                           lm_head=self.lm_head)  # fmt: skip
