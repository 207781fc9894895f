"""``sublayer bench --jobs``: whole jobs a user runs, sublayer beside the peer a user would pick, in one process.

Every row times its implementations interleaved (:func:`sublayer.bench.harness.time_interleaved`) on the same
inputs and weights; ratio = the peer's time / sublayer's (> 1: sublayer is faster).

* ``decode``: GPT-2 124M shape (12 layers, d 768, vocab 50257, random weights saved once as a Hugging Face folder),
  prompt 32 + 32 greedy tokens, batch 1 and 8: ``GPT2.generate`` (fp32) and ``fast_inference(model,
  quantize="int8").generate`` against CTranslate2's ``Generator`` in float32 and int8 (when ``ctranslate2`` is
  installed: ``pip install 'sublayer[peers]'``), and ``fast_inference(model, dtype=torch.bfloat16).generate``
  (bf16 panels where the CPU multiplies bf16 natively) against our fp32; then each of the three against HF
  ``GPT2LMHeadModel.generate`` in fp32 (every token generated: ``min_new_tokens``), the job an HF user runs.
  Rate: generated tokens/s.
* ``translate``: ``Transformer.translate``, the fast path against the reference steps: the demo's shape (d 128,
  2 pre-norm layers, 500 sources of 12 tokens, greedy) and d 512 (6 post-norm layers, vocab 8000, batch 8, beam 4).
* ``train``: one AdamW training step (forward, loss over real tokens, backward, step; dropout 0.1; the fused
  ``torch.optim.AdamW(fused=True)`` of HF ``Trainer``'s default ``optim`` on every side) against HF: BERT of
  MiniLM's shape (6 layers, d 384) on 16 x 128 right-padded (lengths 32..128; loss: mean square of the real hidden
  states) and GPT-2 (6 layers, d 512, vocab 8192) on 8 x 128 (``GPT2.loss`` vs ``labels=``); fp32, and
  where the CPU multiplies bf16 natively also both sides under bf16 autocast.
* ``int8``: BERT inference of MiniLM's shape, 64 x 128 padded: ``fast_inference(quantize="int8")`` against the
  float32 fast path, with the int8 model's worst token and sentence cosine to float32 (and CTranslate2 int8 when
  ``model`` is a folder with a tokenizer); a second row, the same int8 times against our bf16 fast path
  (``fast_inference(dtype=torch.bfloat16)``, timed in the same rounds).
* ``embed``: MiniLM sentence embeddings, 64 x 128 padded: ``fast_inference(bert).embed`` against HF ``BertModel``
  with sentence-transformers' mean pooling and L2 normalisation.
* ``demo``: ``sublayer demo``'s training (40 steps of its default size), tokens/s at the threads the command
  chooses (:func:`sublayer.kernels.cpu.choose_threads`) against 1 thread.

``contention``: every job twice, quiet and beside a competing busy process
(:func:`sublayer.bench.harness.busy_neighbour`), the report adding each ratio's busy / quiet.

* ``hf``: live HF models (BERT and GPT-2 fine-tuning steps, sentence-transformers ``encode``) patched by
  :func:`sublayer.hf.patch` against unpatched (:mod:`sublayer.bench.hfpatch`).
* ``llama``, ``llama-train`` (run only when named in ``only``): a SmolLM-135M-shaped Llama, greedy decoding against
  llama.cpp and HF ``generate``, and an AdamW step against HF ``labels=`` (:mod:`sublayer.bench.llama`).
* ``gpt2-llamacpp`` (run only when named in ``only``; needs llama.cpp's peers environment): the ``decode`` job's
  GPT-2, ``GPT2.generate`` fp32 and ``fast_inference(model, dtype=torch.bfloat16)`` against llama.cpp f32, f16 and
  bf16 (GGUFs converted from the same folder), batch 1 and 8 (:func:`sublayer.bench.llama.gpt2_rows`).
* ``ov-embed``, ``ov-decode`` (run only when named in ``only``): MiniLM embeddings and GPT-2 greedy decoding against
  OpenVINO and OpenVINO GenAI, f32 / bf16 / int8 weights, run from a side environment
  (:mod:`sublayer.bench.openvino_peer`).

``model``: a BERT folder (e.g. all-MiniLM-L6-v2) whose weights the int8 and embed rows use (random weights of
MiniLM's shape without it). ``quick``: tiny shapes, every row, for tests.

Only torch, this package's harness and sublayer's public API (``sublayer.models``, ``sublayer.demo``) are used, so
the jobs also run against other revisions of sublayer (``benchmarks/compare_revisions.py``; the demo row falls back
to torch's thread count where ``sublayer.kernels.cpu.choose_threads`` is missing).
"""

from __future__ import annotations

import contextlib
import dataclasses
import importlib
import importlib.util
import io
import json
import sys
import types
from collections.abc import Callable, Iterator
from pathlib import Path

import torch
import torch.nn.functional as F

from .harness import (BERT_SIZES, READ, Row, adamw_step, bert_batch, bert_model, busy_neighbour, command_line,
                      contention_table, cpu_info, ct2_greedy, machine, mean_pool, padded_batch, read_rates, summarize,
                      time_interleaved, Worker, write_report)  # fmt: skip

__all__ = [
    "DEFAULT_JOBS", "JOBS", "ct2_generator", "decoding_switch", "fast_and_reference", "gpt2_decoding", "gpt2_folder",
    "gpt2_llamacpp_rows", "llama_rows", "llama_train_rows", "padding_switch", "run_jobs", "switched",
]  # fmt: skip

DROPOUT = 0.1


def _switch(names: tuple[str, ...]) -> Callable[[bool], None] | None:
    """The first ``set_enabled`` found among the modules ``names`` (None where this sublayer has none)."""
    for name in names:
        try:
            fn = getattr(importlib.import_module(name), "set_enabled", None)
        except ImportError:
            continue
        if fn is not None:
            return fn
    return None


@contextlib.contextmanager
def switched(switch: Callable[[bool], None] | None, flag: bool) -> Iterator[None]:
    """``switch(flag)`` inside the block, ``switch(True)`` after it (nothing when ``switch`` is None)."""
    if switch is not None:
        switch(flag)
    try:
        yield
    finally:
        if switch is not None:
            switch(True)


def decoding_switch() -> Callable[[bool], None] | None:
    """``set_enabled(flag)`` of the fast decoding path (False: the reference steps run)."""
    return _switch(("sublayer.runtime.generation", "sublayer.runtime", "sublayer.models.decoding"))


def fast_and_reference(run: Callable[[], object], reps: int) -> tuple[dict, dict]:
    """``run()`` on the fast decoding path ("sublayer") and, where this sublayer can switch it off, on the reference
    steps ("reference steps"): each one's output (the warm-up) and its :func:`time_interleaved` timing."""
    switch = decoding_switch()

    def on(fast: bool):
        with switched(switch, fast):
            return run()

    fns = {"sublayer": lambda: on(True)} | ({"reference steps": lambda: on(False)} if switch is not None else {})
    return {k: f() for k, f in fns.items()}, time_interleaved(fns, reps, 0)


def gpt2_folder(cfg, out: Path) -> Path:
    """A random GPT-2 of ``cfg`` saved as a HF folder with a byte-less toy tokenizer (vocab.json + merges.txt,
    token ``t{i}`` = id i), which CTranslate2's converter needs; reused when present."""
    from sublayer.models import GPT2

    folder = Path(out) / f"gpt2-random-l{cfg.n_layers}-d{cfg.d_model}-v{cfg.vocab_size}"
    if not (folder / "config.json").is_file():
        torch.manual_seed(0)
        GPT2(cfg).save_pretrained(folder)
        vocab = {f"t{i}": i for i in range(cfg.vocab_size - 1)}
        vocab["<|endoftext|>"] = cfg.vocab_size - 1
        (folder / "vocab.json").write_text(json.dumps(vocab))
        (folder / "merges.txt").write_text("#version: 0.2\n")
    return folder


def _ct2_model(folder: Path, out: Path) -> Path | None:
    """CTranslate2's float32 conversion of the HF ``folder`` (made once under ``out``), or None without
    ctranslate2."""
    try:
        import ctranslate2
    except ImportError:
        return None
    ct2 = Path(out) / (Path(folder).name + "-ct2-float32")
    if not (ct2 / "model.bin").is_file():
        ctranslate2.converters.TransformersConverter(str(folder)).convert(str(ct2), force=True)
    return ct2


def ct2_generator(folder: Path, compute_type: str = "float32"):
    """CTranslate2's generator on the float32 conversion of the GPT-2 ``folder`` (converted beside it), its
    weights cast to ``compute_type`` on load (``"int8"``: CTranslate2's int8 quantization), in a process of its own
    (:class:`Ct2Generator`); None without ctranslate2."""
    ct2 = _ct2_model(folder, Path(folder).parent)
    return None if ct2 is None else Ct2Generator(ct2, compute_type, torch.get_num_threads())


class Ct2Generator(Worker):
    """CTranslate2's ``Generator`` on the converted folder ``path``, run in a process of its own (``ct2_worker.py``; its
    ``generate_batch`` answers as the Generator's: one result a row with ``sequences_ids``).

    In the same process, a Generator that has run slows torch's parallel regions until it is deleted (torch's
    OpenMP threads no longer spin between regions: ``OMP_WAIT_POLICY=ACTIVE`` takes the slow-down away), and every
    torch and sublayer row timed beside it ran up to a third slower. Out of process, each engine runs as alone.
    """

    WORKER, NAME = "ct2_worker.py", "CTranslate2"

    def __init__(self, path: Path, compute_type: str, threads: int) -> None:
        super().__init__(sys.executable)
        self.ask(op="load", path=str(path), compute_type=compute_type, threads=threads)

    def generate_batch(self, tokens: list[list[str]], **kw) -> list:
        ans = self.ask(op="generate", tokens=tokens, kw=kw)
        return [types.SimpleNamespace(sequences_ids=ids) for ids in ans["ids"]]

    def __del__(self) -> None:
        with contextlib.suppress(Exception):
            self.close()


def gpt2_decoding(quick: bool, work: Path):
    """The ``decode`` job's model and lengths: (config, prompt length, new tokens, HF folder, our GPT2 in eval
    mode, the rows' shape label); GPT-2 124M shape with prompt 32 + 32, or (``quick``) a tiny one with 8 + 8."""
    from sublayer.models import GPT2, GPT2Config

    size = dict(vocab_size=512, d_model=64, n_layers=2, n_heads=4, max_positions=64, bos_token_id=511,
                eos_token_id=511) if quick else {}  # fmt: skip
    cfg = GPT2Config(dropout=0.0, embd_dropout=0.0, attn_dropout=0.0, **size)
    prompt = new = 8 if quick else 32
    folder = gpt2_folder(cfg, work)
    shape = f"{cfg.n_layers}L d{cfg.d_model} V{cfg.vocab_size}, prompt {prompt} + {new}"
    return cfg, prompt, new, folder, GPT2.from_pretrained(folder).eval(), shape


def hf_gpt2_greedy(folder: Path) -> Callable[[torch.Tensor, int], torch.Tensor] | None:
    """HF ``GPT2LMHeadModel.generate`` on the GPT-2 ``folder`` in fp32 eager, greedy, every one of ``new`` tokens
    (``min_new_tokens``: no early end): ``(ids (B, T), new) -> (B, T + new)``; None without transformers."""
    try:
        import transformers
    except ImportError:
        return None
    hf = transformers.GPT2LMHeadModel.from_pretrained(folder).eval()
    pad = hf.config.vocab_size - 1

    def generate(ids: torch.Tensor, new: int) -> torch.Tensor:
        return hf.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=new, min_new_tokens=new,
                           do_sample=False, pad_token_id=pad)  # fmt: skip

    return generate


def decode_rows(quick: bool, reps: int, work: Path, model=None) -> list[Row]:
    """Greedy GPT-2 decoding, batch 1 and 8, fp32 and int8 against CTranslate2, bf16 against our fp32 (see the
    module doc)."""
    from sublayer.models import fast_inference

    cfg, prompt, new, folder, ours, shape = gpt2_decoding(quick, work)
    int8 = fast_inference(ours, quantize="int8")
    bf16 = fast_inference(ours, dtype=torch.bfloat16)  # bf16 panels where the CPU multiplies bf16 natively
    ct2 = {dt: ct2_generator(folder, dt) for dt in ("float32", "int8")}
    hf = hf_gpt2_greedy(folder)
    rows = []
    for b in (1, 8):
        ids = torch.randint(0, cfg.vocab_size - 1, (b, prompt), generator=torch.Generator().manual_seed(b))
        toks = [[f"t{i}" for i in r] for r in ids.tolist()]
        fns = {"sublayer fp32": lambda: ours.generate(ids, new), "sublayer int8": lambda: int8.generate(ids, new),
               "sublayer bf16": lambda: bf16.generate(ids, new)}  # fmt: skip
        fns |= {f"CTranslate2 {dt}": (lambda g=g: ct2_greedy(g, toks, new)) for dt, g in ct2.items() if g is not None}
        if hf is not None:  # what an HF user runs
            fns["HF generate"] = lambda: hf(ids, new)
        outs = {k: f() for k, f in fns.items()}  # the warm-up
        res = time_interleaved(fns, reps, 0)

        def row(vs: str, dt: str, base: str, times: dict) -> Row:  # ours in ``dt`` against ``base``
            rows.append(Row(f"GPT-2 greedy decoding{vs}, batch {b}", shape, dt, "generate", base=base, work=b * new,
                            unit="tok").fill({"sublayer": res[f"sublayer {dt}"], **times}))  # fmt: skip
            return rows[-1]

        for dt, peer in (("fp32", "CTranslate2 float32"), ("int8", "CTranslate2 int8")):
            r = row("", dt, peer, {peer: res[peer]} if peer in res else {})
            if peer in outs:
                r.extra["same tokens as CTranslate2"] = outs[f"sublayer {dt}"][:, prompt:].tolist() == outs[peer]
            else:
                r.extra["peer"] = "ctranslate2 not installed"
        r = row("", "bf16", "sublayer fp32", {"sublayer fp32": res["sublayer fp32"]})
        r.extra["compute dtype"] = str(bf16.compute_dtype).replace("torch.", "")
        r.extra["same tokens as fp32"] = outs["sublayer bf16"].tolist() == outs["sublayer fp32"].tolist()
        for dt in ("fp32", "int8", "bf16") if hf is not None else ():  # each engine against the HF user's job
            r = row(" vs HF generate", dt, "HF fp32", {"HF fp32": res["HF generate"]})
            r.extra["same tokens as HF"] = outs[f"sublayer {dt}"].tolist() == outs["HF generate"].tolist()
    return rows


def translate_rows(quick: bool, reps: int, work: Path, model=None) -> list[Row]:
    """``Transformer.translate`` on the fast path against the reference steps (see the module doc)."""
    from sublayer.models import Transformer

    demo = dict(d_model=128, n_heads=4, d_ff=256, n_layers=2, norm_first=True)  # name, sizes, vocab, b, beam, S, L
    if quick:
        cases = [("demo d128 l2 pre-norm", demo, 40, 16, 1, 12, 16),
                 ("tiny d32 l1 post-norm", dict(d_model=32, n_heads=2, d_ff=64, n_layers=1), 50, 4, 2, 6, 8)]
    else:
        cases = [("demo d128 l2 pre-norm", demo, 40, 500, 1, 12, 16),
                 ("d512 l6 post-norm", dict(d_model=512, n_heads=8, d_ff=2048, n_layers=6), 8000, 8, 4, 24, 32)]
    rows = []
    for name, kw, vocab, b, beam, src_len, max_len in cases:
        torch.manual_seed(0)
        m = Transformer(vocab, vocab, dropout=0.0, max_len=64, **kw).eval()
        src = torch.randint(3, vocab, (b, src_len), generator=torch.Generator().manual_seed(b))
        outs, res = fast_and_reference(lambda: m.translate(src, max_len, bos=1, eos=2, beam_size=beam), reps)
        row = Row(f"Transformer.translate {name}", f"batch {b} x {src_len}, beam {beam}", "fp32", "translate",
                  base="reference steps", work=float(outs["sublayer"].numel()), unit="tok").fill(res)  # fmt: skip
        if "reference steps" in outs:
            row.extra["same output as reference"] = outs["sublayer"].tolist() == outs["reference steps"].tolist()
        rows.append(row)
    return rows


def padding_switch() -> Callable[[bool], None] | None:
    """``set_enabled(flag)`` of padding-free execution (False: the padded path)."""
    return _switch(("sublayer.runtime.packing", "sublayer.runtime", "sublayer.models.padding_free"))


def train_rows(quick: bool, reps: int, work: Path, model=None, *, padded: bool = False) -> list[Row]:
    """One AdamW step of BERT and of GPT-2 against HF (see the module doc); ``padded``: also our model with
    padding-free execution off (column ``sublayer padded``), where this sublayer has the switch."""
    from sublayer.models import GPT2, Bert, BertConfig, GPT2Config

    drop = dict(dropout=DROPOUT, attn_dropout=DROPOUT)
    gsize = dict(vocab_size=1000, d_model=64, n_layers=2, n_heads=4, max_positions=64) if quick else \
        dict(vocab_size=8192, d_model=512, n_layers=6, n_heads=8, max_positions=128)  # fmt: skip
    bcfg = BertConfig(**BERT_SIZES[quick], **drop)
    gcfg = GPT2Config(**gsize, embd_dropout=DROPOUT, bos_token_id=0, eos_token_id=0, **drop)
    bshape, gshape = ((4, 32, 8), (4, 32, 8)) if quick else ((16, 128, 32), (8, 128, 32))
    switch = padding_switch() if padded else None
    rows = []
    for kind, cfg, (b, t, lo) in (("BERT", bcfg, bshape), ("GPT-2", gcfg, gshape)):
        torch.manual_seed(0)
        ours = (Bert(cfg, pooler=False) if kind == "BERT" else GPT2(cfg)).train()
        hf = ours.to_hf().train()
        ids, mask = padded_batch(b, t, lo, cfg.vocab_size)
        w = mask[..., None].float() / mask.sum()  # the mean over real tokens
        if kind == "BERT":
            losses = {"sublayer": lambda m=ours: (m(ids, mask).square() * w).sum(),
                      "HF": lambda: (hf(input_ids=ids, attention_mask=mask).last_hidden_state.square() * w).sum()}  # fmt: skip
        else:
            labels = ids.masked_fill(mask == 0, -100)
            losses = {"sublayer": lambda m=ours: m.loss(ids, attention_mask=mask),
                      "HF": lambda: hf(input_ids=ids, attention_mask=mask, labels=labels).loss}  # fmt: skip
        models = {"sublayer": ours, "HF": hf}
        if switch is not None:  # a twin with its own optimizer: the same weights on every side at the start
            twin = (Bert(cfg, pooler=False) if kind == "BERT" else GPT2(cfg)).train()
            twin.load_state_dict(ours.state_dict())

            def padded_loss(m=twin, f=losses["sublayer"]):
                with switched(switch, False):
                    return f(m)

            losses["sublayer padded"], models["sublayer padded"] = padded_loss, twin
        for bf16 in (False, True) if native_bf16() else (False,):  # bf16: every side under the same autocast
            steps = {k: adamw_step(models[k], f, bf16=bf16) for k, f in losses.items()}
            row = Row(f"{kind} training step (AdamW) vs HF", f"{cfg.n_layers}L d{cfg.d_model} {b}x{t} (len {lo}..{t})",
                      "bf16 autocast" if bf16 else "fp32", "training", base="HF", work=float(mask.sum()),
                      unit="real tok").fill(time_interleaved(steps, reps, 1))  # fmt: skip
            row.extra["HF attn"] = str(hf.config._attn_implementation)
            rows.append(row)
    return rows


def native_bf16() -> bool:
    """Whether the CPU multiplies bf16 natively (AVX512_BF16 or AMX-BF16): the bf16 autocast training rows run."""
    return any(v for k, v in cpu_info()["features"].items() if k in ("AVX512_BF16", "AMX_BF16"))


def int8_rows(quick: bool, reps: int, work: Path, model: Path | None = None) -> list[Row]:
    """int8 BERT inference against the float32 fast path (see the module doc)."""
    from sublayer.models import fast_inference

    ours, name = bert_model(quick, model)
    ids, mask, shape = bert_batch(quick, ours.config.vocab_size)
    fp32, int8 = fast_inference(ours, dtype=torch.float32), fast_inference(ours, quantize="int8")
    bf16 = fast_inference(ours, dtype=torch.bfloat16)
    fns = {"sublayer": lambda: int8(ids, mask), "sublayer fp32": lambda: fp32(ids, mask),
           "sublayer bf16": lambda: bf16(ids, mask)}  # fmt: skip
    if model is not None:
        try:
            import ctranslate2

            ct2 = ctranslate2.Encoder(str(_ct2_model(Path(model), work)), device="cpu", compute_type="int8",
                                      intra_threads=torch.get_num_threads())  # fmt: skip
            lists = [r[: int(n)].tolist() for r, n in zip(ids, mask.sum(1))]
            fns["CTranslate2 int8"] = lambda: ct2.forward_batch(lists)
        except Exception:  # noqa: BLE001 - no ctranslate2, or a folder it cannot convert: no column
            pass
    res = time_interleaved(fns, reps, 1)
    vs_bf16 = Row(f"BERT int8 inference vs our bf16 ({name})", shape, "int8", "forward", base="sublayer bf16",
                  work=float(ids.shape[0]), unit="seq").fill({k: res[k] for k in ("sublayer", "sublayer bf16")})
    vs_bf16.extra["bf16 compute dtype"] = str(bf16.compute_dtype).replace("torch.", "")
    res.pop("sublayer bf16")
    row = Row(f"BERT int8 inference ({name})", shape, "int8", "forward", base="sublayer fp32",
              work=float(ids.shape[0]), unit="seq").fill(res)  # fmt: skip
    h, ref = int8(ids, mask), fp32(ids, mask)
    real = mask.bool()
    row.extra["int8 min token cos vs fp32"] = round(float(F.cosine_similarity(h[real], ref[real], dim=-1).min()), 5)
    sentence = (mean_pool(h, mask) * mean_pool(ref, mask)).sum(-1).min()
    row.extra["int8 min sentence cos vs fp32"] = round(float(sentence), 5)
    row.extra["int8 GEMM"] = "int8_linear" if getattr(int8, "own_gemm", False) else "linear_dynamic"
    vs_bf16.extra["int8 min token cos vs fp32"] = row.extra["int8 min token cos vs fp32"]
    return [row, vs_bf16]


def embed_rows(quick: bool, reps: int, work: Path, model: Path | None = None) -> list[Row]:
    """MiniLM sentence embeddings: the fast path against HF + mean pooling (see the module doc)."""
    from sublayer.models import fast_inference

    ours, name = bert_model(quick, model)
    hf = ours.to_hf().eval()
    fast = fast_inference(ours)
    ids, mask, shape = bert_batch(quick, ours.config.vocab_size)

    def hf_embed():
        with torch.no_grad():
            return mean_pool(hf(input_ids=ids, attention_mask=mask).last_hidden_state, mask)

    res = time_interleaved({"sublayer": lambda: fast.embed(ids, mask), "HF": hf_embed}, reps, 1)
    row = Row(f"sentence embedding ({name})", shape, str(fast.compute_dtype).replace("torch.", ""), "embed",
              base="HF", work=float(ids.shape[0]), unit="seq").fill(res)  # fmt: skip
    row.extra["min cos vs HF"] = round(float((fast.embed(ids, mask).float() * hf_embed()).sum(-1).min()), 5)
    return [row]


def demo_rows(quick: bool, reps: int, work: Path, model=None) -> list[Row]:
    """``sublayer demo``'s training at the threads it chooses against 1 thread (see the module doc); the
    threads are chosen when the row starts, as the command chooses them when it starts."""
    from sublayer.demo import DemoConfig, train

    try:
        from sublayer.demo.config import demo_threads

        threads, why = demo_threads()
    except ImportError:  # a sublayer without the choice: torch's count
        threads, why = torch.get_num_threads(), "torch's default"
    size = dict(steps=3, batch_size=16, n_val=4, n_test=4) if quick else dict(steps=40, n_val=16, n_test=16)
    cfg = DemoConfig(**size)
    ms: dict[str, list[float]] = {"sublayer": [], "1 thread": []}
    for _ in range(reps):
        for name, n in (("sublayer", threads), ("1 thread", 1)):
            with contextlib.redirect_stdout(io.StringIO()):  # the demo's result line
                metrics = train(dataclasses.replace(cfg, out=str(Path(work) / "demo"), threads=n, quiet=True,
                                                    overwrite=True, eval_every=10**6, save_every=10**6))  # fmt: skip
            ms[name].append(1e6 / metrics["tokens_per_second"])  # ms per 1000 training tokens
    row = Row("sublayer demo training, default threads vs 1", f"{cfg.steps} steps of {cfg.batch_size} pairs",
              "fp32", "training", base="1 thread", work=1000.0, unit="tok")  # fmt: skip
    row.fill({k: summarize(v) for k, v in ms.items()})
    row.extra["threads"] = f"{threads} ({why})"
    return [row]


def _job(module: str, name: str, **kw) -> Callable[..., list[Row]]:
    """A job running ``module``'s ``name`` (imported when the job runs, ``kw`` passed on)."""

    def rows(quick: bool, reps: int, work: Path, model=None) -> list[Row]:
        return getattr(importlib.import_module(module, __package__), name)(quick, reps, work, model, **kw)

    rows.__doc__ = f"The rows of :func:`{importlib.util.resolve_name(module, __package__)}.{name}`."
    return rows


# (hf: imported by its full name, as this file also runs standalone)
hf_rows = _job("sublayer.bench.hfpatch", "hf_rows")
llama_rows, llama_train_rows = _job(".llama", "decode_rows"), _job(".llama", "train_rows")
gpt2_llamacpp_rows = _job(".llama", "gpt2_rows", gpt2_decoding=gpt2_decoding)
ov_embed_rows = _job(".openvino_peer", "embed_rows")
ov_decode_rows = _job(".openvino_peer", "decode_rows", gpt2_decoding=gpt2_decoding, ct2_generator=ct2_generator)

JOBS: dict[str, Callable[..., list[Row]]] = {
    "decode": decode_rows, "translate": translate_rows, "train": train_rows, "int8": int8_rows, "embed": embed_rows,
    "hf": hf_rows,
    "demo": demo_rows,
    "llama": llama_rows, "llama-train": llama_train_rows, "gpt2-llamacpp": gpt2_llamacpp_rows,
    "ov-embed": ov_embed_rows, "ov-decode": ov_decode_rows,
}  # fmt: skip
# what runs without --only (the Llama and OpenVINO jobs are asked for by name: their peers live in side envs)
DEFAULT_JOBS = ("decode", "translate", "train", "int8", "embed", "hf", "demo")


def run_jobs(*, quick: bool = False, reps: int | None = None, only: str | None = None, model: str | Path | None = None,
             work: str | Path = "runs/bench/jobs", report: str | Path | None = None, notes: str = "",
             contention: bool = False, log: Callable[[str], None] = print) -> list[Row]:  # fmt: skip
    """The rows of the jobs named in ``only`` (comma-separated keys of :data:`JOBS`; default
    :data:`DEFAULT_JOBS`), each logged.

    ``work``: the folder for the GPT-2 checkpoint and its CTranslate2 conversions. ``report``: a ``.md`` file or a
    folder (then ``jobs-<cpu kind>-<date>.md`` in it; ``llama-...`` when only Llama jobs ran) for the markdown report
    (:func:`sublayer.bench.harness.write_report`), ``notes`` in its header. ``contention``: each job runs quiet,
    then beside a competing busy process (:func:`sublayer.bench.harness.busy_neighbour`); the rows' modes say
    ``[quiet]`` / ``[busy]`` and the report adds :func:`sublayer.bench.harness.contention_table`.

    Raises:
        ValueError: ``only`` names no job, or ``reps`` below 1.
    """
    names = [n.strip() for n in (only or ",".join(DEFAULT_JOBS)).split(",") if n.strip()]
    if not names or set(names) - set(JOBS):
        raise ValueError(f"only must name jobs of {','.join(JOBS)} (comma-separated), got {only!r}")
    if reps is not None and reps < 1:
        raise ValueError(f"reps must be >= 1, got {reps}")
    reps = reps or (2 if quick else 3)
    work = Path(work)
    work.mkdir(parents=True, exist_ok=True)
    rows: list[Row] = []
    by: dict[str, list[Row]] = {"quiet": [], "busy": []}
    for name in names:
        read = read_rates() if contention else None  # what a memory-bound job can keep on one core
        for cond in ("quiet", "busy") if contention else ("",):
            with busy_neighbour() if cond == "busy" else contextlib.nullcontext():
                got = JOBS[name](quick, reps, work, None if model is None else Path(model))
            for r in got:
                if cond:
                    r.mode += f" [{cond}]"
                    by[cond].append(r)
                if cond == "quiet":
                    r.extra[READ] = f"{read[0]:.1f} / {read[1]:.1f} ({read[0] / read[1]:.2f})"
                x = r.ratio()
                ms = f"{r.times_ms['sublayer']:9.1f} ms" if "sublayer" in r.times_ms else "     none"
                log(f"{r.case:48s} {r.shape:34s} {r.dtype:5s} {cond:5s} sublayer {ms}  "
                    + (f"x{x:.2f} vs {r.base}" if x is not None else f"({r.base}: none)"))
                rows.append(r)
    if report is not None:
        llama = all(n.startswith("llama") for n in names)  # its own file: llama-<cpu kind>-<date>.md
        title = "sublayer Llama (SmolLM-135M shape) vs llama.cpp and HF" if llama else "sublayer whole jobs vs peers"
        if all(n.startswith("ov-") for n in names):
            title = "sublayer vs OpenVINO and OpenVINO GenAI (MiniLM embedding, GPT-2 decoding)"
        if names == ["gpt2-llamacpp"]:
            title = "sublayer GPT-2 greedy decoding vs llama.cpp (f32, f16, bf16 GGUF)"
        title += (", quiet and beside a busy process" if contention else "") + (" (quick: tiny shapes)" if quick else "")
        info = machine()
        for module, versions, jobs in ((".llama", "peer_versions", ("llama", "gpt2-llamacpp")),
                                       (".openvino_peer", "ov_versions", ("ov-",))):  # the side environments' peers
            if any(n.startswith(jobs) for n in names):
                info["versions"].update(getattr(importlib.import_module(module, __package__), versions)())
        appendix = contention_table(by["quiet"], by["busy"]) if contention else ""
        kind = "llama" if llama else "jobs"
        path = write_report(report, kind + ("-contention" if contention else ""), title, rows, command=command_line(),
                            notes=notes, reps=reps, info=info, appendix=appendix)  # fmt: skip
        log(f"wrote {path}")
    return rows
