"""Decoding benchmark: GPT-2 greedy generation tokens/s and the weight bandwidth each engine reaches.

Engines on the same random GPT-2 (saved once as a Hugging Face folder under ``--out``): sublayer's fast decoding
path (:mod:`sublayer.runtime.causal`, through ``GPT2.generate`` and ``fast_inference(gpt2).generate``), the
reference loop it replaced (``SUBLAYER_DECODING=0``), HF ``generate`` and, when the optional peer is installed
(``pip install 'sublayer[peers]'``), CTranslate2's ``Generator`` in float32. Runs are interleaved (engine after
engine, repeated); the median is reported. ``GB/s`` = matrix bytes each engine reads per decoding step (every
weight once, in the dtype it reads: :func:`_bytes_read`) x steps/s, beside the machine's copy bandwidth (read +
write) and the LM head's GEMV at 1 and all threads (torch vs ``skinny_linear`` on float32, bfloat16 and int8 panels,
vs the rate the threads read memory: :func:`_gemv_rows`).

int8 rows: ``fast_inference(gpt2, quantize="int8")`` (weight-only int8, :mod:`sublayer.models.quantized_gpt2`;
also with the LM head kept float) against CTranslate2 ``compute_type="int8"`` (quantized by CTranslate2 when it
loads the float32 conversion), each with the fraction of its greedy tokens equal to sublayer's fp32 ones
("same as fp32": position by position, so one early difference counts every later token too) and, for
sublayer's int8 models, the teacher-forced next-token agreement ("next-token agreement": the argmax of the int8
model's logits over the fp32 greedy sequence equals the fp32 token). On the random weights used here the
next-token distributions are flat, which makes both fractions pessimistic figures.
"""

from __future__ import annotations

import argparse
import itertools
import json
from pathlib import Path
from typing import Callable

import torch
import torch.nn.functional as F

from .. import kernels
from ..models import GPT2, GPT2Config, Transformer, fast_inference, quantized
from ..runtime.linear import int8_screens_rows
from .harness import copy_gbps, ct2_greedy, time_interleaved
from .jobs import ct2_generator, decoding_switch, fast_and_reference, gpt2_folder, hf_gpt2_greedy, switched

__all__ = ["run_decode_bench"]


def _gemv_rows(n: int, k: int, reps: int, threads: int, *, spread: int = 1 << 27) -> list[dict]:
    """One decoding GEMV (n, k) at 1 and ``threads`` threads, 1 and 8 rows: torch's ``F.linear`` on the float32
    weight, ``skinny_linear`` on float32, bfloat16 and int8 panels and, where the CPU has AVX512-VNNI or AMX-INT8,
    ``int8_linear`` on int8 quads (one row at 24 bits, 8 rows at 8: what int8 decoding runs there), each call on
    the next of enough copies of its weight to span ``spread`` bytes (128 MB: past the last-level cache, so every
    call reads its weight from memory as a decoding step does), beside the rate at which the same threads read
    memory (``torch.sum`` over the float32 weight's copies). A row: case, rows, threads, engine, ms (a call),
    GB/s (its weight bytes / ms)."""
    if not kernels.available():
        return []
    ops = kernels.ops()
    w = torch.randn(n, k)
    q = torch.randint(-127, 128, (n, k), dtype=torch.int8)
    scale, colsum = torch.rand(n), q.sum(1, dtype=torch.int32)

    def copies(t: torch.Tensor) -> Callable[[], torch.Tensor]:
        return itertools.cycle([t] + [t.clone() for _ in range(-(-spread // t.nbytes) - 1)]).__next__

    p32, p16, p8 = (copies(ops.pack_linear_weight(t)) for t in (w, w.bfloat16(), q))
    quads = copies(ops.pack_int8_quads(q, True)) if int8_screens_rows() else None
    reads = copies(w)
    nbytes = {"sublayer skinny_linear bf16": w.nbytes // 2, "sublayer skinny_linear int8": q.nbytes,
              "sublayer int8_linear": q.nbytes}  # fmt: skip
    rows = []
    try:
        for t in sorted({1, threads}):
            torch.set_num_threads(t)
            for m in (1, 8):
                x = torch.randn(m, k)
                fns: dict[str, Callable[[], object]] = {
                    "torch F.linear": lambda: F.linear(x, w),
                    "sublayer skinny_linear": lambda: ops.skinny_linear(x, p32(), None, n),
                    "sublayer skinny_linear bf16": lambda: ops.skinny_linear(x, p16(), None, n),
                    "sublayer skinny_linear int8": lambda: ops.skinny_linear(x, p8(), None, n, 0, scale),
                }
                if quads is not None:
                    bits = 24 if m == 1 else 8
                    fns["sublayer int8_linear"] = lambda b=bits: ops.int8_linear(
                        x, quads(), colsum, scale, None, n, 0, None, b
                    )
                if m == 1:
                    fns["read (torch sum)"] = lambda: reads().sum()
                for name, tm in time_interleaved(fns, reps, 1).items():
                    rows.append({"case": f"GEMV {n}x{k}", "rows": m, "threads": t, "engine": name, "ms": tm.ms,
                                 "GB/s": nbytes.get(name, w.nbytes) / (tm.ms * 1e-3) / 1e9})  # fmt: skip
    finally:
        torch.set_num_threads(threads)
    return rows


def _bytes_read(engine: str, step_bytes: int, head_bytes: int, *, rows: int = 1, int8_rows: bool = False) -> float:
    """Weight bytes an engine reads per greedy step of ``rows`` rows: float32 everywhere, except sublayer's fast path
    (the LM head screened by :class:`~sublayer.runtime.linear.GreedyHead` with an int8 copy for one row and, where
    ``int8_rows`` (a VNNI or AMX-INT8 CPU), for several; else a 16-bit copy) and int8 (a byte per weight; "head
    float" keeps the head in float32)."""
    layers = step_bytes - head_bytes
    if "int8" in engine:
        return layers / 4 + (head_bytes if "head float" in engine else head_bytes / 4)
    if engine in ("sublayer GPT2.generate", "sublayer fast_inference fp32"):
        return layers + head_bytes / (4 if rows == 1 or int8_rows else 2)
    return step_bytes


def _translate_row(case: str, batch: int, run: Callable[[], object], tokens_of, reps: int, label: str,
                   log: Callable[[str], None], *, beam: int = 1) -> dict:
    """One translate row: ``run()`` fast vs reference (:func:`sublayer.bench.jobs.fast_and_reference`), tokens/s
    of each (the tokens counted by ``tokens_of(fast outputs)``) and whether the outputs are the same; logged as
    ``label``."""
    outs, res = fast_and_reference(run, reps)
    tokens, fast, ref = tokens_of(outs["sublayer"]), res["sublayer"].ms * 1e-3, res["reference steps"].ms * 1e-3
    same = [o.tolist() for o in outs["sublayer"]] == [o.tolist() for o in outs["reference steps"]]
    row = {"case": case, "batch": batch, "beam": beam, "fast tok/s": tokens / fast, "reference tok/s": tokens / ref,
           "x": ref / fast, "same output": same}  # fmt: skip
    log(f"translate {label}  fast {row['fast tok/s']:8.1f} tok/s  reference {row['reference tok/s']:8.1f} tok/s  "
        f"x{row['x']:.2f}  same output: {row['same output']}")
    return row


def _translate_rows(quick: bool, reps: int, log: Callable[[str], None]) -> list[dict]:
    """``Transformer.translate`` on the fast path vs the reference steps (same weights, same outputs checked):
    the demo's model (d 128, 2 pre-norm layers; batch 1, 8 and 500 as its evaluation) and a 6-layer d 512 one."""
    torch.manual_seed(0)
    cases = [("demo d128 l2 pre-norm", dict(d_model=128, n_heads=4, d_ff=256, n_layers=2, norm_first=True), 40,
              [(1, 1), (8, 1), (500, 1)], 12, 16)]  # fmt: skip
    if not quick:
        cases.append(("d512 l6 post-norm", dict(d_model=512, n_heads=8, d_ff=2048, n_layers=6), 8000,
                      [(1, 1), (8, 4)], 24, 32))  # fmt: skip
    rows = []
    for name, kw, vocab, runs, src_len, max_len in cases:
        m = Transformer(vocab, vocab, dropout=0.0, max_len=64, **kw).eval()
        for b, beam in runs:
            src = torch.randint(3, vocab, (b, src_len), generator=torch.Generator().manual_seed(b))
            rows.append(_translate_row(
                f"Transformer.translate {name}", b, lambda: m.translate(src, max_len, bos=1, eos=2, beam_size=beam),
                lambda out: out.numel(), reps, f"{name:22s} batch {b:3d} beam {beam}", log, beam=beam,
            ))  # fmt: skip
    return rows


def _demo_eval_row(folder: str | Path, reps: int, log: Callable[[str], None]) -> dict | None:
    """The trained demo checkpoint's own evaluation (``make demo`` writes it to runs/demo): its held-out pairs in
    batches of 500, padded sources, rows ending at their eos; fast path vs reference steps. None without it."""
    from ..demo.checkpoint import load_checkpoint
    from ..demo.report import translate_pairs
    from ..demo.task import held_out_pairs

    folder = Path(folder)
    if not (folder / "model.safetensors").is_file():
        return None
    model, vocab, _ = load_checkpoint(folder)
    meta = json.loads((folder / "metrics.json").read_text()) if (folder / "metrics.json").is_file() else {}
    pairs = held_out_pairs(meta.get("seed", 0), meta.get("n_test", 1000), salt=2)
    return _translate_row(
        f"Transformer.translate demo checkpoint ({folder}): its evaluation, {len(pairs)} pairs, padded", 500,
        lambda: translate_pairs(model, vocab, pairs), lambda outs: sum(int((o != vocab.pad).sum()) for o in outs),
        reps, f"demo checkpoint evaluation ({len(pairs)} pairs)", log,
    )  # fmt: skip  (tokens: generated up to each row's eos)


def run_decode_bench(
    out: str | Path = "runs/bench",
    *,
    quick: bool = False,
    batches: tuple[int, ...] = (1, 8),
    reps: int | None = None,
    peers: bool = True,
    engines: str | None = None,
    translate: bool = True,
    demo_dir: str | Path = "runs/demo",
    log: Callable[[str], None] = print,
) -> list[dict]:
    """Time greedy generation (prompt 32, 64 new tokens; GPT-2 small: 12 layers, d 768, vocab 50257 — ``quick``:
    4 layers, d 256, vocab 8191, 16 new tokens) per engine and batch size; write ``decode.json``/``decode.md``.

    Then ``Transformer.translate`` fast vs reference (see :func:`_translate_rows`; ``translate=False`` skips it),
    and, when ``demo_dir`` holds a trained demo checkpoint (``make demo``), its own evaluation (not with ``quick``).
    ``engines``: comma-separated substrings of engine names to run (default all).

    Returns:
        the rows (dicts: case, batch, engine, tok/s, GB/s, same tokens as HF, same as fp32; GEMV rows; translate
        rows).
    """
    out = Path(out)
    out.mkdir(parents=True, exist_ok=True)
    reps = reps or (2 if quick else 3)
    threads = torch.get_num_threads()
    kernels.available()
    size = dict(vocab_size=8191, d_model=256, n_layers=4, n_heads=4) if quick else {}
    cfg = GPT2Config(dropout=0.0, embd_dropout=0.0, attn_dropout=0.0, **size)
    prompt, new = 32, (16 if quick else 64)
    d, f, v = cfg.d_model, cfg.hidden_size, cfg.vocab_size
    step_bytes = 4 * (cfg.n_layers * (4 * d * d + 2 * d * f) + v * d)  # every matrix once per step
    int8_screen = int8_screens_rows()  # GreedyHead's screen of several rows
    folder = gpt2_folder(cfg, out)
    model = GPT2.from_pretrained(folder).eval()
    fast = fast_inference(model, dtype=torch.float32)
    int8 = fast_inference(model, quantize="int8")
    hf = hf_gpt2_greedy(folder) if peers else None
    ct2 = {dt: ct2_generator(folder, dt) for dt in ("float32", "int8")} if peers else {}
    wanted = None if engines is None else [e.strip() for e in engines.split(",") if e.strip()]

    def want(name: str) -> bool:
        return wanted is None or name == "sublayer GPT2.generate" or any(w in name for w in wanted)

    # the LM head kept float: what int8 on the head costs in accuracy / buys in speed
    int8_head_float = quantized.quantize(model, keep_float=("head",)) if want("sublayer int8, head float") else None
    copy = copy_gbps(64 * 1024 * 1024)  # 256 MB
    log(f"copy bandwidth {copy:.1f} GB/s (read + write), {threads} threads; "
        f"{step_bytes / 1e6:.0f} MB of weights per step")
    rows = _gemv_rows(v, d, 5, threads)
    for r in rows:
        log(f"{r['case']:22s} rows {r['rows']:2d} threads {r['threads']}  {r['engine']:28s} {r['ms']:8.2f} ms  "
            f"{r['GB/s']:6.1f} GB/s")
    case = f"GPT-2 l{cfg.n_layers} d{d} v{v}, prompt {prompt} + {new} greedy"
    switch = decoding_switch()
    for b in batches:
        ids = torch.randint(0, v - 1, (b, prompt), generator=torch.Generator().manual_seed(b))

        def ours(obj=model, on=True):
            with switched(switch, on):
                return obj.generate(ids, new)[:, prompt:]

        fns: dict[str, Callable[[], torch.Tensor]] = {
            "sublayer GPT2.generate": ours,
            "sublayer fast_inference fp32": lambda: ours(fast),
            "sublayer reference loop": lambda: ours(model, False),
            "sublayer int8": lambda: ours(int8),
            "sublayer int8, head float": lambda: ours(int8_head_float),
        }
        if hf is not None:
            fns["HF generate"] = lambda: hf(ids, new)[:, prompt:]
        toks = [[f"t{i}" for i in row] for row in ids.tolist()]
        fns |= {f"CTranslate2 {dt}": (lambda g=g: torch.tensor(ct2_greedy(g, toks, new)))
                for dt, g in ct2.items() if g is not None}  # fmt: skip
        fns = {name: fn for name, fn in fns.items() if want(name)}
        outs = {name: fn() for name, fn in fns.items()}  # warm-up (packs the weights, builds caches)
        times = {name: t.ms * 1e-3 for name, t in time_interleaved(fns, reps, 0).items()}
        hf_out, fp32 = outs.get("HF generate"), outs["sublayer GPT2.generate"]
        forced = {}  # teacher-forced next-token agreement of our int8 models with the fp32 greedy tokens
        seq = torch.cat([ids, fp32], 1)
        for name, obj in (("sublayer int8", int8), ("sublayer int8, head float", int8_head_float)):
            if name in fns and obj is not None:
                pred = obj(seq)[:, prompt - 1 : -1].argmax(-1)
                forced[name] = float((pred == fp32).float().mean())
        for name in fns:
            sec = times[name]
            tps = b * new / sec
            nbytes = _bytes_read(name, step_bytes, 4 * v * d, rows=b, int8_rows=int8_screen)
            row = {
                "case": case, "batch": b, "engine": name, "tok/s": tps, "GB/s": nbytes * new / sec / 1e9,
                "same tokens as HF": None if hf_out is None else outs[name].tolist() == hf_out.tolist(),
                "same as fp32": float((outs[name] == fp32).float().mean()), "next-token agreement": forced.get(name),
            }  # fmt: skip
            rows.append(row)
            extra = "" if name not in forced else f"  next-token agreement: {forced[name]:.3f}"
            log(f"batch {b:2d}  {name:30s} {tps:8.1f} tok/s  {row['GB/s']:6.1f} GB/s  "
                f"same as HF: {row['same tokens as HF']}  same as fp32: {row['same as fp32']:.3f}{extra}")
        for ours_name, peer in (("sublayer GPT2.generate", "CTranslate2 float32"), ("sublayer int8", "CTranslate2 int8")):
            if ours_name in fns and peer in fns:
                r = times[peer] / times[ours_name]
                log(f"batch {b:2d}  {ours_name} / {peer} tok/s: x{r:.2f}")
    if translate:
        rows += _translate_rows(quick, reps, log)
        demo = None if quick else _demo_eval_row(demo_dir, reps, log)
        rows += [demo] if demo is not None else []
    meta = {"threads": threads, "copy GB/s": copy, "step bytes": step_bytes, "kernels": kernels.status(), "reps": reps}
    (out / "decode.json").write_text(json.dumps({"meta": meta, "rows": rows}, indent=1))
    tables = [
        ("batch | engine | tok/s | GB/s | same tokens as HF | same as fp32 | next-token agreement", "tok/s", lambda r: [
            r["batch"], r["engine"], f"{r['tok/s']:.1f}", f"{r['GB/s']:.1f}", r["same tokens as HF"],
            f"{r['same as fp32']:.3f}", "" if r["next-token agreement"] is None else f"{r['next-token agreement']:.3f}",
        ]),
        ("GEMV | rows | threads | engine | ms | GB/s", "ms", lambda r: [
            r["case"], r["rows"], r["threads"], r["engine"], f"{r['ms']:.2f}", f"{r['GB/s']:.1f}"]),
        ("translate | batch | beam | fast tok/s | reference tok/s | x | same output", "beam", lambda r: [
            r["case"], r["batch"], r["beam"], f"{r['fast tok/s']:.1f}", f"{r['reference tok/s']:.1f}", f"{r['x']:.2f}",
            r["same output"],
        ]),
    ]  # fmt: skip  (a row belongs to the table whose key it has)
    lines = [f"# Decoding ({case}; {threads} threads; copy bandwidth {copy:.1f} GB/s)"]
    for head, key, cells in tables:
        lines += ["", f"| {head} |", "|" + "---|" * len(head.split(" | "))]
        lines += ["| " + " | ".join(map(str, cells(r))) + " |" for r in rows if key in r]
    (out / "decode.md").write_text("\n".join(lines) + "\n")
    log(f"wrote {out / 'decode.json'}, {out / 'decode.md'}")
    return rows


if __name__ == "__main__":
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", default="runs/bench")
    ap.add_argument("--quick", action="store_true")
    ap.add_argument("--batches", default="1,8")
    ap.add_argument("--reps", type=int, default=None)
    ap.add_argument("--no-peers", action="store_true")
    ap.add_argument("--engines", default=None, help="comma-separated substrings of engine names (default all)")
    ap.add_argument("--no-translate", action="store_true")
    a = ap.parse_args()
    run_decode_bench(
        a.out, quick=a.quick, batches=tuple(int(x) for x in a.batches.split(",")), reps=a.reps, peers=not a.no_peers,
        engines=a.engines, translate=not a.no_translate,
    )
