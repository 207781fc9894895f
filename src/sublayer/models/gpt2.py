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
import os
from typing import Any

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from .. import checkpoints as ckpt
from .. import functional as SF
from ..checkpoints import FROM_CONFIG
from ..functional.cross_entropy import check_options, check_targets
from .._checks import check_choice, check_eps, check_positive_int, check_probability
from ..checkpoints import gpt2 as keymap
from ..nn import LayerNorm, MultiHeadAttention, PositionWiseFFN, PreNormResidual
from . import padding_free
from .config import ModelConfig

__all__ = ["GPT2Config", "GPT2", "GPT2Block", "check_input_ids"]

# HF config fields that change the math; only these values are implemented.
_HF_FIXED = {
    "scale_attn_weights": True,
    "scale_attn_by_inverse_layer_idx": False,
    "reorder_and_upcast_attn": False,
    "add_cross_attention": False,
}


def _check_token_id(name: str, value: object, vocab_size: int, *, negative: bool = False) -> None:
    """None, or an int id in ``[0, vocab_size)`` (``negative``: also ``[-vocab_size, 0)``, counted from the end)."""
    if value is None:
        return
    low = -vocab_size if negative else 0
    if isinstance(value, bool) or not isinstance(value, int) or not low <= value < vocab_size:
        rule = f"[{low}, vocab_size={vocab_size})" if negative else f"[0, vocab_size={vocab_size})"
        raise ValueError(f"{name} must be None or an int in {rule}, got {value!r}")


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
            _check_token_id(name, value, self.vocab_size, negative=True)
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
        ref = cls()
        return cls(
            vocab_size=d.get("vocab_size", ref.vocab_size),
            max_positions=d.get("n_positions", ref.max_positions),
            d_model=d.get("n_embd", ref.d_model),
            n_layers=d.get("n_layer", ref.n_layers),
            n_heads=d.get("n_head", ref.n_heads),
            d_ff=d.get("n_inner"),
            activation=ckpt.hf_activation("activation_function", d.get("activation_function", "gelu_new")),
            eps=d.get("layer_norm_epsilon", ref.eps),
            dropout=d.get("resid_pdrop", ref.dropout),
            embd_dropout=d.get("embd_pdrop", ref.embd_dropout),
            attn_dropout=d.get("attn_pdrop", ref.attn_dropout),
            tie_word_embeddings=d.get("tie_word_embeddings", True),
            bos_token_id=d.get("bos_token_id", ref.bos_token_id),  # absent: HF's default, 50256
            eos_token_id=d.get("eos_token_id", ref.eos_token_id),
            pad_token_id=d.get("pad_token_id"),
        )

    def to_hf_dict(self) -> dict[str, Any]:
        """The Hugging Face ``config.json`` dict (``GPT2LMHeadModel``) for this config."""
        if self.activation not in ckpt.io.TO_HF_ACTIVATIONS:
            raise ValueError(f"activation {self.activation!r} has no Hugging Face GPT-2 equivalent")
        return {
            "model_type": "gpt2",
            "architectures": ["GPT2LMHeadModel"],
            "vocab_size": self.vocab_size,
            "n_positions": self.max_positions,
            "n_embd": self.d_model,
            "n_layer": self.n_layers,
            "n_head": self.n_heads,
            "n_inner": self.d_ff,
            "activation_function": ckpt.io.TO_HF_ACTIVATIONS[self.activation],
            "layer_norm_epsilon": self.eps,
            "resid_pdrop": self.dropout,
            "embd_pdrop": self.embd_dropout,
            "attn_pdrop": self.attn_dropout,
            "tie_word_embeddings": self.tie_word_embeddings,
            "bos_token_id": self.bos_token_id,
            "eos_token_id": self.eos_token_id,
            "pad_token_id": self.pad_token_id,
            **_HF_FIXED,
        }


def check_input_ids(
    name: str, ids: object, vocab_size: int, max_len: int | None = None, *, limit_name: str = "vocab_size"
) -> None:
    """``ids`` must be an int64/int32 tensor (B, T), T >= 1, values in [0, vocab_size), T <= max_len.
    ``limit_name`` names ``vocab_size`` in the error (``max_positions`` for position ids...)."""
    if not isinstance(ids, Tensor):
        raise TypeError(f"{name} must be a torch.Tensor of token ids, got {type(ids).__name__}")
    if ids.dtype not in (torch.int64, torch.int32):  # what embedding lookups take (uint8/bool would mask-index)
        raise TypeError(f"{name} must hold integer token ids, got dtype {ids.dtype} (int64 or int32: use .long())")
    if ids.dim() != 2 or ids.shape[1] == 0:
        raise ValueError(f"{name} must have shape (batch, seq_len) with seq_len >= 1, got {tuple(ids.shape)}")
    if max_len is not None and ids.shape[1] > max_len:
        raise ValueError(f"{name} has {ids.shape[1]} positions, more than max_positions={max_len}")
    # the value checks read the data: skipped while torch.compile traces (a fullgraph graph cannot branch on data)
    if ids.numel() and not torch.compiler.is_compiling() and (int(ids.min()) < 0 or int(ids.max()) >= vocab_size):
        raise ValueError(
            f"{name} must lie in [0, {limit_name}={vocab_size}), got values in [{int(ids.min())}, {int(ids.max())}]"
        )


def check_attention_mask(mask: object, shape: tuple[int, ...]) -> Tensor:
    """HF attention mask (1 = token, 0 = pad), (B, T) -> our key_padding_mask (True = pad)."""
    if not isinstance(mask, Tensor):
        raise TypeError(f"attention_mask must be a torch.Tensor, got {type(mask).__name__}")
    if tuple(mask.shape) != tuple(shape):
        raise ValueError(f"attention_mask must have the shape of input_ids {tuple(shape)}, got {tuple(mask.shape)}")
    if mask.numel() and not torch.compiler.is_compiling() and not bool(((mask == 0) | (mask == 1)).all()):
        raise ValueError("attention_mask must hold only 0 (padding) and 1 (token)")
    return mask == 0


class GPT2Block(nn.Module):
    """One GPT-2 block: ``x + drop(attn(ln_1(x)))`` (causal) then ``x + drop(ffn(ln_2(x)))``.

    Attributes (the names of :class:`sublayer.nn.EncoderBlock`): ``self_attn``, ``ffn``, ``attn_residual``,
    ``ffn_residual`` (pre-norm residuals; ``.norm`` is ln_1 / ln_2).

    Shape:
        x (B, T, d_model); key_padding_mask (B, T_k) True = padding, covering cached keys too -> (B, T, d_model).
    """

    def __init__(self, config: GPT2Config, *, device=None, dtype=None) -> None:
        super().__init__()
        kw = {"device": device, "dtype": dtype}
        d = config.d_model
        self.attn_residual = PreNormResidual(d, config.dropout, eps=config.eps, **kw)
        self.self_attn = MultiHeadAttention(d, config.n_heads, dropout=config.attn_dropout, **kw)
        self.ffn_residual = PreNormResidual(d, config.dropout, eps=config.eps, **kw)
        self.ffn = PositionWiseFFN(d, config.hidden_size, activation=config.activation, **kw)

    def forward(
        self, x: Tensor, *, key_padding_mask: Tensor | None = None, kv_cache: SF.KVCache | None = None
    ) -> Tensor:
        def attn(h: Tensor) -> Tensor:
            # is_causal is bottom-right aligned: a 1-token query after a cached prefix sees the whole prefix.
            return self.self_attn(h, key_padding_mask=key_padding_mask, is_causal=True, kv_cache=kv_cache)[0]

        x = self.attn_residual(x, attn)
        return self.ffn_residual(x, self.ffn)


class GPT2(nn.Module):
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
        Returns logits (B, T, vocab_size). When ``attention_mask`` marks padding, the layers run on the real
        tokens only (:mod:`sublayer.models.padding_free`) and the logits at padded positions are zeros.

    Raises:
        TypeError/ValueError: ids not integer (B, T), out of the vocabulary, longer than max_positions, bad mask.
    """

    def __init__(self, config: GPT2Config, *, device=None, dtype=None) -> None:
        super().__init__()
        if not isinstance(config, GPT2Config):
            raise TypeError(f"config must be a GPT2Config, got {type(config).__name__}")
        self.config = config
        # generate's defaults: config's special ids until from_pretrained reads a generation_config.json
        self.generation_config = ckpt.GenerationConfig.from_model_config(config)
        kw = {"device": device, "dtype": dtype}
        self.wte = nn.Embedding(config.vocab_size, config.d_model, **kw)
        self.wpe = nn.Embedding(config.max_positions, config.d_model, **kw)
        self.blocks = nn.ModuleList([GPT2Block(config, **kw) for _ in range(config.n_layers)])
        self.ln_f = LayerNorm(config.d_model, config.eps, **kw)
        self.lm_head = nn.Linear(config.d_model, config.vocab_size, bias=False, **kw)
        self._tie_weights()
        self.reset_parameters()

    def _tie_weights(self) -> None:
        if self.config.tie_word_embeddings:
            self.lm_head.weight = self.wte.weight

    def reset_parameters(self) -> None:
        """GPT-2's init: N(0, 0.02) weights, zero biases, residual output projections scaled by 1/sqrt(2·n_layers)."""
        std = 0.02
        for m in self.modules():
            if isinstance(m, (nn.Linear, nn.Embedding)):
                nn.init.normal_(m.weight, 0.0, std)
                if getattr(m, "bias", None) is not None:
                    nn.init.zeros_(m.bias)
            elif isinstance(m, LayerNorm):
                m.reset_parameters()
        for block in self.blocks:
            for lin in (block.self_attn.out_proj, block.ffn.fc2):
                nn.init.normal_(lin.weight, 0.0, std / math.sqrt(2 * self.config.n_layers))

    def _hidden(
        self,
        input_ids: Tensor,
        position_ids: Tensor,
        key_padding_mask: Tensor | None,
        caches: list[SF.KVCache] | None,
    ) -> Tensor:
        x = F.dropout(self.wte(input_ids) + self.wpe(position_ids), self.config.embd_dropout, self.training)
        for i, block in enumerate(self.blocks):
            x = block(x, key_padding_mask=key_padding_mask, kv_cache=None if caches is None else caches[i])
        return self.ln_f(x)

    def _position_ids(self, position_ids: Tensor | None, b: int, t: int, device) -> Tensor:
        """``position_ids`` checked ((B or 1, T), below max_positions), or ``arange(T)`` (1, T) when None."""
        if position_ids is None:
            return torch.arange(t, device=device)[None]
        check_input_ids("position_ids", position_ids, self.config.max_positions, limit_name="max_positions")
        if position_ids.shape[-1] != t or position_ids.shape[0] not in (1, b):
            raise ValueError(f"position_ids must have shape ({b} or 1, {t}), got {tuple(position_ids.shape)}")
        return position_ids

    def forward(
        self, input_ids: Tensor, *, attention_mask: Tensor | None = None, position_ids: Tensor | None = None
    ) -> Tensor:
        check_input_ids("input_ids", input_ids, self.config.vocab_size, self.config.max_positions)
        b, t = input_ids.shape
        kpm = None if attention_mask is None else check_attention_mask(attention_mask, (b, t))
        maybe_packed = kpm is not None or position_ids is not None  # arange positions: one document per row
        position_ids = self._position_ids(position_ids, b, t, input_ids.device)
        if maybe_packed and padding_free.gpt2_applies(self, kpm, position_ids):  # real tokens only; packed documents
            return padding_free.gpt2_logits(self, input_ids, position_ids, kpm)
        return self.lm_head(self._hidden(input_ids, position_ids, kpm, None))

    def loss(
        self,
        input_ids: Tensor,
        *,
        attention_mask: Tensor | None = None,
        labels: Tensor | None = None,
        ignore_index: int = -100,
        position_ids: Tensor | None = None,
    ) -> Tensor:
        """Mean next-token cross-entropy, equal to HF ``GPT2LMHeadModel(input_ids, attention_mask=...,
        labels=...).loss``; the LM head runs only at positions that have a target, as one fused linear +
        cross-entropy (:func:`sublayer.functional.linear_cross_entropy`): no (B, T, vocab) logits are kept.

        Args:
            input_ids: (B, T) ids. attention_mask: (B, T) 1 = token, 0 = padding (HF convention), optional.
            labels: (B, T) ids in [0, vocab_size) or ``ignore_index``; None -> ``input_ids`` with padding set
                to ``ignore_index``. Shifted inside as HF does: position t predicts ``labels[:, t + 1]``.
            ignore_index: label value that adds nothing to the loss.
            position_ids: as :meth:`forward` (restarts at 0 mark packed documents); pass labels with
                ``ignore_index`` at each document's first token so no document predicts the next one's start.

        Returns:
            0-dim tensor (float32; float64 for a float64 model): the mean over all (row, position) pairs that
            have a target.

        Raises:
            TypeError/ValueError: as :meth:`forward`; labels not integer, of another shape, or outside the
            vocabulary; no position with a target (T = 1, or every label ``ignore_index``): HF returns NaN there.
        """
        check_input_ids("input_ids", input_ids, self.config.vocab_size, self.config.max_positions)
        b, t = input_ids.shape
        kpm = None if attention_mask is None else check_attention_mask(attention_mask, (b, t))
        check_options(ignore_index)
        if labels is None:
            labels = input_ids if kpm is None else input_ids.masked_fill(kpm, ignore_index)
        else:
            check_targets("labels", labels, self.config.vocab_size, ignore_index)
            if labels.shape != input_ids.shape:
                raise ValueError(f"labels must have the shape of input_ids {(b, t)}, got {tuple(labels.shape)}")
        # HF: pad labels with ignore_index on the right, then shift left by one
        targets = torch.cat([labels[:, 1:], labels.new_full((b, 1), ignore_index)], dim=1)
        if not bool((targets != ignore_index).any()):
            raise ValueError(
                f"no position has a target (seq_len={t}, every shifted label is ignore_index={ignore_index}): the "
                "mean loss is undefined (HF returns nan)"
            )
        position_ids = self._position_ids(position_ids, b, t, input_ids.device)
        if padding_free.gpt2_applies(self, kpm, position_ids):  # hidden rows of the real tokens only
            h, packing = padding_free.gpt2_hidden(self, input_ids, position_ids, kpm)
            targets = packing.pack(targets)
        else:
            h = self._hidden(input_ids, position_ids, kpm, None).reshape(b * t, -1)
            targets = targets.reshape(-1)
        # grad_in_forward: the head's gradients are made in the forward pass (3 GEMMs, not 4), holding one
        # (vocab, d_model) weight gradient until backward instead of any logits: ~4 % of a training step here
        return SF.linear_cross_entropy(
            h, self.lm_head.weight, targets, bias=self.lm_head.bias, ignore_index=ignore_index, grad_in_forward=True
        )

    @torch.no_grad()
    def generate(
        self,
        input_ids: Tensor,
        max_new_tokens: int = FROM_CONFIG,
        *,
        temperature: float = FROM_CONFIG,
        top_k: int | None = FROM_CONFIG,
        top_p: float | None = FROM_CONFIG,
        do_sample: bool = FROM_CONFIG,
        eos_token_id: int | None = FROM_CONFIG,
        pad_token_id: int | None = FROM_CONFIG,
        attention_mask: Tensor | None = None,
        generator: torch.Generator | None = None,
    ) -> Tensor:
        """Continue ``input_ids`` token by token with a KV cache (greedy: the same tokens as HF ``generate``).

        Runs in eval mode (dropout off) without gradients and restores the training flag afterwards.

        The decoding options default to :data:`~sublayer.checkpoints.FROM_CONFIG`: the value of
        :attr:`generation_config` (a folder's ``generation_config.json``, else ``config``'s special ids), else HF's
        global default (:data:`sublayer.checkpoints.generation.DEFAULTS`), as HF's ``generate``. A value passed
        wins; ``None`` passed keeps its meaning (``eos_token_id=None``: no end token, ``top_k=None``: no top-k).

        Args:
            input_ids: (B, T) prompt ids. With ``attention_mask`` (1 = token, 0 = pad) prompts may be
                left-padded; positions then count real tokens only (as HF's ``generate``).
            max_new_tokens: tokens to add (>= 0); T + max_new_tokens <= max_positions. Default: the config's
                ``max_new_tokens``, else its ``max_length`` minus T, else 20 (at most ``max_positions - T``).
            temperature, top_k, top_p: sampling filters, applied in HF's order (temperature, top-k, top-p:
                keep the fewest most likely tokens whose probability sums to at least ``top_p``). HF's defaults:
                1.0, 50, 1.0.
            do_sample: sample from the filtered distribution; False (HF's default) -> greedy argmax (filters
                ignored).
            eos_token_id: a row that produced it is finished; later positions get ``pad_token_id`` (None ->
                ``eos_token_id``); decoding stops early once every row is finished. Default: the model's end token.
            generator: a ``torch.Generator`` for reproducible sampling.

        Returns:
            (B, T + n) ids: the prompt followed by n <= max_new_tokens new tokens.

        Raises:
            ValueError/TypeError: bad ids or mask, max_new_tokens < 0, too long, temperature <= 0,
            top_k < 1, top_p outside (0, 1], eos/pad ids outside the vocabulary (also those of
            ``generation_config``).
        """
        cfg = self.config
        check_input_ids("input_ids", input_ids, cfg.vocab_size, cfg.max_positions)
        gen = self.generation_config
        gen.check_vocab(cfg.vocab_size)
        max_new_tokens, temperature, top_k, top_p, do_sample, eos_token_id, pad_token_id = gen.resolve(
            input_ids.shape[1], cfg.max_positions, max_new_tokens=max_new_tokens, temperature=temperature, top_k=top_k, top_p=top_p,
            do_sample=do_sample, eos_token_id=eos_token_id, pad_token_id=pad_token_id,
        ).values()  # fmt: skip
        if isinstance(max_new_tokens, bool) or not isinstance(max_new_tokens, int) or max_new_tokens < 0:
            raise ValueError(f"max_new_tokens must be an int >= 0, got {max_new_tokens!r}")
        b, t = input_ids.shape
        if t + max_new_tokens > cfg.max_positions:
            raise ValueError(
                f"prompt length {t} + max_new_tokens {max_new_tokens} exceeds max_positions={cfg.max_positions}"
            )
        if isinstance(temperature, bool) or not isinstance(temperature, (int, float)) or not temperature > 0:
            raise ValueError(f"temperature must be a float > 0, got {temperature!r}")
        check_positive_int("top_k", top_k, allow_none=True)
        if top_p is not None and (isinstance(top_p, bool) or not isinstance(top_p, (int, float)) or not 0 < top_p <= 1):
            raise ValueError(f"top_p must be in (0, 1], got {top_p!r}")
        if not isinstance(do_sample, bool):
            raise TypeError(f"do_sample must be a bool, got {do_sample!r}")
        _check_token_id("eos_token_id", eos_token_id, cfg.vocab_size)
        _check_token_id("pad_token_id", pad_token_id, cfg.vocab_size)
        pad = eos_token_id if pad_token_id is None else pad_token_id

        device = input_ids.device
        if attention_mask is None:
            kpm = None
            positions = torch.arange(t, device=device)[None].expand(b, t)
        else:
            kpm = check_attention_mask(attention_mask, (b, t))
            positions = (attention_mask.long().cumsum(-1) - 1).masked_fill(kpm, 0)
            if bool(kpm.all(dim=1).any()):
                raise ValueError("attention_mask has a row with no token (all 0)")
        was_training = self.training
        self.eval()
        def pick(logits: Tensor) -> Tensor:  # (B, V) float32 -> (B,) next ids
            if do_sample:
                probs = _filtered_probs(logits, temperature, top_k, top_p)
                return torch.multinomial(probs, 1, generator=generator).squeeze(1)
            return logits.argmax(dim=-1)

        try:
            from . import decoding  # the fast decoding path, tested against the reference loop below

            source, weights = decoding.gpt2_source(self), None
            if source is None and hasattr(self, "decode_weights") and decoding.enabled():  # e.g. QuantizedGPT2
                source, weights = self, self.decode_weights()
            if source is not None:
                return decoding.gpt2_generate(
                    source, input_ids, positions, kpm if kpm is None or kpm.any() else None, max_new_tokens,
                    prefill=self._hidden, pick=pick, eos_token_id=eos_token_id, pad=pad, weights=weights,
                    greedy=not do_sample,
                )  # fmt: skip
            caches = [SF.KVCache() for _ in self.blocks]
            out = input_ids
            finished = torch.zeros(b, dtype=torch.bool, device=device)
            step_ids, step_pos = input_ids, positions
            for _ in range(max_new_tokens):
                h = self._hidden(step_ids, step_pos, kpm if kpm is None or kpm.any() else None, caches)
                nxt = pick(self.lm_head(h[:, -1]).float())
                if eos_token_id is not None:
                    nxt = torch.where(finished, torch.full_like(nxt, pad), nxt)
                    finished = finished | (nxt == eos_token_id)
                out = torch.cat([out, nxt[:, None]], dim=1)
                if eos_token_id is not None and bool(finished.all()):
                    break
                step_ids, step_pos = nxt[:, None], step_pos[:, -1:] + 1
                if kpm is not None:
                    kpm = torch.cat([kpm, torch.zeros(b, 1, dtype=torch.bool, device=device)], dim=1)
            return out
        finally:
            self.train(was_training)

    @classmethod
    def from_pretrained(cls, folder: str | os.PathLike, *, device=None, dtype=None) -> GPT2:
        """Load a Hugging Face GPT-2 folder (``config.json`` + ``model.safetensors`` or ``pytorch_model.bin``), in
        eval mode (as HF's ``from_pretrained``).

        Key names and layouts are mapped by :mod:`sublayer.checkpoints.gpt2`; loading is strict.

        Raises:
            FileNotFoundError: no folder, config or weights file. CheckpointError (a ValueError): bad JSON,
            unsupported config, unreadable file, or one message listing every missing/unexpected/wrong-shape key.
        """
        config, tensors, source = ckpt.read_hf_folder(folder, GPT2Config.from_hf_dict)
        model = cls(config, device="meta", dtype=dtype)  # no random init: every parameter is loaded below
        model.generation_config = ckpt.read_generation_config(folder, config.vocab_size) or model.generation_config
        n, tied = config.n_layers, config.tie_word_embeddings
        return ckpt.live.load_checked(
            model, tensors, source, canonical=lambda k: keymap.canonical(k, tied=tied), device=device,
            to_hf=lambda sd: keymap.to_hf(sd, n, tied=tied), from_hf=lambda sd: keymap.from_hf(sd, n, tied=tied),
            after_empty=model._tie_weights,  # to_empty makes new parameters: tie again
        ).eval()  # fmt: skip  (as HF's from_pretrained: dropout off until .train())

    @classmethod
    def from_hf(cls, model: nn.Module, *, device=None, dtype=None) -> GPT2:
        """Convert a live Hugging Face ``GPT2LMHeadModel`` (or ``GPT2Model``): same logits and gradients.

        Keys are mapped by :mod:`sublayer.checkpoints.gpt2` as for a folder, strictly; the copy lives on the HF
        model's device and dtype unless ``device``/``dtype`` say otherwise, in its train/eval mode.

        Raises:
            TypeError: not an HF model. CheckpointError (a ValueError): unsupported config, or one message listing
            every missing/unexpected/wrong-shape key.
        """
        config, tensors, source = ckpt.live.read_hf_model(model, GPT2Config.from_hf_dict)
        where, dtype0 = ckpt.live.placement(model)
        ours = cls(config, device="meta", dtype=dtype or dtype0)
        ours.generation_config = ckpt.generation.of_hf_model(model) or ours.generation_config
        n, tied = config.n_layers, config.tie_word_embeddings
        return ckpt.live.load_checked(
            ours, tensors, source, canonical=lambda k: keymap.canonical(k, tied=tied), device=device or where,
            to_hf=lambda sd: keymap.to_hf(sd, n, tied=tied), from_hf=lambda sd: keymap.from_hf(sd, n, tied=tied),
            after_empty=ours._tie_weights,
        ).train(model.training)  # fmt: skip

    def to_hf(self) -> nn.Module:
        """This model as a Hugging Face ``transformers.GPT2LMHeadModel`` (weights copied; same device, dtype,
        train/eval mode). Needs ``transformers``."""
        tensors = keymap.to_hf(self.state_dict(), self.config.n_layers, tied=self.config.tie_word_embeddings)
        tensors = {(k if k == "lm_head.weight" else keymap.PREFIX + k): v for k, v in tensors.items()}
        return ckpt.live.build_hf_model("GPT2LMHeadModel", self.config.to_hf_dict(), tensors, training=self.training)

    def save_pretrained(self, folder: str | os.PathLike) -> None:
        """Write ``model.safetensors``, ``config.json`` and ``generation_config.json`` (:attr:`generation_config`)
        that HF ``GPT2LMHeadModel.from_pretrained`` loads (keys with the ``transformer.`` prefix; a tied ``lm_head``
        is not written). Files are written under a temporary name and renamed."""
        tensors = keymap.to_hf(self.state_dict(), self.config.n_layers, tied=self.config.tie_word_embeddings)
        tensors = {(k if k == "lm_head.weight" else keymap.PREFIX + k): v for k, v in tensors.items()}
        ckpt.write_folder(folder, tensors, self.config.to_hf_dict())
        ckpt.write_generation_config(folder, self.generation_config)


def _filtered_probs(logits: Tensor, temperature: float, top_k: int | None, top_p: float | None) -> Tensor:
    """Sampling distribution (B, V) after temperature, top-k and top-p (nucleus) filtering."""
    logits = logits / temperature
    if top_k is not None and top_k < logits.shape[-1]:
        kth = logits.topk(top_k, dim=-1).values[..., -1:]
        logits = logits.masked_fill(logits < kth, float("-inf"))
    if top_p is not None and top_p < 1.0:
        sorted_logits, order = logits.sort(dim=-1, descending=True)
        p = sorted_logits.softmax(dim=-1)
        before = p.cumsum(dim=-1) - p  # probability mass of the more likely tokens
        drop = before >= top_p
        drop[..., 0] = False  # always keep the most likely token
        logits = logits.masked_fill(torch.zeros_like(drop).scatter(-1, order, drop), float("-inf"))
    return logits.softmax(dim=-1)
