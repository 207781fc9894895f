"""Fused, memory-lean CPU paths for Add & Norm, the FFN and dropout (custom autograd Functions over
:mod:`sublayer.kernels`).

Each public function here has the signature of its reference in :mod:`sublayer.functional` plus a keyword-only
``impl``: ``"auto"`` (the default; what the modules use) takes the fused path when it applies — CPU tensors, float32 or
bfloat16 (also under ``torch.autocast("cpu", dtype=torch.bfloat16)`` with float32 weights), a supported activation,
no forward-mode AD, functorch transform or ``torch.compile`` tracing — and the reference otherwise; ``"fused"`` forces
the kernels (float64 too, for gradcheck) and raises ``RuntimeError`` if they cannot run; ``"reference"`` always runs
the reference.

What the fused path changes, and what it does not:

* Dropout uses a counter-based Philox4x32-10 stream keyed by a 64-bit seed drawn from torch's default generator (or
  ``generator=``), so ``torch.manual_seed`` reproduces it; the mask is NOT the one ``F.dropout`` would draw (only its
  distribution is the same: keep-rate ``1 - p`` rounded to a multiple of 2^-16, kept values scaled by 1 / that
  rate — :func:`keep_probability` — so the mean is exactly unbiased). A ``p`` whose rounded threshold would be 0 or
  2^16 (``p <= 2^-17`` or ``p >= 1 - 2^-17``) takes the reference path under ``impl="auto"`` and is a ``ValueError``
  under ``impl="fused"``. The FFN's backward regenerates its masks from the seeds; Add & Norm keeps its mask as 1
  bit per element (d/8 bytes a row), cheaper than drawing it again. No full-precision mask is ever stored.
* Add & Norm saves only the (rounded) sum ``x + dropout(y)``, per-row float32 mean/rstd and the 1-bit mask; its
  backward computes the sum's gradient once and hands it to both inputs (a copy of it when there is no dropout
  and the dtypes match: gradients returned by an autograd Function must never alias each other).
* The FFN saves its input and, for ReLU, the fc2 input (``h > 0`` tells ReLU's derivative and the dropout mask at
  once), otherwise the fc1 output before bias (the pre-activation; packed ``[gate | up]`` for SwiGLU/GeGLU/ReGLU);
  the hidden activation is recomputed in backward. With ``recompute=True`` it saves the input only and runs fc1
  again in backward.
* bf16 GEMMs on a CPU without AVX512_BF16/AMX run in fp32 on upcast operands, rounded to bf16 once
  (:func:`sublayer.kernels.native_bf16_gemm`), because oneDNN's bf16 GEMM is several times slower than fp32 there.
* Results equal the reference within its own low-precision error (tests derive the tolerances). The backward is
  not differentiable again: a backward with ``create_graph=True`` raises ``RuntimeError`` (use
  ``impl="reference"`` or ``sublayer.kernels.set_enabled(False)`` for higher-order gradients).
"""

from __future__ import annotations

import math
from collections.abc import Sequence

import torch
import torch.utils.checkpoint
from torch import Tensor

from .. import kernels
from ..kernels import onednn
from .._checks import (
    check_choice,
    check_last_dims,
    check_param_shape,
    check_probability,
    check_same_shape,
    check_tensor,
    normalize_shape,
)
from . import ffn as _ffn
from . import norm as _norm

__all__ = [
    "add_norm", "feed_forward", "dropout", "linear", "dropout_seed", "keep_probability", "FUSED_ACTIVATIONS", "IMPLS",
]  # fmt: skip

IMPLS = ("auto", "fused", "reference")
# activation name -> kernel id (csrc/act_norm.h: enum Act); a gated name -> its gate's id, run by glu_fwd/glu_bwd
ACT_IDS = {"relu": 1, "gelu": 2, "gelu_tanh": 3, "silu": 4, "relu2": 5}
GLU_IDS = {"swiglu": 4, "geglu": 2, "reglu": 1}  # a gated activation -> its gate's ACT_IDS id
FUSED_ACTIVATIONS: tuple[str, ...] = (*ACT_IDS, *GLU_IDS)
_RELU = 1
_AUTO_DTYPES = (torch.float32, torch.bfloat16)
_FUSED_DTYPES = (torch.float32, torch.bfloat16, torch.float64)


def dropout_seed(generator: torch.Generator | None = None) -> int:
    """A 63-bit dropout seed drawn from ``generator`` (default: torch's CPU generator, so ``manual_seed`` rules)."""
    return int(torch.empty((), dtype=torch.int64).random_(generator=generator))


def keep_probability(p: float) -> float:
    """The keep rate of the fused dropout for drop probability ``p``: ``1 - round(p · 2^16) / 2^16`` (its 16-bit
    threshold); kept values are scaled by its inverse. Equals ``1 - p`` to 2^-17."""
    return 1.0 - round(p * 65536) / 65536


def _fused_p_ok(impl: str, **ps: float) -> bool:
    """True if every drop probability is 0 or expressible by the fused dropout's 16-bit keep threshold
    (``round(p · 2^16)`` in [1, 2^16 - 1]); else False, or a ValueError for ``impl="fused"``."""
    for name, p in ps.items():
        if p > 0 and not 1 <= round(p * 65536) <= 65535:
            if impl == "fused":
                raise ValueError(
                    f"{name}={p} is too close to {0 if p < 0.5 else 1} for the fused dropout's 16-bit keep threshold "
                    f"(it needs 2^-17 < p < 1 - 2^-17 or p = 0); use impl='reference' (torch's dropout)"
                )
            return False
    return True


def _plain_cpu(*ts: Tensor | None) -> bool:
    return all(t is None or (t.device.type == "cpu" and type(t) in (Tensor, torch.nn.Parameter)) for t in ts)


def bf16_autocast(*ts: Tensor | None) -> bool:
    """Whether bfloat16 CPU autocast is on and computes with these inputs: every one float32 or bfloat16, on the CPU
    (autocast casts the float32 operands of a linear to bfloat16; other mixes are not its bfloat16 computation)."""
    if not torch.is_autocast_enabled("cpu") or torch.get_autocast_dtype("cpu") != torch.bfloat16:
        return False
    return all(t.device.type == "cpu" and t.dtype in (torch.float32, torch.bfloat16) for t in ts if t is not None)


def _why_not_fused(dtypes_ok: bool, *ts: Tensor | None) -> str | None:
    """None if the fused path can run on these tensors, else the reason."""
    # first: under torch.compile, kernels.available() (a lock, maybe a build) would be a graph break
    if torch.compiler.is_compiling() or torch._C._are_functorch_transforms_active():
        return "torch.compile / functorch transforms use the reference path"
    if not kernels.available():
        if not kernels.switched_on():
            return "the kernels are switched off (SUBLAYER_KERNELS=0 or sublayer.kernels.set_enabled(False))"
        return f"the kernels are unavailable ({kernels.build_error()})"
    if not _plain_cpu(*ts):
        return "the fused path needs plain CPU tensors"
    if not dtypes_ok:
        return "unsupported dtype combination for the fused path"
    if torch.autograd.forward_ad._current_level >= 0:
        return "forward-mode AD uses the reference path"
    return None


def _use_fused(impl: str, dtypes_auto_ok: bool, dtypes_fused_ok: bool, *ts: Tensor | None) -> bool:
    check_choice("impl", impl, IMPLS)
    if impl == "reference":
        return False
    if impl == "auto":  # the cheap switch first: no build attempted when switched off
        return kernels.switched_on() and _why_not_fused(dtypes_auto_ok, *ts) is None
    why = _why_not_fused(dtypes_fused_ok, *ts)
    if why is not None:
        raise RuntimeError(f"impl='fused' cannot run: {why}")
    return True


def _refuse_double_backward() -> None:
    # A backward run with create_graph=True would silently give gradients that do not depend on the inputs
    # (the kernels are not differentiable): refuse loudly instead.
    if torch.is_grad_enabled():
        raise RuntimeError(
            "sublayer's fused CPU kernels do not support double backward (create_graph=True); use "
            "impl='reference', sublayer.kernels.set_enabled(False) or SUBLAYER_KERNELS=0 for higher-order gradients"
        )


# ----------------------------------------------------------------------------------------------- Add & Norm
class _AddNormFn(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, y, weight, bias, eps, p, seed, rms):  # x, y: (N, d) contiguous
        acc = _norm.acc_dtype(x)
        w = weight.to(acc) if weight is not None else None
        b = bias.to(acc) if bias is not None else None
        need = any(ctx.needs_input_grad[:4])
        out, s, mean, rstd, keep = kernels.ops().add_norm_fwd(x, y, w, b, eps, p, seed, rms, need)
        if need:
            ctx.save_for_backward(s, mean, rstd, w, keep)
        ctx.meta = (
            x.dtype, y.dtype, p, rms,
            weight.dtype if weight is not None else None, bias.dtype if bias is not None else None,
        )  # fmt: skip
        return out

    @staticmethod
    def backward(ctx, g):
        _refuse_double_backward()
        s, mean, rstd, w, keep = ctx.saved_tensors  # keep: the dropout mask, 1 bit per element
        xdt, ydt, p, rms, wdt, bdt = ctx.meta
        has_b = bdt is not None
        nx, ny, nw, nb = ctx.needs_input_grad[:4]
        share = p == 0.0 and xdt == ydt  # one gradient tensor for both inputs
        dx, dy, dw, db = kernels.ops().add_norm_bwd(
            g.contiguous(), s, mean, rstd, w, keep, xdt, ydt, p, rms,
            bool(ny and not share), bool(nw and w is not None), bool(nb and has_b),
        )  # fmt: skip
        if share:  # a copy when both are returned: aliased gradients would be accumulated twice into leaves
            dy = dx.clone() if nx else dx
        return (
            dx if nx else None,
            dy if ny else None,
            dw.to(wdt) if (nw and w is not None) else None,
            db.to(bdt) if (nb and has_b) else None,
            None, None, None, None,
        )  # fmt: skip


def add_norm(
    x: Tensor,
    y: Tensor,
    normalized_shape: int | Sequence[int],
    weight: Tensor | None = None,
    bias: Tensor | None = None,
    eps: float = 1e-5,
    *,
    dropout: float = 0.0,
    training: bool = True,
    norm: str = "layer",
    impl: str = "auto",
    generator: torch.Generator | None = None,
) -> Tensor:
    """``norm(x + dropout(y))`` — :func:`sublayer.functional.add_norm` with a fused CPU path.

    Args:
        x, y, normalized_shape, weight, bias, eps, dropout, training, norm: as the reference
            (``bias`` is ignored for ``norm="rms"``).
        impl: ``"auto"``, ``"fused"`` or ``"reference"`` (see the module docstring).
        generator: where the fused dropout's seed comes from (default: torch's CPU generator).

    Returns:
        Tensor of the shape of ``x``, dtype ``torch.result_type(x, y)``.

    Raises:
        ValueError: as the reference (shapes, dropout, norm) or for an unknown ``impl``.
        RuntimeError: ``impl="fused"`` where the fused path cannot run.
    """
    check_choice("norm", norm, _norm.NORMS)
    check_probability("dropout", dropout)
    check_tensor("x", x)
    check_tensor("y", y)
    check_same_shape("x", x, "y", y)
    shape = normalize_shape("normalized_shape", normalized_shape)
    check_last_dims("x", x, shape)
    rms = norm == "rms"
    b = None if rms else bias
    check_param_shape("weight", weight, shape)
    check_param_shape("bias", b, shape)
    p = float(dropout) if training else 0.0
    p_ok = _fused_p_ok(impl, dropout=p)
    auto_ok = x.dtype in _AUTO_DTYPES and y.dtype in _AUTO_DTYPES and p_ok
    fused_ok = (x.dtype in _AUTO_DTYPES and y.dtype in _AUTO_DTYPES or x.dtype == y.dtype == torch.float64) and p_ok
    if not _use_fused(impl, auto_ok, fused_ok, x, y, weight, b):
        return _norm.add_norm(x, y, shape, weight, bias, eps, dropout=dropout, training=training, norm=norm)
    d = math.prod(shape)
    # seed -1: the kernel draws it from torch's default generator itself (what dropout_seed() would draw)
    seed = (dropout_seed(generator) if generator is not None else -1) if p > 0 else 0
    x2, y2 = x.reshape(-1, d).contiguous(), y.reshape(-1, d).contiguous()
    w2 = weight.reshape(d) if weight is not None else None
    b2 = b.reshape(d) if b is not None else None
    out = _AddNormFn.apply(x2, y2, w2, b2, float(eps), p, seed, rms)
    return out.view(x.shape)


# ----------------------------------------------------------------------------------------------- FFN
class _FFNFn(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, w1, b1, w2, b2, act, gated, p, p_out, seed1, seed2, recompute):
        # x: (N, d) contiguous, one dtype for all; gated: fc1's output packs [gate | up], (N, 2f)
        ops = kernels.ops()
        acc = _norm.acc_dtype(x)
        need = any(ctx.needs_input_grad[:5])
        up, mm = _gemm(x.dtype)
        b1a = b1.to(acc) if b1 is not None else None
        b2a = b2.to(acc) if b2 is not None else None
        a = mm(up(x), up(w1).t())  # (N, f) or (N, 2f), bias added in the elementwise pass
        keep_a = need and (gated or act != _RELU) and not recompute
        # dropout(act(a + b1)) — or, gated, dropout(act(gate) * up) of the packed a — in one elementwise pass
        h = ops.glu_fwd(a, b1a, act, p, seed1) if gated else ops.act_fwd(a, b1a, act, p, seed1, not keep_a)
        o = mm(up(h), up(w2).t())
        if b2a is not None or p_out > 0:
            o = ops.act_fwd(o, b2a, 0, p_out, seed2, True)  # bias + output dropout, in place
        if need:
            # recompute: x alone (fc1 runs again in backward). Else ReLU: h alone gives both relu' and the mask;
            # other activations: the pre-activation a (h is recomputed).
            sv = None if recompute else (a if keep_a else h)
            ctx.save_for_backward(x, w1, w2, b1a, sv)
        ctx.meta = (act, gated, p, p_out, seed1, seed2, recompute,
                    b1.dtype if b1 is not None else None, b2.dtype if b2 is not None else None)  # fmt: skip
        return o

    @staticmethod
    def backward(ctx, go):
        _refuse_double_backward()
        x, w1, w2, b1a, sv = ctx.saved_tensors
        act, gated, p, p_out, seed1, seed2, recompute, b1dt, b2dt = ctx.meta
        nx, nw1, nb1, nw2, nb2 = ctx.needs_input_grad[:5]
        nb1, nb2 = nb1 and b1dt is not None, nb2 and b2dt is not None
        ops = kernels.ops()
        up, mm = _gemm(go.dtype)
        go = go.contiguous()
        if p_out > 0:
            g2, _, db2 = ops.act_bwd(go, None, None, 0, p_out, seed2, False, bool(nb2), False)
        else:
            g2 = go
            db2 = go.sum(0, dtype=_norm.acc_dtype(go)) if nb2 else None
        if recompute:  # fc1 again (and, for ReLU, the hidden activation with the same dropout mask)
            sv = mm(up(x), up(w1).t())
            if act == _RELU and not gated:
                sv = ops.act_fwd(sv, b1a, act, p, seed1, True)
        g2u = up(g2)
        dh = mm(g2u, up(w2))  # (N, f)
        if gated:
            da, h, db1 = ops.glu_bwd(dh, sv, b1a, act, p, seed1, bool(nw2), bool(nb1))
        elif act == _RELU:
            da, _, db1 = ops.act_bwd(dh, sv, None, act, p, seed1, False, bool(nb1), True)
            h = sv
        else:
            da, h, db1 = ops.act_bwd(dh, sv, b1a, act, p, seed1, bool(nw2), bool(nb1), True)
        dw2 = mm(g2u.t(), up(h)) if nw2 else None
        del h, g2u, sv
        dau = up(da)
        dw1 = mm(dau.t(), up(x)) if nw1 else None
        dx = mm(dau, up(w1)) if nx else None
        return (
            dx, dw1, db1.to(b1dt) if nb1 else None, dw2, db2.to(b2dt) if nb2 else None,
            None, None, None, None, None, None, None,
        )  # fmt: skip


def _gemm(dtype: torch.dtype):
    """(upcast, mm) for GEMMs on ``dtype`` operands: bf16 without native bf16 GEMMs multiplies in fp32 and rounds
    the product to bf16 once (what a bf16 GEMM with fp32 accumulation returns), faster on AVX2."""
    if dtype == torch.bfloat16 and not kernels.native_bf16_gemm():
        return (lambda t: t.float()), (lambda a, b: torch.mm(a, b).to(torch.bfloat16))
    if dtype == torch.float32 and kernels.cpu.onednn_fp32_gemm():
        return (lambda t: t), onednn.mm
    return (lambda t: t), torch.mm


def feed_forward(
    x: Tensor,
    fc1_weight: Tensor,
    fc1_bias: Tensor | None,
    fc2_weight: Tensor,
    fc2_bias: Tensor | None,
    *,
    activation: str = "relu",
    dropout: float = 0.0,
    output_dropout: float = 0.0,
    training: bool = True,
    recompute: bool = False,
    impl: str = "auto",
    generator: torch.Generator | None = None,
) -> Tensor:
    """``fc2(dropout(act(fc1(x))))`` then ``output_dropout`` — :func:`sublayer.functional.feed_forward` with a
    fused CPU path (bias + activation + dropout in one pass between the GEMMs; lean saved tensors).

    Args:
        x, fc1_weight, fc1_bias, fc2_weight, fc2_bias, activation, dropout, output_dropout, training: as the
            reference (gated activations included: ``fc1`` packs [gate; up]).
        recompute: save only the input for backward and run fc1 (and the activation) again there: one more
            GEMM for no hidden-size tensor kept. The reference path does the same through
            ``torch.utils.checkpoint`` (which also re-runs fc2).
        impl: ``"auto"``, ``"fused"`` or ``"reference"`` (see the module docstring).
        generator: where the fused dropout's seeds come from (default: torch's CPU generator).

    Returns:
        (..., d_out).

    Raises:
        ValueError: as the reference (activation, dropout, input size) or for an unknown ``impl``.
        RuntimeError: ``impl="fused"`` where the fused path cannot run.
    """
    _ffn.activation_fn(activation)  # validates the name
    check_probability("dropout", dropout)
    check_probability("output_dropout", output_dropout)
    check_tensor("x", x)
    ts = (x, fc1_weight, fc1_bias, fc2_weight, fc2_bias)
    gated = activation in GLU_IDS
    shapes_ok = (
        x.dim() >= 1
        and fc1_weight.dim() == 2
        and fc2_weight.dim() == 2
        and x.shape[-1] == fc1_weight.shape[1]
        and fc2_weight.shape[1] * (2 if gated else 1) == fc1_weight.shape[0]
        and (fc1_bias is None or fc1_bias.shape == (fc1_weight.shape[0],))
        and (fc2_bias is None or fc2_bias.shape == (fc2_weight.shape[0],))
    )
    autocast = torch.is_autocast_enabled("cpu")
    dts = {t.dtype for t in ts if t is not None}
    if autocast:  # bfloat16 autocast's mixes run fused (in bfloat16); other autocasts and mixes: the reference
        auto_ok = bf16_autocast(*ts)
        fused_ok = auto_ok
    else:
        auto_ok = len(dts) == 1 and dts <= set(_AUTO_DTYPES)
        fused_ok = len(dts) == 1 and dts <= set(_FUSED_DTYPES)
    ok = activation in FUSED_ACTIVATIONS and shapes_ok
    if training:
        ok = ok and _fused_p_ok(impl, dropout=float(dropout), output_dropout=float(output_dropout))
    if not _use_fused(impl, ok and auto_ok, ok and fused_ok, *ts):
        kw = {"activation": activation, "dropout": dropout, "output_dropout": output_dropout, "training": training}
        if recompute and torch.is_grad_enabled():
            return torch.utils.checkpoint.checkpoint(
                _ffn.feed_forward, x, fc1_weight, fc1_bias, fc2_weight, fc2_bias, use_reentrant=False, **kw
            )
        return _ffn.feed_forward(x, fc1_weight, fc1_bias, fc2_weight, fc2_bias, **kw)
    if autocast:
        ts = tuple(t.to(torch.bfloat16) if t is not None else None for t in ts)
    x, w1, b1, w2, b2 = ts
    p = float(dropout) if training else 0.0
    p_out = float(output_dropout) if training else 0.0
    seed1 = dropout_seed(generator) if p > 0 else 0
    seed2 = dropout_seed(generator) if p_out > 0 else 0
    x2 = x.reshape(math.prod(x.shape[:-1]), x.shape[-1]).contiguous()  # not -1: x may be empty
    with torch.autocast("cpu", enabled=False):
        act = GLU_IDS[activation] if gated else ACT_IDS[activation]
        out = _FFNFn.apply(x2, w1, b1, w2, b2, act, gated, p, p_out, seed1, seed2, bool(recompute))
    return out.view(*x.shape[:-1], w2.shape[0])


# ----------------------------------------------------------------------------------------------- linear
class _LinearFn(torch.autograd.Function):
    """A linear whose products, the gradients' too, run as :func:`_gemm` runs them for its dtype: float32 on oneDNN
    (:func:`sublayer.kernels.onednn.linear`, for CPUs where torch's BLAS runs a generic code path:
    :func:`sublayer.kernels.cpu.onednn_fp32_gemm`); bf16 in fp32 on the bf16 operands, the product (bias included)
    rounded to bf16 once (what a bf16 GEMM with fp32 accumulation returns, for CPUs whose native bf16 GEMM is slow);
    float64 as it is (the same code is gradchecked). A backward with ``create_graph=True`` runs torch's own
    products, so higher-order gradients work."""

    @staticmethod
    def forward(ctx, x, w, b):  # one dtype: x (N, in) (float32: row-major), w (out, in), b (out,) or None
        ctx.save_for_backward(x, w)
        ctx.has_bias = b is not None
        if x.dtype == torch.float32:
            return onednn.linear(x, w, b)
        up = _gemm(x.dtype)[0]
        out = torch.addmm(up(b), up(x), up(w).t()) if b is not None else torch.mm(up(x), up(w).t())
        return out.to(x.dtype)

    @staticmethod
    def backward(ctx, g):
        x, w = ctx.saved_tensors
        nx, nw, nb = ctx.needs_input_grad
        up, mm = ((lambda t: t), torch.mm) if torch.is_grad_enabled() else _gemm(x.dtype)
        g = up(g)
        dx = mm(g, up(w)) if nx else None
        dw = mm(g.t(), up(x)) if nw else None
        db = g.sum(0).to(x.dtype) if nb and ctx.has_bias else None
        return dx, dw, db


def linear(x: Tensor, weight: Tensor, bias: Tensor | None = None) -> Tensor:
    """``F.linear``, with two CPU paths for the products that torch's default BLAS runs slowly:

    * bf16 (bf16 tensors, or float32 ones under ``torch.autocast("cpu", dtype=torch.bfloat16)``) on a CPU without
      native bf16 GEMMs (:func:`sublayer.kernels.native_bf16_gemm`): the GEMMs run in fp32 on the bf16-rounded
      operands and round once — the numbers of a bf16 GEMM with fp32 accumulation, faster there;
    * float32 where :func:`sublayer.kernels.cpu.onednn_fp32_gemm` (AMD CPUs with AVX-512, whose BLAS path there is
      generic), for products of at least 2^24 multiply-adds: the forward and the gradients through oneDNN.
      The same product up to the summation order.

    Everything else (other dtypes, CUDA, DTensor, ``torch.compile``, kernels switched off) is ``F.linear`` itself.

    Args:
        x: (..., in_features). weight: (out_features, in_features). bias: (out_features,) or None.

    Returns:
        (..., out_features): bf16 on the bf16 path, else what ``F.linear`` returns.
    """
    if (
        not kernels.switched_on()
        or torch.compiler.is_compiling()
        or torch._C._are_functorch_transforms_active()
        or torch.autograd.forward_ad._current_level >= 0
        or not _plain_cpu(x, weight, bias)
        or x.dim() == 0
        or weight.dim() != 2
        or x.shape[-1] != weight.shape[-1]  # F.linear raises its own error
    ):
        return torch.nn.functional.linear(x, weight, bias)
    if _onednn_linear_applies(x, weight, bias):
        x2, w, b = x.contiguous(), weight, bias
    elif _bf16_linear_applies(x, weight, bias) and not kernels.native_bf16_gemm():
        x2, w, b = (t.to(torch.bfloat16) if t is not None else None for t in (x, weight, bias))
    else:
        return torch.nn.functional.linear(x, weight, bias)
    with torch.autocast("cpu", enabled=False):
        out = _LinearFn.apply(x2.reshape(math.prod(x.shape[:-1]), x.shape[-1]), w, b)
    return out.view(*x.shape[:-1], weight.shape[0])


def _onednn_linear_applies(x: Tensor, weight: Tensor, bias: Tensor | None) -> bool:
    if torch.is_autocast_enabled("cpu") or not weight.is_contiguous():
        return False
    if any(t.dtype != torch.float32 for t in (x, weight, bias) if t is not None):
        return False
    if bias is not None and (bias.dim() != 1 or bias.shape[0] != weight.shape[0] or not bias.is_contiguous()):
        return False  # F.linear raises its own error (or takes the strided bias)
    return kernels.use_onednn(x, weight.shape[0])


def _bf16_linear_applies(x: Tensor, weight: Tensor, bias: Tensor | None) -> bool:
    if torch.is_autocast_enabled("cpu"):
        return bf16_autocast(x, weight, bias)
    return all(t.dtype == torch.bfloat16 for t in (x, weight, bias) if t is not None)


# ----------------------------------------------------------------------------------------------- dropout
class _DropoutFn(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, p, seed):  # x: (N, f) contiguous
        ctx.meta = (p, seed)
        return kernels.ops().act_fwd(x, None, 0, p, seed, False)

    @staticmethod
    def backward(ctx, g):
        _refuse_double_backward()
        p, seed = ctx.meta
        dx, _, _ = kernels.ops().act_bwd(g.contiguous(), None, None, 0, p, seed, False, False, False)
        return dx, None, None


def dropout(
    x: Tensor,
    p: float = 0.5,
    training: bool = True,
    *,
    impl: str = "auto",
    generator: torch.Generator | None = None,
) -> Tensor:
    """Inverted dropout with the fused Philox stream (``F.dropout``'s distribution, not its mask).

    The mask of element ``e`` (row-major flat index) depends on the seed and ``e`` only. Identity when not
    ``training`` or ``p == 0``.

    Args:
        x: any shape. p: drop probability in [0, 1). training: apply only when True.
        impl: ``"auto"``, ``"fused"`` or ``"reference"`` (``F.dropout``).
        generator: where the seed comes from (default: torch's CPU generator).

    Returns:
        Tensor like ``x``.

    Raises:
        ValueError: ``p`` outside [0, 1), an unknown ``impl``, or with ``impl="fused"`` a ``p`` its 16-bit keep
            threshold cannot express (see :func:`keep_probability`).
    """
    check_probability("p", p)
    check_tensor("x", x)
    p_ok = not training or _fused_p_ok(impl, p=float(p))
    if not _use_fused(impl, p_ok and x.dtype in _AUTO_DTYPES, p_ok and x.dtype in _FUSED_DTYPES, x):
        return torch.nn.functional.dropout(x, p, training)
    if not training or p == 0:
        return x
    x2 = x.reshape(math.prod(x.shape[:-1]), x.shape[-1]) if x.dim() else x.reshape(1, 1)
    x2 = x2.contiguous()  # (not reshape(-1, d): x may be empty, its last dim 0 included)
    return _DropoutFn.apply(x2, float(p), dropout_seed(generator)).view(x.shape)
