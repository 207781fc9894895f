"""An inference fast path for :class:`~sublayer.models.Bert` and the decoder-only LMs (:class:`~sublayer.models.GPT2`,
:class:`~sublayer.models.Llama`: one class for all, over :mod:`sublayer.runtime.causal`).

``fast = fast_inference(model, dtype=torch.bfloat16)`` returns a separate, inference-only wrapper object
(:class:`FastBert` / :class:`FastCausalLM`); the model itself is not changed and keeps training as before. The wrapper:

* caches the weights once in the *compute dtype*: bf16 when the CPU multiplies bf16 natively (AVX512_BF16 / AMX,
  :func:`sublayer.kernels.native_bf16_gemm`), otherwise float32 — on an AVX2 CPU oneDNN's bf16 GEMMs are
  several times slower than fp32, so asking for bf16 there gives the fp32 path (``fast.compute_dtype`` tells
  which one runs);
* fuses q, k, v into one GEMM, adds biases inside the GEMM (``addmm``), runs bias + activation and residual add +
  LayerNorm in the fused kernels of :mod:`sublayer.kernels` (fp32 statistics; the reference ops when the kernels
  are off), attention in ``F.scaled_dot_product_attention`` with the padding mask;
* BERT with padding: the dense layers only see real tokens (padding rows are dropped before the GEMMs and put back
  for attention only), so a batch of mixed lengths costs the FLOPs of its real tokens. The hidden states at padded
  positions are returned as zeros (the reference model computes values there that nothing should read);
* runs without autograd (outputs never require grad), without dropout (eval semantics, whatever ``model.training``
  says) and with autocast switched off inside (the compute dtype above decides; calling it under
  ``torch.autocast`` changes nothing);
* never uses stale weights: the cast weights come from :func:`sublayer.runtime.weights.prepared`, rebuilt after any
  optimizer step (fused ones too), ``load_state_dict``, ``.to()``, in-place writes and writes through ``.data``
  (see there).

Memory: with float32 compute the cache aliases the parameters except the fused q/k/v weight (one copy of the
attention input projections); with bf16 compute it holds a bf16 copy of every matrix (half the model's size).

Outputs are float32 (the model's dtype), like ``BertModel`` under ``torch.autocast("cpu", dtype=torch.bfloat16)``.
In bf16 the results keep cosine similarity >= 0.999 to the fp32 model (tests check it).
"""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F
from torch import Tensor

from .. import kernels
from ..runtime import causal
from ..runtime.linear import DenseLinear
from ..runtime.rows import add_norm, bias_act, inference, kernels_on, layer_norm
from ..runtime.weights import clear_cache, prepared
from .outputs import BaseModelOutput
from .bert import Bert, mean_pooled
from .causal_lm import CausalLM, PreparedCausalLM

__all__ = ["fast_inference", "FastBert", "FastCausalLM", "FastGPT2", "linear_factory"]

_DTYPES = (torch.float32, torch.bfloat16)


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
            QuantizedCausalLM; its float parts run in float32 whatever ``dtype`` says).

    Returns:
        :class:`FastBert` (``__call__``/``forward``, ``embed``, ``pooled`` as the model's) or
        :class:`FastCausalLM` (``__call__``/``forward`` giving logits, ``generate``).

    Raises:
        TypeError: ``model`` is not a Bert or a causal LM. ValueError: ``dtype`` not float32/bfloat16,
        ``quantize`` not None/"int8", or the model's parameters are not CPU tensors of a supported dtype.
    """
    if dtype not in _DTYPES:
        raise ValueError(f"dtype must be torch.float32 or torch.bfloat16, got {dtype!r}")
    if quantize is not None:
        from . import quantized

        quantized.check_quantize(quantize)
        return quantized.quantize(model)
    if isinstance(model, Bert):
        return FastBert(model, dtype=dtype)
    if isinstance(model, CausalLM):
        return FastCausalLM(model, dtype=dtype)
    raise TypeError(f"fast_inference needs a sublayer Bert, GPT2 or Llama model, got {type(model).__name__}")


# ----------------------------------------------------------------------------------------------- building blocks
def _check_model_params(model: torch.nn.Module) -> None:
    dtypes = (torch.float32, torch.bfloat16) if isinstance(model, CausalLM) else (torch.float32,)
    for name, p in model.named_parameters():
        if p.dtype not in dtypes or p.device.type != "cpu":
            kinds = " or ".join(str(d).removeprefix("torch.") for d in dtypes)
            raise ValueError(f"fast_inference needs {kinds} CPU parameters; {name} is {p.dtype} on {p.device}")


class _FastBase:
    """Shared: compute dtype, weight cache, inference-only mode switches."""

    def __init__(self, model, dtype: torch.dtype) -> None:
        _check_model_params(model)
        self.model = model
        self.config = model.config
        self.dtype = dtype
        self.compute_dtype = compute_dtype(dtype)
        self.training = False

    def _c(self, t: Tensor) -> Tensor:
        return t.detach().to(self.compute_dtype).contiguous()

    @staticmethod
    def _f(t: Tensor | None) -> Tensor | None:
        return None if t is None else t.detach().float().contiguous()

    def _block_weights(self, blk) -> dict:
        """One block's cached weights: fused q|k|v, out-projection, both norms and the FFN (GEMM weights
        transposed once, in the compute dtype; norm parameters in fp32)."""
        a, f = blk.self_attn, blk.ffn
        n1, n2 = blk.attn_residual.norm, blk.ffn_residual.norm
        wqkv, bqkv = self._qkv(a)
        return {
            "wqkv_t": wqkv.t(), "bqkv": bqkv,
            "wo_t": self._c(a.out_proj.weight).t(), "bo": self._c(a.out_proj.bias),
            "n1w": self._f(n1.weight), "n1b": self._f(n1.bias), "eps1": n1.eps,
            "w1_t": self._c(f.fc1.weight).t(), "b1": self._f(f.fc1.bias),
            "w2_t": self._c(f.fc2.weight).t(), "b2": self._c(f.fc2.bias),
            "n2w": self._f(n2.weight), "n2b": self._f(n2.bias), "eps2": n2.eps,
        }  # fmt: skip

    def _qkv(self, attn) -> tuple[Tensor, Tensor]:
        w = torch.cat([attn.q_proj.weight, attn.k_proj.weight, attn.v_proj.weight], 0)
        b = torch.cat([attn.q_proj.bias, attn.k_proj.bias, attn.v_proj.bias], 0)
        return self._c(w), self._c(b)

    def _weights(self) -> dict:
        """The cast weights (:func:`sublayer.runtime.weights.prepared`: rebuilt whenever a parameter changes)."""
        key = ("fast", type(self).__name__, self.compute_dtype, kernels_on())
        return prepared(self.model, key, lambda m: self._build())

    def refresh(self) -> None:
        """Re-cast the weights on the next call (needed only after a write through ``param.data`` to a few
        elements, see :mod:`sublayer.runtime.weights`)."""
        clear_cache(self.model)

    def eval(self):
        return self

    def train(self, mode: bool = True):
        """Inference only: ``train(True)`` raises; train the wrapped model instead (``fast.model``)."""
        if mode:
            raise RuntimeError(
                f"{type(self).__name__} is an inference-only wrapper; train the model itself (fast.model): "
                "the wrapper re-caches its weights on the next call"
            )
        return self

    def __call__(self, *args, **kwargs):
        return self.forward(*args, **kwargs)

    def __repr__(self) -> str:
        return f"{type(self).__name__}({type(self.model).__name__}, compute_dtype={self.compute_dtype})"


# ----------------------------------------------------------------------------------------------- BERT
class FastBert(_FastBase):
    """Inference fast path of a :class:`Bert` (built by :func:`fast_inference`).

    Forward: as :meth:`Bert.forward` (``input_ids``, ``attention_mask`` 1 = token, ``token_type_ids``,
    ``return_dict``) -> float32 (B, T, d_model); hidden states at padded positions are zeros. ``embed`` and ``pooled`` as the model's.

    Raises:
        TypeError/ValueError: as :meth:`Bert.forward` (ids, mask, token types).
    """

    def _build(self) -> dict:
        m = self.model
        e = m.embeddings
        layers = [self._block_weights(blk) for blk in m.encoder.layers]
        pool = None
        if m.pooler is not None:
            pool = (self._f(m.pooler.dense.weight).t(), self._f(m.pooler.dense.bias))
        return {
            "word": e.word_embeddings.weight.detach(), "pos": e.position_embeddings.weight.detach(),
            "type": e.token_type_embeddings.weight.detach(),
            "nw": self._f(e.norm.weight), "nb": self._f(e.norm.bias), "eps": e.norm.eps,
            "layers": layers, "pool": pool,
        }  # fmt: skip

    @inference
    def forward(
        self,
        input_ids: Tensor,
        attention_mask: Tensor | None = None,
        token_type_ids: Tensor | None = None,
        *,
        return_dict: bool = False,
    ) -> Tensor | BaseModelOutput:
        kpm, token_type_ids = self.model._prepare(input_ids, attention_mask, token_type_ids)
        W = self._weights()
        cfg = self.config
        B, T = input_ids.shape
        d, H = cfg.d_model, cfg.n_heads
        hd = d // H
        cd = self.compute_dtype
        # embeddings (float32 tables), then LayerNorm into the compute dtype
        x = W["word"][input_ids] + W["pos"][:T][None] + W["type"][token_type_ids]  # (B, T, d) fp32
        keep = None
        if kpm is not None and bool(kpm.any()):
            keep = (~kpm).reshape(-1).nonzero().squeeze(1)  # flat indices of real tokens
            x = x.reshape(B * T, d).index_select(0, keep)
            mask = (~kpm)[:, None, None, :]  # (B, 1, 1, T) True = attend
        else:
            x = x.reshape(B * T, d)
            mask = None
        x = layer_norm(x, W["nw"], W["nb"], W["eps"]).to(cd)  # (N, d), N = real tokens
        scale = 1.0 / math.sqrt(hd)
        full = None
        for L in W["layers"]:
            qkv = torch.addmm(L["bqkv"], x, L["wqkv_t"])  # (N, 3d)
            if keep is not None:
                # one zeroed (B·T, 3d) buffer for all layers: the padded rows stay zero (masked keys still
                # multiply their zero weights, so they must hold no garbage)
                full = qkv.new_zeros(B * T, 3 * d) if full is None else full
                qkv = full.index_copy_(0, keep, qkv)
            q, k, v = qkv.view(B, T, 3, H, hd).permute(2, 0, 3, 1, 4)  # each (B, H, T, hd)
            ctx = F.scaled_dot_product_attention(q, k, v, attn_mask=mask, scale=scale)
            ctx = ctx.transpose(1, 2).reshape(B * T, d)
            if keep is not None:
                ctx = ctx.index_select(0, keep)
            y = torch.addmm(L["bo"], ctx, L["wo_t"])
            x, _ = add_norm(x, y, L["n1w"], L["n1b"], L["eps1"], want_sum=False)
            h = bias_act(torch.mm(x, L["w1_t"]), L["b1"], cfg.activation)
            y = torch.addmm(L["b2"], h, L["w2_t"])
            del h
            x, _ = add_norm(x, y, L["n2w"], L["n2b"], L["eps2"], want_sum=False)
        x = x.float()
        if keep is not None:
            out = x.new_zeros(B * T, d)
            out.index_copy_(0, keep, x)
            x = out
        if not return_dict:
            return x.view(B, T, d)
        pool = None if W["pool"] is None else torch.tanh(torch.addmm(W["pool"][1], x.view(B, T, d)[:, 0], W["pool"][0]))
        return BaseModelOutput(last_hidden_state=x.view(B, T, d), pooler_output=pool)

    @inference
    def pooled(
        self, input_ids: Tensor, attention_mask: Tensor | None = None, token_type_ids: Tensor | None = None
    ) -> Tensor:
        """As :meth:`Bert.pooled`: ``tanh(dense(h[:, 0]))`` (B, d_model), float32.

        Raises:
            ValueError: the model has no pooler.
        """
        if self.model.pooler is None:
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


# ----------------------------------------------------------------------------------------------- causal LMs
def linear_factory(dtype: torch.dtype):
    """The prepared format of a causal LM's dense layers for a compute dtype (``linear`` of
    :func:`sublayer.runtime.causal.build`): float32 packed panels, else the weight cast once (:class:`DenseLinear`)."""
    if dtype == torch.float32:
        return causal.packed_linear
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
        return prepared(self.model, key, lambda m: causal.build(m, linear_factory(self.compute_dtype)))

    @property
    def generation_config(self):
        """The wrapped model's generation defaults."""
        return self.model.generation_config

    @inference
    def lm_head(self, h: Tensor) -> Tensor:
        """(..., d_model) -> (..., vocab_size) float32 logits."""
        return self._weights().head(h.reshape(-1, h.shape[-1])).float().view(*h.shape[:-1], -1)

    def _hidden(
        self, input_ids: Tensor, position_ids: Tensor, key_padding_mask: Tensor | None, caches: list | None
    ) -> Tensor:
        """Final-normed hidden states (B, T, d) in the compute dtype; ``caches``: one KVCache per block."""
        return causal.hidden(self._weights(), input_ids, position_ids, key_padding_mask, caches, self.compute_dtype)

    def fast_decoder(self):
        """The model's fast decoding loop over packed panels of the compute dtype (float32: the same packed
        weights as the model's own ``generate``; bf16: bfloat16 panels, half the bytes per step)."""
        if self.compute_dtype == torch.float32:
            return causal.decoder(self.model)
        return causal.decoder(self.model, lambda: causal.packed_weights(self.model, self.compute_dtype), check=True)


FastGPT2 = FastCausalLM  # the GPT-2 name, kept importable
