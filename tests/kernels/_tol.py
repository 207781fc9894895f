"""Tolerances for fast-vs-reference checks, derived per REFERENCE.md §3 (PyTorch's "fused tolerances" note).

The fast path's error against a float64 evaluation of the reference may be at most ``FACTOR`` times the error the
reference itself makes in the same low precision, plus a floor of a few ulps of the values' magnitude (so exact
reference results, e.g. ReLU on floats, do not demand exactness from a differently-ordered computation).
"""

from __future__ import annotations

import torch

# A fused kernel rounds once where the reference rounds several times, and sums in another order: 4x the
# reference's own error covers that without hiding a real bug (a wrong mask or formula is off by O(1)).
FACTOR = 4.0
ULPS = 8.0


def assert_fast_close(fast: torch.Tensor, ref_lowp: torch.Tensor, ref64: torch.Tensor, *, what: str = "") -> None:
    """``max|fast - ref64| <= FACTOR * max|ref_lowp - ref64| + ULPS * eps(dtype) * max|ref64|``."""
    assert fast.shape == ref64.shape, (what, fast.shape, ref64.shape)
    assert fast.dtype == ref_lowp.dtype, (what, fast.dtype, ref_lowp.dtype)
    if ref64.numel() == 0:
        return
    f, r, w = fast.double(), ref_lowp.double(), ref64.double()
    assert torch.isfinite(f).all(), f"{what}: non-finite values in the fast result"
    err_ref = (r - w).abs().max().item()
    err_fast = (f - w).abs().max().item()
    floor = ULPS * torch.finfo(fast.dtype).eps * w.abs().max().item()
    tol = FACTOR * err_ref + floor
    assert err_fast <= tol, f"{what}: fast error {err_fast:.3e} > {tol:.3e} (reference error {err_ref:.3e})"


def run(
    fn, inputs: list[torch.Tensor], *, g_dtype: torch.dtype = torch.bfloat16, grad_out_seed: int = 1
) -> tuple[torch.Tensor, list[torch.Tensor | None]]:
    """Forward ``fn(*inputs)`` and backward with a fixed random cotangent (rounded through ``g_dtype`` so the
    low-precision and float64 runs see the same values); returns (out, grads of inputs)."""
    leaves = [t.detach().clone().requires_grad_(t.requires_grad) for t in inputs]
    out = fn(*leaves)
    g = torch.randn(out.shape, generator=torch.Generator().manual_seed(grad_out_seed), dtype=torch.float64)
    g = g.to(g_dtype).double()
    need = [t for t in leaves if t.requires_grad]
    if need and out.numel():
        gs = torch.autograd.grad(out, need, g.to(out.dtype), allow_unused=True)
    else:
        gs = [None] * len(need)
    it = iter(gs)
    return out.detach(), [next(it) if t.requires_grad else None for t in leaves]


def as64(ts: list[torch.Tensor]) -> list[torch.Tensor]:
    return [t.detach().double().requires_grad_(t.requires_grad) for t in ts]


def graph_names(t: torch.Tensor) -> str:
    """Names of ``t``'s grad_fn and its direct inputs (to see which path produced it through a final view)."""
    fn = t.grad_fn
    return " ".join([type(fn).__name__] + [type(n).__name__ for n, _ in fn.next_functions if n is not None])
