"""int8 inference for the decoder-only LMs (:class:`~sublayer.models.GPT2`, :class:`~sublayer.models.Llama`):
``fast_inference(model, quantize="int8")`` or :func:`sublayer.models.quantized.quantize` return a
:class:`QuantizedCausalLM` (``QuantizedGPT2`` is the same class). docs/int8.md tells why each choice below
(decoding one row streams the weights from memory; several rows are compute-bound):

* the dense layers of the blocks (fused q|k|v, attention output, fc1, fc2) and the LM head are stored int8,
  symmetric per output channel (:func:`~.int8.quantize_weight`), except those ``keep_float`` names (``fnmatch``
  patterns over ``layers.{i}.{qkv,out,fc1,fc2}`` and ``head``);
* one row (batch-1 decoding steps) keeps float32 precision in its activations: where :func:`~.int8.own_int8_gemm`
  (AVX512-VNNI or AMX-INT8) carried as 24-bit integers (:func:`~sublayer.runtime.linear.quantize_rows24`) in three
  uint8 planes through the ``int8_linear`` kernel, exact integer sums, ``· s + b`` in the epilogue; elsewhere
  weight-only, ``y = act((x @ q^T) · s + b)`` with float32 activations, exact products and fp32 sums, by the
  ``skinny_linear`` kernel of the float decoding path on int8 panels (widened in registers). Without the C++
  kernels :func:`~sublayer.runtime.linear.weight_int8_linear_reference` computes the weight-only form in plain
  PyTorch (slower, same results up to the summation order);
* several rows (the prompt, batched decoding steps), where :func:`~.int8.own_int8_gemm`, quantize each row's
  activations to 8 bits as BERT's int8 path does (:class:`~sublayer.runtime.linear.Int8Linear`: uint8 per token
  with its own scale and zero point, exact int32 sums); elsewhere they stay weight-only;
* embeddings, norms, rotary positions, attention (SDPA for the prompt, ``decode_attention`` over the static cache)
  and the activations stay float32; keys and values are held in bfloat16 (the KV caches: half the bytes a batched
  step reads from them; the prompt attends over the same rounded keys and values), except in a wrapper with every
  dense layer kept float, which is the float model;
* the forward and the decoding loop are the engine's (:mod:`sublayer.runtime.causal`, with the int8 linears as its
  ``linear`` factory), so the static KV cache, the greedy/sampling rules and the one-call step
  (``causal_decode_layers``) are the float path's.

The LM head is int8 by default (:data:`DEFAULT_KEEP_FLOAT_GPT2` is empty): it is a third of GPT-2 small's matrix
bytes, so keeping it float (``keep_float=("head",)``) makes greedy decoding at batch 1 markedly slower, and on
GPT-2-sized models it did not raise agreement with the fp32 model's tokens (``sublayer bench --decode`` has rows
for both).

``quantize(model)`` is an independent snapshot holding only the tensors it uses (its own copies, under the engine's
names, :func:`sublayer.runtime.causal.named_tensors`); ``fast_inference(model, quantize="int8")`` holds the model
and re-quantizes from its current weights on the next call after any change
(:func:`sublayer.runtime.weights.prepared`). :meth:`QuantizedCausalLM.save_pretrained` writes them to
``model.safetensors`` + ``config.json`` (the model's HF config with a ``quantization_config`` entry);
:func:`sublayer.models.quantized.load_quantized` reads them back; ``GPT2.from_pretrained`` /
``Llama.from_pretrained`` refuse such a folder.
"""

from __future__ import annotations

import torch
from torch import Tensor

from .. import checkpoints as ckpt
from ..runtime import causal
from ..runtime.linear import Int8Linear, PackedLinear, weight_int8_linear_reference
from .causal_lm import CausalLM, PreparedCausalLM
from .int8 import (
    LINEARS, Int8Wrapper, check_float_cpu, check_keep_float, dense_names, folder_spec, int8_tensors, own_int8_gemm,
)  # fmt: skip

__all__ = [
    "DEFAULT_KEEP_FLOAT_GPT2", "WeightInt8Linear", "weight_int8_linear_reference", "int8_linear",
    "QuantizedCausalLM", "QuantizedGPT2", "skeleton",
]  # fmt: skip

DEFAULT_KEEP_FLOAT_GPT2: tuple[str, ...] = ()


class WeightInt8Linear(Int8Linear):
    """:class:`~sublayer.runtime.linear.Int8Linear` as int8 decoding builds it, in groups of 48 columns: with
    ``int8_rows`` (where :func:`~.int8.own_int8_gemm`) int8 activations, several rows at 8 bits and one row at 24;
    without, weight-only (float32 activations times the widened int8 panels).

    Args:
        q: (N, K) int8. scale: (N,) float32. bias: (N,) float32 or None. int8_rows: as above.
    """

    def __init__(self, q: Tensor, scale: Tensor, bias: Tensor | None = None, *, int8_rows: bool = False) -> None:
        super().__init__(
            q, scale, bias, activations="int8" if int8_rows else "float", grouped=True,
            single_row_bits=24 if int8_rows else 8,
        )  # fmt: skip


def int8_linear(name: str, t: dict[str, Tensor]):
    """One dense layer of a saved or quantized tensor dict (``linear`` of :func:`sublayer.runtime.causal.build`):
    :class:`WeightInt8Linear` where ``{name}.qweight`` is present (int8 activations for several rows where
    :func:`~.int8.own_int8_gemm`), else float32 :class:`PackedLinear` (a tied float head is the embedding
    ``wte``)."""
    b = t.get(f"{name}.bias")
    if f"{name}.qweight" in t:
        return WeightInt8Linear(t[f"{name}.qweight"], t[f"{name}.scale"], b, int8_rows=own_int8_gemm())
    return PackedLinear(t.get(f"{name}.weight", t["wte"]), b)


class QuantizedCausalLM(Int8Wrapper, PreparedCausalLM):
    """int8 inference wrapper of a decoder-only LM (:class:`GPT2`, :class:`Llama`; build with ``quantize`` /
    ``fast_inference(quantize="int8")``), over :mod:`sublayer.runtime.causal`.

    ``forward(input_ids, attention_mask=None, position_ids=None)``: as the model's ``forward`` -> float32 logits
    (B, T, vocab_size). ``generate``: the model's ``generate`` arguments and checks, decoded by
    :func:`sublayer.runtime.causal.decode` over the int8 weights (``SUBLAYER_DECODING=0``: the reference loop,
    re-running :meth:`forward`'s blocks with a growing cache).

    Args:
        skeleton: the model's class built on the meta device (its structure: head layout, norms, rotary); a
            wrapper that follows ``model`` reads ``model``'s own (its norms' eps as they are at each call).
        tensors: the engine's named tensors (:func:`sublayer.runtime.causal.named_tensors`), dense weights as
            ``{name}.qweight`` + ``{name}.scale`` unless kept float (None with ``model``).
        keep_float: the patterns the dense layers were matched against.
        model: None (a snapshot of ``tensors``), or the model to follow: its current weights re-quantized on the
            next call after any change.

    Raises:
        TypeError/ValueError: as the model's ``forward`` / ``generate``.
    """

    def __init__(
        self, skeleton: torch.nn.Module, tensors: dict[str, Tensor] | None, keep_float: tuple[str, ...], *,
        model: CausalLM | None = None,
    ) -> None:  # fmt: skip
        self.skeleton = skeleton
        self._follow(skeleton.config, keep_float, model, tensors)
        self._generation_config = ckpt.GenerationConfig.from_model_config(self.config)  # a snapshot's defaults
        self._key = ("int8", self.keep_float)

    @classmethod
    def from_model(
        cls, model: CausalLM, keep_float=DEFAULT_KEEP_FLOAT_GPT2, *, follow: bool = False
    ) -> QuantizedCausalLM:
        """See :func:`sublayer.models.quantized.quantize`: a snapshot of ``model``'s weights now, or with ``follow``
        a wrapper holding ``model`` that re-quantizes its current weights whenever they changed."""
        keep_float = check_keep_float(keep_float, dense_names(model.config.n_layers, head=True))
        out = cls(skeleton(model), None if follow else _int8_tensors(model, keep_float, copy=True), keep_float,
                  model=model if follow else None)  # fmt: skip
        out._generation_config = model.generation_config
        out.weights()  # quantizes now (and checks the model)
        return out

    @property
    def generation_config(self) -> ckpt.GenerationConfig:
        """``generate``'s defaults: a wrapper that follows a model reads the model's at each call (as the float
        wrapper does); a snapshot keeps its own (the model's when it was made, or its folder's), which may be set."""
        return self._generation_config if self.model is None else self.model.generation_config

    @generation_config.setter
    def generation_config(self, value: ckpt.GenerationConfig) -> None:
        if self.model is not None:
            raise AttributeError(f"{type(self).__name__} follows its model's generation_config: set the model's")
        self._generation_config = value

    def _build(self, t: dict[str, Tensor]) -> tuple[dict[str, Tensor], causal.CausalWeights]:
        cache = torch.bfloat16 if any(name.endswith(".qweight") for name in t) else torch.float32
        structure = self.skeleton if self.model is None else self.model  # a followed model's eps, as it has them now
        return t, causal.build(structure, int8_linear, t, cache_dtype=cache)

    def _quantize(self, model: CausalLM) -> dict[str, Tensor]:
        return _int8_tensors(model, self.keep_float, copy=False)

    def weights(self) -> causal.CausalWeights:
        """The decoding weights (:func:`sublayer.runtime.causal.build` over the int8 tensors)."""
        return self._parts()[1]

    _weights = weights  # what PreparedCausalLM's forward reads
    _activations = "float32 for one row, int8 per token for several where the CPU has VNNI (chosen at run time)"

    def fast_decoder(self):
        """The float path's decoding loop over the int8 weights (``SUBLAYER_DECODING=0``: the reference loop)."""
        return causal.decoder(self, weights=self.weights)

    @staticmethod
    def expected_tensors(skeleton: torch.nn.Module, keep_float: tuple[str, ...]) -> dict:
        """What a saved folder holds: name -> (shape, dtype) (a tied float head is ``wte`` itself)."""
        return folder_spec(causal.named_tensors(skeleton), keep_float, tied=skeleton.config.tie_word_embeddings)

    def __repr__(self) -> str:
        W = self.weights()
        lins = [L[k] for L in W.layers for k in LINEARS] + [W.head]
        n_q = sum(isinstance(lin, WeightInt8Linear) for lin in lins)
        return f"{type(self).__name__}(int8 layers={n_q}/{len(lins)}, keep_float={self.keep_float})"


def _int8_tensors(model: CausalLM, keep_float: tuple[str, ...], *, copy: bool) -> dict[str, Tensor]:
    """``model``'s engine tensors with the dense weights quantized (``{layer}.qweight`` + ``{layer}.scale``) unless
    ``keep_float`` matches them; ``copy``: the float tensors cloned (a snapshot), else views of the parameters."""
    check_float_cpu(model)
    return int8_tensors(causal.named_tensors(model), keep_float, copy=copy, tied=model.config.tie_word_embeddings)


def skeleton(model: CausalLM) -> CausalLM:
    """``model``'s class and config on the meta device: its structure without weights."""
    return type(model)(model.config, device="meta")


QuantizedGPT2 = QuantizedCausalLM  # the GPT-2 name, kept importable
