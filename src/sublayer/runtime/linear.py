"""Prepared weight formats of one linear layer: what a fast path multiplies instead of an ``nn.Linear``'s weight.

* :class:`PackedLinear` — float32 (or float16 / int8-with-scales) panels of 16 output columns for the
  ``skinny_linear`` kernel (few rows: decoding steps), torch's GEMM on the unpacked weight for more rows;
* :class:`DenseLinear` — the weight cast once to another compute dtype (bf16 on CPUs that multiply it natively);
* :class:`GreedyHead` — the argmax of an LM head read in float16, exact to the float32 argmax.

Each is called as ``linear(x (M, K), activation=None) -> (M, N)`` (an FFN activation fused after the bias), so a
model's prepared forward does not depend on the format. :mod:`sublayer.runtime.weights` builds and caches them.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import Tensor

from .. import kernels
from .rows import EPILOGUE, ffn_hidden, kernels_on

__all__ = ["PackedLinear", "DenseLinear", "GreedyHead", "SKINNY_MAX_ROWS", "skinny_max_rows", "NO_SCALE"]


class PackedLinear:
    """``y = x @ weight.T + bias`` for few rows, the weight packed once for the ``skinny_linear`` kernel.

    Args:
        weight: (N, K) float32 (``nn.Linear`` layout). bias: (N,) or None.

    Call: x (M, K) float32 with unit inner stride (a column slice of a wider tensor works) -> (M, N).
    Without the kernels, or for more than :func:`skinny_max_rows` rows, ``F.linear`` runs on the unpacked weight.
    """

    def __init__(self, weight: Tensor, bias: Tensor | None = None) -> None:
        weight = weight.detach().float().contiguous()
        self.out_features, self.in_features = weight.shape
        self.bias = None if bias is None else bias.detach().float().contiguous()
        self.weight = weight  # the parameter itself (no copy) for batches above skinny_max_rows()
        self.packed = kernels.ops().pack_linear_weight(weight) if kernels_on() else None
        self.max_rows = skinny_max_rows() if self.packed is not None else 0  # decided once, not per call

    def __call__(self, x: Tensor, activation: str | None = None) -> Tensor:
        """``activation`` (an FFN activation name) is applied after the bias: fused into the kernel's epilogue
        (``fused.ACT_IDS``), a separate pass for any other."""
        if x.shape[0] <= self.max_rows:
            act = EPILOGUE.get(activation, 0)
            y = kernels.ops().skinny_linear(x, self.packed, self.bias, self.out_features, act)
            return y if activation is None or act else ffn_hidden(y, None, activation)
        y = F.linear(x, self.weight, self.bias)
        return y if activation is None else ffn_hidden(y, None, activation)

    def flat(self) -> tuple[Tensor, Tensor, Tensor] | None:
        """``(packed, scale, bias)`` as the one-call decoding steps take a linear (no scale, no bias: an empty
        tensor), or None (no kernels)."""
        if self.packed is None:
            return None
        return self.packed, NO_SCALE, NO_SCALE if self.bias is None else self.bias


# Up to this many rows the several-row micro-kernels (AVX-512: 8 rows x 2 panels; AVX2: 6 rows x 16 columns) are
# used; above it a blocked GEMM (torch's) wins. `sublayer bench --decode` measures both.
SKINNY_MAX_ROWS = 32


def skinny_max_rows() -> int:
    """Most rows ``PackedLinear`` multiplies with ``skinny_linear`` (above: torch's GEMM on the unpacked weight)."""
    return SKINNY_MAX_ROWS


NO_SCALE = torch.empty(0)  # the scale argument of a float linear in the kernels' calls


class GreedyHead:
    """``argmax(x @ weight.T + bias)`` per row, equal to the float32 argmax, reading the weight in float16.

    The LM head is a third of GPT-2 small's bytes per token. A greedy step needs only the argmax, so this screens
    every vocabulary row with a float16 copy of the weight (half the bytes) and recomputes in float32 only the
    rows that could still be the maximum: with ``w16`` the float16 weight and ``x`` the float32 input,

        |x·w16_j - x·w_j| <= ||x||_2 ||w_j - w16_j||_2            (Cauchy-Schwarz; w_j - w16_j is known exactly)

    plus the float32 rounding of either sum (<= 2 (K+2) u ||x||_2 ||w_j||_2, any summation order, u = 2^-24) and
    of the bias addition. A row j whose screened logit plus its bound is below the best screened logit minus that
    row's bound cannot be the float32 maximum, so the argmax over the candidates' float32 logits (typically one to
    a few rows; ``screened_argmax`` in C++) is the argmax over all rows (ties: the first index, as
    ``torch.argmax``). When the best lower end is not finite, every row is recomputed.

    Args:
        weight: (V, K) float32. bias: (V,) or None.

    Call: x (M, K) float32 -> (M,) int64 ids. Needs the kernels (``skinny_linear`` on float16 panels).
    """

    def __init__(self, weight: Tensor, bias: Tensor | None = None) -> None:
        w = weight.detach().float().contiguous()
        self.weight, self.bias = w, None if bias is None else bias.detach().float().contiguous()
        self.out_features, k = w.shape
        w16 = w.half()
        self.usable = bool(torch.isfinite(w16).all())  # |w| beyond float16's range: no screening
        diff = (w.double() - w16.double()).norm(dim=1)
        rounding = 2 * (k + 2) * 2.0**-24 * torch.maximum(w.double().norm(dim=1), w16.double().norm(dim=1))
        self.bound = ((diff + rounding) * (1 + 2.0**-10)).float()  # (V,) per unit of ||x||_2, rounded up
        self.packed = kernels.ops().pack_linear_weight(w16) if self.usable else None

    def __call__(self, x: Tensor) -> Tensor:
        if self.packed is None:
            return F.linear(x, self.weight, self.bias).argmax(-1)
        ops = kernels.ops()
        screened = ops.skinny_linear(x, self.packed, self.bias, self.out_features, 0)  # (M, V)
        return ops.screened_argmax(x, screened, self.weight, self.bias, self.bound)

    def reference(self, x: Tensor) -> Tensor:
        """The same selection in PyTorch ops (what ``screened_argmax`` computes), for tests."""
        screened = F.linear(x, self.weight.half().float(), self.bias)
        xnorm = x.double().norm(dim=1, keepdim=True).float() * (1 + 2.0**-10)
        err = torch.addcmul(screened.abs() * 2.0**-21, xnorm, self.bound[None])  # (M, V)
        best_low = (screened - err).amax(dim=1, keepdim=True)
        cand = ((screened + err) >= best_low) | ~torch.isfinite(best_low) | screened.isnan().any(1, keepdim=True)
        logits = torch.where(cand, F.linear(x, self.weight, self.bias), float("-inf"))
        return logits.argmax(dim=-1), cand.sum(dim=1)


class DenseLinear:
    """``y = act(x @ weight.T + bias)`` with the weight cast once to ``dtype`` (a compute dtype other than the
    packed float32 panels', e.g. bf16 on CPUs that multiply it natively); the call of :class:`PackedLinear`.

    Args:
        weight: (N, K). bias: (N,) or None. dtype: the GEMM's dtype (x is cast to it).
    """

    def __init__(self, weight: Tensor, bias: Tensor | None, dtype: torch.dtype) -> None:
        self.weight_t = weight.detach().to(dtype).t()
        self.bias = None if bias is None else bias.detach().to(dtype)
        self.bias32 = None if bias is None else bias.detach().float()
        self.out_features = weight.shape[0]

    def __call__(self, x: Tensor, activation: str | None = None) -> Tensor:
        x = x.to(self.weight_t.dtype)
        if activation is not None:
            return ffn_hidden(torch.mm(x, self.weight_t), self.bias32, activation)
        return torch.mm(x, self.weight_t) if self.bias is None else torch.addmm(self.bias, x, self.weight_t)
