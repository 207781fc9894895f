"""``sublayer bench``: sublayer's fused CPU paths side by side with eager PyTorch (and HF, torch.compile).

Every case runs the eager reference and sublayer in the same process, interleaved, on the same inputs; the report
gives medians (and the inter-quartile spread, because shared machines are noisy), the ratio eager/sublayer
(> 1: sublayer is faster), the FFN's time against its GEMMs alone, Add & Norm's bandwidth against a measured copy,
and the bytes each saves for backward (``torch.autograd.graph.saved_tensors_hooks``, parameters excluded).

A training step is what the sub-layer does inside a network: forward, then backward of a fixed upstream gradient
(random, made once), with the inputs' and parameters' ``.grad`` cleared first (inputs stand for activations, whose
gradients flow on instead of accumulating). Harness work (filling a gradient, accumulating into old ``.grad``) would
otherwise be timed on both sides and flatten the ratios.

Allocator: every case runs under glibc's default ``malloc`` (what a user's script gets) and, by default, again with
memory reuse (:func:`sublayer.set_memory_reuse`); the report puts the two side by side, with the minor page faults
per call. ``mallopt`` cannot be undone inside a process, so a setting the current process no longer has runs in a
fresh child process (``python -m sublayer.bench`` with the same options): the default one in a process where memory
reuse is on (the ``sublayer`` CLI turns it on), or where ``LD_PRELOAD``/``MALLOC_*`` set another allocator.

Writes ``bench.json``, ``bench.md`` and ``bench.png`` to ``out``.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import platform
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable
from dataclasses import asdict, dataclass
from pathlib import Path

import torch
from torch import nn

from .. import kernels, memory
from .. import nn as layers
from ..models import fast_inference
from ..runtime.linear import Int8Linear, PackedLinear
from .harness import (
    CLOCKS, Row, bert_batch, bert_model, command_line, copy_gbps, saved_bytes, set_clock, time_interleaved,
    write_report,
)  # fmt: skip
from .jobs import int8_rows, run_jobs, train_rows
from .loss import bench_loss

__all__ = ["Shape", "SHAPES", "QUICK_SHAPES", "MALLOC_SETTINGS", "run_bench", "main"]

# allocator settings the bench can measure: name -> how the report calls it
MALLOC_SETTINGS = {"default": "glibc default", "reuse": "memory reuse (sublayer.set_memory_reuse)"}


@dataclass(frozen=True)
class Shape:
    name: str
    batch: int
    seq: int
    d: int
    f: int
    heads: int

    @property
    def tokens(self) -> int:
        return self.batch * self.seq


SHAPES = [
    Shape("tutorial 64x256 d512", 64, 256, 512, 2048, 8),
    Shape("small 16x128 d512", 16, 128, 512, 2048, 8),
    Shape("BERT-base 32x128", 32, 128, 768, 3072, 12),
    Shape("MiniLM 64x128", 64, 128, 384, 1536, 12),
]
QUICK_SHAPES = [Shape("tutorial-quick 2x128 d512", 2, 128, 512, 2048, 8)]
DROPOUT = 0.1
CASES = ("addnorm", "ffn", "encoder", "hf", "bert", "loss", "models", "gemv")  # --cases picks among these
GEMV_SHAPES = [(768, 768), (3072, 768), (50257, 768)]  # (N, K): GPT-2 small's attention out, fc1, LM head


def _autocast(bf16: bool):
    return torch.autocast("cpu", dtype=torch.bfloat16) if bf16 else contextlib.nullcontext()


def _step_fns(mods: dict[str, nn.Module], inputs: tuple[torch.Tensor, ...], bf16: bool, mode: str):
    """fn per impl: a forward (eval, no_grad) or a training step (train, forward + backward) on ``inputs``."""
    fns = {}
    for name, m in mods.items():
        if mode == "forward":
            m.eval()

            def f(m=m):
                with torch.no_grad(), _autocast(bf16):
                    m(*inputs)

        else:
            m.train()
            params = list(m.parameters())
            upstream: dict[tuple, torch.Tensor] = {}  # one fixed upstream gradient per output shape/dtype

            def f(m=m, params=params, upstream=upstream):
                for t in (*params, *inputs):
                    t.grad = None
                with _autocast(bf16):
                    out = m(*inputs)
                key = (out.shape, out.dtype)
                if key not in upstream:
                    upstream[key] = torch.randn(out.shape, generator=torch.Generator().manual_seed(0)).to(out.dtype)
                out.backward(upstream[key])

        fns[name] = f
    return fns


class _EagerAddNorm(nn.Module):
    def __init__(self, d, p, dtype=None):
        super().__init__()
        self.drop, self.norm = nn.Dropout(p), nn.LayerNorm(d, dtype=dtype)

    def forward(self, x, y):
        return self.norm(x + self.drop(y))


def _row(case: str, s: Shape, bf16: bool, mode: str, mods: dict, inputs: tuple, reps: int, warmup: int, **more) -> Row:
    """A row of ``mods`` stepped on ``inputs`` (:func:`_step_fns`) and the functions ``more``, timed interleaved."""
    fns = _step_fns(mods, inputs, bf16, mode) | more
    return Row(case, s.name, "bf16 autocast" if bf16 else "fp32", mode).fill(time_interleaved(fns, reps, warmup))


def _impls(eager: nn.Module, ours: nn.Module, use_compile: bool) -> dict[str, nn.Module]:
    """The modules timed: eager, sublayer and, when asked, torch.compile of the eager one (if it compiles)."""
    mods = {"eager": eager, "sublayer": ours}
    if use_compile:
        with contextlib.suppress(Exception):  # a missing compiler toolchain etc.: just no column
            mods["compile"] = torch.compile(eager)
    return mods


def _saved_extra(row: Row, mods: dict[str, nn.Module], inputs: tuple[torch.Tensor, ...], bf16: bool) -> None:
    """The bytes autograd saves in ``m(*inputs)`` (training mode), eager vs sublayer, as the row's extras."""
    saved: dict[str, int] = {}
    for name in ("eager", "sublayer"):
        m = mods[name].train()
        with _autocast(bf16):
            saved[name] = saved_bytes(lambda: m(*inputs), list(m.parameters()))
        row.extra[f"saved MiB {name}"] = round(saved[name] / 2**20, 3)
    row.extra["saved ratio"] = round(saved["sublayer"] / saved["eager"], 3) if saved["eager"] else float("nan")


def bench_ffn(s: Shape, bf16: bool, mode: str, reps: int, warmup: int, use_compile: bool) -> Row:
    torch.manual_seed(0)
    eager = nn.Sequential(nn.Linear(s.d, s.f), nn.ReLU(), nn.Dropout(DROPOUT), nn.Linear(s.f, s.d))
    ours = layers.PositionWiseFFN(s.d, s.f, dropout=DROPOUT)
    ours.fc1.load_state_dict(eager[0].state_dict())
    ours.fc2.load_state_dict(eager[3].state_dict())
    x = torch.randn(s.batch, s.seq, s.d, requires_grad=(mode == "training"))
    mods = _impls(eager, ours, use_compile)
    # the GEMMs alone, in the dtype the FFN multiplies in (bf16 without native bf16 GEMMs multiplies in fp32)
    dt = torch.bfloat16 if bf16 and kernels.native_bf16_gemm() else torch.float32
    x2 = x.detach().reshape(-1, s.d).to(dt)
    w1, w2 = eager[0].weight.detach().to(dt), eager[3].weight.detach().to(dt)
    h = torch.relu(x2 @ w1.t())

    def gemms():
        a = x2 @ w1.t()
        o = h @ w2.t()
        if mode == "training":
            o @ w2, o.t() @ h, a.t() @ x2, a @ w1

    row = _row("FFN relu (nn.Sequential)", s, bf16, mode, mods, (x,), reps, warmup, gemms=gemms)
    row.extra |= {f"{k} / GEMMs alone": round(row.ratio("gemms", k), 3) for k in ("sublayer", "eager")}
    if mode == "training":
        _saved_extra(row, mods, (x,), bf16)
    return row


def bench_add_norm(s: Shape, bf16: bool, mode: str, reps: int, warmup: int, use_compile: bool, copy_gbps: float) -> Row:
    dt = torch.bfloat16 if bf16 else torch.float32
    torch.manual_seed(0)
    eager = _EagerAddNorm(s.d, DROPOUT, dtype=dt)
    ours = layers.AddNorm(s.d, DROPOUT, dtype=dt)
    x, y = (torch.randn(s.batch, s.seq, s.d).to(dt).requires_grad_(mode == "training") for _ in range(2))
    mods = _impls(eager, ours, use_compile)
    fns = _step_fns(mods, (x, y), False, mode)
    res = time_interleaved(fns, reps, warmup)
    row = Row("Add&Norm LN(x + Dropout(y))", s.name, "bf16" if bf16 else "fp32", mode).fill(res)
    n, es = x.numel(), x.element_size()
    # minimal traffic: forward (no grad) reads x, y and writes out (3s); training also writes the sum (4s) and
    # its backward reads g, sum and writes dx, dy (4s).
    nbytes = (3 if mode == "forward" else 8) * n * es
    row.extra["sublayer GB/s"] = round(nbytes / (res["sublayer"].ms * 1e-3) / 1e9, 2)
    row.extra["copy GB/s"] = round(copy_gbps, 2)
    if mode == "training":
        _saved_extra(row, mods, (x, y), False)
    return row


def bench_encoder(s: Shape, bf16: bool, mode: str, reps: int, warmup: int) -> Row:
    torch.manual_seed(0)
    eager = nn.TransformerEncoderLayer(s.d, s.heads, s.f, dropout=DROPOUT, batch_first=True)
    ours = layers.EncoderBlock(s.d, s.heads, s.f, dropout=DROPOUT)
    x = torch.randn(s.batch, s.seq, s.d, requires_grad=(mode == "training"))
    mods = {"eager": eager, "sublayer": ours}
    return _row("EncoderBlock vs nn.TransformerEncoderLayer", s, bf16, mode, mods, (x,), reps, warmup)


def bench_hf(s: Shape, bf16: bool, mode: str, reps: int, warmup: int) -> list[Row]:
    try:
        from transformers import BertConfig, GPT2Config
        from transformers.models.bert.modeling_bert import BertOutput
        from transformers.models.gpt2.modeling_gpt2 import GPT2MLP
    except Exception:  # noqa: BLE001 - transformers is optional here
        return []
    torch.manual_seed(0)
    cfg = GPT2Config(n_embd=s.d, n_inner=s.f, resid_pdrop=DROPOUT, activation_function="gelu_new")
    hf = GPT2MLP(s.f, cfg)
    ours = layers.PositionWiseFFN(s.d, s.f, activation="gelu_tanh", output_dropout=DROPOUT)
    x = torch.randn(s.batch, s.seq, s.d, requires_grad=(mode == "training"))
    mods = {"eager": hf, "sublayer": ours}
    mlp = _row("HF GPT2MLP (gelu_new, resid dropout)", s, bf16, mode, mods, (x,), reps, warmup)

    bcfg = BertConfig(hidden_size=s.d, intermediate_size=s.f, hidden_dropout_prob=DROPOUT, layer_norm_eps=1e-12)
    hf_out = BertOutput(bcfg)

    class _OursBertOutput(nn.Module):
        def __init__(self):
            super().__init__()
            self.dense = nn.Linear(s.f, s.d)
            self.addnorm = layers.AddNorm(s.d, DROPOUT, eps=1e-12)

        def forward(self, h, inp):
            return self.addnorm(inp, self.dense(h))

    ob = _OursBertOutput()
    h = torch.randn(s.batch, s.seq, s.f, requires_grad=(mode == "training"))
    inp = torch.randn(s.batch, s.seq, s.d, requires_grad=(mode == "training"))
    mods = {"eager": hf_out, "sublayer": ob}
    return [mlp, _row("HF BertOutput (dense, dropout, LN)", s, bf16, mode, mods, (h, inp), reps, warmup)]


def bench_bert_inference(quick: bool, reps: int, warmup: int) -> list[Row]:
    """BERT inference at MiniLM size (hidden 384, 6 layers, 12 heads, d_ff 1536; batch 64 x 128 tokens, real
    lengths uniform in 32..128): ``sublayer.models.fast.fast_inference(Bert)`` vs HF ``BertModel`` under bf16
    autocast ("eager" column), HF fp32, our plain ``Bert`` in fp32 and under the same bf16 autocast as HF, all
    with the same weights and padding mask.
    ``--quick``: a tiny model (2 layers, d 96) on 4 x 32 tokens."""
    if not _has_transformers():
        return []
    ours = bert_model(quick)[0]
    hf = ours.to_hf()
    fast = fast_inference(ours, dtype=torch.bfloat16)
    ids, mask, shape = bert_batch(quick, ours.config.vocab_size)
    name = ("tiny " if quick else "MiniLM ") + shape

    def call(bf16: bool, m=None):  # HF's BertModel (m None) or ``m``, under bf16 autocast or not
        def f():
            with torch.no_grad(), _autocast(bf16):
                return m(ids, mask) if m else hf(input_ids=ids, attention_mask=mask).last_hidden_state

        return f

    fns = {
        "eager": call(True), "sublayer": lambda: fast(ids, mask), "HF fp32": call(False),
        "sublayer fp32": call(False, ours), "sublayer autocast": call(True, ours),
    }  # fmt: skip
    # HF under bf16 autocast takes seconds per call on CPUs without native bf16 GEMMs: few rounds
    res = time_interleaved(fns, min(reps, 3), min(warmup, 1))
    row = Row("BERT inference: fast path vs HF BertModel bf16 autocast", name, "bf16", "forward").fill(res)
    real = mask.bool()
    ref = call(False)()
    cos = torch.nn.functional.cosine_similarity(fast(ids, mask)[real], ref[real], dim=-1).min()
    row.extra["fast compute dtype"] = str(fast.compute_dtype).replace("torch.", "")
    row.extra["HF attn"] = str(hf.config._attn_implementation)
    row.extra["real tokens"] = f"{int(real.sum())}/{mask.numel()}"
    row.extra |= {f"x vs {k}": round(row.ratio("sublayer", k), 2) for k in ("HF fp32", "sublayer fp32")}
    row.extra["plain Bert autocast x vs HF autocast"] = round(row.ratio("sublayer autocast", "eager"), 2)
    row.extra["min cos vs HF fp32"] = round(float(cos), 5)
    return [row]


def bench_gemv(quick: bool, reps: int, warmup: int) -> list[Row]:
    """A decoding step's linear layers (``runtime.linear.PackedLinear``'s ``skinny_linear``), 1 and 8 rows:
    bf16 panels ("sublayer") vs float32 panels and torch's ``F.linear`` on the float32 weight ("eager"); for 8
    rows also the bf16 panels widened to float32 instead of ``vdpbf16ps`` (where the CPU has AVX512_BF16).
    ``--quick``: without the LM head's 50257 x 768."""
    if not kernels.available():
        return []
    ops = kernels.ops()
    rows: list[Row] = []
    for n, k in GEMV_SHAPES[:2] if quick else GEMV_SHAPES:
        g = torch.Generator().manual_seed(n + k)
        w, b = torch.randn(n, k, generator=g) * 0.02, torch.randn(n, generator=g)
        p32, p16 = ops.pack_linear_weight(w), ops.pack_linear_weight(w.bfloat16())
        for m in (1, 8):
            x = torch.randn(m, k, generator=g)
            fns = {
                "eager": lambda x=x: torch.nn.functional.linear(x, w, b),
                "sublayer": lambda x=x: ops.skinny_linear(x, p16, b, n),
                "fp32 panels": lambda x=x: ops.skinny_linear(x, p32, b, n),
            }
            dot = m > 1 and ops.decode_bf16_dot(-1)
            if dot:

                def widened(x=x):
                    ops.decode_bf16_dot(0)
                    try:
                        return ops.skinny_linear(x, p16, b, n)
                    finally:
                        ops.decode_bf16_dot(1)

                fns["bf16 widened"] = widened
            calls = max(1, (1 << 24) // (n * k))  # several calls per timing: a small GEMV takes microseconds
            timed = {name: (lambda f=f: [f() for _ in range(calls)]) for name, f in fns.items()}
            row = Row("decoding GEMV: bf16 panels vs torch fp32", f"{n}x{k} rows {m} (x{calls} calls)", "bf16",
                      "forward").fill(time_interleaved(timed, max(reps, 5), warmup))  # fmt: skip
            row.extra |= {f"x vs {k}": round(row.ratio("sublayer", k), 2)
                          for k in ("fp32 panels", "bf16 widened") if k in fns}  # fmt: skip
            row.extra["bf16 GB/s"] = round(p16.numel() * 2 * calls / row.times_ms["sublayer"] / 1e6, 1)
            rows.append(row)
    return rows + _bench_int8_activations(reps, warmup)


def _bench_int8_activations(reps: int, warmup: int) -> list[Row]:
    """Several rows at 768 x 3072 (GPT-2's fc2): ``Int8Linear`` with int8 activations ("sublayer") vs the same
    weight weight-only (``activations="float"``), float32 panels and torch's ``F.linear`` ("eager")."""
    n, k = 768, 3072
    g = torch.Generator().manual_seed(n + k)
    w, b = torch.randn(n, k, generator=g) * 0.02, torch.randn(n, generator=g)
    s = w.abs().amax(1) / 127
    q = torch.round(w / s[:, None]).to(torch.int8)
    lin8, lin8w, lin32 = Int8Linear(q, s, b), Int8Linear(q, s, b, activations="float"), PackedLinear(w, b)
    rows = []
    for m in (8, 32):
        x = torch.randn(m, k, generator=g)
        calls = 4
        fns = {"eager": lambda: torch.nn.functional.linear(x, w, b), "sublayer": lambda: lin8(x),
               "int8 weight-only": lambda: lin8w(x), "fp32 panels": lambda: lin32(x)}  # fmt: skip
        timed = {name: (lambda f=f: [f() for _ in range(calls)]) for name, f in fns.items()}
        row = Row("int8 activations (Int8Linear) vs weight-only int8 and fp32", f"{n}x{k} rows {m} (x{calls} calls)",
                  "int8", "forward").fill(time_interleaved(timed, max(reps, 5), warmup))  # fmt: skip
        row.extra |= {f"x vs {k}": round(row.ratio("sublayer", k), 2) for k in ("int8 weight-only", "fp32 panels")}
        cos = torch.nn.functional.cosine_similarity(lin8(x), fns["eager"]()).min()
        row.extra["min cos vs fp32"] = round(float(cos), 5)
        rows.append(row)
    return rows


def _fmt(v: float | None, nd: int = 2) -> str:
    return "—" if v is None else f"{v:.{nd}f}"


def to_markdown(rows: list[Row], meta: dict) -> str:
    """The report: one table; with both allocator settings, the memory-reuse run in columns beside the default's."""
    settings = list(dict.fromkeys(r.malloc for r in rows)) or [meta.get("malloc settings", ["default"])[0]]
    first = settings[0]
    other = {(r.case, r.shape, r.dtype, r.mode): r for r in rows if r.malloc != first}
    malloc_line = "; ".join(f"{MALLOC_SETTINGS[m]}: {meta['allocator'][m]}" for m in settings if m in meta.get("allocator", {}))
    cols = ["case", "shape", "dtype", "mode", "eager ms", "sublayer ms", "ratio", "faults"]
    o = "reuse" if first == "default" else "default"
    if other:
        cols += [f"{o}: eager ms", f"{o}: sublayer ms", f"{o}: ratio", f"{o}: faults"]
        which = f"Columns without a prefix: {MALLOC_SETTINGS[first]}; '{o}:' columns: {MALLOC_SETTINGS[o]}."
    else:
        which = f"All columns: {MALLOC_SETTINGS[first]}."
    cols += ["compile ms", "notes"]
    lines = [
        f"sublayer bench — torch {meta['torch']}, {meta['threads']} threads, {meta['cpu']}, kernels: {meta['kernels']}",
        "",
        f"malloc — {malloc_line or meta.get('malloc', '')}",
        "",
        which,
        "",
        f"Times are medians in ms of {'CPU time' if meta.get('clock') == 'cpu' else 'wall time'} (± inter-quartile "
        "range / median); the eager column holds the row's reference (eager PyTorch, HF, or sublayer fp32 for "
        "int8); ratio = eager / sublayer (> 1: faster); faults = median minor page faults per call "
        "(eager / sublayer).",
        "",
    ]
    lines += ["| " + " | ".join(cols) + " |", "|" + "---|" * len(cols)]

    def cells(r: Row | None) -> list[str]:
        if r is None:
            return ["—"] * 4

        def t(k):
            return f"{r.times_ms[k]:.2f} ±{100 * r.spread[k]:.0f}%" if k in r.times_ms else "—"

        f = r.faults
        flt = f"{f[r.base]:.0f} / {f['sublayer']:.0f}" if r.base in f and "sublayer" in f else "—"
        return [t(r.base), t("sublayer"), _fmt(r.ratio()), flt]

    for r in rows:
        if r.malloc != first:
            continue
        c = [r.case, r.shape, r.dtype, r.mode, *cells(r)]
        if other:
            c += cells(other.get((r.case, r.shape, r.dtype, r.mode)))
        c += [f"{r.times_ms['compile']:.2f}" if "compile" in r.times_ms else "—",
              ", ".join(f"{k} {v}" for k, v in r.extra.items())]  # fmt: skip
        lines.append("| " + " | ".join(c) + " |")
    return "\n".join(lines) + "\n"


def _figure(rows: list[Row]):
    """The bench.png figure: one bar per row (its full label: case, shape, dtype, mode), its ratio written on it."""
    from matplotlib.figure import Figure

    def short(case: str) -> str:
        return case.split(" (")[0].split(" vs ")[0].replace("HF ", "").replace(" LN", "")

    both = len({r.malloc for r in rows}) > 1
    labels = [
        f"{short(r.case)} {r.shape.split(' ')[0]} {r.dtype.split(' ')[0]} {r.mode}" + (f" [{r.malloc}]" if both else "")
        for r in rows
    ]
    vals = [r.ratio() or 0.0 for r in rows]
    fig = Figure(figsize=(9, max(3, 0.3 * len(rows) + 1)))
    ax = fig.add_subplot()
    bars = ax.barh(range(len(rows)), vals, color=["tab:green" if v >= 1 else "tab:red" for v in vals])
    ax.bar_label(bars, labels=[f"{v:.2f}×" for v in vals], fontsize=7, padding=2)
    ax.set_xlim(0, max(vals + [1.0]) * 1.15)  # room for the values
    ax.axvline(1.0, color="k", lw=0.8)
    ax.set_yticks(range(len(rows)), labels, fontsize=7)
    ax.invert_yaxis()
    ax.set_xlabel("speed-up vs eager PyTorch (eager time / sublayer time)")
    ax.set_title("sublayer vs eager (dropout 0.1)" + (" — [default] glibc malloc, [reuse] memory reuse" if both else ""))
    return fig


def _add(rows: list[Row], new: list[Row], malloc: str, log: Callable[[str], None]) -> None:
    """The rows ``new``, run under the allocator setting ``malloc``, appended to ``rows`` and logged."""
    for r in new:
        r.malloc = malloc
        rows.append(r)
        f = r.faults
        flt = f"  faults {f[r.base]:.0f}/{f['sublayer']:.0f}" if {r.base, "sublayer"} <= f.keys() else ""
        log(f"[{r.malloc:7s}] {r.case:44s} {r.shape:22s} {r.dtype:13s} {r.mode:8s} {r.base} "
            f"{r.times_ms[r.base]:9.2f} ms  sublayer {r.times_ms['sublayer']:9.2f} ms  x{_fmt(r.ratio())}{flt}")


def _measure(
    shapes: list[Shape], *, quick: bool, use_compile: bool, reps: int, dts: list[str], cases: list[str],
    extras: bool, malloc: str, log: Callable[[str], None],
) -> list[Row]:
    """Every case of every shape in THIS process (whose allocator setting is ``malloc``); ``extras``: also
    torch.compile and the BERT inference case."""
    kernels.available()  # build first so the first timing does not include it
    warmup = 1 if quick else 2
    rows: list[Row] = []

    def add(new: list[Row]) -> None:
        _add(rows, new, malloc, log)

    for s in shapes:
        copy = [copy_gbps(s.tokens * s.d, dt, max(reps, 5)) for dt in (torch.float32, torch.bfloat16)]  # [bf16]
        for mode in ("training", "forward"):
            for bf16 in [dt == "bf16" for dt in ("fp32", "bf16") if dt in dts]:
                comp = extras and use_compile and not bf16 and s is shapes[0]
                if "addnorm" in cases:
                    add([bench_add_norm(s, bf16, mode, reps, warmup, comp, copy[bf16])])
                if "ffn" in cases:
                    add([bench_ffn(s, bf16, mode, reps, warmup, comp)])
                if "encoder" in cases and (not quick or mode == "training"):
                    add([bench_encoder(s, bf16, mode, reps, warmup)])
                if "hf" in cases and not quick and s is shapes[0]:
                    add(bench_hf(s, bf16, mode, reps, warmup))
    if extras and "bert" in cases and "bf16" in dts and (quick or any("minilm" in s.name.lower() for s in shapes)):
        add(bench_bert_inference(quick, reps, warmup))
    if extras and "gemv" in cases and "bf16" in dts:  # decoding's skinny_linear: bf16 / fp32 panels, torch
        add(bench_gemv(quick, reps, warmup))
    if extras and "loss" in cases and "fp32" in dts:  # the fused LM-head loss (sublayer.bench.loss): op and GPT-2 step
        add(bench_loss(quick, reps, warmup))
    if extras and "models" in cases and "fp32" in dts and _has_transformers():  # whole-model training steps vs HF
        add(train_rows(quick, min(reps, 5), None, padded=True))
    return rows


def _has_transformers() -> bool:
    try:
        import transformers  # noqa: F401
    except Exception:  # noqa: BLE001 - transformers is optional here
        return False
    return True


def _measure_in_child(spec: dict, log: Callable[[str], None]) -> tuple[list[Row], str]:
    """Run ``_measure`` in a fresh ``python -m sublayer.bench --child`` process; its rows and allocator line."""
    with tempfile.TemporaryDirectory() as tmp:
        spec_path, rows_path = Path(tmp) / "spec.json", Path(tmp) / "rows.json"
        spec_path.write_text(json.dumps({**spec, "rows_out": str(rows_path)}))
        env = dict(os.environ)
        if spec["malloc"] == "default":  # nothing from outside either: glibc as a user's script gets it
            for k in [k for k in env if k.startswith("MALLOC_") and k.endswith("_")] + ["LD_PRELOAD"]:
                env.pop(k, None)
        src = str(Path(__file__).resolve().parents[2])  # this sublayer, even when it is not installed
        env["PYTHONPATH"] = os.pathsep.join([src, *filter(None, [env.get("PYTHONPATH")])])
        proc = subprocess.Popen(
            [sys.executable, "-m", "sublayer.bench", "--child", str(spec_path)],
            env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
        )  # fmt: skip
        assert proc.stdout is not None
        tail: list[str] = []
        for line in proc.stdout:
            line = line.rstrip("\n")
            tail = (tail + [line])[-20:]
            if line.startswith("["):
                log(line)
        if proc.wait() != 0:
            raise RuntimeError(f"the bench's {spec['malloc']!r} allocator run failed:\n" + "\n".join(tail))
        data = json.loads(rows_path.read_text())
    return [Row(**r) for r in data["rows"]], data["allocator"]


def _child(spec_path: str) -> None:
    """``python -m sublayer.bench --child SPEC``: one allocator setting's rows, written to spec["rows_out"]."""
    spec = json.loads(Path(spec_path).read_text())
    threads, clock, rows_out = spec.pop("threads"), spec.pop("clock"), spec.pop("rows_out")
    if spec["malloc"] == "reuse" and not memory.set_memory_reuse():
        raise SystemExit("memory reuse is unavailable here (not glibc)")
    if threads:
        torch.set_num_threads(threads)
    set_clock(clock)
    rows = _measure([Shape(**s) for s in spec.pop("shapes")], **spec, log=lambda line: print(line, flush=True))
    out = {"rows": [asdict(r) for r in rows], "allocator": memory.allocator_setting()}
    Path(rows_out).write_text(json.dumps(out))


def run_bench(
    out: str | Path = "runs/bench",
    *,
    quick: bool = False,
    use_compile: bool | None = None,
    reps: int | None = None,
    threads: int | None = None,
    shapes: str | None = None,
    dtypes: str = "fp32,bf16",
    cases: str | None = None,
    malloc: str = "both",
    clock: str = "wall",
    reuse_memory: bool = False,
    model: str | Path | None = None,
    report: str | Path | None = None,
    notes: str = "",
    log: Callable[[str], None] = print,
) -> list[Row]:
    """Run every case; write bench.json / bench.md / bench.png to ``out``; return the rows.

    Args:
        malloc: ``"default"`` (glibc's defaults), ``"reuse"`` (:func:`sublayer.set_memory_reuse`) or ``"both"``
            (default: each case under both, reported side by side). A setting this process does not have runs in
            a child process; this process's own allocator setting is never changed.
        cases: comma-separated subset of addnorm, ffn, encoder, hf, bert, loss, models, gemv (default: all).
        clock: ``"wall"`` (default) or ``"cpu"``: this process's CPU time per call, for shared machines (use it
            with ``threads=1``: with more threads it adds up the threads' times).
        reuse_memory: old spelling of ``malloc="reuse"``.
        model: a BERT folder whose weights the int8 row (``dtypes`` containing ``int8``,
            :func:`sublayer.bench.jobs.int8_rows`) uses (random MiniLM-size weights without it).
        report: also a markdown report with the machine, versions, date and command
            (:func:`sublayer.bench.harness.write_report`): a ``.md`` file, or a folder for
            ``kernels-<cpu kind>-<date>.md``; ``notes`` go in its header.

    Raises:
        ValueError: ``shapes`` matches no shape, ``reps``/``threads`` below 1, or an unknown ``dtypes``/``cases``/
            ``malloc``.
    """
    for name, value in (("reps", reps), ("threads", threads)):
        if value is not None and value < 1:
            raise ValueError(f"{name} must be >= 1, got {value}")
    if reuse_memory:
        malloc = "reuse"
    set_clock(clock)
    if malloc not in (*MALLOC_SETTINGS, "both"):
        raise ValueError(f"malloc must be one of default, reuse, both, got {malloc!r}")
    all_shapes = QUICK_SHAPES if quick else SHAPES
    if shapes is not None:  # (an empty one matches none)
        keys = [k.strip().lower() for k in shapes.split(",") if k.strip()]
        picked = [s for s in all_shapes if any(k in s.name.lower() for k in keys)]
        if not picked:
            raise ValueError(f"--shapes {shapes!r} matches none of: {', '.join(s.name for s in all_shapes)}")
        all_shapes = picked
    dts = [t.strip().lower() for t in dtypes.split(",") if t.strip()]
    if not dts or set(dts) - {"fp32", "bf16", "int8"}:
        raise ValueError(f"dtypes must be a comma-separated subset of fp32,bf16,int8, got {dtypes!r}")
    if not _has_transformers():
        log("transformers is not installed: skipping the Hugging Face rows (pip install transformers to time them)")
    picked_cases = [c.strip().lower() for c in (",".join(CASES) if cases is None else cases).split(",") if c.strip()]
    if not picked_cases or set(picked_cases) - set(CASES):
        raise ValueError(f"cases must be a comma-separated subset of {','.join(CASES)}, got {cases!r}")
    if threads is not None:
        torch.set_num_threads(threads)
    out = Path(out)
    out.mkdir(parents=True, exist_ok=True)
    reps = reps or (3 if quick else 7)
    use_compile = (not quick) if use_compile is None else use_compile
    settings = list(MALLOC_SETTINGS) if malloc == "both" else [malloc]
    kernels.available()
    meta = {
        "torch": torch.__version__, "threads": torch.get_num_threads(),
        "cpu": f"{platform.machine()} {torch.backends.cpu.get_cpu_capability()}", "kernels": kernels.status(),
        "quick": quick, "reps": reps, "dropout": DROPOUT, "dtypes": dts, "cases": picked_cases, "clock": clock,
        "native bf16 GEMM": kernels.native_bf16_gemm(), "malloc settings": settings,
        "malloc": " and ".join(MALLOC_SETTINGS[m] for m in settings), "allocator": {},
    }  # fmt: skip
    rows: list[Row] = []
    t_start = time.perf_counter()
    for i, setting in enumerate(settings):
        extras = i == 0  # torch.compile and BERT inference: under the first setting only
        log(f"--- malloc: {MALLOC_SETTINGS[setting]} ---")
        reuse = memory.memory_reuse_active()  # does this process have (or can it take, losing none) the setting?
        here = reuse if setting == "reuse" else not reuse and memory.env_allocator() is None
        opts = dict(quick=quick, use_compile=use_compile, reps=reps, dts=dts, cases=picked_cases, extras=extras,
                    malloc=setting)  # fmt: skip
        if here:
            rows += _measure(all_shapes, **opts, log=log)
            meta["allocator"][setting] = memory.allocator_setting()
        else:
            spec = {**opts, "shapes": [asdict(s) for s in all_shapes], "clock": clock,
                    "threads": torch.get_num_threads()}  # fmt: skip
            child_rows, meta["allocator"][setting] = _measure_in_child(spec, log)
            rows += child_rows
    if "int8" in dts:  # int8 BERT inference vs fp32 and CTranslate2 (sublayer.bench.jobs.int8_rows), here
        _add(rows, int8_rows(quick, reps, out, model), "reuse" if memory.memory_reuse_active() else "default", log)
    meta["seconds"] = round(time.perf_counter() - t_start, 1)
    (out / "bench.json").write_text(json.dumps({"meta": meta, "rows": [asdict(r) for r in rows]}, indent=1))
    (out / "bench.md").write_text(to_markdown(rows, meta))
    try:
        # bbox_inches="tight": the figure grows to hold the longest label instead of cutting it
        _figure(rows).savefig(out / "bench.png", dpi=120, bbox_inches="tight")
    except ImportError:
        log("matplotlib missing: no bench.png")
    if report is not None:
        title = "sublayer bench: sub-layers vs eager PyTorch, HF and torch.compile"
        log(f"wrote {write_report(report, 'kernels', title, rows, command=command_line(), notes=notes, reps=reps)}")
    log(f"malloc: {meta['malloc']}")
    log(f"wrote {out / 'bench.json'}, {out / 'bench.md'}, {out / 'bench.png'} in {meta['seconds']} s")
    return rows


def main(argv: list[str] | None = None) -> None:
    """``python -m sublayer.bench [--quick] [--out DIR] [--no-compile] [--malloc default|reuse|both]``."""
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", default="runs/bench")
    ap.add_argument("--quick", action="store_true")
    ap.add_argument("--compile", dest="use_compile", action="store_true", default=None)
    ap.add_argument("--no-compile", dest="use_compile", action="store_false")
    ap.add_argument("--reps", type=int, default=None)
    ap.add_argument("--threads", type=int, default=None)
    ap.add_argument("--shapes", default=None)
    ap.add_argument("--dtypes", default="fp32,bf16")
    ap.add_argument("--cases", default=None)
    ap.add_argument("--clock", default="wall", choices=list(CLOCKS))
    ap.add_argument("--malloc", default="both", choices=[*MALLOC_SETTINGS, "both"])
    ap.add_argument("--reuse-memory", action="store_true", help="same as --malloc reuse")
    ap.add_argument("--child", default=None, help=argparse.SUPPRESS)
    ap.add_argument("--model", default=None, help="BERT folder for the int8 (and --jobs int8, embed) rows")
    ap.add_argument("--jobs", action="store_true", help="the whole-job suite (sublayer.bench.jobs) instead")
    ap.add_argument("--only", default=None, help="with --jobs: comma-separated subset of its jobs")
    ap.add_argument("--report", default=None, help="a markdown report: a .md file or a folder")
    ap.add_argument("--notes", default="", help="a line for the report's header")
    kw = vars(ap.parse_args(argv))
    child, jobs, only = kw.pop("child"), kw.pop("jobs"), kw.pop("only")
    if child:
        _child(child)
    elif jobs:
        if kw["threads"]:
            torch.set_num_threads(kw["threads"])
        run_jobs(quick=kw["quick"], reps=kw["reps"], only=only, model=kw["model"], work=Path(kw["out"]) / "jobs",
                 report=kw["report"], notes=kw["notes"])  # fmt: skip
    else:
        run_bench(**kw)


if __name__ == "__main__":
    main()
