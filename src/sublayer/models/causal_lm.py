"""What every causal language model shares (GPT-2, the Llama family): inputs, forward, loss and generate, written
once over the model's own embedding and blocks (read top to bottom in the model's file).

A model subclasses :class:`CausalLM`, names its ``config_class``, key map (``keymap``, a module of
:mod:`sublayer.checkpoints`), token embedding and final norm (``embedding``, ``final_norm``: attribute names),
and defines ``config`` (``vocab_size``, optional ``max_positions``), ``blocks`` (:class:`CausalBlock` s of the
standard sub-layers), ``lm_head``, ``causal_parts()`` (its embedding, position table or rotary module, final norm
and head: :class:`sublayer.runtime.causal.CausalParts`) and ``_embed(input_ids, position_ids)`` -> (embeddings,
rotary ``(cos, sin)`` or None), read by :meth:`CausalLM._hidden`. It then gets Hugging Face folders and models
in and out (``from_pretrained``, ``from_hf``, ``to_hf``, ``save_pretrained``), padding-free training and
inference on padded batches and packed documents (:mod:`sublayer.runtime.padding_free`), the fused LM-head loss
with HF's ``labels=`` meaning, and generation through the fast decoding step, ``fast_inference`` and int8
(:mod:`sublayer.runtime.causal`), with no engine code of its own.
"""

from __future__ import annotations

import os

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from .. import functional as SF
from .._checks import check_attention_mask, check_input_ids
from ..functional.cross_entropy import check_options, check_targets
from ..functional.packing import PackedBatch, document_mask
from ..nn.hooks import hooked
from .. import checkpoints as ckpt
from ..checkpoints import FROM_CONFIG
from ..runtime import causal, generation, padding_free
from ..runtime.rows import InferenceOnly, eval_mode, inference
from .outputs import CausalLMOutput

__all__ = [
    "CausalBlock", "CausalLM", "PreparedCausalLM", "generate_with_config", "check_inputs", "shifted_targets",
]  # fmt: skip


class CausalBlock(nn.Module):
    """A pre-norm causal block, ``x + drop(attn(norm_1(x)))`` then ``x + drop(ffn(norm_2(x)))``; a model's block
    subclasses it and builds ``attn_residual``, ``self_attn``, ``ffn_residual``, ``ffn`` (the names of
    :class:`sublayer.nn.EncoderBlock`).

    Shape:
        x (B, T, d_model); key_padding_mask (B, T_k) True = padding, covering cached keys too; attn_mask (B|1, 1,
        T, T_k) bool True = masked (other documents); rotary ``(cos, sin)`` (B | 1, T, head_dim) or None
        -> (B, T, d_model). With ``packing`` (:class:`sublayer.functional.packing.PackedBatch`): packed rows
        (N, d_model) -> (N, d_model), rotary (N, head_dim).
    """

    def forward(
        self,
        x: Tensor,
        *,
        key_padding_mask: Tensor | None = None,
        attn_mask: Tensor | None = None,
        kv_cache: SF.KVCache | None = None,
        packing: PackedBatch | None = None,
        rotary: tuple[Tensor, Tensor] | None = None,
    ) -> Tensor:
        def attn(h: Tensor) -> Tensor:
            # is_causal is bottom-right aligned: a 1-token query after a cached prefix sees the whole prefix.
            return self.self_attn(
                h, key_padding_mask=key_padding_mask, attn_mask=attn_mask, is_causal=True, kv_cache=kv_cache,
                rotary=rotary, packing=packing,
            )[0]  # fmt: skip

        x = self.attn_residual(x, attn)
        return self.ffn_residual(x, self.ffn)


class _Decoding:
    """What :func:`sublayer.runtime.generation.generate` reads beside ``lm_head`` and ``fast_decoder`` (its
    ``CausalLM`` protocol), over ``_hidden`` and ``config.n_layers``: the models' and their prepared forms'."""

    def hidden_states(
        self, input_ids: Tensor, position_ids: Tensor, key_padding_mask: Tensor | None, caches: list | None
    ) -> Tensor:
        """Final hidden states (B, T, d_model) of ids at positions; ``caches`` (one KVCache per block) extended."""
        return self._hidden(input_ids, position_ids, key_padding_mask, caches)

    def new_caches(self) -> list[SF.KVCache]:
        """One empty KV cache per block."""
        return [SF.KVCache() for _ in range(self.config.n_layers)]


class CausalLM(_Decoding, nn.Module):
    """Base of the causal language models: see the module docstring."""

    config_class: type  # set by each model: its config class, key map, token embedding's and final norm's attributes
    keymap = None
    embedding = final_norm = ""

    def __init__(self, config=None) -> None:
        super().__init__()
        if not hasattr(self, "config_class"):  # a model that sets its own ``config`` and ``generation_config``
            return
        if not isinstance(config, self.config_class):
            raise TypeError(f"config must be a {self.config_class.__name__}, got {type(config).__name__}")
        self.config = config
        # generate's defaults: config's special ids until from_pretrained reads a generation_config.json
        self.generation_config = ckpt.GenerationConfig.from_model_config(config)

    def _tie_weights(self) -> None:
        if self.config.tie_word_embeddings:
            self.lm_head.weight = getattr(self, self.embedding).weight

    def _hidden(self, input_ids: Tensor, position_ids: Tensor, key_padding_mask: Tensor | None, caches: list | None,
                *, packing: PackedBatch | None = None, documents: bool = True) -> Tensor:  # fmt: skip
        """Final hidden states (final norm applied): (B, T, d_model), or (N, d_model) for rows packed by ``packing``
        (``input_ids`` and ``position_ids`` (N,) then). Packed documents (``position_ids`` restarting at 0, looked
        for when ``documents``) attend block-diagonally in both layouts; with ``caches`` the blocks read and extend
        them (decoding: ``key_padding_mask`` covers the cached keys)."""
        x, rotary = self._embed(input_ids, position_ids)
        docs = document_mask(position_ids) if documents and packing is None and caches is None else None
        for i, block in enumerate(self.blocks):
            cache = None if caches is None else caches[i]
            x = block(x, rotary=rotary, key_padding_mask=key_padding_mask, attn_mask=docs, kv_cache=cache,
                      packing=packing)
        return getattr(self, self.final_norm)(x)

    # ---- checkpoints: the model's key map between its state dict and Hugging Face's names -------------------

    def _load(self, tensors: dict[str, Tensor], source: object, device):
        n, tied, keymap = self.config.n_layers, self.config.tie_word_embeddings, self.keymap
        return ckpt.live.load_checked(
            self, tensors, str(source), canonical=lambda k: keymap.canonical(k, tied=tied), device=device,
            to_hf=lambda sd: keymap.to_hf(sd, n, tied=tied), from_hf=lambda sd: keymap.from_hf(sd, n, tied=tied),
            after_empty=self._tie_weights,  # to_empty makes new parameters: tie again
        )  # fmt: skip

    def _hf_tensors(self) -> dict[str, Tensor]:
        tensors = self.keymap.to_hf(self.state_dict(), self.config.n_layers, tied=self.config.tie_word_embeddings)
        return {(k if k == "lm_head.weight" else self.keymap.PREFIX + k): v for k, v in tensors.items()}

    @classmethod
    def from_pretrained(cls, folder: str | os.PathLike, *, device=None, dtype=None):
        """Load a Hugging Face folder of the model's family (``config.json`` + ``model.safetensors``, a sharded
        ``model.safetensors.index.json`` or ``pytorch_model.bin``; ``generation_config.json`` when present), in
        eval mode (as HF's ``from_pretrained``).

        Key names and layouts are mapped by the model's key map (:mod:`sublayer.checkpoints.gpt2`,
        :mod:`sublayer.checkpoints.llama`); loading is strict.

        Raises:
            FileNotFoundError: no folder, config or weights file. CheckpointError (a ValueError): bad JSON,
            unsupported config (naming the key and value), unreadable file, or one message listing every
            missing/unexpected/wrong-shape key.
        """
        config, tensors, source = ckpt.read_hf_folder(folder, cls.config_class.from_hf_dict)
        model = cls(config, device="meta", dtype=dtype)  # no random init: every parameter is loaded
        model.generation_config = ckpt.read_generation_config(folder, config.vocab_size) or model.generation_config
        return model._load(tensors, source, device).eval()  # as HF's from_pretrained: dropout off until .train()

    @classmethod
    def from_hf(cls, model: nn.Module, *, device=None, dtype=None):
        """Convert a live Hugging Face model of the family (``GPT2LMHeadModel`` or ``GPT2Model``;
        ``LlamaForCausalLM`` / ``Qwen2ForCausalLM``, or a base ``LlamaModel`` / ``Qwen2Model`` with tied
        embeddings): same logits and gradients. Keys are mapped as for a folder, strictly; the copy lives on the HF
        model's device and dtype unless ``device``/``dtype`` say otherwise, in its train/eval mode; its
        ``generation_config`` is the HF model's.

        Raises:
            TypeError: not an HF model. CheckpointError (a ValueError): unsupported config, or one message listing
            every missing/unexpected/wrong-shape key.
        """
        config, tensors, source = ckpt.live.read_hf_model(model, cls.config_class.from_hf_dict)
        where, dtype0 = ckpt.live.placement(model)
        ours = cls(config, device="meta", dtype=dtype or dtype0)
        ours.generation_config = ckpt.generation.of_hf_model(model) or ours.generation_config
        return ours._load(tensors, source, device or where).train(model.training)

    def to_hf(self) -> nn.Module:
        """This model as its Hugging Face class (``GPT2LMHeadModel``, ``LlamaForCausalLM`` / ``Qwen2ForCausalLM``:
        the config's ``architectures``), weights copied; same device, dtype, train/eval mode. Needs
        ``transformers``."""
        d = self.config.to_hf_dict()
        return ckpt.live.build_hf_model(d["architectures"][0], d, self._hf_tensors(), training=self.training)

    def save_pretrained(self, folder: str | os.PathLike) -> None:
        """Write ``model.safetensors``, ``config.json`` and ``generation_config.json`` (:attr:`generation_config`)
        that the Hugging Face class's ``from_pretrained`` loads (keys with its prefix, ``transformer.`` or
        ``model.``; a tied ``lm_head`` is not written). Files are written under a temporary name and renamed."""
        ckpt.write_folder(folder, self._hf_tensors(), self.config.to_hf_dict())
        ckpt.write_generation_config(folder, self.generation_config)

    def causal_parts(self) -> causal.CausalParts:
        """The model-level parts the decoding engine reads (:class:`sublayer.runtime.causal.CausalParts`)."""
        raise NotImplementedError

    def fast_decoder(self):
        """The fast decoding loop of :func:`sublayer.runtime.generation.generate` over this model's packed
        weights, or None (the reference loop: switched off, not float32 or bfloat16 CPU, hooks, sharded)."""
        return causal.decoder(self)

    def _packed_hidden(
        self, input_ids: Tensor, position_ids: Tensor, kpm: Tensor | None, run: Tensor | None = None
    ) -> tuple[Tensor, PackedBatch] | None:
        """``(h (N, d_model), descriptor)`` on the padding-free path, or None where the padded path runs (no
        padding and one document per row, the path switched off, hooks, a sharded model). ``run``: (B, T) bool
        positions to compute (default: the real tokens)."""
        b, t = input_ids.shape
        if not padding_free.applies(self, kpm, position_ids[:, 1:] == 0):  # padding, or a document starts inside
            return None
        pk = PackedBatch(kpm, rows=run, position_ids=position_ids, batch=b, seq_len=t)
        return self._hidden(pk.pack(input_ids), pk.pack(position_ids), None, None, packing=pk), pk

    def forward(
        self,
        input_ids: Tensor,
        *,
        attention_mask: Tensor | None = None,
        position_ids: Tensor | None = None,
        labels: Tensor | None = None,
        return_dict: bool = False,
    ) -> Tensor | CausalLMOutput:
        """Logits (B, T, vocab_size) (see the model's class docstring for the inputs).

        Args:
            labels: (B, T) ids or -100, as HF's ``labels=``: the output is then a :class:`CausalLMOutput` whose
                ``loss`` is :meth:`loss` (fused LM head + cross-entropy: ``logits`` stay None, none are built);
                ``out[0]`` is the loss, as HF's tuple.
            return_dict: a :class:`CausalLMOutput` (``.logits``) instead of the logits tensor.
        """
        if labels is not None:
            return CausalLMOutput(
                loss=self.loss(input_ids, attention_mask=attention_mask, labels=labels, position_ids=position_ids)
            )
        logits = self._logits(input_ids, attention_mask, position_ids)
        return CausalLMOutput(logits=logits) if return_dict else logits

    def _logits(self, input_ids: Tensor, attention_mask: Tensor | None, position_ids: Tensor | None) -> Tensor:
        _, _, kpm, pos = check_inputs(self.config, input_ids, attention_mask, position_ids)
        if kpm is None and position_ids is None:  # no padding, one document per row: nothing that reads the data
            return self.lm_head(self._hidden(input_ids, pos, None, None, documents=False))
        packed = self._packed_hidden(input_ids, pos, kpm)  # real tokens only; packed documents
        if packed is not None:
            h, pk = packed
            return pk.unpack(self.lm_head(h))
        kpm = kpm if kpm is not None and bool(kpm.any()) else None
        logits = self.lm_head(self._hidden(input_ids, pos, kpm, None))
        return logits if kpm is None else logits.masked_fill(kpm[..., None], 0.0)

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
        cross-entropy (:func:`sublayer.functional.linear_cross_entropy`): no (B, T, vocab) logits are kept. While
        ``lm_head`` has a hook, it is called itself on the padded layout (as :meth:`forward` calls it).

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
        b, t, kpm, position_ids = check_inputs(self.config, input_ids, attention_mask, position_ids)
        targets = shifted_targets(self.config, input_ids, labels, kpm, ignore_index)
        # every position with a target runs, padding or not (the last left pad predicts the first token)
        run = None if kpm is None else ~kpm | (targets != ignore_index)
        head_hooked = hooked(self.lm_head, backward=True)
        packed = None if head_hooked else self._packed_hidden(input_ids, position_ids, kpm, run)
        if packed is not None:
            h, pk = packed
            targets = pk.pack(targets)
        else:
            kpm = kpm if kpm is not None and bool(kpm.any()) else None
            h = self._hidden(input_ids, position_ids, kpm, None).reshape(b * t, -1)
            targets = targets.reshape(-1)
        if head_hooked:  # the head's own forward on the padded layout (the hook rule), as forward calls it
            logits = self.lm_head(h.reshape(b, t, -1))
            logits = logits.to(torch.float64 if logits.dtype == torch.float64 else torch.float32)
            return F.cross_entropy(logits.reshape(b * t, -1), targets, ignore_index=ignore_index)
        # grad_in_forward: the head's gradients are made in the forward pass (3 GEMMs, not 4), holding one
        # (vocab, d_model) weight gradient until backward instead of any logits
        return SF.linear_cross_entropy(
            h, self.lm_head.weight, targets, bias=self.lm_head.bias, ignore_index=ignore_index, grad_in_forward=True
        )

    def generate(
        self,
        input_ids: Tensor,
        max_new_tokens: int = FROM_CONFIG,
        *,
        max_length: int | None = None,
        temperature: float = FROM_CONFIG,
        top_k: int | None = FROM_CONFIG,
        top_p: float | None = FROM_CONFIG,
        do_sample: bool = FROM_CONFIG,
        eos_token_id: int | list[int] | None = FROM_CONFIG,
        pad_token_id: int | None = FROM_CONFIG,
        attention_mask: Tensor | None = None,
        generator: torch.Generator | None = None,
        streamer=None,
    ) -> Tensor:
        """Continue ``input_ids`` token by token with a KV cache (greedy: the same tokens as HF ``generate``),
        through :func:`sublayer.runtime.generation.generate` (the model's fast decoding step where it has one).

        Runs in eval mode (dropout off) without gradients and restores every submodule's training flag afterwards.

        The decoding options default to :data:`~sublayer.checkpoints.FROM_CONFIG`: the value of
        ``generation_config`` (a folder's ``generation_config.json``, else ``config``'s special ids), else HF's
        global default (:data:`sublayer.checkpoints.generation.DEFAULTS`), as HF's ``generate``. A value passed
        wins; ``None`` passed keeps its meaning (``eos_token_id=None``: no end token, ``top_k=None``: no top-k).

        Args:
            input_ids: (B, T) prompt ids. With ``attention_mask`` (1 = token, 0 = pad) prompts may be
                left-padded; positions then count real tokens only (as HF's ``generate``). Without it, as HF's
                ``generate``, the prompt's ``pad_token_id`` s are padding when that id is no end token (a row of
                pad ids only raises ValueError).
            max_new_tokens: tokens to add (>= 0); T + max_new_tokens <= max_positions. Default: the config's
                ``max_new_tokens``, else its ``max_length`` minus T, else 20 (at most ``max_positions - T``).
            max_length: the total length, prompt included (HF's meaning): ``max_new_tokens = max_length - T``;
                ``max_new_tokens`` given too wins (as HF).
            temperature, top_k, top_p: sampling filters, applied in HF's order (temperature, top-k, top-p:
                keep the fewest most likely tokens whose probability sums to at least ``top_p``; ``top_k=0`` or None:
                no top-k filter, as HF). HF's defaults: 1.0, 50, 1.0.
            do_sample: sample from the filtered distribution; False (HF's default) -> greedy argmax (filters
                ignored).
            eos_token_id: an id or a list of ids: a row that produced one is finished; later positions get
                ``pad_token_id`` (None -> the first eos id); decoding stops early once every row is finished.
                Default: the model's end token(s).
            generator: a ``torch.Generator`` for reproducible sampling.
            streamer: HF's streamer protocol (``transformers.TextStreamer``, ``TextIteratorStreamer``, or any
                object with ``put(ids)`` and ``end()``): ``put`` gets the prompt (B, T), then each step's (B,)
                new ids as they are made (finished rows: ``pad_token_id``), then ``end()``.

        Returns:
            (B, T + n) ids: the prompt followed by n <= max_new_tokens new tokens (an empty batch, B = 0: an
            empty (0, T + max_new_tokens)).

        Raises:
            ValueError/TypeError: bad ids or mask, max_new_tokens < 0, max_length <= T, too long, temperature < 0
            (or 0 to sample), top_k < 0, top_p outside (0, 1], eos/pad ids outside the vocabulary (also those of
            ``generation_config``).
        """
        return generate_with_config(
            self, input_ids, max_new_tokens, max_length=max_length, temperature=temperature, top_k=top_k, top_p=top_p,
            do_sample=do_sample, eos_token_id=eos_token_id, pad_token_id=pad_token_id, attention_mask=attention_mask,
            generator=generator, streamer=streamer,
        )  # fmt: skip


def generate_with_config(lm, input_ids: Tensor, max_new_tokens=FROM_CONFIG, *, max_length=None, **options) -> Tensor:
    """:func:`sublayer.runtime.generation.generate` with every option left at ``FROM_CONFIG`` taken from
    ``lm.generation_config`` (see :meth:`CausalLM.generate`, also for ``max_length``); ``lm`` is a model or its
    prepared form."""
    cfg = lm.config
    max_positions = getattr(cfg, "max_positions", None)
    check_input_ids("input_ids", input_ids, cfg.vocab_size, max_positions)
    if max_length is not None:
        t = input_ids.shape[1]
        if isinstance(max_length, bool) or not isinstance(max_length, int) or max_length <= t:
            raise ValueError(
                f"max_length must be an int > the prompt length {t} (it counts the prompt, as HF's), got {max_length!r}"
            )
        if max_new_tokens is FROM_CONFIG:  # both given: max_new_tokens wins, as HF
            max_new_tokens = max_length - t
    gen = lm.generation_config
    gen.check_vocab(cfg.vocab_size)
    names = ("temperature", "top_k", "top_p", "do_sample", "eos_token_id", "pad_token_id")
    resolved = gen.resolve(
        input_ids.shape[1], max_positions, max_new_tokens=max_new_tokens,
        **{k: options.pop(k, FROM_CONFIG) for k in names},
    )  # fmt: skip
    if not isinstance(resolved["do_sample"], bool):
        raise TypeError(f"do_sample must be a bool, got {resolved['do_sample']!r}")
    return generation.generate(lm, input_ids, resolved.pop("max_new_tokens"), **resolved, **options)


def shifted_targets(config, input_ids: Tensor, labels: Tensor | None, kpm: Tensor | None, ignore_index: int) -> Tensor:
    """The (B, T) next-token targets of HF's ``labels=`` (``labels[:, t + 1]`` at t, ``ignore_index`` last); None
    labels -> ``input_ids`` with padding (``kpm`` True) ignored. Raises ValueError/TypeError for bad labels or
    when no position has a target."""
    b, t = input_ids.shape
    check_options(ignore_index)
    if labels is None:
        labels = input_ids if kpm is None else input_ids.masked_fill(kpm, ignore_index)
    else:
        check_targets("labels", labels, config.vocab_size, ignore_index)
        if labels.shape != input_ids.shape:
            raise ValueError(f"labels must have the shape of input_ids {(b, t)}, got {tuple(labels.shape)}")
        labels = labels.long()  # ignore_index written below must not wrap to a narrow dtype's value
    # HF: pad labels with ignore_index on the right, then shift left by one
    targets = torch.cat([labels[:, 1:], labels.new_full((b, 1), ignore_index)], dim=1)
    if not bool((targets != ignore_index).any()):
        raise ValueError(
            f"no position has a target (seq_len={t}, every shifted label is ignore_index={ignore_index}): the "
            "mean loss is undefined (HF returns nan)"
        )
    return targets


def check_inputs(config, input_ids: Tensor, attention_mask: Tensor | None, position_ids: Tensor | None):
    """A causal LM's inputs checked: ``(B, T, key padding mask (True = padding) or None, position_ids)``, the
    positions (B or 1, T), >= 0, below ``config.max_positions`` when the model has learned positions, or
    ``arange(T)`` (1, T) when None."""
    max_positions = getattr(config, "max_positions", None)
    check_input_ids("input_ids", input_ids, config.vocab_size, max_positions)
    b, t = input_ids.shape
    kpm = None if attention_mask is None else check_attention_mask(attention_mask, (b, t))
    if position_ids is None:
        return b, t, kpm, torch.arange(t, device=input_ids.device)[None]
    check_input_ids("position_ids", position_ids, max_positions, limit_name="max_positions")
    if position_ids.shape[-1] != t or position_ids.shape[0] not in (1, b):
        raise ValueError(f"position_ids must have shape ({b} or 1, {t}), got {tuple(position_ids.shape)}")
    return b, t, kpm, position_ids


class PreparedCausalLM(_Decoding, InferenceOnly):
    """The inference-only prepared form of a causal LM (``fast_inference``, int8): forward and generate, with the
    model's checks, over the subclass's ``_weights()`` (:class:`sublayer.runtime.causal.CausalWeights`, run by
    :func:`sublayer.runtime.causal.hidden` and its head in ``compute_dtype``) and its ``fast_decoder()``; ``config``
    and ``generation_config`` as the model's. No autograd, no dropout."""

    @inference
    def forward(
        self,
        input_ids: Tensor,
        *,
        attention_mask: Tensor | None = None,
        position_ids: Tensor | None = None,
        labels: Tensor | None = None,
        return_dict: bool = False,
    ) -> Tensor | CausalLMOutput:
        """As the model's ``forward``: logits (B, T, vocab_size), float32, zeros at padded positions; with
        ``labels`` (HF's meaning, see :meth:`CausalLM.loss`) or ``return_dict``, a :class:`CausalLMOutput` holding
        ``loss`` (float32, as the model's: every position with a target counts, a padded one too, from its logits
        before they are zeroed) and ``logits``. Where the prepared form steps aside, the model's own output."""
        cfg = self.config
        b, t, kpm, position_ids = check_inputs(cfg, input_ids, attention_mask, position_ids)
        kpm = kpm if kpm is not None and bool(kpm.any()) else None
        if (ref := self._reference()) is not None:  # the model's own forward: hooks see every call
            with eval_mode(ref):
                out = ref(input_ids, attention_mask=attention_mask, position_ids=position_ids, labels=labels,
                          return_dict=True)  # fmt: skip
            logits = None if out.logits is None else out.logits.float()  # float32, as the prepared path's
            return CausalLMOutput(loss=out.loss, logits=logits) if labels is not None or return_dict else logits
        full = self.lm_head(self._hidden(input_ids, position_ids, kpm, None))
        logits = full if kpm is None else full.masked_fill(kpm[..., None], 0.0)
        if labels is None:
            return CausalLMOutput(logits=logits) if return_dict else logits
        # every position with a target counts, padding or not (the last left pad predicts the first token)
        targets = shifted_targets(cfg, input_ids, labels, kpm, -100).reshape(-1)
        loss = F.cross_entropy(full.reshape(b * t, -1).float(), targets, ignore_index=-100)
        return CausalLMOutput(loss=loss, logits=logits)

    @inference
    def lm_head(self, h: Tensor) -> Tensor:
        """(..., d_model) -> (..., vocab_size) float32 logits: the weights' head, in ``compute_dtype``."""
        x = h.reshape(-1, h.shape[-1]).to(self.compute_dtype).contiguous()
        return self._weights().head(x).float().unflatten(0, h.shape[:-1])

    @inference
    def generate(self, input_ids: Tensor, max_new_tokens: int = FROM_CONFIG, **kwargs) -> Tensor:
        """As :meth:`CausalLM.generate` (same arguments, defaults and checks) over the prepared weights (the
        model's own ``generate`` where the prepared form steps aside)."""
        if (ref := self._reference()) is not None:
            return ref.generate(input_ids, max_new_tokens, **kwargs)
        return generate_with_config(self, input_ids, max_new_tokens, **kwargs)

    def _hidden(
        self, input_ids: Tensor, position_ids: Tensor, key_padding_mask: Tensor | None, caches: list | None
    ) -> Tensor:
        """Final-normed hidden states (B, T, d) in the compute dtype; ``caches``: one KVCache per block."""
        return causal.hidden(self._weights(), input_ids, position_ids, key_padding_mask, caches, self.compute_dtype)
