"""An inference fast path for :class:`~sublayer.models.Bert` and the decoder-only LMs (:class:`~sublayer.models.GPT2`,
:class:`~sublayer.models.Llama`: one class for all, over :mod:`sublayer.runtime.causal`).

``fast = fast_inference(model, dtype=torch.bfloat16)`` returns a separate, inference-only wrapper object
(:class:`FastBert` / :class:`FastCausalLM`); the model itself is not changed and keeps training as before. The wrapper:

* caches the weights once in the *compute dtype*: bf16 when the CPU multiplies bf16 natively (AVX512_BF16 / AMX,
  :func:`sublayer.kernels.native_bf16_gemm`), otherwise float32 — on an AVX2 CPU oneDNN's bf16 GEMMs are
  several times slower than fp32, so asking for bf16 there gives the fp32 path (``fast.compute_dtype`` tells
  which one runs); BERT's weights, and a causal LM's in bf16 (for its forward and the prompt of ``generate``), are
  packed once for oneDNN in the compute dtype (:class:`sublayer.runtime.linear.OneDNNLinear`: bias and GELU fused
  into the GEMM);
* BERT runs the one prepared encoder of :mod:`sublayer.runtime.encoder` (shared with the int8 wrapper and
  ``sublayer.hf``'s patched ``BertModel``): q, k, v fused into one GEMM, bias + activation and residual add +
  LayerNorm in the fused kernels of :mod:`sublayer.kernels` (fp32 statistics; the reference ops when the kernels
  are off), attention on the packed rows of each run of equal-length sequences (the fused ``qkv_self_attention``
  kernel in float32, ``packed_self_attention`` in bf16);
* BERT with padding: padding rows are dropped before the first layer, the dense layers and the attention only see
  real tokens, so a batch of mixed lengths costs the FLOPs of its real tokens. The hidden states at padded
  positions are returned as zeros (the reference model computes values there that nothing should read);
* steps aside for the model's own forward (in eval mode) while a module of the model has a hook, or the model is
  sharded (:mod:`sublayer.runtime.rules`), so hooks see every call; ``generate`` then runs the model's ``generate``;
* runs without autograd (outputs never require grad), without dropout (eval semantics, whatever ``model.training``
  says) and with autocast switched off inside (the compute dtype above decides; calling it under
  ``torch.autocast`` changes nothing);
* never uses stale weights: the cast weights come from :func:`sublayer.runtime.weights.prepared`, rebuilt after any
  optimizer step (fused ones too), ``load_state_dict``, ``.to()``, in-place writes and writes through ``.data``
  (see there).

Memory: BERT's cache holds a copy of every matrix in the compute dtype (float32 oneDNN panels, or bf16: half the
model's size).

Outputs are float32 (the model's dtype), like ``BertModel`` under ``torch.autocast("cpu", dtype=torch.bfloat16)``.
In bf16 the results keep cosine similarity >= 0.999 to the fp32 model (tests check it).
"""

from __future__ import annotations

import torch

from .. import kernels
from ..kernels import onednn
from ..runtime import causal
from ..runtime.linear import DenseLinear, OneDNNLinear
from ..runtime.rows import kernels_on
from ..runtime.weights import clear_cache, prepared
from .bert import Bert
from .causal_lm import CausalLM, PreparedCausalLM
from .prepared_bert import PreparedBert, bert_activations, bert_eps, bert_layers, bert_tensors

__all__ = ["fast_inference", "PreparedBert", "FastBert", "float_linear", "FastCausalLM", "FastGPT2", "linear_factory"]


def compute_dtype(dtype: torch.dtype) -> torch.dtype:
    """The dtype the fast path computes in when ``dtype`` is asked for: bf16 only with native bf16 GEMMs."""
    if dtype == torch.bfloat16 and not kernels.native_bf16_gemm():
        return torch.float32
    return dtype


def fast_inference(
    model: Bert | CausalLM, *, dtype: torch.dtype = torch.bfloat16, quantize: str | None = None
) -> FastBert | FastCausalLM:
    """An inference-only fast wrapper around ``model`` (see the module docstring).

    Args:
        model: a :class:`Bert` or a decoder-only LM (:class:`GPT2`, :class:`Llama`) on the CPU, float32 (or,
            for the LMs, bfloat16) parameters.
        dtype: ``torch.bfloat16`` (default: bf16 weights and activations where the CPU has native bf16 GEMMs,
            float32 elsewhere) or ``torch.float32``.
        quantize: None, or ``"int8"``: the int8 wrapper of :mod:`sublayer.models.quantized` (QuantizedBert /
            QuantizedCausalLM; its float parts run in float32 whatever ``dtype`` says), which like the float
            wrappers re-quantizes from the model's current weights after any change (``quantize(model,
            follow=True)``).

    Returns:
        :class:`FastBert` (``__call__``/``forward``, ``embed``, ``pooled`` as the model's) or
        :class:`FastCausalLM` (``__call__``/``forward`` giving logits, ``generate``).

    Raises:
        TypeError: ``model`` is not a Bert or a causal LM. ValueError: ``dtype`` not float32/bfloat16,
        ``quantize`` not None/"int8", or the model's parameters are not CPU tensors of a supported dtype (a
        wrapper's call raises it too once they no longer are, e.g. after ``model.half()``).
    """
    if dtype not in (torch.float32, torch.bfloat16):
        raise ValueError(f"dtype must be torch.float32 or torch.bfloat16, got {dtype!r}")
    if quantize is not None:
        from . import quantized

        quantized.check_quantize(quantize)
        return quantized.quantize(model, follow=True)
    if isinstance(model, Bert):
        return FastBert(model, dtype=dtype)
    if isinstance(model, CausalLM):
        return FastCausalLM(model, dtype=dtype)
    raise TypeError(f"fast_inference needs a sublayer Bert, GPT2 or Llama model, got {type(model).__name__}")


# ----------------------------------------------------------------------------------------------- building blocks
def check_parameters(model: Bert | CausalLM) -> None:
    """Raises ValueError unless ``model``'s parameters are CPU tensors of a dtype the wrappers run: float32 (the LMs
    also bfloat16). Checked when a wrapper is made and whenever its weights are prepared again (after
    ``model.half()`` or ``.double()`` the wrapper raises as a new one would)."""
    dtypes = (torch.float32, torch.bfloat16) if isinstance(model, CausalLM) else (torch.float32,)
    for name, p in model.named_parameters():
        if p.dtype not in dtypes or p.device.type != "cpu":
            kinds = " or ".join(str(d).removeprefix("torch.") for d in dtypes)
            raise ValueError(f"fast_inference needs {kinds} CPU parameters; {name} is {p.dtype} on {p.device}")


class _FastBase:
    """Shared: the model's checks, compute dtype, refresh, what ``train(True)`` says (the mode switches:
    :class:`sublayer.runtime.rows.InferenceOnly`)."""

    _train_error = ("is an inference-only wrapper; train the model itself (fast.model): the wrapper re-caches its "
                    "weights on the next call")  # fmt: skip

    def __init__(self, model, dtype: torch.dtype) -> None:
        check_parameters(model)
        self.model = model
        self.config = model.config
        self.dtype = dtype
        self.compute_dtype = compute_dtype(dtype)

    def refresh(self) -> None:
        """Re-cast the weights on the next call (needed only after a write through ``param.data`` to a few
        elements, see :mod:`sublayer.runtime.weights`)."""
        clear_cache(self.model)

    def __repr__(self) -> str:
        return f"{type(self).__name__}({type(self.model).__name__}, compute_dtype={self.compute_dtype})"


# ----------------------------------------------------------------------------------------------- BERT
def float_linear(dtype: torch.dtype):
    """The prepared format of a float BERT's dense layers (``linear`` of :func:`bert_layers`) for a compute dtype:
    float32 or bf16 (the weight rounded once) packed for oneDNN (:class:`OneDNNLinear`)."""
    return lambda t, name: OneDNNLinear(t[f"{name}.weight"], t[f"{name}.bias"], dtype=dtype)


class FastBert(_FastBase, PreparedBert):
    """Inference fast path of a :class:`Bert` (built by :func:`fast_inference`): :class:`PreparedBert` on layers in
    the compute dtype (:func:`float_linear`), prepared from the model's parameters by
    :func:`sublayer.runtime.weights.prepared` (never stale).

    Raises:
        TypeError/ValueError: as :meth:`Bert.forward` (ids, mask, token types).
    """

    def _check(self, *args):
        return self.model._prepare(*args)

    def _parts(self) -> tuple[dict, list[dict]]:
        """The tensors and layers (:func:`sublayer.runtime.weights.prepared`: rebuilt whenever a parameter changes)."""
        return prepared(self.model, ("fast", type(self).__name__, self.compute_dtype, kernels_on()), self._build)

    def _build(self, model: Bert) -> tuple[dict, list[dict]]:
        check_parameters(model)
        t = bert_tensors(model)
        return t, bert_layers(t, self.config, float_linear(self.compute_dtype), bert_eps(model, self.config),
                             bert_activations(model, self.config))  # fmt: skip


# ----------------------------------------------------------------------------------------------- causal LMs
def linear_factory(dtype: torch.dtype):
    """The prepared format of a causal LM's dense layers for a compute dtype (``linear`` of
    :func:`sublayer.runtime.causal.build`): float32 packed panels; else the weight cast once and packed for oneDNN
    where it runs that dtype (:class:`OneDNNLinear`: bias and GELU fused into the GEMM), or cast once
    (:class:`DenseLinear`)."""
    if dtype == torch.float32:
        return causal.packed_linear
    if onednn.available(dtype):
        return lambda name, t: OneDNNLinear(t[f"{name}.weight"], t.get(f"{name}.bias"), dtype=dtype)
    return lambda name, t: DenseLinear(t[f"{name}.weight"], t.get(f"{name}.bias"), dtype)


class FastCausalLM(_FastBase, PreparedCausalLM):
    """Inference fast path of a decoder-only LM (:class:`GPT2`, :class:`Llama`; built by :func:`fast_inference`)
    over :mod:`sublayer.runtime.causal`.

    Forward: as the model's ``forward`` -> float32 logits (B, T, vocab_size). ``generate``: the model's
    ``generate`` (same arguments; greedy gives the model's tokens at float32): the prompt runs through this
    wrapper's forward, each new token through the fast step over packed panels of the compute dtype.

    Raises:
        TypeError/ValueError: as the model's ``forward`` / ``generate``.
    """

    def _weights(self) -> causal.CausalWeights:
        if self.compute_dtype == torch.float32:  # the weights generate decodes with: one prepared copy for both
            return causal.packed_weights(self.model)
        key = ("fast", self.compute_dtype, kernels_on())
        return prepared(self.model, key, self._build)

    def _build(self, model: CausalLM) -> causal.CausalWeights:
        check_parameters(model)
        return causal.build(model, linear_factory(self.compute_dtype))

    @property
    def generation_config(self):
        """The wrapped model's generation defaults."""
        return self.model.generation_config

    def fast_decoder(self):
        """The model's fast decoding loop over packed panels of the compute dtype (float32: the same packed
        weights as the model's own ``generate``; bf16: bfloat16 panels, half the bytes per step)."""
        if self.compute_dtype == torch.float32:
            return causal.decoder(self.model)
        return causal.decoder(self.model, lambda: causal.packed_weights(self.model, self.compute_dtype), check=True)


FastGPT2 = FastCausalLM  # the GPT-2 name, kept importable
