"""Prepared weight formats of one linear layer: what a fast path multiplies instead of an ``nn.Linear``'s weight.

* :class:`PackedLinear` — float32 or bfloat16 panels of 16 output columns for the
  ``skinny_linear`` kernel (few rows: decoding steps; bf16 in 12 bits a weight where the CPU has AVX-512 and
  AVX512_BF16, :func:`compact_bf16`), torch's GEMM on the unpacked weight for more rows;
* :class:`Int8Linear` — an int8 weight (symmetric per output channel) times int8 activations quantized per row
  (``int8_linear``: AVX512-VNNI where present), or float32 activations (weight-only, ``skinny_linear``);
* :class:`DenseLinear` — the weight cast once to another compute dtype (bf16 on CPUs that multiply it natively);
* :class:`OneDNNLinear` — float32 on a weight packed once for oneDNN (many rows: encoders), GELU fused;
* :class:`GreedyHead` — the argmax of an LM head read in 16 bits, exact to the float32 argmax.

Each is called as ``linear(x (M, K), activation=None) -> (M, N)`` (an FFN activation fused after the bias), so a
model's prepared forward does not depend on the format. :mod:`sublayer.runtime.weights` builds and caches them.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import Tensor

from .. import kernels
from ..functional import fused
from ..kernels import onednn
from .rows import EPILOGUE, ffn_hidden, kernels_on

__all__ = [
    "PackedLinear", "Int8Linear", "DenseLinear", "OneDNNLinear", "GreedyHead", "SKINNY_MAX_ROWS", "skinny_max_rows",
    "NO_SCALE", "COMPACT_MAX_EXCEPTIONS", "compact_bf16", "compact_kernels", "quantize_weight", "quantize_rows",
    "int8_linear_reference", "int8_screens_rows",
]  # fmt: skip


COMPACT_MAX_EXCEPTIONS = 1 / 256  # the share of a weight's entries above which compact_bf16 keeps bf16 panels


class PackedLinear:
    """``y = x @ weight.T + bias`` for few rows, the weight packed once for the ``skinny_linear`` kernel.

    Args:
        weight: (N, K) (``nn.Linear`` layout). bias: (N,) or None (kept float32).
        dtype: the panels' dtype: ``torch.float32`` or ``torch.bfloat16`` (half the bytes a decoding step
            streams; the weight is rounded to bf16 once).
        compact: bf16 panels in :func:`compact_bf16`'s 12 bits a weight (the same weights: three quarters of the
            bytes a step streams, the same products and float32 sums in another order). None: where
            :func:`compact_kernels` (AVX-512 and AVX512_BF16) rebuild them in registers as they stream in; bf16
            panels where more than :data:`COMPACT_MAX_EXCEPTIONS` of the weights do not fit the table.

    Call: x (M, K) float32 with unit inner stride (a column slice of a wider tensor works) -> (M, N) float32.
    Up to :func:`skinny_max_rows` rows ``skinny_linear`` multiplies the panels: float32 x times the bf16 weight
    widened exactly, float32 sums (one row; and several rows without AVX512_BF16 or with
    ``decode_bf16_dot(0)``), or with AVX512_BF16 and several rows x rounded to bf16 and ``vdpbf16ps`` (exact
    bf16 products, float32 sums; see ``kernels/csrc/packed_linear.cpp``). Above it, or without the kernels,
    torch's GEMM runs on :attr:`weight`: float32, or for ``dtype=torch.bfloat16`` on CPUs that multiply bf16
    natively (:func:`sublayer.kernels.native_bf16_gemm`) a bf16 copy (x and the product rounded to bf16, the bias
    added in float32, as under ``torch.autocast``), elsewhere the float32 weight (the bf16 one widened if only
    that was given).

    Raises:
        ValueError: ``dtype`` is neither float32 nor bfloat16.
    """

    def __init__(
        self, weight: Tensor, bias: Tensor | None = None, *, dtype: torch.dtype = torch.float32, compact: bool | None = None
    ) -> None:
        if dtype not in (torch.float32, torch.bfloat16):
            raise ValueError(f"PackedLinear: dtype must be torch.float32 or torch.bfloat16, got {dtype}")
        weight = weight.detach()
        self.dtype = dtype
        self.out_features, self.in_features = weight.shape
        self.bias = None if bias is None else bias.detach().float().contiguous()
        panels = weight.to(dtype).contiguous()
        if dtype == torch.bfloat16 and kernels.native_bf16_gemm():
            self.weight = panels  # torch's bf16 GEMM above skinny_max_rows()
        else:  # the parameter itself (no copy) when it is float32
            self.weight = (weight if weight.dtype == torch.float32 else panels).float().contiguous()
        self.packed = None
        if kernels_on():
            if dtype == torch.bfloat16 and (compact_kernels() if compact is None else compact):
                self.packed = compact_bf16(panels)
            if self.packed is None:
                self.packed = kernels.ops().pack_linear_weight(panels)
        # decided once, not per call; without panels -1: torch's GEMM for every row count, an empty x included
        self.max_rows = skinny_max_rows() if self.packed is not None else -1

    def __call__(self, x: Tensor, activation: str | None = None) -> Tensor:
        """``activation`` (an FFN activation name) is applied after the bias: fused into the kernel's epilogue
        (``fused.ACT_IDS``), a separate pass for any other."""
        if x.shape[0] <= self.max_rows:
            act = EPILOGUE.get(activation, 0)
            y = kernels.ops().skinny_linear(x, self.packed, self.bias, self.out_features, act)
            return y if activation is None or act else ffn_hidden(y, None, activation)
        if self.weight.dtype == torch.bfloat16:
            y = torch.mm(x.to(torch.bfloat16), self.weight.t()).float()
            if activation is not None:
                return ffn_hidden(y, self.bias, activation)
            return y if self.bias is None else y.add_(self.bias)
        y = fused.linear(x, self.weight, self.bias)
        return y if activation is None else ffn_hidden(y, None, activation)

    def flat(self) -> tuple[Tensor, Tensor, Tensor] | None:
        """``(packed, scale, bias)`` as the one-call decoding steps take a linear (no scale, no bias: an empty
        tensor; float32 or bfloat16 panels alike), or None (no kernels)."""
        if self.packed is None:
            return None
        return self.packed, NO_SCALE, NO_SCALE if self.bias is None else self.bias


def compact_kernels() -> bool:
    """Whether the kernels that read compact bf16 panels as they stream in are compiled and on: AVX-512 for one row,
    AVX512_BF16's ``vdpbf16ps`` for several (``decode_avx512``, ``decode_bf16_dot``). Elsewhere compact panels would
    be unpacked before use, so :class:`PackedLinear` keeps bf16 panels."""
    ops = kernels.ops()
    return bool(ops.decode_avx512(-1) and ops.decode_bf16_dot(-1))


def compact_bf16(weight: Tensor) -> Tensor | None:
    """``weight`` (N, K) bfloat16 in the ``pack_compact_bf16`` layout (12 bits a weight, lossless; see
    ``kernels/csrc/packed_linear.cpp``): its table is 0x00 and the 15 most frequent other high bytes (sign and the
    exponent's top 7 bits). None where more than :data:`COMPACT_MAX_EXCEPTIONS` of the weights have a high byte
    outside it (they would each cost 8 bytes and an epilogue product)."""
    w = weight.detach().contiguous()
    counts = torch.bincount(((w.view(torch.int16).to(torch.int32) >> 8) & 0xFF).flatten(), minlength=256)
    top = counts[1:].argsort(descending=True, stable=True)[:15] + 1
    table = torch.cat([top.new_zeros(1), top])
    if w.numel() - counts[table].sum().item() > COMPACT_MAX_EXCEPTIONS * w.numel():
        return None
    return kernels.ops().pack_compact_bf16(w, table.to(torch.uint8))


def quantize_weight(w: Tensor) -> tuple[Tensor, Tensor]:
    """Symmetric per-output-channel int8: ``(q (M, K) int8, scale (M,) float32)`` with ``w ≈ q * scale[:, None]``,
    ``|w - q * scale| <= scale / 2`` elementwise, ``q`` in [-127, 127]. An all-zero row gets scale 1 (q = 0)."""
    w = w.detach().float()
    amax = w.abs().amax(dim=1)
    scale = torch.where(amax > 0, amax / 127.0, torch.ones_like(amax))
    q = torch.round(w / scale[:, None]).clamp_(-127, 127).to(torch.int8)
    return q, scale


def quantize_rows(x: Tensor) -> tuple[Tensor, Tensor]:
    """Asymmetric per-row uint8 quantization as the ``int8_linear`` kernel computes it: x (M, K) float32 ->
    (q (M, K) float32 holding the integers ``u - zp``, s (M, 1)) with ``x ≈ q * s``: over the row's range
    ``[lo, hi] = [min(min_k x, 0), max(max_k x, 0)]``, ``s = (hi - lo) / 255``, the zero point
    ``zp = round(-lo * 255 / (hi - lo))`` and ``u = clamp(round_half_even(x * 255 / (hi - lo)) + zp, 0, 255)``:
    256 levels over each row's own range (an all-zero row: q = 0, s = 0; a row of subnormal entries, whose
    ``255 / (hi - lo)`` overflows float32: q = 0, as zero; a row of finite entries whose ``hi - lo`` overflows
    float32 (entries near -3.4e38 and +3.4e38): ``255 / (hi - lo)`` and s from the range in float64, rounded to
    float32, both finite)."""
    lo = x.amin(dim=1, keepdim=True).clamp(max=0)
    hi = x.amax(dim=1, keepdim=True).clamp(min=0)
    rng = hi - lo
    inv = 255 / torch.where(rng > 0, rng, 1)
    inv = torch.where((rng > 0) & torch.isfinite(inv), inv, 0)
    s = rng / 255
    wide, rng64 = torch.isinf(rng) & torch.isfinite(lo) & torch.isfinite(hi), hi.double() - lo.double()
    inv = torch.where(wide, (255 / rng64).to(x.dtype), inv)
    s = torch.where(wide, (rng64 / 255).to(x.dtype), s)
    zp = torch.round(-lo * inv)
    return (torch.round(x * inv) + zp).clamp_(0, 255) - zp, s


def quantize_rows24(x: Tensor) -> tuple[Tensor, Tensor]:
    """Each row as 24-bit integers, as the ``int8_linear`` kernel's ``bits=24`` computes it: x (M, K) float32 ->
    (t (M, K) float64 holding integers, s (M, 1) float64) with ``x ≈ t * s``: ``s = 2^(E - 22)`` where
    ``2^(E-1) <= m < 2^E`` for the row's ``m = max_k |x_k|``, ``t = round_half_even(x / s)``, so
    ``|t| <= 2^22`` and ``|x - t s| <= s / 2 <= m 2^-22`` (about float32's own precision at the row's largest
    entry). A zero row has s = 0 (and t = 0); a row with an infinite or NaN entry s = NaN (its outputs are NaN)."""
    m = x.abs().amax(dim=1, keepdim=True).double()
    s = torch.ldexp(torch.ones_like(m), (torch.frexp(m).exponent - 22).double())
    t = torch.round(x.double() / s).nan_to_num_(0.0, 0.0, 0.0)
    s = torch.where(m > 0, s, 0.0).masked_fill_(~torch.isfinite(m), float("nan"))
    return t, s


def int8_linear_reference(
    x: Tensor, q: Tensor, scale: Tensor, bias: Tensor | None, *, inv_smooth: Tensor | None = None, bits: int = 8
) -> Tensor:
    """``((x_q @ q^T) * s_x) * scale + bias`` in PyTorch, the sums exact (float64 holds them): x (M, K) float32,
    q (N, K) int8, scale (N,) -> (M, N) float32; x (times ``inv_smooth`` (K,) when given) quantized by
    :func:`quantize_rows` (``bits=8``) or :func:`quantize_rows24` (``bits=24``)."""
    xs = x if inv_smooth is None else x * inv_smooth
    if bits == 24:
        t, s = quantize_rows24(xs)
        y = ((t @ q.double().t()) * s).float().mul_(scale)
    else:
        xq, sx = quantize_rows(xs)
        y = (xq.double() @ q.double().t()).float().mul_(sx).mul_(scale)
    return y if bias is None else y.add_(bias)


def weight_int8_linear_reference(x: Tensor, q: Tensor, scale: Tensor, bias: Tensor | None) -> Tensor:
    """``(x @ q^T) * scale + bias`` in plain PyTorch, float32: x (M, K), q (N, K) int8, scale (N,) -> (M, N)."""
    y = F.linear(x, q.float()).mul_(scale)
    return y if bias is None else y.add_(bias)


class Int8Linear:
    """``y = act(x @ (q * scale[:, None]).T + bias)`` from an int8 weight, symmetric per output channel.

    Args:
        q: (N, K) int8. scale: (N,) float32 (the weight is ``q * scale[:, None]``). bias: (N,) or None.
        activations: ``"int8"`` — each row of x quantized to 8 bits (:func:`quantize_rows`: uint8 with the row's
            own scale and zero point), exact int32 sums of uint8 x int8 (the ``int8_linear`` kernel: AVX512-VNNI
            ``vpdpbusd``, minus the zero point times the weight's column sums; a portable loop elsewhere), then
            ``* s_x * scale + bias`` in float32 (:func:`int8_linear_reference` without the kernels); ``"float"``
            — weight-only: float32 x times the exactly widened weight (``skinny_linear`` on int8 panels,
            :func:`weight_int8_linear_reference` without the kernels).
        single_row_bits: int8 activations only: 24 carries a call of one row (batch-1 decoding, memory-bound) as
            24-bit integers instead (:func:`quantize_rows24`: three uint8 planes through the same kernel, about
            float32's precision, at the rate memory delivers the weights); 8: as several rows.
        smooth: (K,) float32 or None, int8 activations only: SmoothQuant's per-input-channel divisor, x / smooth
            is what is quantized (``q * scale`` then holds ``W * smooth``; the kernel multiplies by its inverse in
            its quantization pass).
        grouped: int8 activations only: pack the weight in groups of 48 columns (``pack_int8_quads(q,
            grouped=True)``), one sequential stream per kernel call, for layers that mostly see a few rows (decoding
            steps); False: panels of 16 columns, for many rows (encoders). Same results either way.

    Call: x (M, K) float32 with unit inner stride, ``activation`` an FFN activation name or None -> (M, N).
    The weight is packed at the first call with the kernels on.

    Raises:
        ValueError: ``activations`` is neither "int8" nor "float", ``smooth`` or ``single_row_bits=24`` with float
            activations, ``single_row_bits`` neither 8 nor 24, ``scale`` / ``bias`` not of shape (N,) or
            ``smooth`` not (K,); at the call, ``x`` not (M, K).
        TypeError: ``q`` is not a 2-D int8 tensor.
    """

    def __init__(
        self, q: Tensor, scale: Tensor, bias: Tensor | None = None, *, activations: str = "int8",
        smooth: Tensor | None = None, grouped: bool = False, single_row_bits: int = 8,
    ) -> None:  # fmt: skip
        if activations not in ("int8", "float"):
            raise ValueError(f"Int8Linear: activations must be 'int8' or 'float', got {activations!r}")
        if smooth is not None and activations != "int8":
            raise ValueError("Int8Linear: smooth applies to int8 activations only (activations='int8')")
        if single_row_bits not in (8, 24) or (single_row_bits == 24 and activations != "int8"):
            raise ValueError(
                f"Int8Linear: single_row_bits must be 8 or 24 (24 with int8 activations), got {single_row_bits!r}"
            )
        if q.dtype != torch.int8 or q.dim() != 2:
            raise TypeError(f"Int8Linear: q must be a 2-D int8 tensor, got {q.dtype} {tuple(q.shape)}")
        for name, t, size, side in (("scale", scale, q.shape[0], "N"), ("bias", bias, q.shape[0], "N"),
                                    ("smooth", smooth, q.shape[1], "K")):  # fmt: skip
            if t is not None and tuple(t.shape) != (size,):
                raise ValueError(f"Int8Linear: {name} must have shape ({side}={size},) for q of shape (N, K)="
                                 f"{tuple(q.shape)}, got {tuple(t.shape)}")  # fmt: skip
        self.q, self.scale, self.activations = q.detach().contiguous(), scale.detach().float().contiguous(), activations
        self.bias = None if bias is None else bias.detach().float().contiguous()
        self.out_features, self.in_features = q.shape
        self.colsum = self.q.sum(dim=1, dtype=torch.int32)  # takes the activations' zero points back
        self.smooth = None if smooth is None else smooth.detach().float().contiguous()
        self.inv_smooth = None if smooth is None else (1.0 / self.smooth).contiguous()
        self._packed: Tensor | None = None
        self.grouped, self.single_row_bits = grouped, single_row_bits

    def packed(self) -> Tensor:
        """The weight in the kernel's layout (``pack_int8_quads`` / ``pack_linear_weight``), packed once."""
        if self._packed is None:
            ops = kernels.ops()
            int8 = self.activations == "int8"
            self._packed = ops.pack_int8_quads(self.q, self.grouped) if int8 else ops.pack_linear_weight(self.q)
        return self._packed

    def flat(self) -> tuple[Tensor, Tensor, Tensor] | None:
        """``(panels, scale, bias)`` of a weight-only layer for the one-call decoding step (``skinny_linear``'s
        operands; no bias: an empty tensor), or None (int8 activations, or no kernels)."""
        if self.activations != "float" or not kernels_on():
            return None
        return self.packed(), self.scale, torch.empty(0) if self.bias is None else self.bias

    def flat_quads(self) -> tuple[Tensor, Tensor, Tensor, Tensor] | None:
        """``(quads, scale, bias, colsum)``: the one-call decoding step's ``int8_linear`` operands (no bias: an
        empty tensor), or None (weight-only, SmoothQuant, ``single_row_bits=8``, or no kernels): the step multiplies
        one row at 24 bits and several at 8, as this layer does only with ``single_row_bits=24``."""
        if self.activations != "int8" or self.smooth is not None or self.single_row_bits != 24 or not kernels_on():
            return None
        return self.packed(), self.scale, torch.empty(0) if self.bias is None else self.bias, self.colsum

    def __call__(self, x: Tensor, activation: str | None = None) -> Tensor:
        if x.dim() != 2 or x.shape[1] != self.in_features:
            raise ValueError(f"Int8Linear: x must be (M, K={self.in_features}) for q of shape (N, K)="
                             f"{tuple(self.q.shape)}, got {tuple(x.shape)}")  # fmt: skip
        bits = self.single_row_bits if x.shape[0] == 1 else 8
        if kernels_on():
            act, n = EPILOGUE.get(activation, 0), self.out_features
            if self.activations == "int8":
                y = kernels.ops().int8_linear(
                    x, self.packed(), self.colsum, self.scale, self.bias, n, act, self.inv_smooth, bits
                )
            else:
                y = kernels.ops().skinny_linear(x, self.packed(), self.bias, n, act, self.scale)
            return y if activation is None or act else ffn_hidden(y, None, activation)
        if self.activations == "int8":
            y = int8_linear_reference(x, self.q, self.scale, self.bias, inv_smooth=self.inv_smooth, bits=bits)
        else:
            y = weight_int8_linear_reference(x, self.q, self.scale, self.bias)
        return y if activation is None else ffn_hidden(y, None, activation)


# Up to this many rows the several-row micro-kernels (AVX-512: 8 rows x 2 panels; AVX2: 6 rows x 16 columns) are
# used; above it a blocked GEMM (torch's) wins. `sublayer bench --decode` measures both.
SKINNY_MAX_ROWS = 32


def skinny_max_rows() -> int:
    """Most rows ``PackedLinear`` multiplies with ``skinny_linear`` (above: torch's GEMM on the unpacked weight)."""
    return SKINNY_MAX_ROWS


NO_SCALE = torch.empty(0)  # the scale argument of a float linear in the kernels' calls


def int8_screens_rows() -> bool:
    """Whether :class:`GreedyHead` screens several rows with int8 activations by default: CPUs with AVX512_VNNI or
    AMX-INT8 (``int8_linear``'s ``vpdpbusd``)."""
    return kernels.cpu.has("avx512_vnni", "amx_int8")


class GreedyHead:
    """``argmax(x @ weight.T + bias)`` per row, equal to the float32 argmax, reading the weight in 16 bits.

    The LM head is a third of GPT-2 small's bytes per token. A greedy step needs only the argmax, so this screens
    every vocabulary row with a 16-bit copy ``w16`` of the weight (half the bytes) and recomputes in float32 only
    the rows that could still be the maximum. With ``x`` the float32 input and ``x16`` what the kernel multiplies
    (``x`` itself, or ``x`` rounded to bfloat16 where several rows take ``vdpbf16ps``, ``||x - x16|| <= 2^-8 ||x||``),

        |x·w_j - x16·w16_j| <= ||x||_2 (||w_j - w16_j||_2 + c ||w16_j||_2)   (Cauchy-Schwarz; c = 2^-8 for a
                                                                                bfloat16 screen, else 0)

    plus the float32 rounding of either sum (<= 2 (K+2) u ||x||_2 ||w_j||_2, any summation order, u = 2^-24), a
    bfloat16 screen's flushed denormals and underflows (<= 2K (1 + ||w16_j||) 2^-126, covered for rows with
    ``||x||_2 >= 2^-60``; smaller rows are multiplied in float32) and the bias addition. A row j whose screened
    logit plus its bound is below the best screened logit minus that row's bound cannot be the float32 maximum,
    so the argmax over the candidates' float32 logits (typically one to a few rows; ``screened_argmax`` in C++)
    is the argmax over all rows (ties: the first index, as ``torch.argmax``). When the best lower end is not
    finite, every row is recomputed.

    A single row (batch-1 decoding: bound by the bytes it reads) is screened with an int8 copy instead, ``q * s``
    with a float32 scale per vocabulary row (a quarter of float32's bytes; the weight-only ``skinny_linear`` on
    int8 panels: float32 x times the exactly widened q, float32 sums, then ``* s``), under the same bound with
    ``q * s`` for ``w16_j`` and c = 0: a wider bound (int8 keeps about 8 bits of a row, bfloat16 about 9 of each
    weight), so a few more rows are recomputed, but half the bytes of the 16-bit screen. Where several rows take
    int8 activations (below), a single row goes through the same ``int8_linear`` instead, carried as 24-bit
    integers (:func:`quantize_rows24`, exact integer sums: the bytes at the rate memory delivers them), and the
    bound gains ``sqrt(K) 2^-22 ||q_j s_j||_2`` (``||x - x̂||_2 <= sqrt(K) max|x| 2^-22``); a row with
    ``||x||_2 < 2^-60`` is multiplied in float32.

    Several rows on a CPU with AVX512-VNNI (or AMX-INT8) are screened with the same int8 copy and int8
    activations (``int8_linear``: each row of x quantized to uint8 as :func:`quantize_rows`, ``x̂ = (u - zp) s_x``,
    exact int32 sums ``(u - zp)·q_j``, then ``* s_x * s_j + b_j`` in float32): half the 16-bit screen's bytes and
    four multiply-adds an instruction. The bound gains the activations' rounding, by Cauchy-Schwarz again,

        |x·w_j - x̂·ŵ_j| <= ||x||_2 ||w_j - ŵ_j||_2 + ||x - x̂||_2 ||ŵ_j||_2          (ŵ_j = q_j s_j)

    where ``||x - x̂||_2`` is measured on the row as the kernel quantizes it (``screened_argmax`` repeats the
    kernel's quantization in C++, double sums, rounded up; a priori each ``|x_k - x̂_k| <= s_x / 2``, so it is at
    most ``sqrt(K) s_x / 2``, ``s_x = range / 255``), the integer sums are exact, and the three float32 roundings
    of the dequantization add ``<= 4u ||x̂||_2 ||ŵ_j||_2`` (u = 2^-24) plus an underflow ``<= 2^-149`` (covered by
    a floor of ``2^-80 * 2^-40`` on the term; rows with ``||x||_2 < 2^-60`` are multiplied in float32, which
    also keeps the quantization's ``255 / range`` finite); the float32 summation term of the recomputation
    remains. Elsewhere (no VNNI, ``K > 2^16`` where int32 sums could overflow, or ``int8_rows=False``) several
    rows take the 16-bit screen.

    Args:
        weight: (V, K) float32. bias: (V,) or None.
        screen: the copy's dtype, ``torch.float16`` or ``torch.bfloat16`` (None: bfloat16 where the CPU has
            AVX512_BF16 (its dot product does twice the work per instruction of widening float16 for several
            rows; the bound is wider), else float16).
        int8_single_row: screen a single row with the int8 copy (at 24 bits where ``int8_rows``, else on int8
            panels; False: with the 16-bit one, as several rows).
        int8_rows: screen several rows with the int8 copy and int8 activations (None: where the CPU has
            AVX512-VNNI or AMX-INT8; True where it lacks them runs the kernel's portable loop, for tests).

    Call: x (M, K) float32 -> (M,) int64 ids. Needs the kernels (``skinny_linear`` on 16-bit panels).

    Raises:
        ValueError: ``screen`` is neither float16 nor bfloat16.
    """

    def __init__(
        self, weight: Tensor, bias: Tensor | None = None, *, screen: torch.dtype | None = None,
        int8_single_row: bool = True, int8_rows: bool | None = None,
    ) -> None:  # fmt: skip
        if screen is None:
            screen = torch.bfloat16 if kernels.cpu.has("avx512_bf16") else torch.float16
        if screen not in (torch.float16, torch.bfloat16):
            raise ValueError(f"GreedyHead: screen must be torch.float16 or torch.bfloat16, got {screen}")
        w = weight.detach().float().contiguous()
        self.weight, self.bias = w, None if bias is None else bias.detach().float().contiguous()
        self.out_features = w.shape[0]
        self.screen = screen
        w16 = w.to(screen)
        self.usable = bool(torch.isfinite(w16).all())  # |w| beyond float16's range: no screening
        w16d = w16.double()
        if screen == torch.bfloat16:  # denormals are read as zero by vdpbf16ps
            w16d = torch.where(w16d.abs() < 2.0**-126, 0.0, w16d)
        self.bound = _screen_bound(w, w16d, rounded_x=screen == torch.bfloat16)
        self.packed = kernels.ops().pack_linear_weight(w16) if self.usable else None
        if int8_rows is None:
            int8_rows = int8_screens_rows()
        int8_rows = int8_rows and w.shape[1] <= 2**16
        self.q = self.scale = self.bound1 = self.packed1 = self.bound24 = None  # the int8 screen of a single row
        self.quads = self.colsum = self.bound_q = None  # and of several rows with int8 activations
        if (int8_single_row or int8_rows) and bool(torch.isfinite(w).all()):
            self.q, self.scale = quantize_weight(w)
            wq = self.q.double() * self.scale.double()[:, None]
            self.bound1 = _screen_bound(w, wq, rounded_x=False)
            if int8_single_row and not int8_rows:
                self.packed1 = kernels.ops().pack_linear_weight(self.q)
            if int8_single_row and int8_rows:
                self.bound24 = _screen_bound(w, wq, rounded_x=False, bits24=True)
                self.quads = kernels.ops().pack_int8_quads(self.q, grouped=True)  # a few rows: one stream
                self.colsum = self.q.sum(dim=1, dtype=torch.int32)
                self.bound_q = (wq.norm(dim=1) * (1 + 2.0**-10) + 2.0**-40).float()  # ||ŵ_j||, rounded up

    def __call__(self, x: Tensor) -> Tensor:
        ops = kernels.ops()
        if x.shape[0] == 1 and self.bound24 is not None:
            if not self._large(x):
                return F.linear(x, self.weight, self.bias).argmax(-1)
            V = self.out_features
            screened = ops.int8_linear(x, self.quads, self.colsum, self.scale, self.bias, V, 0, None, 24)
            return ops.screened_argmax(x, screened, self.weight, self.bias, self.bound24)
        if x.shape[0] == 1 and self.packed1 is not None:
            screened = ops.skinny_linear(x, self.packed1, self.bias, self.out_features, 0, self.scale)  # (1, V)
            return ops.screened_argmax(x, screened, self.weight, self.bias, self.bound1)
        if self.quads is not None and x.shape[0] > 1 and self._large(x):
            screened = ops.int8_linear(x, self.quads, self.colsum, self.scale, self.bias, self.out_features, 0, None)
            return ops.screened_argmax(x, screened, self.weight, self.bias, self.bound1, self.bound_q)
        if self.packed is None or (self.screen == torch.bfloat16 and not self._large(x)):
            return F.linear(x, self.weight, self.bias).argmax(-1)
        screened = ops.skinny_linear(x, self.packed, self.bias, self.out_features, 0)  # (M, V)
        return ops.screened_argmax(x, screened, self.weight, self.bias, self.bound)

    @staticmethod
    def _large(x: Tensor) -> bool:
        """Whether every row has ``||x||_2 >= 2^-60`` (or a NaN: every row is recomputed then anyway)."""
        n = torch.linalg.vector_norm(x.detach(), dim=1)
        m = float(n.min())  # one reduction and one read in the common case (no NaN: min is NaN only with one)
        return m >= 2.0**-60 if m == m else bool(((n >= 2.0**-60) | n.isnan()).all())

    def reference(self, x: Tensor) -> Tensor:
        """The same selection in PyTorch ops (what ``screened_argmax`` computes over the float16 screen, or a
        bfloat16 one with x rounded to bfloat16 as several rows multiply on AVX512_BF16, or the int8 one of a
        single row (at 24 bits where several rows take int8 activations), or of several rows with int8
        activations) -> (ids, candidates per row), for tests."""
        bound, extra = self.bound, 0.0
        if x.shape[0] == 1 and self.bound24 is not None:
            screened, bound = int8_linear_reference(x, self.q, self.scale, self.bias, bits=24), self.bound24
        elif x.shape[0] == 1 and self.packed1 is not None:
            screened, bound = F.linear(x, self.q.float(), None).mul_(self.scale), self.bound1
            screened = screened if self.bias is None else screened + self.bias
        elif self.quads is not None and x.shape[0] > 1 and self._large(x):
            screened, bound = int8_linear_reference(x, self.q, self.scale, self.bias), self.bound1
            xq, sx = quantize_rows(x)
            xq = xq.double() * sx.double()
            e = ((x.double() - xq).norm(dim=1) + xq.norm(dim=1) * 2.0**-22) * (1 + 2.0**-9)
            extra = e.clamp(min=2.0**-80).float()[:, None] * self.bound_q[None]  # (M, V)
        else:
            xs = x.bfloat16().float() if self.screen == torch.bfloat16 and x.shape[0] > 1 else x
            screened = F.linear(xs, self.weight.to(self.screen).float(), self.bias)
        xnorm = x.double().norm(dim=1, keepdim=True).float() * (1 + 2.0**-10)
        err = torch.addcmul(screened.abs() * 2.0**-21 + extra, xnorm, bound[None])  # (M, V)
        best_low = (screened - err).amax(dim=1, keepdim=True)
        cand = ((screened + err) >= best_low) | ~torch.isfinite(best_low) | screened.isnan().any(1, keepdim=True)
        logits = torch.where(cand, F.linear(x, self.weight, self.bias), float("-inf"))
        return logits.argmax(dim=-1), cand.sum(dim=1)


def _screen_bound(w: Tensor, ws: Tensor, *, rounded_x: bool, bits24: bool = False) -> Tensor:
    """:class:`GreedyHead`'s bound per unit of ``||x||_2`` for each row of the float32 weight ``w`` (V, K) screened
    with ``ws`` (float64, the screen's values; bfloat16 denormals as zero): ``||w_j - ws_j||``, the float32
    rounding of either sum, with ``rounded_x`` (x rounded to bfloat16, vdpbf16ps) ``2^-8 ||ws_j||`` and the
    flushed underflows, with ``bits24`` (x carried as 24-bit integers, :func:`quantize_rows24`:
    ``||x - x̂||_2 <= sqrt(K) max|x| 2^-22``) ``sqrt(K) 2^-22 ||ws_j||``; rounded up."""
    k = w.shape[1]
    diff, ns = (w.double() - ws).norm(dim=1), ws.norm(dim=1)
    rounding = 2 * (k + 2) * 2.0**-24 * torch.maximum(w.double().norm(dim=1), ns)
    if bits24:
        diff = diff + k**0.5 * 2.0**-22 * ns
    if rounded_x:
        diff = diff + 2.0**-8 * ns + 2 * k * (1 + ns) * 2.0**-66  # x rounded to bf16; underflow at |x| >= 2^-60
    return ((diff + rounding) * (1 + 2.0**-10)).float()  # (V,)


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


class OneDNNLinear:
    """``y = act(x @ weight.T + bias)`` on a weight packed once for oneDNN (:mod:`sublayer.kernels.onednn`; erf and
    tanh GELU fused as its post-op); ``F.linear`` where oneDNN is absent or cannot run ``dtype`` (bf16 on an AVX2
    CPU). The call of :class:`PackedLinear`. Holds the packed weight only (the cast one where it runs ``F.linear``).

    Args:
        weight: (N, K). bias: (N,) or None.
        dtype: the GEMM's dtype, ``torch.float32`` (default) or ``torch.bfloat16`` (weight and bias rounded to
            bf16 once, x cast to it, float32 sums, bf16 output, as :class:`DenseLinear` in bf16).

    Raises:
        ValueError: ``dtype`` is neither float32 nor bfloat16.
    """

    def __init__(self, weight: Tensor, bias: Tensor | None = None, *, dtype: torch.dtype = torch.float32) -> None:
        if dtype not in (torch.float32, torch.bfloat16):
            raise ValueError(f"OneDNNLinear: dtype must be torch.float32 or torch.bfloat16, got {dtype}")
        self.dtype = dtype
        self.weight = weight.detach().to(dtype).contiguous()
        self.bias = None if bias is None else bias.detach().to(dtype).contiguous()
        self.out_features = weight.shape[0]
        self.packed = onednn.pack(self.weight) if onednn.available(dtype) else None
        if self.packed is not None:
            self.weight = None

    def __call__(self, x: Tensor, activation: str | None = None) -> Tensor:
        x = x.to(self.dtype)
        if self.packed is None:
            y = F.linear(x, self.weight, self.bias)
        elif activation in _ONEDNN_GELU:
            return onednn.linear(x.contiguous(), self.packed, self.bias, gelu=_ONEDNN_GELU[activation])
        else:
            y = onednn.linear(x.contiguous(), self.packed, self.bias)
        return y if activation is None else ffn_hidden(y, None, activation)


_ONEDNN_GELU = {"gelu": True, "gelu_tanh": "tanh"}  # FFN activation -> onednn.linear's fused GELU
