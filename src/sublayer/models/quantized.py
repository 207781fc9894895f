"""int8 inference: ``fast_inference(model, quantize="int8")`` or :func:`quantize` for :class:`~sublayer.models.Bert`
(this module: int8 weights and int8 activations) and the decoder-only LMs :class:`~sublayer.models.GPT2` and
:class:`~sublayer.models.Llama` (int8 weights for decoding; activations at float32 precision for one row, int8
for several where the CPU has AVX512-VNNI or AMX-INT8; :mod:`sublayer.models.quantized_gpt2`:
:class:`QuantizedCausalLM`). All save with ``save_pretrained`` and load with :func:`load_quantized`, which reads the
folder's ``model_type``. docs/int8.md tells what is quantized and how, the defaults and the accuracy; here, BERT:

* every dense layer of the blocks (fused q|k|v, attention output, FFN in and out) except those named by
  ``keep_float``: weights int8, symmetric per output channel (:func:`quantize_weight`), quantized when the wrapper
  is built (a following wrapper: again whenever the model's weights changed);
* their inputs are quantized dynamically, per token. Where :func:`own_int8_gemm` (the kernels built, a CPU with
  AVX512-VNNI or AMX-INT8) the layers are :class:`sublayer.runtime.linear.Int8Linear` with int8 activations (each
  token uint8 with its own scale and zero point, :func:`sublayer.runtime.linear.quantize_rows`; exact int32 sums;
  bias and GELU fused into the output pass). Elsewhere (AVX2 CPUs, where that kernel has no fast int8 loop) this
  module's :class:`Int8Linear`: each token divided by its own ``max|x|``, the result through
  ``quantized::linear_dynamic`` (the op of the deprecated ``torch.ao.quantization.quantize_dynamic``: uint8 with
  one scale per call, int32 accumulation; engine: :func:`engine`), the output multiplied back per token and the
  float bias added. Its scaling and epilogues (bias + GELU, bias + residual + LayerNorm) are fused C++ passes
  (``kernels/csrc/int8.cpp``) that also prepare the next layer's scaled input; the PyTorch expressions in this file
  are their reference, and without fbgemm (another CPU architecture) :func:`int8_linear_reference` computes the
  same numbers in plain PyTorch (slowly);
* **SmoothQuant** (:func:`smooth_factors`): before quantizing, ``quantize`` runs the float layers once on
  calibration ids and moves each input channel's outliers (the LayerNorm outputs', an order of magnitude above the
  median in all-MiniLM-L6-v2) into the weight's column, which per-channel int8 absorbs;
* what stays float32: embeddings, LayerNorms, attention (:mod:`sublayer.runtime.encoder`), GELU, the pooler, and
  the dense layers matched by ``keep_float`` (``fnmatch`` patterns over ``layers.{i}.{qkv,out,fc1,fc2}``; default
  :func:`default_keep_float`, chosen by measurement: see the comments of :data:`DEFAULT_KEEP_FLOAT`).

``quantize(model)`` is an independent snapshot (it holds only the tensors it uses, its own copies);
``fast_inference(model, quantize="int8")`` (``quantize(model, follow=True)``) holds the model and re-quantizes from
its current weights on the next call after any change (:func:`sublayer.runtime.weights.prepared`, as the float
fast paths). :meth:`QuantizedBert.save_pretrained` writes ``model.safetensors`` + ``config.json`` (the HF config
with a ``quantization_config`` entry); :func:`load_quantized` reads them back without quantizing again. The float
``Bert.from_pretrained`` refuses such a folder and names :func:`load_quantized`.
"""

from __future__ import annotations

import functools
import os
import warnings

import torch
from torch import Tensor

from .. import checkpoints as ckpt
from .. import kernels
from ..functional import fused
from .bert import Bert, BertConfig
from .prepared_bert import PreparedBert, bert_activations, bert_eps, bert_layers, bert_tensors
from ..runtime.linear import Int8Linear as ActInt8Linear
from ..runtime.rows import add_norm, bias_act, kernels_on
from .causal_lm import CausalLM
from .gpt2 import GPT2, GPT2Config
from .llama import MODEL_TYPES as LLAMA_TYPES
from .llama import Llama, LlamaConfig
from .int8 import (
    LINEARS,
    QUANT_METHOD,
    QUANTIZE_CHOICES,
    Int8Wrapper,
    Spec,
    check_float_cpu,
    check_keep_float,
    check_quantize,
    check_tensors,
    dense_names,
    folder_spec,
    int8_tensors,
    own_int8_gemm,
    quantize_weight,
)
from .quantized_gpt2 import DEFAULT_KEEP_FLOAT_GPT2, QuantizedCausalLM, QuantizedGPT2

__all__ = [
    "QUANTIZE_CHOICES",
    "DEFAULT_KEEP_FLOAT",
    "DEFAULT_KEEP_FLOAT_OWN_GEMM",
    "default_keep_float",
    "QUANT_METHOD",
    "quantize",
    "load_quantized",
    "is_quantized_folder",
    "check_quantize",
    "quantize_weight",
    "int8_linear_reference",
    "Int8Linear",
    "own_int8_gemm",
    "QuantizedBert",
    "QuantizedGPT2",
    "QuantizedCausalLM",
]

# The FFN output layers of the first two blocks stay float32: their inputs (GELU outputs) hold the "massive
# activations" of a few tokens (one channel orders of magnitude above the rest), which per-token int8 cannot
# represent next to the other channels. Chosen on all-MiniLM-L6-v2 by the minimum token cosine to HF fp32 over
# real texts and random ids: keeping these two layers float raised it most; keeping more float bought little.
DEFAULT_KEEP_FLOAT: tuple[str, ...] = ("layers.[01].fc2",)
# On sublayer's int8_linear (own_int8_gemm) every token has its own zero point as well as its own scale: 256 levels
# over [min, max] of the row rather than a grid symmetric about 0, which the mostly-positive GELU outputs fill
# twice as finely. There every dense layer is int8 by default: on all-MiniLM-L6-v2 the minimum token cosine to
# fp32 is then 0.995 on random ids and 0.991 on real texts, above linear_dynamic's 0.991 / 0.991 with
# DEFAULT_KEEP_FLOAT (and 0.997 / 0.994 when those two layers stay float).
DEFAULT_KEEP_FLOAT_OWN_GEMM: tuple[str, ...] = ()
SMOOTH_ALPHA = 0.5


def _fbgemm() -> bool:
    """Whether an int8 GEMM engine is there (fbgemm; oneDNN too where :func:`engine` picks it)."""
    return "fbgemm" in torch.backends.quantized.supported_engines


@functools.cache
def engine() -> str:
    """The quantized engine the int8 GEMMs are packed for: ``"onednn"`` on CPUs with AMX-INT8 or AVX512-VNNI
    (oneDNN uses them, fbgemm does not), ``"fbgemm"`` elsewhere (AVX2). ``SUBLAYER_INT8_ENGINE=fbgemm|onednn``
    overrides (read at the first call)."""
    return kernels.cpu.int8_engine(torch.backends.quantized.supported_engines)


def default_keep_float(own_gemm: bool | None = None) -> tuple[str, ...]:
    """BERT's dense layers kept float32 when ``keep_float`` is None: :data:`DEFAULT_KEEP_FLOAT_OWN_GEMM` on
    sublayer's ``int8_linear`` (``own_gemm``; None: :func:`own_int8_gemm`), :data:`DEFAULT_KEEP_FLOAT` on
    ``linear_dynamic``."""
    own = own_int8_gemm() if own_gemm is None else own_gemm
    return DEFAULT_KEEP_FLOAT_OWN_GEMM if own else DEFAULT_KEEP_FLOAT


# ----------------------------------------------------------------------------------------------- one linear
def activation_qparams(x: Tensor) -> tuple[float, int]:
    """fbgemm's dynamic input quantization parameters: uint8 over ``[min(x, 0), max(x, 0)]``, ``(scale, zero_point)``."""
    lo, hi = min(float(x.min()), 0.0), max(float(x.max()), 0.0)
    scale = (hi - lo) / 255 if hi > lo else 1.0
    return scale, int(min(max(round(-lo / scale), 0), 255))


def _row_scale(x: Tensor) -> Tensor:
    """Per-token scale ``max|x[i, :]|`` (N, 1); 1 for an all-zero row."""
    r = x.abs().amax(dim=1, keepdim=True)
    return torch.where(r > 0, r, torch.ones_like(r))


def int8_linear_reference(
    x: Tensor, q: Tensor, scale: Tensor, bias: Tensor | None, smooth: Tensor | None = None
) -> Tensor:
    """What :class:`Int8Linear` computes, in plain PyTorch (float64, exact for these integer sums): each token
    divided by its ``max|x|`` (per-token scale ``r``), the result quantized to uint8 with
    :func:`activation_qparams` (one scale for the call, so per token the grid step is ``r * 2/255`` or finer),
    times ``q``, rescaled by ``r * scale``, plus ``bias``. With ``smooth`` (K,), ``x / smooth`` is quantized
    (``q`` then holds ``W * smooth``). (N, K) -> (N, M) float32."""
    x = x.double() if smooth is None else x.double() / smooth.double()
    r = _row_scale(x)
    xn = x / r
    sx, zp = activation_qparams(xn)
    xq = torch.clamp(torch.round(xn / sx) + zp, 0, 255) - zp
    y = (xq @ q.double().t()) * (sx * scale.double()) * r
    if bias is not None:
        y = y + bias.double()
    return y.float()


class _Epilogues:
    """The call and fused epilogues of the ``linear_dynamic`` path's layers (:class:`Int8Linear`, :class:`FloatLinear`)
    over their ``raw`` GEMM: rescale + bias (+ activation, or + residual + LayerNorm) in one pass that also prepares
    the next int8 layer's input (the protocol of :mod:`sublayer.runtime.encoder`)."""

    def __call__(self, x: Tensor, activation: str | None = None, *, pre=None) -> Tensor:
        y, r = self.raw(x, pre)
        return _epilogue(y, r, self.bias) if activation is None else _epilogue_act(y, r, self.bias, activation, None)[0]

    def act(self, x: Tensor, activation: str, *, pre=None, nxt=None):
        """``(act(x W^T + b), nxt's prepared input or None)``."""
        y, r = self.raw(x, pre)
        return _epilogue_act(y, r, self.bias, activation, nxt)

    def add_norm(self, x: Tensor, resid: Tensor, norm: tuple, *, pre=None, nxt=None):
        """``(LN(resid + x W^T + b), nxt's prepared input or None)``; ``norm`` is ``(weight, bias, eps)``."""
        y, r = self.raw(x, pre)
        return _epilogue_add_norm(y, r, self.bias, resid, *norm, nxt)


class Int8Linear(_Epilogues):
    """``y = x @ dequant(q).T + bias`` with ``x`` quantized dynamically (see the module docstring).

    Args:
        q: (M, K) int8 weight; scale: (M,) float32 per output channel; bias: (M,) float32 or None;
        smooth: (K,) float32 or None: per-input-channel divisor of ``x`` whose inverse ``q`` carries
            (``q * scale ≈ W * smooth``), SmoothQuant's migration of activation outliers into the weights.

    Call: ``x`` (N, K) float32, ``activation`` or None, ``pre`` (its :meth:`prepare` d input, or None) -> (N, M)
    float32; ``act`` / ``add_norm``: fused epilogues (:class:`_Epilogues`).
    """

    def __init__(self, q: Tensor, scale: Tensor, bias: Tensor | None, smooth: Tensor | None = None) -> None:
        self.q, self.scale, self.bias = q, scale.float(), None if bias is None else bias.float()
        # the kernels' "prepare the next input" switch is this vector being given: ones when not smoothed
        self._inv = torch.ones(q.shape[1]) if smooth is None else (1.0 / smooth.float())
        self._packed = None
        if _fbgemm():
            prev = torch.backends.quantized.engine
            torch.backends.quantized.engine = engine()  # the packed object keeps its engine
            try:
                with warnings.catch_warnings():  # quantized tensors are marked deprecated; fbgemm still takes them
                    warnings.simplefilter("ignore")
                    wq = torch._make_per_channel_quantized_tensor(
                        q, self.scale.double(), torch.zeros_like(self.scale, dtype=torch.long), 0
                    )
                    self._packed = torch.ops.quantized.linear_prepack(wq, None)
            finally:
                torch.backends.quantized.engine = prev

    def prepare(self, x: Tensor) -> tuple[Tensor, Tensor]:
        """``(xs, r)``: ``x / smooth`` divided by its per-token max ``r`` (N, 1): what the int8 GEMM quantizes (a
        row of subnormal entries, whose ``1 / r`` overflows float32: ``xs`` zeros, ``r`` 1)."""
        if kernels_on():
            return kernels.ops().int8_scale_rows(x, self._inv)
        x = x * self._inv
        r = _row_scale(x)
        tiny = torch.isinf(1 / r)  # subnormal entries only (1 / max overflows float32): the row quantized as zero
        return torch.where(tiny, 0.0, x / r), r.masked_fill(tiny, 1.0)

    def raw(self, x: Tensor, pre: tuple[Tensor, Tensor] | None = None) -> tuple[Tensor, Tensor]:
        """``(y, r)`` with ``y * r = x @ W.T`` (no bias): the int8 GEMM of ``pre`` or of ``prepare(x)``."""
        xs, r = pre if pre is not None else self.prepare(x)
        if self._packed is None:
            return int8_linear_reference(xs, self.q, self.scale, None), r
        return torch.ops.quantized.linear_dynamic(xs, self._packed, False), r


class FloatLinear(_Epilogues):
    """``addmm(b, x, w.T)`` with ``w`` transposed once: the layers kept in float. ``amax``: when not None, each
    call folds its input's per-channel ``max|x|`` into it (calibration)."""

    def __init__(self, w: Tensor, b: Tensor | None) -> None:
        self.w, self.bias = w.detach().float().contiguous(), None if b is None else b.detach().float()
        self._wt = self.w.t()
        self.amax: Tensor | None = None

    def raw(self, x: Tensor, pre=None) -> tuple[Tensor, None]:
        """``(x @ W.T, None)`` (no bias), as :meth:`Int8Linear.raw`; records ``amax`` when calibrating."""
        if self.amax is not None:
            torch.maximum(self.amax, x.abs().amax(dim=0), out=self.amax)
        return torch.mm(x, self._wt), None


def smooth_factors(x_amax: Tensor, w: Tensor, alpha: float = SMOOTH_ALPHA) -> Tensor:
    """SmoothQuant's per-input-channel factors ``s = max|x|^alpha / max|W[:, k]|^(1 - alpha)`` (K,), clamped to
    [1e-5, 1e5]; channels never seen or with zero weights get 1."""
    w_amax = w.detach().float().abs().amax(dim=0)
    s = x_amax.float().clamp_min(1e-5).pow(alpha) / w_amax.clamp_min(1e-5).pow(1.0 - alpha)
    ok = (x_amax > 0) & (w_amax > 0)
    return torch.where(ok, s.clamp(1e-5, 1e5), torch.ones_like(s))


def _make_linear(t: dict[str, Tensor], name: str, own: bool = False):
    b = t.get(f"{name}.bias")
    if f"{name}.qweight" in t:
        cls = ActInt8Linear if own else Int8Linear  # the same stored tensors serve both GEMMs
        return cls(t[f"{name}.qweight"], t[f"{name}.scale"], b, smooth=t.get(f"{name}.smooth"))
    return FloatLinear(t[f"{name}.weight"], b)


# ------------------------------------------------------------- epilogues: rescale, bias, act / add & norm, prepare
# Each takes a GEMM's raw output ``y`` and its per-token scales ``r`` (None for a float layer) and, when the next
# linear is int8, also returns that linear's prepared input ``(xs, r)`` (None otherwise), in one pass with the
# kernels on; the reference expressions otherwise.
def _prepare(lin, x: Tensor):
    return lin.prepare(x) if isinstance(lin, Int8Linear) else None


def _epilogue(y: Tensor, r: Tensor | None, b: Tensor | None) -> Tensor:
    """``y * r + b``."""
    if r is None:
        return y if b is None else y.add_(b)
    if kernels_on():
        return kernels.ops().int8_rescale_rows_(y, r, b)
    y.mul_(r)
    return y if b is None else y.add_(b)


def _epilogue_act(y: Tensor, r: Tensor | None, b: Tensor | None, act: str, nxt):
    """``h = act(y * r + b)`` -> ``(h, None)``, or ``(xs, (xs, r2))`` prepared for the int8 ``nxt``."""
    inv = nxt._inv if isinstance(nxt, Int8Linear) else None
    if kernels_on() and act in fused.ACT_IDS:
        h, r2 = kernels.ops().int8_act_rows_(y, r, b, fused.ACT_IDS[act], inv)
        return (h, (h, r2)) if isinstance(nxt, Int8Linear) else (h, None)
    if r is not None:
        y.mul_(r)
    h = bias_act(y, b, act)
    return h, _prepare(nxt, h)


def _epilogue_add_norm(y, r, b, resid, w, beta, eps: float, nxt):
    """``x = LN(y * r + b + resid)`` -> ``(x, nxt's prepared input or None)``."""
    inv = nxt._inv if isinstance(nxt, Int8Linear) else None
    if kernels_on():
        x, xs, r2 = kernels.ops().int8_add_norm_rows_(y, r, b, resid, w, beta, eps, inv)
        return x, ((xs, r2) if isinstance(nxt, Int8Linear) else None)
    y = _epilogue(y, r, b)
    x, _ = add_norm(resid, y, w, beta, eps, want_sum=False)
    return x, _prepare(nxt, x)


# ----------------------------------------------------------------------------------------------- BERT
class QuantizedBert(Int8Wrapper, PreparedBert):
    """int8 inference wrapper of a :class:`Bert` (build with :func:`quantize` / ``fast_inference(quantize="int8")``):
    :class:`~.fast.PreparedBert` on int8 layers: a snapshot's own tensors, or (``model`` given) the model's
    current weights re-quantized on the next call after any change, with the same ``calibration`` ids.

    Forward: as :meth:`Bert.forward` (``input_ids``, ``attention_mask`` 1 = token, ``token_type_ids``) -> float32
    (B, T, d_model); hidden states at padded positions are zeros. ``embed`` and ``pooled`` as the model's.
    ``own_gemm`` (None: :func:`own_int8_gemm`): the int8 layers on sublayer's ``int8_linear`` (True) or on
    ``quantized::linear_dynamic`` (False); the same stored tensors serve both.

    Raises:
        TypeError/ValueError: as :meth:`Bert.forward`.
    """

    def __init__(
        self, config: BertConfig, tensors: dict[str, Tensor] | None, keep_float: tuple[str, ...], *,
        own_gemm: bool | None = None, model: Bert | None = None, calibration: Tensor | None | bool = None,
    ) -> None:  # fmt: skip
        self.own_gemm = own_int8_gemm() if own_gemm is None else bool(own_gemm)
        self._follow(config, keep_float, model, tensors)
        if model is not None:  # following: the same calibration ids at every re-quantization, and in the cache key
            given = isinstance(calibration, Tensor)
            self.calibration = calibration.clone() if given else calibration
            ids = (tuple(calibration.shape), *calibration.flatten().tolist()) if given else calibration
            self._key = ("int8", self.keep_float, self.own_gemm, ids)
        self.pooler = "pooler.dense.weight" in self._parts()[0]  # builds the layers (a following wrapper quantizes)
        self._check = Bert(config, pooler=self.pooler, device="meta")._prepare  # checks only

    def _build(self, t: dict[str, Tensor]) -> tuple[dict[str, Tensor], list[dict]]:
        linear = lambda t, name: _make_linear(t, name, self.own_gemm)  # noqa: E731
        return t, bert_layers(t, self.config, linear, bert_eps(self.model, self.config),
                             bert_activations(self.model, self.config))  # fmt: skip

    def _quantize(self, model: Bert) -> dict[str, Tensor]:
        return _int8_tensors(model, self.keep_float, self.calibration, copy=False)

    @property
    def layers(self) -> list[dict]:
        """The layers of :func:`sublayer.runtime.encoder.run_layers`."""
        return self._parts()[1]

    _train_error = "is inference-only; train the float model and quantize it again"
    split_probs = False  # bf16 probabilities: their error is small next to int8 activations

    @property
    def attention_dtype(self) -> torch.dtype | None:
        """bf16 attention (the ``packed_self_attention`` kernel: bf16 q, k, v and probabilities, float32 sums and
        softmax) where the kernels run and the CPU multiplies bf16 natively; float32 elsewhere."""
        return torch.bfloat16 if kernels_on() and kernels.native_bf16_gemm() else None

    @classmethod
    def from_model(
        cls, model: Bert, keep_float=None, calibration: Tensor | None | bool = None, *,
        own_gemm: bool | None = None, follow: bool = False,
    ) -> QuantizedBert:
        """See :func:`quantize`; ``own_gemm`` as the constructor's."""
        keep_float = default_keep_float(own_gemm) if keep_float is None else keep_float
        keep_float = check_keep_float(keep_float, dense_names(model.config.n_layers))
        if follow:
            return cls(model.config, None, keep_float, own_gemm=own_gemm, model=model, calibration=calibration)
        t = _int8_tensors(model, keep_float, calibration, copy=True)
        return cls(model.config, t, keep_float, own_gemm=own_gemm)

    @staticmethod
    def expected_tensors(config: BertConfig, keep_float: tuple[str, ...]) -> tuple[Spec, set[str]]:
        """What a saved folder holds: name -> (shape, dtype), and the names that may be absent (the pooler, the
        smoothing factors of an uncalibrated model)."""
        spec = folder_spec(bert_tensors(Bert(config, device="meta")), keep_float, smooth=True)  # shapes only
        return spec, {"pooler.dense.weight", "pooler.dense.bias"} | {k for k in spec if k.endswith(".smooth")}

    def __repr__(self) -> str:
        n_q = sum(isinstance(L[k], (Int8Linear, ActInt8Linear)) for L in self.layers for k in LINEARS)
        gemm = "int8_linear" if self.own_gemm else "linear_dynamic"
        return f"QuantizedBert(int8 layers={n_q}/{4 * len(self.layers)}, keep_float={self.keep_float}, gemm={gemm})"


def _int8_tensors(model: Bert, keep_float: tuple[str, ...], calibration, *, copy: bool) -> dict[str, Tensor]:
    """``model``'s stored int8 tensors (:func:`quantize`'s smoothing and quantization, :func:`~.int8.int8_tensors`);
    ``copy``: every tensor its own (a snapshot), else the float ones may be views of the parameters."""
    check_float_cpu(model)
    t = {k: v.float() for k, v in bert_tensors(model).items()}
    amax = {}
    if calibration is not False:
        ref = QuantizedBert(model.config, t, ("*",))
        for i, L in enumerate(ref.layers):
            for k in LINEARS:
                L[k].amax = amax[f"layers.{i}.{k}"] = torch.zeros(L[k].w.shape[1])
        ref(_calibration_ids(model.config, calibration))
    smooth = {k: smooth_factors(x_amax, t[f"{k}.weight"]) for k, x_amax in amax.items()}
    return int8_tensors(t, keep_float, copy=copy, smooth=smooth)


def _calibration_ids(config: BertConfig, calibration: Tensor | None | bool) -> Tensor:
    """The ids the float model runs on to measure each dense layer's input range: the user's (B, T) ids, or
    (default) 8 x min(128, max_positions) random ids from a fixed seed."""
    if isinstance(calibration, Tensor):
        return calibration
    g = torch.Generator().manual_seed(0)
    lo = 1 if config.vocab_size > 1 else 0
    return torch.randint(lo, config.vocab_size, (8, min(128, config.max_positions)), generator=g)


def quantize(
    model: Bert | CausalLM, *, keep_float=None, calibration: Tensor | None | bool = None, follow: bool = False
) -> QuantizedBert | QuantizedCausalLM:
    """The int8 inference wrapper of ``model`` (see the module docstring): by default an independent snapshot of
    the weights ``model`` has now (it holds only its own tensors, not the model); with ``follow`` (what
    ``fast_inference(model, quantize="int8")`` returns) a wrapper holding ``model`` that re-quantizes from the
    current weights on the next call after any change (:func:`sublayer.runtime.weights.prepared`, the float fast
    paths' cache; BERT with the same calibration ids each time).

    Args:
        model: a :class:`Bert` or a decoder-only LM (:class:`GPT2`, :class:`Llama`) with float32 CPU parameters.
        keep_float: ``fnmatch`` patterns of dense layers left in float32, over ``layers.{i}.{qkv,out,fc1,fc2}``
            (the LMs also ``head``, the LM head); None: :func:`default_keep_float` (BERT) /
            :data:`~sublayer.models.quantized_gpt2.DEFAULT_KEEP_FLOAT_GPT2` (the LMs).
        calibration: BERT only: (B, T) token ids the float layers run on to measure input ranges for the
            smoothing factors; None: 8 random sequences (fixed seed); False: no smoothing. The LMs are not
            smoothed: nothing to calibrate (must be None).
        follow: keep ``model`` and re-quantize its weights whenever they changed (False: a snapshot).

    Raises:
        TypeError: not a Bert or causal LM, or ``keep_float`` not a sequence of str. ValueError: a ``keep_float``
        pattern that matches no layer, parameters not float32 or not on the CPU, bad calibration ids (as
        :meth:`Bert.forward`), ``calibration`` given for a causal LM.
    """
    if isinstance(model, Bert):
        return QuantizedBert.from_model(model, keep_float, calibration, follow=follow)
    if isinstance(model, CausalLM):
        if calibration is not None:
            raise ValueError(
                f"calibration applies to BERT's SmoothQuant; {type(model).__name__}'s int8 has no smoothing to "
                f"calibrate (each row's activations are quantized as they come, or kept float32), so calibration "
                f"must be None, got "
                f"{type(calibration).__name__}"
            )
        keep_float = DEFAULT_KEEP_FLOAT_GPT2 if keep_float is None else keep_float
        return QuantizedCausalLM.from_model(model, keep_float, follow=follow)
    raise TypeError(f"int8 quantization needs a sublayer Bert, GPT2 or Llama model, got {type(model).__name__}")


# model_type -> the decoder-only LM class and its config class (load_quantized)
_CAUSAL = {"gpt2": (GPT2, GPT2Config), **{k: (Llama, LlamaConfig) for k in LLAMA_TYPES}}


def is_quantized_folder(folder: str | os.PathLike) -> bool:
    """Whether ``folder/config.json`` names sublayer's int8 format (False when there is no readable config)."""
    try:
        qc = ckpt.read_config(folder).get("quantization_config")
    except (OSError, ValueError):
        return False
    return isinstance(qc, dict) and qc.get("quant_method") == QUANT_METHOD


def load_quantized(folder: str | os.PathLike) -> QuantizedBert | QuantizedCausalLM:
    """Read a folder written by :meth:`QuantizedBert.save_pretrained` or :meth:`QuantizedCausalLM.save_pretrained`
    (by its config's ``model_type``: gpt2, llama, qwen2 or BERT's).

    Raises:
        FileNotFoundError: no folder/config/weights. CheckpointError: not a sublayer int8 folder, or one message
        listing every tensor missing, unexpected, of the wrong shape or of the wrong dtype.
    """
    hf = ckpt.read_config(folder)
    qc = hf.get("quantization_config")
    if not isinstance(qc, dict) or qc.get("quant_method") != QUANT_METHOD:
        raise ckpt.CheckpointError(
            f"{folder} is not a sublayer int8 folder (config.json has no quantization_config with "
            f"quant_method={QUANT_METHOD!r}); load float folders with Bert/GPT2.from_pretrained and quantize them"
        )
    lm = _CAUSAL.get(hf.get("model_type"))
    try:
        config = (lm[1] if lm else BertConfig).from_hf_dict({k: v for k, v in hf.items() if k != "quantization_config"})
    except (ValueError, TypeError) as e:
        raise ckpt.CheckpointError(f"config file {os.path.join(folder, ckpt.CONFIG_NAME)}: {e}") from None
    tensors, source = ckpt.read_state_dict(folder)
    keep = qc.get("keep_float", [])
    if not isinstance(keep, list) or not all(isinstance(p, str) for p in keep):
        raise ckpt.CheckpointError(f"{source}: quantization_config keep_float must be a list of str, got {keep!r}")
    keep = tuple(keep)
    if lm:
        skeleton = lm[0](config, device="meta")
        spec, optional = QuantizedCausalLM.expected_tensors(skeleton, keep), set()
    else:
        spec, optional = QuantizedBert.expected_tensors(config, keep)
    pooler = ("pooler.dense.weight" in tensors) + ("pooler.dense.bias" in tensors)
    if pooler == 1:  # both or neither
        optional -= {"pooler.dense.weight", "pooler.dense.bias"}
    check_tensors(tensors, spec, source, optional)
    if lm:
        model = QuantizedCausalLM(skeleton, dict(tensors), keep)
        model.generation_config = ckpt.read_generation_config(folder, config.vocab_size) or model.generation_config
        return model
    return QuantizedBert(config, dict(tensors), keep)
