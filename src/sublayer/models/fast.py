"""An inference fast path for :class:`~sublayer.models.Bert` and :class:`~sublayer.models.GPT2`.

``fast = fast_inference(model, dtype=torch.bfloat16)`` returns a separate, inference-only wrapper object
(:class:`FastBert` / :class:`FastGPT2`); the model itself is not changed and keeps training as before. The wrapper:

* caches the weights once in the *compute dtype*: bf16 when the CPU multiplies bf16 natively (AVX512_BF16 / AMX,
  :func:`sublayer.kernels.native_bf16_gemm`), otherwise float32 — on an AVX2 CPU oneDNN's bf16 GEMMs are ~8x slower
  than fp32, so asking for bf16 there gives the fp32 path (``fast.compute_dtype`` tells which one runs);
* fuses q, k, v into one GEMM, adds biases inside the GEMM (``addmm``), runs bias + activation and residual add +
  LayerNorm in the fused kernels of :mod:`sublayer.kernels` (fp32 statistics; the reference ops when the kernels
  are off), attention in ``F.scaled_dot_product_attention`` with the padding mask;
* BERT with padding: the dense layers only see real tokens (padding rows are dropped before the GEMMs and put back
  for attention only), so a batch of mixed lengths costs the FLOPs of its real tokens. The hidden states at padded
  positions are returned as zeros (the reference model computes values there that nothing should read);
* runs without autograd (outputs never require grad), without dropout (eval semantics, whatever ``model.training``
  says) and with autocast switched off inside (the compute dtype above decides; calling it under
  ``torch.autocast`` changes nothing);
* never uses stale weights: every call compares the parameters' version counters and storages with those it cached
  and re-caches after an optimizer step, ``load_state_dict`` or ``.to()``. Writes through ``param.data`` bypass
  the version counter: call :meth:`FastBert.refresh` / :meth:`FastGPT2.refresh` after those.

Memory: with float32 compute the cache aliases the parameters except the fused q/k/v weight (one copy of the
attention input projections); with bf16 compute it holds a bf16 copy of every matrix (half the model's size).

Outputs are float32 (the model's dtype), like ``BertModel`` under ``torch.autocast("cpu", dtype=torch.bfloat16)``.
In bf16 the results keep cosine similarity >= 0.999 to the fp32 model (tests check it).
"""

from __future__ import annotations

import functools
import math

import torch
import torch.nn.functional as F
from torch import Tensor

from .. import functional as SF
from .. import kernels
from ..checkpoints import FROM_CONFIG
from ..functional import fused
from .bert import Bert
from .gpt2 import GPT2, check_attention_mask, check_input_ids

__all__ = ["fast_inference", "FastBert", "FastGPT2"]

_DTYPES = (torch.float32, torch.bfloat16)


def compute_dtype(dtype: torch.dtype) -> torch.dtype:
    """The dtype the fast path computes in when ``dtype`` is asked for: bf16 only with native bf16 GEMMs."""
    if dtype == torch.bfloat16 and not kernels.native_bf16_gemm():
        return torch.float32
    return dtype


def fast_inference(
    model: Bert | GPT2, *, dtype: torch.dtype = torch.bfloat16, quantize: str | None = None
) -> FastBert | FastGPT2:
    """An inference-only fast wrapper around ``model`` (see the module docstring).

    Args:
        model: a :class:`Bert` or :class:`GPT2` on the CPU, float32 parameters.
        dtype: ``torch.bfloat16`` (default: bf16 weights and activations where the CPU has native bf16 GEMMs,
            float32 elsewhere) or ``torch.float32``.
        quantize: None, or ``"int8"``: the int8 wrapper of :mod:`sublayer.models.quantized` (QuantizedBert /
            QuantizedGPT2; its float parts run in float32 whatever ``dtype`` says).

    Returns:
        :class:`FastBert` (``__call__``/``forward``, ``embed``, ``pooled`` as the model's) or :class:`FastGPT2`
        (``__call__``/``forward`` giving logits, ``generate``).

    Raises:
        TypeError: ``model`` is not a Bert or GPT2. ValueError: ``dtype`` not float32/bfloat16, ``quantize``
        not None/"int8", or the model's parameters are not float32 CPU tensors.
    """
    if dtype not in _DTYPES:
        raise ValueError(f"dtype must be torch.float32 or torch.bfloat16, got {dtype!r}")
    if quantize is not None:
        from . import quantized

        quantized.check_quantize(quantize)
        return quantized.quantize(model)
    if isinstance(model, Bert):
        return FastBert(model, dtype=dtype)
    if isinstance(model, GPT2):
        return FastGPT2(model, dtype=dtype)
    raise TypeError(f"fast_inference needs a sublayer Bert or GPT2 model, got {type(model).__name__}")


# ----------------------------------------------------------------------------------------------- building blocks
def _inference(fn):
    """No autograd and no autocast inside: the wrapper's compute dtype decides every GEMM's dtype (autocast would
    send them to bf16 GEMMs even where those are ~8x slower than fp32)."""

    @functools.wraps(fn)
    def wrapper(*args, **kwargs):
        with torch.no_grad(), torch.autocast("cpu", enabled=False):
            return fn(*args, **kwargs)

    return wrapper


def _kernels_on() -> bool:
    return kernels._enabled and kernels.available()


def _layer_norm(x: Tensor, w: Tensor, b: Tensor, eps: float) -> Tensor:
    """LayerNorm over the last dim, fp32 statistics, output in x's dtype."""
    if x.dtype == torch.float32:
        return F.layer_norm(x, w.shape, w, b, eps)
    return F.layer_norm(x.float(), w.shape, w, b, eps).to(x.dtype)


def _add_norm(
    x: Tensor, y: Tensor, w: Tensor, b: Tensor, eps: float, *, want_sum: bool
) -> tuple[Tensor, Tensor | None]:
    """``(LN(x + y), x + y if want_sum)`` for 2-D (N, d) x, y; w, b float32."""
    if _kernels_on():
        out, s, _, _, _ = kernels.ops().add_norm_fwd(x, y, w, b, eps, 0.0, 0, False, want_sum)
        return out, (s if want_sum else None)
    s = x + y
    return _layer_norm(s, w, b, eps), s


def _bias_act(a: Tensor, b: Tensor, act: str) -> Tensor:
    """``act(a + b)`` in place where the kernels run; a (N, f) contiguous, b float32 (f,)."""
    if _kernels_on() and act in fused._ACT_IDS:
        return kernels.ops().act_fwd(a, b, fused._ACT_IDS[act], 0.0, 0, True)
    return SF.activation_fn(act)((a.float() + b).to(a.dtype) if a.dtype != torch.float32 else a + b)


class _Cache:
    """Weights cast once; rebuilt when a source parameter changes (version counter, storage or dtype)."""

    def __init__(self, model: torch.nn.Module, build) -> None:
        self._model, self._build, self._stamp, self.w = model, build, None, None

    def _current_stamp(self) -> tuple:
        # inference tensors (made under torch.inference_mode) have no version counter: their storage, dtype and
        # device still tell a replaced parameter, not one changed in place under inference_mode
        return tuple(
            (-1 if p.is_inference() else p._version, p.data_ptr(), p.dtype, p.device) for p in self._model.parameters()
        )

    def get(self):
        stamp = self._current_stamp()
        if stamp != self._stamp:
            with torch.no_grad():
                self.w = self._build()
            self._stamp = stamp
        return self.w


def _check_model_params(model: torch.nn.Module) -> None:
    for name, p in model.named_parameters():
        if p.dtype != torch.float32 or p.device.type != "cpu":
            raise ValueError(f"fast_inference needs float32 CPU parameters; {name} is {p.dtype} on {p.device}")


class _FastBase:
    """Shared: compute dtype, weight cache, inference-only mode switches."""

    def __init__(self, model, dtype: torch.dtype) -> None:
        _check_model_params(model)
        self.model = model
        self.config = model.config
        self.dtype = dtype
        self.compute_dtype = compute_dtype(dtype)
        self._cache = _Cache(model, self._build)
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

    def refresh(self) -> None:
        """Re-cast the weights on the next call (needed only after writes through ``param.data``)."""
        self._cache._stamp = None

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

    Forward: as :meth:`Bert.forward` (``input_ids``, ``attention_mask`` 1 = token, ``token_type_ids``) ->
    float32 (B, T, d_model); hidden states at padded positions are zeros. ``embed`` and ``pooled`` as the model's.

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

    @_inference
    def forward(
        self, input_ids: Tensor, attention_mask: Tensor | None = None, token_type_ids: Tensor | None = None
    ) -> Tensor:
        kpm, token_type_ids = self.model._prepare(input_ids, attention_mask, token_type_ids)
        W = self._cache.get()
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
        x = _layer_norm(x, W["nw"], W["nb"], W["eps"]).to(cd)  # (N, d), N = real tokens
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
            x, _ = _add_norm(x, y, L["n1w"], L["n1b"], L["eps1"], want_sum=False)
            h = _bias_act(torch.mm(x, L["w1_t"]), L["b1"], cfg.activation)
            y = torch.addmm(L["b2"], h, L["w2_t"])
            del h
            x, _ = _add_norm(x, y, L["n2w"], L["n2b"], L["eps2"], want_sum=False)
        x = x.float()
        if keep is not None:
            out = x.new_zeros(B * T, d)
            out.index_copy_(0, keep, x)
            x = out
        return x.view(B, T, d)

    @_inference
    def pooled(
        self, input_ids: Tensor, attention_mask: Tensor | None = None, token_type_ids: Tensor | None = None
    ) -> Tensor:
        """As :meth:`Bert.pooled`: ``tanh(dense(h[:, 0]))`` (B, d_model), float32.

        Raises:
            ValueError: the model has no pooler.
        """
        if self.model.pooler is None:
            raise ValueError("this Bert has no pooler (built with pooler=False or loaded from a file without one)")
        h = self(input_ids, attention_mask, token_type_ids)
        w, b = self._cache.get()["pool"]
        return torch.tanh(torch.addmm(b, h[:, 0], w))

    @_inference
    def embed(
        self, input_ids: Tensor, attention_mask: Tensor | None = None, token_type_ids: Tensor | None = None
    ) -> Tensor:
        """As :meth:`Bert.embed`: mean over real tokens, L2-normalised, (B, d_model) float32.

        Raises:
            ValueError: as :meth:`forward`, or a row with no token.
        """
        h = self(input_ids, attention_mask, token_type_ids)
        if attention_mask is None:
            mean = h.mean(dim=1)
        else:
            w = attention_mask.to(h.dtype)[..., None]
            count = w.sum(dim=1)
            if bool((count == 0).any()):
                raise ValueError("attention_mask has a row with no token (all 0): nothing to average")
            mean = (h * w).sum(dim=1) / count  # padded rows are zeros here anyway
        return F.normalize(mean, p=2.0, dim=-1)


# ----------------------------------------------------------------------------------------------- GPT-2
class FastGPT2(_FastBase):
    """Inference fast path of a :class:`GPT2` (built by :func:`fast_inference`).

    Forward: as :meth:`GPT2.forward` -> float32 logits (B, T, vocab_size). ``generate``: :meth:`GPT2.generate`'s
    loop (same arguments, greedy gives the model's tokens) over the fast blocks with a KV cache.

    Raises:
        TypeError/ValueError: as :meth:`GPT2.forward` / :meth:`GPT2.generate`.
    """

    def _build(self) -> dict:
        m = self.model
        layers = [self._block_weights(blk) for blk in m.blocks]
        return {
            "wte": m.wte.weight.detach(), "wpe": m.wpe.weight.detach(), "layers": layers,
            "nfw": self._f(m.ln_f.weight), "nfb": self._f(m.ln_f.bias), "epsf": m.ln_f.eps,
            "head_t": self._c(m.lm_head.weight).t(),
        }  # fmt: skip

    @property
    def decode_model(self):
        """The model whose float32 weights :mod:`sublayer.models.decoding` streams in ``generate`` (None: this
        wrapper's own weights differ from the model's, e.g. native bf16, and the reference loop runs)."""
        return self.model if self.compute_dtype == torch.float32 and self.dtype in _DTYPES else None

    # what GPT2.generate needs from ``self``
    @property
    def blocks(self):
        return self.model.blocks

    @property
    def generation_config(self):
        return self.model.generation_config

    @_inference
    def lm_head(self, h: Tensor) -> Tensor:
        W = self._cache.get()
        return torch.matmul(h.to(self.compute_dtype), W["head_t"]).float()

    def _hidden(
        self, input_ids: Tensor, position_ids: Tensor, key_padding_mask: Tensor | None, caches: list | None
    ) -> Tensor:
        """Final-LayerNormed hidden states (B, T, d) in the compute dtype; ``caches``: one KVCache per block."""
        W = self._cache.get()
        cfg = self.config
        B, T = input_ids.shape
        d, H = cfg.d_model, cfg.n_heads
        hd = d // H
        cd = self.compute_dtype
        x = (W["wte"][input_ids] + W["wpe"][position_ids]).to(cd).reshape(B * T, d)
        past = 0 if caches is None else len(caches[0])
        tk = past + T
        if key_padding_mask is None and past == 0:
            mask, causal = None, True
        elif key_padding_mask is None and T == 1:
            mask, causal = None, False
        else:
            mask = SF.causal_mask(T, tk, device=x.device)[None, None]
            if key_padding_mask is not None:
                mask = mask & ~key_padding_mask[:, None, None, :]
            causal = False
        L0 = W["layers"][0]
        h = _layer_norm(x, L0["n1w"], L0["n1b"], L0["eps1"])
        layers = W["layers"]
        for i, L in enumerate(layers):
            qkv = torch.addmm(L["bqkv"], h, L["wqkv_t"])
            q, k, v = qkv.view(B, T, 3, H, hd).permute(2, 0, 3, 1, 4)
            if caches is not None:
                k, v = caches[i].update(k, v)
            ctx = F.scaled_dot_product_attention(q, k, v, attn_mask=mask, is_causal=causal)
            y = torch.addmm(L["bo"], ctx.transpose(1, 2).reshape(B * T, d), L["wo_t"])
            h, x = _add_norm(x, y, L["n2w"], L["n2b"], L["eps2"], want_sum=True)  # x += attn; h = ln_2(x)
            a = _bias_act(torch.mm(h, L["w1_t"]), L["b1"], cfg.activation)
            y = torch.addmm(L["b2"], a, L["w2_t"])
            del a
            nxt = layers[i + 1] if i + 1 < len(layers) else None
            if nxt is not None:  # x += ffn; h = next ln_1(x)
                h, x = _add_norm(x, y, nxt["n1w"], nxt["n1b"], nxt["eps1"], want_sum=True)
            else:  # x += ffn; h = ln_f(x)
                h, _ = _add_norm(x, y, W["nfw"], W["nfb"], W["epsf"], want_sum=False)
        return h.view(B, T, d)

    @_inference
    def forward(
        self, input_ids: Tensor, *, attention_mask: Tensor | None = None, position_ids: Tensor | None = None
    ) -> Tensor:
        cfg = self.config
        check_input_ids("input_ids", input_ids, cfg.vocab_size, cfg.max_positions)
        b, t = input_ids.shape
        kpm = None if attention_mask is None else check_attention_mask(attention_mask, (b, t))
        position_ids = GPT2._position_ids(self, position_ids, b, t, input_ids.device)  # type: ignore[arg-type]
        kpm = kpm if kpm is not None and bool(kpm.any()) else None
        return self.lm_head(self._hidden(input_ids, position_ids, kpm, None))

    @_inference
    def generate(self, input_ids: Tensor, max_new_tokens: int = FROM_CONFIG, **kwargs) -> Tensor:
        """:meth:`GPT2.generate` (same arguments, defaults and checks) over the fast path."""
        return GPT2.generate(self, input_ids, max_new_tokens, **kwargs)  # type: ignore[arg-type]
