"""int8 inference for :class:`~sublayer.models.GPT2`: ``fast_inference(gpt2, quantize="int8")`` or
:func:`sublayer.models.quantized.quantize` return a :class:`QuantizedGPT2`.

GPT-2 decoding multiplies a few rows per step, so its time is the time to stream the weights from memory: this path
is **weight-only int8** (unlike BERT's, whose activations are quantized too, see :mod:`.quantized`):

* the dense layers of the blocks (fused q|k|v, attention output, fc1, fc2) and the LM head are stored int8,
  symmetric per output channel (:func:`~.quantized.quantize_weight`: ``w ≈ q · s[j]``, error <= ``s[j] / 2``),
  except those ``keep_float`` names (``fnmatch`` patterns over ``layers.{i}.{qkv,out,fc1,fc2}`` and ``head``);
* activations stay float32: ``y = act((x @ q^T) · s + b)`` with exact products and fp32 sums, by the
  ``skinny_linear`` kernel of the float decoding path (``kernels/csrc/packed_linear.cpp``) on int8 panels: the float
  panels at a quarter of the bytes, widened to fp32 in registers, the scale applied in the epilogue. The same
  kernel for every row count, so the prompt (prefill) and the decoding steps share one numerics. Without the C++
  kernels :func:`weight_int8_linear_reference` computes them in plain PyTorch (``F.linear`` on the widened
  weight; slower, same results up to the summation order);
* embeddings, LayerNorms, attention (SDPA for the prompt, ``decode_attention`` over the static cache) and the
  activations stay float32;
* decoding runs the float path's loop (:func:`sublayer.models.decoding.gpt2_generate` with ``weights=``), so the
  static KV cache, the greedy/sampling rules and the one-call step (``gpt2_decode_layers``) are the float path's.

The LM head is int8 by default (:data:`DEFAULT_KEEP_FLOAT_GPT2` is empty): it is a third of GPT-2 small's matrix
bytes, so keeping it float (``keep_float=("head",)``) makes greedy decoding at batch 1 markedly slower, and on
GPT-2-sized models it did not raise agreement with the fp32 model's tokens (``sublayer bench --decode`` has rows
for both).

The wrapper holds only the tensors it uses: :meth:`QuantizedGPT2.save_pretrained` writes them to
``model.safetensors`` + ``config.json`` (the HF GPT-2 config with a ``quantization_config`` entry);
:func:`sublayer.models.quantized.load_quantized` reads them back; ``GPT2.from_pretrained`` refuses such a folder.
"""

from __future__ import annotations

import fnmatch
import os

import torch
import torch.nn.functional as F
from torch import Tensor

from .. import checkpoints as ckpt
from .. import functional as SF
from .. import kernels
from ..functional import fused
from . import decoding
from .causal_lm import PreparedCausalLM
from .int8 import LINEARS, check_float_cpu, check_keep_float, dense_names, dense_spec, quant_config, quantize_weight
from ..runtime.linear import PackedLinear
from ..runtime.rows import inference, kernels_on
from .gpt2 import GPT2, GPT2Config

__all__ = ["DEFAULT_KEEP_FLOAT_GPT2", "WeightInt8Linear", "weight_int8_linear_reference", "QuantizedGPT2"]

DEFAULT_KEEP_FLOAT_GPT2: tuple[str, ...] = ()


def weight_int8_linear_reference(x: Tensor, q: Tensor, scale: Tensor, bias: Tensor | None) -> Tensor:
    """``(x @ q^T) * scale + bias`` in plain PyTorch, float32: x (M, K), q (N, K) int8, scale (N,) -> (M, N)."""
    y = F.linear(x, q.float()).mul_(scale)
    return y if bias is None else y.add_(bias)


class WeightInt8Linear:
    """``y = act((x @ q^T) * scale + bias)``: int8 weight (symmetric per output channel), float32 activations.

    Args:
        q: (N, K) int8. scale: (N,) float32. bias: (N,) float32 or None.

    Call: ``x`` (M, K) float32 with unit inner stride, ``activation`` an FFN activation name or None -> (M, N).
    The weight is packed once (``pack_linear_weight``: int8 panels) at the first call with the kernels on.
    """

    def __init__(self, q: Tensor, scale: Tensor, bias: Tensor | None = None) -> None:
        self.q, self.scale = q.contiguous(), scale.float().contiguous()
        self.bias = None if bias is None else bias.float().contiguous()
        self.out_features, self.in_features = q.shape
        self._packed: Tensor | None = None

    def __call__(self, x: Tensor, activation: str | None = None) -> Tensor:
        if kernels_on() and (activation is None or activation in fused.ACT_IDS):
            act = 0 if activation is None else fused.ACT_IDS[activation]
            return kernels.ops().skinny_linear(x, self.packed(), self.bias, self.out_features, act, self.scale)
        y = weight_int8_linear_reference(x, self.q, self.scale, self.bias)
        return y if activation is None else SF.activation_fn(activation)(y)

    def packed(self) -> Tensor:
        """The int8 weight in ``skinny_linear``'s panels (packed at the first call)."""
        if self._packed is None:
            self._packed = kernels.ops().pack_linear_weight(self.q)
        return self._packed

    def flat(self) -> tuple[Tensor, Tensor, Tensor] | None:
        """``(packed, scale, bias)`` for ``gpt2_decode_layers`` (packed_linear.cpp's ``skinny_linear`` reads the same
        int8 panels), or None without the kernels or a bias."""
        if not kernels_on() or self.bias is None:
            return None
        return self.packed(), self.scale, self.bias


def _make_linear(t: dict[str, Tensor], name: str, default_weight: Tensor | None = None):
    b = t.get(f"{name}.bias")
    if f"{name}.qweight" in t:
        return WeightInt8Linear(t[f"{name}.qweight"], t[f"{name}.scale"], b)
    return PackedLinear(t.get(f"{name}.weight", default_weight), b)


class QuantizedGPT2(PreparedCausalLM):
    """int8 inference wrapper of a :class:`GPT2` (build with ``quantize`` / ``fast_inference(quantize="int8")``).

    ``forward(input_ids, attention_mask=None, position_ids=None)``: as :meth:`GPT2.forward` -> float32 logits
    (B, T, vocab_size). ``generate``: :meth:`GPT2.generate`'s arguments and checks, decoded by
    :func:`sublayer.models.decoding.gpt2_generate` over the int8 weights (``SUBLAYER_DECODING=0``: the reference
    loop, re-running :meth:`forward`'s blocks with a growing cache).

    Raises:
        TypeError/ValueError: as :meth:`GPT2.forward` / :meth:`GPT2.generate`.
    """

    def __init__(self, config: GPT2Config, tensors: dict[str, Tensor], keep_float: tuple[str, ...]) -> None:
        self.config, self.tensors, self.keep_float = config, tensors, tuple(keep_float)
        self.generation_config = ckpt.GenerationConfig.from_model_config(config)  # generate's defaults
        self.compute_dtype = torch.float32
        self.training = False
        t = tensors
        self.layers = [{k: _make_linear(t, f"layers.{i}.{k}") for k in LINEARS} for i in range(config.n_layers)]
        self.head = _make_linear(t, "head", None if "head.weight" in t else t["wte"])
        self._W: dict | None = None

    @property
    def blocks(self) -> list:
        """One entry per block (``GPT2.generate`` counts its caches over it)."""
        return self.layers

    @classmethod
    def from_model(cls, model: GPT2, keep_float=DEFAULT_KEEP_FLOAT_GPT2) -> QuantizedGPT2:

        keep_float = check_keep_float(keep_float, dense_names(model.config.n_layers, head=True))
        check_float_cpu(model)
        cfg = model.config
        d = cfg.d_model

        def ln(prefix: str, norm) -> dict[str, Tensor]:
            b = norm.bias if norm.bias is not None else torch.zeros(d)
            return {f"{prefix}.weight": norm.weight.detach(), f"{prefix}.bias": b.detach()}

        t: dict[str, Tensor] = {"wte": model.wte.weight.detach(), "wpe": model.wpe.weight.detach()}
        t |= ln("ln_f", model.ln_f)
        dense: dict[str, tuple[Tensor, Tensor | None]] = {}
        for i, blk in enumerate(model.blocks):
            a, f, p = blk.self_attn, blk.ffn, f"layers.{i}"
            t |= ln(f"{p}.ln1", blk.attn_residual.norm) | ln(f"{p}.ln2", blk.ffn_residual.norm)
            dense[f"{p}.qkv"] = (
                torch.cat([a.q_proj.weight, a.k_proj.weight, a.v_proj.weight], 0),
                torch.cat([a.q_proj.bias, a.k_proj.bias, a.v_proj.bias], 0),
            )
            dense[f"{p}.out"] = (a.out_proj.weight, a.out_proj.bias)
            dense[f"{p}.fc1"] = (f.fc1.weight, f.fc1.bias)
            dense[f"{p}.fc2"] = (f.fc2.weight, f.fc2.bias)
        dense["head"] = (model.lm_head.weight, None)
        for name, (w, b) in dense.items():
            if b is not None:
                t[f"{name}.bias"] = b.detach()
            if any(fnmatch.fnmatchcase(name, pat) for pat in keep_float):
                if name != "head" or not cfg.tie_word_embeddings:  # a tied float head is wte itself
                    t[f"{name}.weight"] = w.detach()
            else:
                t[f"{name}.qweight"], t[f"{name}.scale"] = quantize_weight(w)
        # detached copies: the wrapper does not follow later changes to the model
        t = {k: v.detach().float().contiguous().clone() if v.is_floating_point() else v.contiguous()
             for k, v in t.items()}  # fmt: skip
        out = cls(cfg, t, keep_float)
        out.generation_config = model.generation_config
        return out

    # -- what GPT2.generate needs from ``self``
    def decode_weights(self) -> dict:
        """The decoding weights of :func:`sublayer.models.decoding.gpt2_generate` (``_build_gpt2``'s keys), built
        once: the int8 linears are :class:`WeightInt8Linear` callables."""
        if self._W is None:
            t = self.tensors
            eps = self.config.eps

            def norm(p: str) -> tuple[Tensor, Tensor, float]:
                return t[f"{p}.weight"], t[f"{p}.bias"], eps

            self._W = {
                "layers": [{"ln1": norm(f"layers.{i}.ln1"), "ln2": norm(f"layers.{i}.ln2"), **L}
                           for i, L in enumerate(self.layers)],
                "lnf": norm("ln_f"), "head": self.head, "wte": t["wte"], "wpe": t["wpe"],
            }  # fmt: skip
            # every block of a step in one C++ call (packed_linear.cpp's skinny_linear on the int8 panels)
            self._W["flat"] = decoding.flat_gpt2(self._W, self.config.activation)
        return self._W

    @inference
    def lm_head(self, h: Tensor) -> Tensor:
        """(..., d_model) float32 -> (..., vocab_size) logits."""
        return self.head(h.reshape(-1, h.shape[-1]).float().contiguous()).view(*h.shape[:-1], -1)

    def _hidden(
        self, input_ids: Tensor, position_ids: Tensor, key_padding_mask: Tensor | None, caches: list | None
    ) -> Tensor:
        """Final-LayerNormed hidden states (B, T, d) float32; ``caches``: one ``SF.KVCache`` per block."""
        return decoding.gpt2_hidden(self.decode_weights(), self.config, input_ids, position_ids, key_padding_mask, caches)

    # -- inference: FastGPT2's forward (its checks, then _hidden and lm_head, which this class defines for int8)
    def fast_decoder(self):
        """The float path's decoding loop over the int8 weights (``SUBLAYER_DECODING=0``: the reference loop)."""
        return decoding.gpt2_decoder(self, weights=self.decode_weights())

    # -- save / load
    def save_pretrained(self, folder: str | os.PathLike) -> None:
        """``model.safetensors`` (the int8 and float tensors), ``config.json`` (HF GPT-2 config with
        ``quantization_config``) and ``generation_config.json``; read back with
        :func:`sublayer.models.quantized.load_quantized`."""

        cfg = self.config.to_hf_dict()
        qc = quant_config(self.keep_float)
        qc["activations"] = "float32 (weight-only int8)"
        cfg["quantization_config"] = qc
        ckpt.write_folder(folder, self.tensors, cfg)
        ckpt.write_generation_config(folder, self.generation_config)

    @staticmethod
    def expected_tensors(config: GPT2Config, keep_float: tuple[str, ...]) -> dict:
        """What a saved folder holds: name -> (shape, dtype) (a tied float head is ``wte`` itself)."""

        d, f, f32 = config.d_model, config.hidden_size, torch.float32
        spec = {"wte": ((config.vocab_size, d), f32), "wpe": ((config.max_positions, d), f32),
                "ln_f.weight": ((d,), f32), "ln_f.bias": ((d,), f32)}  # fmt: skip
        for i in range(config.n_layers):
            p = f"layers.{i}"
            for k, (n_out, n_in) in {"qkv": (3 * d, d), "out": (d, d), "fc1": (f, d), "fc2": (d, f)}.items():
                spec |= dense_spec(f"{p}.{k}", n_out, n_in, keep_float)
            for n in ("ln1", "ln2"):
                spec[f"{p}.{n}.weight"] = spec[f"{p}.{n}.bias"] = ((d,), f32)
        head = dense_spec("head", config.vocab_size, d, keep_float, bias=False)
        if "head.weight" not in head or not config.tie_word_embeddings:
            spec |= head
        return spec

    def __repr__(self) -> str:
        lins = [lin for L in self.layers for lin in L.values()] + [self.head]
        n_q = sum(isinstance(lin, WeightInt8Linear) for lin in lins)
        return f"QuantizedGPT2(weight-only int8 layers={n_q}/{len(lins)}, keep_float={self.keep_float})"
