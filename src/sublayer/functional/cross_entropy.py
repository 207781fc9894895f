"""Fused linear + cross-entropy: the LM-head loss without a ``(N, vocab)`` logits tensor kept for backward.

:func:`linear_cross_entropy` equals ``F.cross_entropy(F.linear(h, weight, bias), target, ignore_index=...,
label_smoothing=..., reduction=...)`` (forward and the gradients of ``h``, ``weight``, ``bias``) and is the loss of
:meth:`sublayer.models.GPT2.loss` and :meth:`sublayer.models.Transformer.loss`. Liger-Kernel's
fused-linear-cross-entropy idea, on the CPU:

* only rows whose target is not ``ignore_index`` are computed (they are gathered once);
* the logits are made about ``chunk_size`` at a time into one reused buffer (forward: blocks of rows; recomputing
  backward: blocks of vocabulary columns, so each block of ``dW`` is written once), turned in place into
  log-probabilities / the gradient of the logits, and immediately reduced to the loss, ``dh`` and ``dW``;
* nothing of size ``(N, vocab)`` outlives a chunk.

Two ways to place the backward work (``grad_in_forward``):

* ``False`` (default): the forward keeps the gathered rows of ``h`` and one log-sum-exp per row; the backward makes
  each chunk's logits again (one extra GEMM: 4 GEMMs in all against eager's 3) and turns them into the gradients.
  Bytes saved for backward: ``n·D`` + ``n`` floats — what eager keeps is ``n·V`` log-probabilities.
* ``True``: the forward already computes ``dh`` (n, D), ``dW`` (V, D) and ``db`` and keeps them; the backward only
  scales them by the incoming gradient (3 GEMMs, as eager). Faster, but it holds a weight-sized gradient from the
  forward until the backward (V·D floats: 154 MB for GPT-2's head), so it saves more bytes for backward than the
  default (it also keeps the gathered rows of ``h``, for a double backward); the gradient is computed even if ``backward`` is never called (with grad mode on and inputs requiring
  grad).

Dtypes: float64 if any input is float64, else float32: bfloat16/float16 inputs (also mixed with float32 weights, as
under autocast) are upcast chunk by chunk (the loss is float32, as HF's upcast logits give; each gradient is
rounded to its input's dtype once).

Double backward (``torch.autograd.grad(loss, ..., create_graph=True)``, e.g. a gradient penalty): the backward then
makes the gradients with the eager composition, differentiable again; it materializes the ``(n, vocab)`` logits, as
eager does.

Under ``torch.autocast("cpu", dtype=torch.bfloat16)`` (float32 or bfloat16 inputs) it is autocast's computation
instead: the logits GEMM in bfloat16 (as autocast's ``F.linear``), the loss in float32 from those bfloat16 logits
(as ``F.cross_entropy(logits.float(), ...)``), the gradient of the logits rounded to bfloat16 and the backward GEMMs
in bfloat16; ``chunk_size`` and ``grad_in_forward`` do not apply. The logits are made at once in bfloat16 and turned
in place, a few rows at a time in float32, into the log-softmax and then the gradient of the logits, which is all
that is kept for backward (``n·V`` bfloat16 values, where autocast's eager composition keeps ``n·V`` float32
log-probabilities); the double backward is not supported there.

All targets ignored: with ``reduction="mean"`` torch and HF return NaN (a mean over zero terms); here it is a
``ValueError``. With ``reduction="sum"`` the loss is 0 with zero gradients, as torch.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import Tensor

from .._checks import check_choice, check_positive_int, check_tensor
from .. import kernels
from ..kernels import onednn
from .fused import bf16_autocast
from .norm import acc_dtype

__all__ = ["linear_cross_entropy", "check_targets", "check_options", "REDUCTIONS"]

REDUCTIONS = ("mean", "sum")
# default chunk: about 32M logits (128 MB in fp32), a few hundred rows per GEMM for vocabularies up to ~100k: each
# chunk streams the whole (V, D) weight through the GEMMs (and the (V, D) gradient in grad_in_forward), so small
# chunks pay that traffic many times (SmolLM's head, V 49152, n 1381: 16 chunks of 86 rows took 1.4x the time of
# 3 of 683)
_CHUNK_ELEMENTS = 1 << 25


def check_targets(name: str, target: object, vocab_size: int, ignore_index: int) -> None:
    """``target`` must be an integer tensor with values in ``[0, vocab_size)`` or equal to ``ignore_index``
    (compared as int64, as torch reads class ids: a uint8 156 is not -100)."""
    check_tensor(name, target)
    if target.dtype.is_floating_point or target.dtype.is_complex or target.dtype == torch.bool:
        raise TypeError(f"{name} must hold integer class ids, got dtype {target.dtype}")
    if target.numel():
        target = target.long()  # a narrow dtype would wrap the bounds and ignore_index in the comparisons
        bad = (target != ignore_index) & ((target < 0) | (target >= vocab_size))
        if bool(bad.any()):
            v = int(target[bad][0])
            raise ValueError(
                f"{name} must lie in [0, vocab_size={vocab_size}) or equal ignore_index={ignore_index}, got {v}"
            )


def _check_args(h, weight, bias, target, ignore_index, label_smoothing, reduction, chunk_size) -> None:
    check_tensor("h", h)
    check_tensor("weight", weight)
    if not h.dtype.is_floating_point:
        raise TypeError(f"h must be a floating-point tensor, got dtype {h.dtype}")
    if h.dim() != 2:
        raise ValueError(f"h must have shape (N, D), got {tuple(h.shape)}")
    if weight.dim() != 2 or weight.shape[1] != h.shape[1]:
        raise ValueError(f"weight must have shape (vocab_size, D={h.shape[1]}), got {tuple(weight.shape)}")
    if weight.shape[0] == 0:
        raise ValueError("weight must have at least one row (vocab_size >= 1)")
    for name, t in (("weight", weight), ("bias", bias)):
        if t is None:
            continue
        check_tensor(name, t)
        if not t.dtype.is_floating_point:
            raise TypeError(f"{name} must be a floating-point tensor, got dtype {t.dtype}")
        if t.device != h.device:
            raise ValueError(f"{name} device {t.device} does not match h device {h.device}")
    if bias is not None and tuple(bias.shape) != (weight.shape[0],):
        raise ValueError(f"bias must have shape (vocab_size={weight.shape[0]},), got {tuple(bias.shape)}")
    check_options(ignore_index, label_smoothing, reduction)
    check_targets("target", target, weight.shape[0], ignore_index)
    if tuple(target.shape) != (h.shape[0],):
        raise ValueError(f"target must have shape (N={h.shape[0]},), got {tuple(target.shape)}")
    if target.device != h.device:
        raise ValueError(f"target device {target.device} does not match h device {h.device}")
    check_positive_int("chunk_size", chunk_size, allow_none=True)


def check_options(ignore_index: object, label_smoothing: object = 0.0, reduction: object = "mean") -> None:
    """``ignore_index`` an int, ``label_smoothing`` a float in [0, 1], ``reduction`` one of :data:`REDUCTIONS`."""
    if isinstance(ignore_index, bool) or not isinstance(ignore_index, int):
        raise TypeError(f"ignore_index must be an int, got {ignore_index!r}")
    if isinstance(label_smoothing, bool) or not isinstance(label_smoothing, (int, float)):
        raise TypeError(f"label_smoothing must be a float in [0, 1], got {label_smoothing!r}")
    if not 0.0 <= float(label_smoothing) <= 1.0:
        raise ValueError(f"label_smoothing must be in [0, 1], got {label_smoothing}")
    check_choice("reduction", reduction, REDUCTIONS)


def _logits(hc: Tensor, w: Tensor, b: Tensor | None, out: Tensor | None, packed: Tensor | None = None) -> Tensor:
    """``hc @ w.T + b`` (c, V), into ``out`` (None: a new tensor). With ``packed`` (:func:`_packed_weight` of ``w``)
    oneDNN's GEMM makes it, and where :func:`sublayer.kernels.use_onednn` oneDNN's on ``w`` as it is; both return a new
    tensor (oneDNN writes no out=)."""
    if packed is not None:
        return onednn.linear(hc, packed, b)
    if kernels.use_onednn(hc, w.shape[0]):
        return onednn.linear(hc.contiguous(), w, b)
    if out is None:
        out = torch.empty(hc.shape[0], w.shape[0], dtype=hc.dtype, device=hc.device)
    if b is None:
        return torch.mm(hc, w.t(), out=out)
    return torch.addmm(b, hc, w.t(), out=out)


# Rows from which the forward's logits GEMMs run on a weight packed for oneDNN: at GPT-2's vocabulary (50257 x 512)
# its GEMM took 97 ms for 334 rows where torch.mm took 165 ms, and packing the weight costs about 50 ms per call.
PACKED_MIN_ROWS = 256


def _packed_weight(w: Tensor, n: int) -> Tensor | None:
    """``w`` (V, D) packed for oneDNN's float32 GEMM when the forward's logits GEMMs of ``n`` rows repay the
    packing (and the kernels are switched on), else None."""
    ok = n >= PACKED_MIN_ROWS and w.dtype == torch.float32 and w.device.type == "cpu" and kernels.switched_on()
    return onednn.pack(w) if ok and onednn.available() else None


def _softmax_to_grad_(p: Tensor, tc: Tensor, v0: int, smoothing: float, vocab: int) -> Tensor:
    """The softmax block ``p`` (columns ``[v0, v0 + p.shape[1])`` of a ``vocab``-wide row) turned in place into
    d loss / d logits: ``p - (1-ε) onehot(tc) - ε/V`` (the onehot only for rows whose target lies in the block)."""
    inside = (tc >= v0) & (tc < v0 + p.shape[1])
    rows = inside.nonzero().squeeze(1)
    value = torch.tensor(smoothing - 1.0, dtype=p.dtype, device=p.device)
    p.index_put_((rows, tc[rows] - v0), value, accumulate=True)
    return p.sub_(smoothing / vocab) if smoothing else p


class _LinearCrossEntropy(torch.autograd.Function):
    """The loss over rows that all have a target (the caller gathers them): ``scale * sum(cross-entropy)``."""

    @staticmethod
    def forward(ctx, h, weight, bias, target, smoothing, scale, chunk, grad_in_forward, need_grad):
        n, d = h.shape
        vocab = weight.shape[0]
        cdt = acc_dtype(h, weight, bias)
        w = weight.to(cdt)
        b = None if bias is None else bias.to(cdt)
        elements = chunk or _CHUNK_ELEMENTS
        rows = max(1, -(-elements // vocab))
        packed = _packed_weight(w, n)
        fresh = packed is not None or kernels.use_onednn(w)  # oneDNN makes each chunk's logits: no buffer to reuse
        buf = None if fresh else torch.empty(min(rows, max(n, 1)), vocab, dtype=cdt, device=h.device)
        row_loss = torch.empty(n, dtype=cdt, device=h.device)
        lse = torch.empty(n, dtype=cdt, device=h.device)
        in_fwd = grad_in_forward and need_grad
        want_h, want_w, want_b = ctx.needs_input_grad[:3] if in_fwd else (False, False, False)
        dh = torch.empty(n, d, dtype=cdt, device=h.device) if want_h else None
        # written by the first chunk (beta=0), accumulated by the others: no zero-fill pass over (V, D)
        dw = (torch.empty if n else torch.zeros)(vocab, d, dtype=cdt, device=h.device) if want_w else None
        db = torch.zeros(vocab, dtype=cdt, device=h.device) if want_b else None
        for s in range(0, n, rows):
            hc = h[s : s + rows].to(cdt)
            tc = target[s : s + rows]
            c = hc.shape[0]
            z = _logits(hc.contiguous(), w, b, None if buf is None else buf[:c], packed)
            zt = z.gather(1, tc[:, None]).squeeze(1)
            logp = torch.ops.aten._log_softmax.out(z, 1, False, out=z)  # in place: one fused pass
            lpt = logp.gather(1, tc[:, None]).squeeze(1)
            lse[s : s + c] = zt - lpt
            loss_c = row_loss[s : s + c]
            torch.mul(lpt, smoothing - 1.0, out=loss_c)
            if smoothing:
                loss_c.sub_(logp.sum(1), alpha=smoothing / vocab)
            if in_fwd:  # d loss / d z = scale * (softmax - (1-eps) onehot - eps/V)
                p = _softmax_to_grad_(logp.exp_(), tc, 0, smoothing, vocab)
                if dh is not None:
                    torch.mul((onednn.mm if kernels.use_onednn(p) else torch.mm)(p, w), scale, out=dh[s : s + c])
                if dw is not None:
                    dw.addmm_(p.t(), hc, beta=1.0 if s else 0.0, alpha=scale)
                if db is not None:
                    db.add_(p.sum(0), alpha=scale)
        loss = row_loss.sum() * scale
        b_dtype = None if bias is None else bias.dtype
        ctx.meta = (smoothing, scale, elements, in_fwd, h.dtype, weight.dtype, b_dtype)
        if in_fwd:
            ctx.grads = (dh, dw, db)  # not saved tensors: bench_loss counts them separately
        if need_grad:  # h, weight, bias are the caller's tensors (references, not copies)
            ctx.save_for_backward(h, target, weight, bias, None if in_fwd else lse)
        return loss

    @staticmethod
    def backward(ctx, g):
        smoothing, scale, elements, in_fwd, h_dtype, w_dtype, b_dtype = ctx.meta
        want_h, want_w, want_b = ctx.needs_input_grad[:3]
        if torch.is_grad_enabled():  # create_graph=True: the gradient must be differentiable again
            return (*_reference_grads(ctx, g), None, None, None, None, None, None)
        if in_fwd:
            # out of place: a retained graph may run this backward again
            dh, dw, db = (None if t is None else t * g.to(t.dtype) for t in ctx.grads)
        else:
            hk, tk, weight, bias, lse = ctx.saved_tensors
            cdt = lse.dtype
            n, d = hk.shape
            vocab = weight.shape[0]
            step = scale * float(g)
            # vocabulary blocks: each dW block is written once (no accumulation traffic), dh (n, D) accumulates
            cols = min(vocab, max(1, -(-elements // max(n, 1))))
            hc = hk.to(cdt)
            buf = None if kernels.use_onednn(hc) else torch.empty(max(n, 1) * cols, dtype=cdt, device=hk.device)
            dh = torch.zeros(n, d, dtype=cdt, device=hk.device) if want_h else None
            dw = torch.empty(vocab, d, dtype=cdt, device=hk.device) if want_w else None
            db = torch.empty(vocab, dtype=cdt, device=hk.device) if want_b and bias is not None else None
            neg_lse = -lse[:, None]
            for v0 in range(0, vocab, cols):
                v1 = min(vocab, v0 + cols)
                wb = weight[v0:v1].to(cdt)
                z = None if buf is None else buf[: n * (v1 - v0)].view(n, v1 - v0)
                if bias is None and z is not None:
                    torch.addmm(neg_lse, hc, wb.t(), out=z)  # z - lse, in the GEMM
                else:
                    z = _logits(hc, wb, None if bias is None else bias[v0:v1].to(cdt), z).add_(neg_lse)
                p = _softmax_to_grad_(z.exp_(), tk, v0, smoothing, vocab)  # z - lse: exp is the softmax
                if dh is not None:
                    dh.add_((onednn.mm if kernels.use_onednn(p) else torch.mm)(p, wb), alpha=step)
                if dw is not None:
                    torch.addmm(dw[v0:v1], p.t(), hc, beta=0.0, alpha=step, out=dw[v0:v1])
                if db is not None:
                    torch.sum(p, 0, out=db[v0:v1]).mul_(step)
        grads = (None if t is None else t.to(dt) for t, dt in zip((dh, dw, db), (h_dtype, w_dtype, b_dtype)))
        return (*grads, None, None, None, None, None, None)


# rows of float32 logits turned into the gradient at once in the bfloat16 path: about 1M values (4 MB, in cache)
_BF16_ROW_ELEMENTS = 1 << 20
_TINY = 1e-30  # a target probability below this takes its log from log_softmax (float32 loses digits near 1e-38)


class _Bf16LinearCrossEntropy(torch.autograd.Function):
    """Autocast's bfloat16 head and float32 loss over rows that all have a target: ``scale * sum(cross-entropy)``."""

    @staticmethod
    def forward(ctx, h, weight, bias, target, smoothing, scale):
        bf = torch.bfloat16
        hb, wb = h.to(bf), weight.to(bf)
        z = F.linear(hb, wb, None if bias is None else bias.to(bf))  # autocast's own GEMM
        n, vocab = z.shape
        row_loss = torch.empty(n, dtype=torch.float32, device=h.device)
        rows = max(1, _BF16_ROW_ELEMENTS // max(vocab, 1))
        for s in range(0, n, rows):
            zc = z[s : s + rows]
            tc = target[s : s + rows]
            f32 = torch.float32
            p = torch.softmax(zc, 1, dtype=f32)  # one exp per logit; log p_t from it, or log_softmax where it underflows
            pt = p.gather(1, tc[:, None]).squeeze(1)
            lpt = pt.log()
            tiny = pt < _TINY
            if smoothing or bool(tiny.any()):
                logp = torch.log_softmax(zc, 1, dtype=f32)
                lpt = torch.where(tiny, logp.gather(1, tc[:, None]).squeeze(1), lpt)
            loss_c = row_loss[s : s + zc.shape[0]]
            torch.mul(lpt, smoothing - 1.0, out=loss_c)
            if smoothing:
                loss_c.sub_(logp.sum(1), alpha=smoothing / vocab)
            # d loss / d z = scale * (softmax - (1-eps) onehot - eps/V), rounded to bfloat16
            torch.mul(_softmax_to_grad_(p, tc, 0, smoothing, vocab), scale, out=zc)
        ctx.dtypes = (h.dtype, weight.dtype, None if bias is None else bias.dtype)
        ctx.save_for_backward(hb, wb, z)
        return row_loss.sum() * scale

    @staticmethod
    def backward(ctx, g):
        if torch.is_grad_enabled():
            raise RuntimeError("linear_cross_entropy under bf16 autocast has no double backward (create_graph=True): "
                               "run it with autocast off, or use the eager F.linear + F.cross_entropy")
        hb, wb, dz = ctx.saved_tensors
        h_dt, w_dt, b_dt = ctx.dtypes
        step = float(g)
        want_h, want_w, want_b = ctx.needs_input_grad[:3]

        def mm(a, b):  # a @ b * step in one bfloat16 GEMM (float32 accumulation, one rounding)
            return torch.mm(a, b) if step == 1.0 else torch.addmm(a.new_empty(()), a, b, beta=0.0, alpha=step)

        dh = mm(dz, wb).to(h_dt) if want_h else None
        dw = mm(dz.t(), hb).to(w_dt) if want_w else None
        db = dz.sum(0, dtype=torch.float32).mul_(step).to(b_dt) if want_b else None
        return dh, dw, db, None, None, None


def _reference_grads(ctx, g: Tensor) -> list[Tensor | None]:
    """Gradients of h, weight, bias made by the eager composition, differentiable again (for ``create_graph``).

    Materializes the (n, V) logits, as eager does: twice-differentiated losses (gradient penalties) pay eager's
    memory."""
    smoothing, scale = ctx.meta[:2]
    h, target, weight, bias = ctx.saved_tensors[:4]
    cdt = acc_dtype(h, weight, bias)
    wanted = [t if want else None for t, want in zip((h, weight, bias), ctx.needs_input_grad[:3])]
    inputs = [t for t in wanted if t is not None]
    z = F.linear(h.to(cdt), weight.to(cdt), None if bias is None else bias.to(cdt))
    loss = F.cross_entropy(z, target, label_smoothing=smoothing, reduction="sum") * scale
    grads = iter(torch.autograd.grad(loss, inputs, g.to(loss.dtype), create_graph=True))
    return [None if t is None else next(grads).to(t.dtype) for t in wanted]


def linear_cross_entropy(
    h: Tensor,
    weight: Tensor,
    target: Tensor,
    *,
    bias: Tensor | None = None,
    ignore_index: int = -100,
    label_smoothing: float = 0.0,
    reduction: str = "mean",
    chunk_size: int | None = None,
    grad_in_forward: bool = False,
) -> Tensor:
    """Cross-entropy of ``h @ weight.T + bias`` against ``target``, made in row chunks (see the module doc).

    Equals ``F.cross_entropy(F.linear(h, weight, bias), target, ignore_index=ignore_index,
    label_smoothing=label_smoothing, reduction=reduction)``; the mean is over the targets that are not
    ``ignore_index``.

    Args:
        h: (N, D) hidden rows (float32, float64, bfloat16 or float16).
        weight: (V, D) output projection (``nn.Linear`` layout; GPT-2's tied ``wte.weight``).
        target: (N,) integer class ids in [0, V) or ``ignore_index``.
        bias: (V,) or None.
        ignore_index: targets with this value add nothing (their rows are never computed).
        label_smoothing: ε in [0, 1]: the target distribution is ``(1-ε)·onehot + ε/V`` (torch's definition).
        reduction: ``"mean"`` (over non-ignored targets) or ``"sum"``.
        chunk_size: logits made at once (forward: ``ceil(chunk_size / V)`` rows; recomputing backward:
            ``ceil(chunk_size / n)`` vocabulary columns); None -> 32M (128 MB in fp32). Results do not depend on it
            beyond rounding.
        grad_in_forward: compute the gradients during the forward (faster, keeps a (V, D) gradient; see the
            module doc). The default recomputes each chunk's logits in backward.

    Returns:
        A 0-dim tensor: float32 (float64 for float64 inputs).

    Raises:
        TypeError: non-tensors, non-floating ``h``/``weight``/``bias``, non-integer targets, bad option types.
        ValueError: shapes that do not fit (expected vs got), targets outside the vocabulary, ``label_smoothing``
            outside [0, 1], unknown ``reduction``, ``chunk_size`` < 1, and ``reduction="mean"`` with every target
            ignored (torch's NaN).
    """
    _check_args(h, weight, bias, target, ignore_index, label_smoothing, reduction, chunk_size)
    if not isinstance(grad_in_forward, bool):
        raise TypeError(f"grad_in_forward must be a bool, got {grad_in_forward!r}")
    need_grad = torch.is_grad_enabled() and any(t is not None and t.requires_grad for t in (h, weight, bias))
    target = target.long()  # as int64, the values torch reads (ignore_index never wraps to a narrow dtype)
    keep = target != ignore_index
    n = int(keep.sum())
    if n == 0 and reduction == "mean":
        raise ValueError(
            f"every target is ignore_index={ignore_index} (or there are none): the mean cross-entropy over "
            "zero targets is undefined (torch and HF return nan); pass reduction='sum' or at least one target"
        )
    if n < h.shape[0]:  # only rows with a target are computed; index_select's backward scatters dh back
        idx = keep.nonzero().squeeze(1)
        h, target = h.index_select(0, idx), target.index_select(0, idx)
    scale = 1.0 / n if reduction == "mean" else 1.0
    if bf16_autocast(h, weight, bias):
        with torch.autocast("cpu", enabled=False):
            return _Bf16LinearCrossEntropy.apply(h, weight, bias, target, float(label_smoothing), scale)
    return _LinearCrossEntropy.apply(
        h, weight, bias, target, float(label_smoothing), scale, chunk_size, grad_in_forward, need_grad
    )
