"""Llama: the decoder-only language model of the Llama family (Llama 2/3, SmolLM, TinyLlama, Qwen2), made of the
sub-layers and loadable from Hugging Face checkpoints.

Architecture (HF ``LlamaForCausalLM`` math): a token embedding, ``n_layers`` pre-norm blocks
``x = x + attn(rms_1(x))`` (causal self-attention with rotary position embeddings and grouped-query attention),
``x = x + ffn(rms_2(x))`` (SwiGLU: ``down(silu(gate(x)) · up(x))``), a final RMSNorm ``norm`` and an LM head, tied
to the embedding or not. Attention is scaled by 1/sqrt(head_dim). Qwen2 is the same with biases on q/k/v.

Module structure (what tensor-parallel plans and the checkpoint key map address): ``embed_tokens``,
``blocks[i].attn_residual.norm`` / ``blocks[i].ffn_residual.norm`` (RMSNorms), ``blocks[i].self_attn.{q,k,v,out}_proj``
(k/v with ``n_kv_heads`` heads), ``blocks[i].ffn.{fc1,fc2}`` (``fc1`` packs ``[gate; up]``), ``norm``, ``lm_head``
(its weight *is* ``embed_tokens.weight`` when tied), ``rotary`` (no parameters).
"""

from __future__ import annotations

import dataclasses
from typing import Any

from torch import Tensor, nn

from .. import functional as SF
from .._checks import check_choice, check_eps, check_positive_int, check_probability
from ..checkpoints import llama as keymap
from ..nn import MultiHeadAttention, PositionWiseFFN, PreNormResidual, RMSNorm, RotaryEmbedding
from ..runtime import generation
from ..runtime.causal import CausalParts
from .causal_lm import CausalBlock, CausalLM
from .config import ModelConfig, init_weights

__all__ = ["LlamaConfig", "Llama", "LlamaBlock", "MODEL_TYPES"]

MODEL_TYPES = ("llama", "qwen2")
_ARCHITECTURES = {"llama": "LlamaForCausalLM", "qwen2": "Qwen2ForCausalLM"}
# HF hidden_act -> our gated activation (gate activation · up)
_HF_GATED = {"silu": "swiglu", "swish": "swiglu", "gelu": "geglu", "relu": "reglu"}
_TO_HF_GATED = {"swiglu": "silu", "geglu": "gelu", "reglu": "relu"}
_MOE_KEYS = ("num_experts", "num_local_experts", "num_experts_per_tok", "n_routed_experts", "moe_intermediate_size")
_REQUIRED = ("vocab_size", "hidden_size", "intermediate_size", "num_hidden_layers", "num_attention_heads")
# the HF config.json key -> our field (or property), in HF's order
_HF_NAMES = (
    ("vocab_size", "vocab_size"), ("max_position_embeddings", "max_positions"), ("hidden_size", "d_model"),
    ("num_hidden_layers", "n_layers"), ("num_attention_heads", "n_heads"), ("num_key_value_heads", "kv_heads"),
    ("head_dim", "attention_head_dim"), ("intermediate_size", "d_ff"), ("hidden_act", "activation"),
    ("rms_norm_eps", "eps"), ("rope_theta", "rope_theta"), ("rope_scaling", "rope_scaling"),
    ("attention_dropout", "attn_dropout"), ("tie_word_embeddings", "tie_word_embeddings"),
    ("bos_token_id", "bos_token_id"), ("eos_token_id", "eos_token_id"), ("pad_token_id", "pad_token_id"),
)  # fmt: skip


@dataclasses.dataclass
class LlamaConfig(ModelConfig):
    """Llama sizes and options (defaults: HF ``LlamaConfig``'s, the 7B shape).

    Args:
        model_type: ``"llama"`` or ``"qwen2"`` (the HF architecture written by ``save_pretrained``).
        vocab_size: tokens. max_positions (``max_position_embeddings``): the context the model was trained for;
            longer inputs (``forward``, ``generate``'s prompt + new tokens) raise ValueError, as GPT-2's (HF runs them).
        d_model (``hidden_size``), n_layers (``num_hidden_layers``), n_heads (``num_attention_heads``): sizes.
        n_kv_heads (``num_key_value_heads``): key/value heads, dividing n_heads; None -> n_heads.
        head_dim: None -> d_model / n_heads. Must be even (rotary pairs).
        d_ff (``intermediate_size``): the gated FFN's hidden size.
        activation: ``swiglu`` (HF ``hidden_act`` silu), ``geglu`` (gelu), ``reglu`` (relu).
        eps (``rms_norm_eps``): RMSNorm eps.
        rope_theta: rotary base.
        rope_scaling: None or a ``llama3`` dict (:func:`sublayer.functional.check_rope_scaling`).
        attention_bias: biases on q/k/v (and, for llama, on the output projection; qwen2 has them on q/k/v only and
            always).
        attn_dropout (``attention_dropout``): on the attention weights in training.
        tie_word_embeddings: the LM head shares the token embedding.
        bos_token_id, pad_token_id: special tokens (None or int); the embedding row of ``pad_token_id`` gets no
            gradient (``nn.Embedding(padding_idx=...)``, as HF). eos_token_id: None, an int or a list of ints
            (instruct checkpoints end a turn with any of several).

    Raises:
        ValueError/TypeError: bad sizes, head layout, activation, eps, rope scaling, probabilities, token ids.
    """

    model_type: str = "llama"
    vocab_size: int = 32000
    max_positions: int = 2048
    d_model: int = 4096
    n_layers: int = 32
    n_heads: int = 32
    n_kv_heads: int | None = None
    head_dim: int | None = None
    d_ff: int = 11008
    activation: str = "swiglu"
    eps: float = 1e-6
    rope_theta: float = 10000.0
    rope_scaling: dict[str, Any] | None = None
    attention_bias: bool = False
    attn_dropout: float = 0.0
    tie_word_embeddings: bool = False
    bos_token_id: int | None = 1
    eos_token_id: int | list[int] | None = 2
    pad_token_id: int | None = None

    def validate(self) -> None:
        check_choice("model_type", self.model_type, MODEL_TYPES)
        for name in ("vocab_size", "max_positions", "d_model", "n_layers", "n_heads", "d_ff"):
            check_positive_int(name, getattr(self, name))
        check_positive_int("n_kv_heads", self.n_kv_heads, allow_none=True)
        check_positive_int("head_dim", self.head_dim, allow_none=True)
        if self.head_dim is None and self.d_model % self.n_heads != 0:
            raise ValueError(f"d_model ({self.d_model}) must be divisible by n_heads ({self.n_heads}) without head_dim")
        if self.n_heads % self.kv_heads != 0:
            raise ValueError(f"n_heads ({self.n_heads}) must be divisible by n_kv_heads ({self.kv_heads})")
        self.rope_scaling = SF.check_rope_scaling(self.rope_scaling)
        SF.rotary_inv_freq(self.attention_head_dim, self.rope_theta, self.rope_scaling)  # even head_dim, theta > 0
        check_choice("activation", self.activation, SF.GATED_ACTIVATIONS)
        check_eps("eps", self.eps)
        check_probability("attn_dropout", self.attn_dropout)
        for name in ("attention_bias", "tie_word_embeddings"):
            if not isinstance(getattr(self, name), bool):
                raise TypeError(f"{name} must be a bool, got {getattr(self, name)!r}")
        if self.model_type == "qwen2" and not self.attention_bias:
            raise ValueError("model_type 'qwen2' has biases on q/k/v: attention_bias must be True, got False")
        for name in ("bos_token_id", "pad_token_id"):
            generation.check_token_id(name, getattr(self, name))
        generation.check_eos_ids("eos_token_id", self.eos_token_id)
        if self.pad_token_id is not None and self.pad_token_id >= self.vocab_size:
            raise ValueError(f"pad_token_id ({self.pad_token_id}) must be below vocab_size ({self.vocab_size})")

    @property
    def kv_heads(self) -> int:
        return self.n_heads if self.n_kv_heads is None else self.n_kv_heads

    @property
    def attention_head_dim(self) -> int:
        return self.d_model // self.n_heads if self.head_dim is None else self.head_dim

    @property
    def out_bias(self) -> bool:
        """Bias on the attention output projection: Llama's ``attention_bias`` covers it, Qwen2's biases do not."""
        return self.attention_bias and self.model_type == "llama"

    @classmethod
    def from_hf_dict(cls, d: dict[str, Any]) -> LlamaConfig:
        """Build from a Hugging Face Llama or Qwen2 ``config.json`` dict (older files' ``rope_theta`` /
        ``rope_scaling`` keys and transformers 5's ``rope_parameters`` alike).

        Fields read: ``model_type vocab_size max_position_embeddings hidden_size num_hidden_layers
        num_attention_heads num_key_value_heads head_dim intermediate_size hidden_act rms_norm_eps rope_theta
        rope_scaling / rope_parameters attention_bias attention_dropout tie_word_embeddings bos/eos/pad_token_id``.
        Bookkeeping keys (``initializer_range``, ``use_cache``, ``architectures``, ``pretraining_tp``...) are
        ignored.

        Raises:
            ValueError: one message naming the key and value of anything the model cannot represent:
            ``model_type`` other than llama/qwen2, a missing size key, ``use_sliding_window`` true (or a
            ``sliding_attention`` layer), a rope type other than default/llama3, ``partial_rotary_factor`` != 1,
            mixture-of-experts keys, ``mlp_bias`` true, an unknown ``hidden_act``, a list of bos or pad ids.
        """
        if not isinstance(d, dict):
            raise TypeError(f"LlamaConfig.from_hf_dict needs a dict, got {type(d).__name__}")
        kind = d.get("model_type")
        if kind not in MODEL_TYPES:
            raise ValueError(f"model_type must be one of {', '.join(map(repr, MODEL_TYPES))} for Llama, got {kind!r}")
        for key in _REQUIRED:
            if key not in d:
                raise ValueError(f"config lacks {key} (needed for model_type {kind!r})")
        refused = [(k, d[k]) for k in ("use_sliding_window", "mlp_bias") if d.get(k)]
        refused += [(k, d[k]) for k in _MOE_KEYS if d.get(k)]
        if any(t != "full_attention" for t in d.get("layer_types") or []):
            refused.append(("layer_types", d["layer_types"]))
        rope = dict(d.get("rope_scaling") or d.get("rope_parameters") or {})
        if rope.get("partial_rotary_factor", d.get("partial_rotary_factor", 1.0)) != 1.0:
            refused.append(("partial_rotary_factor", rope.get("partial_rotary_factor", d.get("partial_rotary_factor"))))
        kind_of_rope = rope.get("rope_type", rope.get("type", "default"))
        if kind_of_rope not in SF.ROPE_TYPES:
            refused.append(("rope_type", kind_of_rope))
        if d.get("hidden_act", "silu") not in _HF_GATED:
            refused.append(("hidden_act", d.get("hidden_act")))
        if refused:
            key, value = refused[0]
            raise ValueError(f"unsupported {kind} option {key}={value!r} (Llama cannot represent it)")
        for key in ("bos_token_id", "pad_token_id"):
            if isinstance(d.get(key), list):
                raise ValueError(f"{key} must be a single id, got the list {d[key]!r}")
        max_positions = d.get("max_position_embeddings", 2048 if kind == "llama" else 32768)
        if kind_of_rope == "llama3":
            rope.setdefault("original_max_position_embeddings", max_positions)
        size, heads, head_dim = d["hidden_size"], d["num_attention_heads"], d.get("head_dim")
        if isinstance(size, int) and isinstance(heads, int) and heads > 0 and head_dim == size // heads:
            head_dim = None  # the default: the config checks the sizes themselves
        return cls(
            model_type=kind,
            vocab_size=d["vocab_size"],
            max_positions=max_positions,
            d_model=d["hidden_size"],
            n_layers=d["num_hidden_layers"],
            n_heads=d["num_attention_heads"],
            n_kv_heads=d.get("num_key_value_heads"),
            head_dim=head_dim,
            d_ff=d["intermediate_size"],
            activation=_HF_GATED[d.get("hidden_act", "silu")],
            eps=d.get("rms_norm_eps", 1e-6),
            rope_theta=rope.get("rope_theta", d.get("rope_theta", 10000.0)),
            rope_scaling=rope if kind_of_rope == "llama3" else None,
            attention_bias=kind == "qwen2" or bool(d.get("attention_bias", False)),
            attn_dropout=d.get("attention_dropout", 0.0),
            tie_word_embeddings=d.get("tie_word_embeddings", False),
            bos_token_id=d.get("bos_token_id"),
            eos_token_id=d.get("eos_token_id"),
            pad_token_id=d.get("pad_token_id"),
        )

    def to_hf_dict(self) -> dict[str, Any]:
        """The Hugging Face ``config.json`` dict (``LlamaForCausalLM`` / ``Qwen2ForCausalLM``) for this config."""
        d = {"model_type": self.model_type, "architectures": [_ARCHITECTURES[self.model_type]],
             **{hf: getattr(self, ours) for hf, ours in _HF_NAMES}}  # fmt: skip
        d["hidden_act"] = _TO_HF_GATED[self.activation]
        d["rope_scaling"] = None if self.rope_scaling is None else dict(self.rope_scaling)  # a copy: HF edits it
        if self.model_type == "llama":
            d.update(attention_bias=self.attention_bias, mlp_bias=False)
        else:
            d.update(use_sliding_window=False)
        return d


class LlamaBlock(CausalBlock):
    """One Llama block: ``x + attn(norm_1(x))`` (causal, rotary, grouped-query) then ``x + ffn(norm_2(x))``.

    Attributes (the names of :class:`sublayer.nn.EncoderBlock`): ``self_attn``, ``ffn`` (gated, no biases),
    ``attn_residual``, ``ffn_residual`` (pre-norm residuals; ``.norm`` is an RMSNorm).

    Shape:
        x (B, T, d_model); key_padding_mask (B, T_k) True = padding, covering cached keys too; attn_mask as
        :func:`sublayer.functional.attention`; rotary ``(cos, sin)`` (B | 1, T, head_dim) -> (B, T, d_model).
    """

    def __init__(self, config: LlamaConfig, *, device=None, dtype=None) -> None:
        super().__init__()
        kw = {"device": device, "dtype": dtype}
        d = config.d_model
        self.attn_residual = PreNormResidual(d, norm="rms", eps=config.eps, **kw)
        self.self_attn = MultiHeadAttention(
            d, config.n_heads, n_kv_heads=config.kv_heads, head_dim=config.attention_head_dim,
            dropout=config.attn_dropout, bias=config.attention_bias, **kw,
        )  # fmt: skip
        if config.attention_bias and not config.out_bias:  # Qwen2: biases on q/k/v only
            self.self_attn.out_proj = nn.Linear(config.n_heads * config.attention_head_dim, d, bias=False, **kw)
        self.ffn_residual = PreNormResidual(d, norm="rms", eps=config.eps, **kw)
        self.ffn = PositionWiseFFN(d, config.d_ff, activation=config.activation, bias=False, **kw)


class Llama(CausalLM):
    """Llama-family language model (HF ``LlamaForCausalLM`` / ``Qwen2ForCausalLM`` math, fp32 logits equal to it).

    Args:
        config: a :class:`LlamaConfig`.
        device, dtype: factory kwargs.

    Forward:
        ``input_ids`` (B, T) ints; ``attention_mask`` (B, T) 1 = token, 0 = padding (HF convention), optional;
        ``position_ids`` (B, T) or (1, T) (the rotary positions), default ``arange(T)`` as HF's forward; positions
        that restart at 0 inside a row mark packed documents (HF's ``DataCollatorWithFlattening``): attention is
        block-diagonal causal, each document sees only itself.
        Returns logits (B, T, vocab_size), zeros at padded positions (every path); with padding or packed
        documents the layers run on the real tokens only (:mod:`sublayer.runtime.padding_free`). ``labels=``,
        ``return_dict=``, ``loss`` and ``generate``: :class:`~sublayer.models.causal_lm.CausalLM`.

    Raises:
        TypeError/ValueError: ids not integer (B, T) or out of the vocabulary, bad mask or positions.
    """

    config_class, keymap, embedding, final_norm = LlamaConfig, keymap, "embed_tokens", "norm"

    def __init__(self, config: LlamaConfig, *, device=None, dtype=None) -> None:
        super().__init__(config)
        kw = {"device": device, "dtype": dtype}
        self.embed_tokens = nn.Embedding(config.vocab_size, config.d_model, padding_idx=config.pad_token_id, **kw)
        self.rotary = RotaryEmbedding(config.attention_head_dim, theta=config.rope_theta, scaling=config.rope_scaling)
        self.blocks = nn.ModuleList([LlamaBlock(config, **kw) for _ in range(config.n_layers)])
        self.norm = RMSNorm(config.d_model, config.eps, **kw)
        self.lm_head = nn.Linear(config.d_model, config.vocab_size, bias=False, **kw)
        self._tie_weights()
        self.reset_parameters()

    def reset_parameters(self) -> None:
        """HF Llama's init: N(0, 0.02) weights, zero biases (and padding row), RMSNorm gains 1."""
        init_weights(self, 0.02)

    def _embed(self, input_ids: Tensor, position_ids: Tensor) -> tuple[Tensor, tuple[Tensor, Tensor]]:
        """Token embeddings and the rotary ``(cos, sin)`` of the positions."""
        x = self.embed_tokens(input_ids)
        return x, self.rotary(position_ids, dtype=x.dtype)

    def causal_parts(self) -> CausalParts:
        return CausalParts(embed=self.embed_tokens.weight, positions=None, rotary=self.rotary, norm=self.norm,
                           lm_head=self.lm_head)  # fmt: skip
