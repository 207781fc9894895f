"""The encoder–decoder Transformer of "Attention Is All You Need", built from the sub-layers.

Token embeddings scaled by √d_model plus sinusoidal positional encodings, an encoder stack and a decoder stack
(:class:`sublayer.nn.TransformerEncoder` / :class:`sublayer.nn.TransformerDecoder`), and an output projection.
Decoding (greedy or beam search) runs incrementally with key/value caches. Checkpoints are a folder holding
``model.safetensors`` and ``config.json``; nothing is ever unpickled.
"""

from __future__ import annotations

import dataclasses
import math
from pathlib import Path

import torch
from torch import Tensor, nn

from .. import functional as SF
from ..functional.cross_entropy import check_options, check_targets
from ..checkpoints.io import CONFIG_NAME, SAFETENSORS_NAME, check_and_convert, folder_path, write_folder
from .._checks import check_choice, check_finite, check_positive_int, check_probability, check_tensor
from ..nn import DecoderBlock, EncoderBlock, TransformerDecoder, TransformerEncoder
from ..nn.hooks import hooked
from ..functional.packing import PackedBatch
from ..runtime import generation, padding_free
from ..runtime.rows import eval_mode
from .config import ModelConfig

__all__ = ["Transformer", "TransformerConfig", "sinusoidal_positional_encoding"]


@dataclasses.dataclass
class TransformerConfig(ModelConfig):
    """Sizes of a :class:`Transformer`. ``from_dict`` rejects unknown keys.

    Attributes:
        src_vocab_size, tgt_vocab_size: vocabulary sizes. d_model: model width. n_heads: attention heads
        (must divide d_model). d_ff: FFN hidden size. n_layers: blocks in each of the encoder and decoder.
        dropout: everywhere (embeddings, attention weights, FFN hidden, residual branches).
        max_len: longest source or target sequence (size of the positional-encoding table).
        norm_first: pre-norm blocks (with one final norm per stack) instead of the original post-norm.
        activation: FFN activation (see :class:`sublayer.nn.PositionWiseFFN`).
    """

    src_vocab_size: int
    tgt_vocab_size: int
    d_model: int = 512
    n_heads: int = 8
    d_ff: int = 2048
    n_layers: int = 6
    dropout: float = 0.1
    max_len: int = 512
    norm_first: bool = False
    activation: str = "relu"

    def validate(self) -> None:
        for name in ("src_vocab_size", "tgt_vocab_size", "d_model", "n_heads", "d_ff", "n_layers", "max_len"):
            check_positive_int(name, getattr(self, name))
        check_probability("dropout", self.dropout)
        check_choice("activation", self.activation, SF.ACTIVATIONS)
        if not isinstance(self.norm_first, bool):
            raise TypeError(f"norm_first must be a bool, got {self.norm_first!r}")
        if self.d_model % self.n_heads != 0:
            raise ValueError(f"d_model ({self.d_model}) must be divisible by n_heads ({self.n_heads})")


def sinusoidal_positional_encoding(max_len: int, d_model: int, *, dtype: torch.dtype = torch.float32) -> Tensor:
    """The sinusoidal table of Vaswani et al.: ``P[t, 2i] = sin(t / 10000^(2i/d))``, ``P[t, 2i+1] = cos(...)``.

    Returns:
        (max_len, d_model); an odd d_model drops the last cosine column.
    """
    check_positive_int("max_len", max_len)
    check_positive_int("d_model", d_model)
    pos = torch.arange(max_len, dtype=torch.float64)[:, None]
    freq = torch.exp(torch.arange(0, d_model, 2, dtype=torch.float64) * (-math.log(10000.0) / d_model))
    table = torch.zeros(max_len, d_model + d_model % 2, dtype=torch.float64)
    table[:, 0::2] = torch.sin(pos * freq)
    table[:, 1::2] = torch.cos(pos * freq)
    return table[:, :d_model].to(dtype)


def _check_tokens(name: str, x: object, vocab: int, max_len: int) -> None:
    check_tensor(name, x)
    if x.dim() != 2:
        raise ValueError(f"{name} must be 2-D token ids (batch, seq), got shape {tuple(x.shape)}")
    if x.dtype not in (torch.int64, torch.int32):  # what embedding lookups take
        raise TypeError(f"{name} must hold integer token ids, got dtype {x.dtype} (int64 or int32: use .long())")
    if x.shape[1] > max_len:
        raise ValueError(f"{name} length {x.shape[1]} exceeds max_len {max_len}")
    if x.numel() and not torch.compiler.is_compiling() and (int(x.min()) < 0 or int(x.max()) >= vocab):
        raise ValueError(f"{name} ids must lie in [0, {vocab}), got min {int(x.min())}, max {int(x.max())}")


def _check_padding_mask(name: str, mask: Tensor | None, tokens: Tensor, tokens_name: str) -> None:
    if mask is None:
        return
    check_tensor(name, mask)
    if mask.shape != tokens.shape:
        raise ValueError(f"{name} must have the shape of {tokens_name} {tuple(tokens.shape)}, got {tuple(mask.shape)}")
    if mask.dtype != torch.bool:
        raise TypeError(f"{name} must be bool (True = padding), got dtype {mask.dtype}")


class Transformer(nn.Module):
    """Encoder–decoder Transformer (Vaswani et al. 2017), post-norm by default.

    Args:
        src_vocab_size, tgt_vocab_size, d_model, n_heads, d_ff, n_layers, dropout, max_len, norm_first,
        activation: see :class:`TransformerConfig`.
        device, dtype: factory kwargs for the parameters.

    Attributes:
        config (:class:`TransformerConfig`), src_embed / tgt_embed (``nn.Embedding``), encoder
        (:class:`TransformerEncoder`), decoder (:class:`TransformerDecoder`), out_proj (``nn.Linear``),
        pos_encoding: (max_len, d_model) non-persistent buffer, rebuilt from float64 whenever the module moves or
            changes dtype (``.to``, ``to_empty``: it is not in the state dict).

    Shape:
        src (B, S) and tgt (B, T) integer ids; padding masks (B, S) / (B, T) bool, True = padding
        -> logits (B, T, tgt_vocab_size). Position t of the logits predicts target token t + 1.
        Memory and logits at padded positions are zeros (every path); when a mask marks padding (teacher
        forcing, no cache), the layers run on the real tokens only (:mod:`sublayer.runtime.padding_free`).

    Raises:
        ValueError/TypeError: bad sizes at construction; at call time, non-2-D or non-integer ids, ids out of
        range, sequences longer than max_len, masks of the wrong shape or dtype, batch mismatches, a ``decode``
        memory of another shape or dtype than the model's.
    """

    def __init__(
        self,
        src_vocab_size: int,
        tgt_vocab_size: int,
        *,
        d_model: int = 512,
        n_heads: int = 8,
        d_ff: int = 2048,
        n_layers: int = 6,
        dropout: float = 0.1,
        max_len: int = 512,
        norm_first: bool = False,
        activation: str = "relu",
        device: torch.device | str | None = None,
        dtype: torch.dtype | None = None,
    ) -> None:
        super().__init__()
        cfg = TransformerConfig(
            src_vocab_size=src_vocab_size, tgt_vocab_size=tgt_vocab_size, d_model=d_model, n_heads=n_heads,
            d_ff=d_ff, n_layers=n_layers, dropout=dropout, max_len=max_len, norm_first=norm_first,
            activation=activation,
        )  # fmt: skip
        self.config = cfg
        kw = {"device": device, "dtype": dtype}
        block = {"dropout": dropout, "activation": activation, "norm_first": norm_first, **kw}
        self.src_embed = nn.Embedding(src_vocab_size, d_model, **kw)
        self.tgt_embed = nn.Embedding(tgt_vocab_size, d_model, **kw)
        pe = sinusoidal_positional_encoding(max_len, d_model, dtype=dtype or torch.get_default_dtype())
        self.register_buffer("pos_encoding", pe.to(device), persistent=False)
        self.encoder = TransformerEncoder(EncoderBlock(d_model, n_heads, d_ff, **block), n_layers)
        self.decoder = TransformerDecoder(DecoderBlock(d_model, n_heads, d_ff, **block), n_layers)
        self.out_proj = nn.Linear(d_model, tgt_vocab_size, **kw)
        self.reset_embeddings()

    def _apply(self, fn, recurse=True):
        # the table is derived, not learned: rebuild it rather than carry a down-cast (or to_empty's unset) copy
        super()._apply(fn, recurse)
        pe = self.pos_encoding
        if pe.device.type != "meta":
            exact = sinusoidal_positional_encoding(self.config.max_len, self.config.d_model, dtype=torch.float64)
            self.pos_encoding = exact.to(device=pe.device, dtype=pe.dtype)
        return self

    def reset_embeddings(self) -> None:
        """Embeddings ~ N(0, 1/d_model): after the √d_model scale they are unit-variance, on the scale of the
        positional encodings (fairseq's choice; ``nn.Embedding``'s N(0, 1) would drown them)."""
        for emb in (self.src_embed, self.tgt_embed):
            nn.init.normal_(emb.weight, std=self.config.d_model**-0.5)

    @classmethod
    def from_config(cls, config: TransformerConfig, **factory) -> Transformer:
        """Build from a :class:`TransformerConfig` (``factory``: device=, dtype=)."""
        if not isinstance(config, TransformerConfig):
            raise TypeError(f"config must be a TransformerConfig, got {type(config).__name__}")
        return cls(**config.to_dict(), **factory)

    def _embed(self, emb: nn.Embedding, ids: Tensor, start: int = 0, positions: Tensor | None = None) -> Tensor:
        """(B, T) ids at positions ``start + arange(T)``, or packed ids (N,) at ``positions`` (N,) -> embeddings."""
        pe = self.pos_encoding[start : start + ids.shape[1]] if positions is None else self.pos_encoding[positions]
        x = emb(ids) * math.sqrt(self.config.d_model) + pe
        return nn.functional.dropout(x, self.config.dropout, self.training)

    def _packed_embed(self, emb: nn.Embedding, ids: Tensor, pk: PackedBatch) -> Tensor:
        return self._embed(emb, pk.pack(ids), positions=pk.pack(torch.arange(ids.shape[1], device=ids.device)[None]))

    def _check_source(self, src: Tensor, src_key_padding_mask: Tensor | None) -> None:
        _check_tokens("src", src, self.config.src_vocab_size, self.config.max_len)
        _check_padding_mask("src_key_padding_mask", src_key_padding_mask, src, "src")

    def encode(self, src: Tensor, *, src_key_padding_mask: Tensor | None = None) -> Tensor:
        """Encode source ids (B, S) -> memory (B, S, d_model)."""
        self._check_source(src, src_key_padding_mask)
        kpm = src_key_padding_mask
        if padding_free.applies(self, kpm):  # the same encoder on the real tokens; zeros at padding
            pk = PackedBatch(kpm)
            return pk.unpack(self.encoder(self._packed_embed(self.src_embed, src, pk), packing=pk))
        memory = self.encoder(self._embed(self.src_embed, src), key_padding_mask=kpm)
        return memory if kpm is None else memory.masked_fill(kpm[..., None], 0.0)

    def decode(
        self,
        tgt: Tensor,
        memory: Tensor,
        *,
        memory_key_padding_mask: Tensor | None = None,
        tgt_key_padding_mask: Tensor | None = None,
        caches: list[tuple[SF.KVCache, SF.KVCache]] | None = None,
    ) -> Tensor:
        """Decode target ids (B, T) against ``memory`` (B, S, d_model) -> logits (B, T, tgt_vocab_size).

        With ``caches`` (from ``self.decoder.new_caches()``), ``tgt`` holds only the new positions, which
        follow the ``len(caches[0][0])`` positions decoded before; ``tgt_key_padding_mask`` then covers the
        cached positions too.
        """
        c = self.config
        start = len(caches[0][0]) if caches else 0
        _check_tokens("tgt", tgt, c.tgt_vocab_size, c.max_len - start)
        check_tensor("memory", memory)
        if memory.dim() != 3 or memory.shape[0] != tgt.shape[0] or memory.shape[2] != c.d_model:
            raise ValueError(
                f"memory must have shape (batch={tgt.shape[0]}, src_len, d_model={c.d_model}), "
                f"got {tuple(memory.shape)}"
            )
        dt = torch.promote_types(self.tgt_embed.weight.dtype, self.pos_encoding.dtype)  # the decoder's queries'
        if memory.dtype != dt:
            raise TypeError(f"memory must have the model's dtype {dt}, got {memory.dtype}")
        if caches is None:
            _check_padding_mask("tgt_key_padding_mask", tgt_key_padding_mask, tgt, "tgt")
        mkpm = memory_key_padding_mask
        if mkpm is not None:  # bool or additive float (the padded path takes both)
            check_tensor("memory_key_padding_mask", mkpm)
            if tuple(mkpm.shape) != tuple(memory.shape[:2]):
                raise ValueError(
                    f"memory_key_padding_mask must have shape (batch, src_len) = {tuple(memory.shape[:2])}, "
                    f"got {tuple(mkpm.shape)}"
                )
        if caches is None and (mkpm is None or mkpm.dtype == torch.bool):
            packed = self._packed_decode(tgt, memory, mkpm, tgt_key_padding_mask)
            if packed is not None:  # the same decoder on the real tokens of target and memory
                h, pk = packed
                return pk.unpack(self.out_proj(h))
        logits = self.out_proj(self._padded_decode(tgt, memory, tgt_key_padding_mask, mkpm, caches, start))
        tkpm = tgt_key_padding_mask if caches is None else None  # bool (checked above); caches: no zeroing
        return logits if tkpm is None else logits.masked_fill(tkpm[..., None], 0.0)

    def _padded_decode(self, tgt: Tensor, memory: Tensor, tkpm: Tensor | None, mkpm: Tensor | None,
                       caches: list | None = None, start: int = 0) -> Tensor:  # fmt: skip
        """The decoder's hidden states (B, T, d_model) on the padded layout (``start``: positions already cached)."""
        return self.decoder(self._embed(self.tgt_embed, tgt, start), memory, tgt_key_padding_mask=tkpm,
                            memory_key_padding_mask=mkpm, caches=caches)  # fmt: skip

    def _packed_decode(
        self, tgt: Tensor, memory: Tensor, mkpm: Tensor | None, tkpm: Tensor | None
    ) -> tuple[Tensor, PackedBatch] | None:
        """``(h (N, d_model), target descriptor)``: the decoder on the real tokens of target and memory, or None
        where the padded path runs."""
        if not padding_free.applies(self, mkpm, tkpm):  # (mkpm's shape: checked by decode, or encode for loss)
            return None
        pk_t = PackedBatch(tkpm, batch=tgt.shape[0], seq_len=tgt.shape[1])
        pk_m = PackedBatch(mkpm, batch=memory.shape[0], seq_len=memory.shape[1])
        x = self._packed_embed(self.tgt_embed, tgt, pk_t)
        return self.decoder(x, pk_m.pack(memory), packing=pk_t, memory_packing=pk_m), pk_t

    def forward(
        self,
        src: Tensor,
        tgt: Tensor,
        *,
        src_key_padding_mask: Tensor | None = None,
        tgt_key_padding_mask: Tensor | None = None,
    ) -> Tensor:
        """Teacher-forced logits: src (B, S), tgt (B, T) -> (B, T, tgt_vocab_size); causal inside."""
        check_tensor("src", src)
        check_tensor("tgt", tgt)
        if src.dim() == 2 and tgt.dim() == 2 and src.shape[0] != tgt.shape[0]:
            raise ValueError(f"src and tgt must share the batch size, got {tuple(src.shape)} and {tuple(tgt.shape)}")
        memory = self.encode(src, src_key_padding_mask=src_key_padding_mask)
        return self.decode(
            tgt, memory, memory_key_padding_mask=src_key_padding_mask, tgt_key_padding_mask=tgt_key_padding_mask
        )

    def loss(
        self,
        src: Tensor,
        tgt_in: Tensor,
        tgt_out: Tensor,
        *,
        src_key_padding_mask: Tensor | None = None,
        tgt_key_padding_mask: Tensor | None = None,
        label_smoothing: float = 0.0,
        ignore_index: int = -100,
        reduction: str = "mean",
    ) -> Tensor:
        """Teacher-forced cross-entropy of ``tgt_out`` given ``src`` and ``tgt_in``, without a (B, T, vocab) logits
        tensor: the output projection and the loss run as one fused, chunked op
        (:func:`sublayer.functional.linear_cross_entropy`) on the positions that have a target only. While
        ``out_proj`` has a hook, it is called itself on the padded layout (as :meth:`forward` calls it).

        Equals ``F.cross_entropy(self(src, tgt_in, src_key_padding_mask=..., tgt_key_padding_mask=...)
        .flatten(0, 1), tgt_out.flatten(), ignore_index=ignore_index, label_smoothing=label_smoothing,
        reduction=reduction)`` with ``tgt_out`` set to ``ignore_index`` where ``tgt_key_padding_mask`` is True.

        Args:
            src: (B, S) source ids. tgt_in: (B, T) decoder input ids (bos + target).
            tgt_out: (B, T) ids the positions predict (target + eos), or ``ignore_index``.
            src_key_padding_mask, tgt_key_padding_mask: (B, S) / (B, T) bool, True = padding; padded target
                positions add nothing to the loss.
            label_smoothing: ε in [0, 1] (torch's definition). reduction: ``"mean"`` over targets or ``"sum"``.

        Returns:
            0-dim tensor (float32 for float32 / bfloat16 models).

        Raises:
            ValueError/TypeError: as :meth:`forward`; ``tgt_out`` not integer, of another shape than ``tgt_in``,
            or outside the target vocabulary; bad ``label_smoothing`` / ``reduction``; ``reduction="mean"``
            with no target left (torch returns nan there).
        """
        check_tensor("tgt_in", tgt_in)
        check_tensor("tgt_out", tgt_out)
        check_options(ignore_index, label_smoothing, reduction)
        c = self.config
        _check_tokens("tgt_in", tgt_in, c.tgt_vocab_size, c.max_len)
        if tgt_out.shape != tgt_in.shape:
            raise ValueError(f"tgt_out must have the shape of tgt_in {tuple(tgt_in.shape)}, got {tuple(tgt_out.shape)}")
        check_targets("tgt_out", tgt_out, c.tgt_vocab_size, ignore_index)
        tgt_out = tgt_out.long()  # ignore_index written at padding must not wrap to a narrow dtype's value
        check_tensor("src", src)
        if src.dim() == 2 and src.shape[0] != tgt_in.shape[0]:
            raise ValueError(
                f"src and tgt_in must share the batch size, got {tuple(src.shape)} and {tuple(tgt_in.shape)}"
            )
        _check_padding_mask("tgt_key_padding_mask", tgt_key_padding_mask, tgt_in, "tgt_in")
        targets = tgt_out if tgt_key_padding_mask is None else tgt_out.masked_fill(tgt_key_padding_mask, ignore_index)
        if reduction == "mean" and not bool((targets != ignore_index).any()):
            raise ValueError(
                f"no target position (every tgt_out is ignore_index={ignore_index} or padding): the mean loss is "
                "undefined (torch returns nan); use reduction='sum' or give at least one target"
            )
        memory = self.encode(src, src_key_padding_mask=src_key_padding_mask)
        packed = self._packed_decode(tgt_in, memory, src_key_padding_mask, tgt_key_padding_mask)
        if packed is not None:  # padded target positions have no target: only the real ones run
            h, pk = packed
            targets = pk.pack(targets)
        else:
            h = self._padded_decode(tgt_in, memory, tgt_key_padding_mask, src_key_padding_mask)
        if hooked(self.out_proj, backward=True):  # the head's own forward (padded layout: the hook rule), as forward
            logits = self.out_proj(h)
            logits = logits.to(torch.float64 if logits.dtype == torch.float64 else torch.float32)
            return nn.functional.cross_entropy(
                logits.reshape(-1, logits.shape[-1]), targets.reshape(-1), ignore_index=ignore_index,
                label_smoothing=label_smoothing, reduction=reduction,
            )  # fmt: skip
        return SF.linear_cross_entropy(
            h.reshape(-1, h.shape[-1]), self.out_proj.weight, targets.reshape(-1), bias=self.out_proj.bias,
            ignore_index=ignore_index, label_smoothing=label_smoothing, reduction=reduction, grad_in_forward=True,
        )  # fmt: skip  (grad_in_forward: 3 GEMMs instead of 4, as GPT2.loss)

    def cross_attention_weights(
        self, src: Tensor, tgt: Tensor, *, src_key_padding_mask: Tensor | None = None
    ) -> list[Tensor]:
        """Per-head cross-attention weights of a teacher-forced pass: one (B, n_heads, T, S) tensor per decoder
        layer (rows: target positions, columns: source positions). Runs without gradients."""
        weights: list[Tensor] = []

        def hook(module, args, kwargs, output):
            kw = {**kwargs, "need_weights": True, "average_attn_weights": False}
            weights.append(module.forward(*args, **kw)[1])  # .forward: no hooks, no recursion

        handles = [layer.cross_attn.register_forward_hook(hook, with_kwargs=True) for layer in self.decoder.layers]
        try:
            with torch.no_grad(), padding_free.disabled():  # the hooks need the modules' own forwards
                self(src, tgt, src_key_padding_mask=src_key_padding_mask)
        finally:
            for h in handles:
                h.remove()
        return weights

    @torch.no_grad()
    def translate(
        self,
        src: Tensor,
        max_len: int,
        *,
        bos: int,
        eos: int,
        src_key_padding_mask: Tensor | None = None,
        beam_size: int = 1,
        pad: int | None = None,
        length_penalty: float = 1.0,
    ) -> Tensor:
        """Decode greedily (``beam_size=1``) or with beam search, with key/value caches; runs in eval mode
        (restoring the previous mode after).

        Args:
            src: (B, S) source ids. max_len: most tokens to generate (eos included).
            bos, eos: begin / end of sequence target ids. src_key_padding_mask: (B, S) True = padding.
            beam_size: beams per sentence. pad: id written after a row's eos (default: eos).
            length_penalty: a finite float; beam search ranks finished hypotheses by
                ``logprob / length**length_penalty``.

        Returns:
            (B, L) generated ids without ``bos``, L ≤ max_len; each row ends at its first ``eos`` (kept) and is
            filled with ``pad`` after it. An empty batch (B = 0) gives (0, max_len).
        """
        c = self.config
        check_positive_int("max_len", max_len)
        check_positive_int("beam_size", beam_size)
        check_finite("length_penalty", length_penalty)
        if max_len > c.max_len:
            raise ValueError(f"max_len ({max_len}) exceeds the model's max_len ({c.max_len})")
        pad = eos if pad is None else pad  # checked as eos first
        for name, v in (("bos", bos), ("eos", eos), ("pad", pad)):
            if isinstance(v, bool) or not isinstance(v, int) or not 0 <= v < c.tgt_vocab_size:
                raise ValueError(f"{name} must be a target id in [0, {c.tgt_vocab_size}), got {v!r}")
        with eval_mode(self):
            from . import decoding, fast_encode  # the fast paths, tested against encode and the reference steps

            self._check_source(src, src_key_padding_mask)
            if src.shape[0] == 0:  # an empty batch at the full length
                return torch.empty(0, max_len, dtype=torch.long, device=self.out_proj.weight.device)
            with generation.fitted_threads():
                memory = fast_encode.encode(self, src, src_key_padding_mask) if decoding.enabled() else None
                if memory is None:
                    memory = self.encode(src, src_key_padding_mask=src_key_padding_mask)
                mask = src_key_padding_mask
                steps = decoding.transformer_stepper(self, memory, mask, max_len, beams=beam_size)
                if steps is None:
                    if beam_size > 1:  # every sentence's memory repeated for its k beams: row i*k + j is beam j of i
                        memory = memory.repeat_interleave(beam_size, dim=0)
                        mask = None if mask is None else mask.repeat_interleave(beam_size, dim=0)
                    steps = self._reference_steps(memory, mask)
                dev = self.out_proj.weight.device
                if beam_size == 1:
                    return generation.greedy_search(steps, src.shape[0], max_len, bos, eos, pad, dev)
                return generation.beam_search(
                    steps, src.shape[0], max_len, bos, eos, pad, beam_size, length_penalty, dev
                )

    def _reference_steps(self, memory, mask):
        """``(step, reorder)``: step(tok (N, 1)) -> next-token logits (N, V) through :meth:`decode` with KV caches;
        reorder(rows) keeps the given batch rows of the caches (beam search), and of the memory and its mask when
        the batch shrinks (greedy rows that ended)."""
        caches = self.decoder.new_caches()

        def step(tok: Tensor) -> Tensor:
            return self.decode(tok, memory, memory_key_padding_mask=mask, caches=caches)[:, -1]

        def reorder(rows: Tensor) -> None:
            nonlocal memory, mask
            shrink = rows.numel() != memory.shape[0]  # beams are permuted within their sentence: same memory
            for sc, cc in caches:
                sc.reorder(rows)
                if shrink:
                    cc.reorder(rows)
            if shrink:
                memory = memory.index_select(0, rows)
                mask = None if mask is None else mask.index_select(0, rows)

        return step, reorder

    # ---- checkpoints ----------------------------------------------------------------------------------------

    def save_pretrained(self, folder: str | Path) -> None:
        """Write ``model.safetensors`` and ``config.json`` to ``folder`` (created if needed), each atomically."""
        write_folder(folder, self.state_dict(), self.config.to_dict())

    @classmethod
    def from_pretrained(cls, folder: str | Path, **factory) -> Transformer:
        """Load a folder written by :meth:`save_pretrained` (strict: every key present, none extra, shapes
        equal; one error lists all problems), in eval mode. ``factory``: device=, dtype=.

        Raises:
            FileNotFoundError: missing folder or file (named). ValueError: bad config, unreadable weights;
            :class:`~sublayer.checkpoints.CheckpointError` (a ValueError): key/shape mismatches, all in one message.
            TypeError: ``folder`` is not a str or an ``os.PathLike``.
        """
        from safetensors.torch import load_file

        folder = folder_path(folder)
        if not folder.is_dir():
            raise FileNotFoundError(f"checkpoint folder not found: {folder}")
        config = TransformerConfig.load(folder / CONFIG_NAME)
        path = folder / SAFETENSORS_NAME
        if not path.is_file():
            raise FileNotFoundError(f"weights file not found: {path}")
        try:
            state = load_file(str(path))
        except Exception as e:  # safetensors raises its own error types for truncated/corrupt files
            raise ValueError(f"cannot read weights file {path}: {e}") from None
        model = cls.from_config(config, **factory)
        shapes = {k: tuple(v.shape) for k, v in model.state_dict().items()}
        model.load_state_dict(check_and_convert(state, shapes, canonical=lambda k: k, source=path))
        return model.eval()  # as HF's from_pretrained: dropout off until .train()
