"""``sublayer bench --dtypes int8 [--model FOLDER]``: int8 BERT inference, speed and accuracy in one run.

Engines, all on the same ids (batch 64 x 128 padded, real lengths uniform in 32..128; ``--quick``: 4 x 32):

* ``sublayer fp32``: ``fast_inference(model, dtype=torch.float32)`` (the "eager" column: the baseline),
* ``sublayer int8``: ``fast_inference(model, quantize="int8")`` (the "sublayer" column),
* ``HF fp32``: ``transformers.BertModel`` (the accuracy reference, timed too),
* ``sublayer bf16``: ``fast_inference(model, dtype=torch.bfloat16)``, only where the CPU multiplies bf16 natively
  (AMX / AVX512_BF16: there it is the other fast choice),
* ``CT2 int8``: CTranslate2's ``Encoder`` with ``compute_type="int8"`` when ``ctranslate2`` is installed
  (``pip install 'sublayer[peers]'``) and ``--model`` names a folder with a tokenizer (converted once under
  ``build/ct2/``).

Accuracy against HF fp32: the minimum cosine over real tokens of the last hidden states, and the minimum cosine
of the mean-pooled, L2-normalised sentence vectors (sentence-transformers' pooling). Without ``--model`` the
weights are random (BERT init), whose activations have none of a trained model's outlier channels: the accuracy
figures then say little; give a trained folder (e.g. all-MiniLM-L6-v2) for real ones.
"""

from __future__ import annotations

import hashlib
from pathlib import Path

import torch
import torch.nn.functional as F

from .kernels import Row, _time_interleaved

__all__ = ["bench_int8"]


def _sentence(h: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    w = mask[..., None].to(h.dtype)
    return F.normalize((h * w).sum(1) / w.sum(1), dim=-1)


def accuracy(h: torch.Tensor, ref: torch.Tensor, mask: torch.Tensor) -> tuple[float, float]:
    """(min cosine over real tokens, min cosine of mean-pooled sentence vectors) of ``h`` against ``ref``."""
    real = mask.bool()
    tok = F.cosine_similarity(h[real], ref[real], dim=-1).min()
    sent = (_sentence(h, mask) * _sentence(ref, mask)).sum(-1).min()
    return float(tok), float(sent)


def _ct2_encoder(folder: Path):
    """A CTranslate2 int8 encoder for ``folder`` (converted once under build/ct2/<hash>), or None."""
    try:
        import ctranslate2
    except ImportError:
        return None
    key = hashlib.sha1(str(folder.resolve()).encode()).hexdigest()[:12]
    out = Path("build") / "ct2" / f"{folder.name}-{key}"
    if not (out / "model.bin").is_file():
        out.parent.mkdir(parents=True, exist_ok=True)
        ctranslate2.converters.TransformersConverter(str(folder)).convert(str(out), force=True)
    return ctranslate2.Encoder(str(out), device="cpu", compute_type="int8", intra_threads=torch.get_num_threads())


def bench_int8(model_folder: str | Path | None, quick: bool, reps: int, warmup: int) -> list[Row]:
    """One row: int8 vs fp32 fast path (ratio), HF fp32 and CTranslate2 int8 times, accuracies in ``extra``."""
    try:
        import transformers
    except ImportError:
        return []
    from ..checkpoints import bert as keymap
    from ..models import Bert, BertConfig
    from ..models.fast import fast_inference

    torch.manual_seed(0)
    if model_folder is not None:
        folder = Path(model_folder)
        ours = Bert.from_pretrained(folder).eval()
        hf = transformers.BertModel.from_pretrained(str(folder), attn_implementation="eager").eval()
        cfg, name = ours.config, folder.name
    else:
        folder = None
        if quick:
            cfg = BertConfig(vocab_size=1000, d_model=96, n_layers=2, n_heads=12, d_ff=384)
        else:
            cfg = BertConfig(vocab_size=30522, d_model=384, n_layers=6, n_heads=12, d_ff=1536)
        ours = Bert(cfg).eval()
        hf_cfg = {k: v for k, v in cfg.to_hf_dict().items() if k not in ("model_type", "architectures")}
        hf = transformers.BertModel(transformers.BertConfig(**hf_cfg)).eval()
        hf.load_state_dict(keymap.to_hf(ours.state_dict(), cfg.n_layers, pooler=True), strict=False)
        name = "random MiniLM-size" if not quick else "random tiny"
    b, t, lo = (4, 32, 8) if quick else (64, 128, 32)
    t = min(t, cfg.max_positions)
    lens = torch.randint(lo, t + 1, (b,))
    mask = (torch.arange(t)[None] < lens[:, None]).long()
    ids = torch.randint(1, cfg.vocab_size, (b, t)) * mask
    fp32 = fast_inference(ours, dtype=torch.float32)
    int8 = fast_inference(ours, quantize="int8")

    def hf_call():
        with torch.no_grad():
            return hf(input_ids=ids, attention_mask=mask).last_hidden_state

    fns = {"eager": lambda: fp32(ids, mask), "sublayer": lambda: int8(ids, mask), "HF fp32": hf_call}
    from .. import kernels
    from ..models import quantized

    if kernels.native_bf16_gemm():  # on such CPUs (AMX) the bf16 fast path is the other choice
        bf16 = fast_inference(ours, dtype=torch.bfloat16)
        fns["sublayer bf16"] = lambda: bf16(ids, mask)
    ct2 = _ct2_encoder(folder) if folder is not None else None
    if ct2 is not None:
        lists = [row[: int(n)].tolist() for row, n in zip(ids, lens)]
        fns["CT2 int8"] = lambda: ct2.forward_batch(lists)
    res = _time_interleaved(fns, reps, warmup)
    row = Row(f"BERT int8 inference ({name})", f"{b}x{t} (len {lo}..{t})", "int8", "forward")
    for k, (tm, sp) in res.items():
        row.times_ms[k], row.spread[k] = tm, sp
    ref = hf_call()
    for label, h in (("sublayer int8", int8(ids, mask)), ("sublayer fp32", fp32(ids, mask))):
        tok, sent = accuracy(h, ref, mask)
        row.extra[f"{label} min token cos"] = round(tok, 5)
        row.extra[f"{label} min sentence cos"] = round(sent, 5)
    if "sublayer bf16" in fns:
        tok, sent = accuracy(bf16(ids, mask), ref, mask)
        row.extra["sublayer bf16 min token cos"], row.extra["sublayer bf16 min sentence cos"] = round(tok, 5), round(sent, 5)
        row.extra["bf16 x vs sublayer fp32"] = round(row.ratio("sublayer bf16", "eager"), 2)
    row.extra["int8 engine"] = quantized.engine()
    row.extra["int8 x vs sublayer fp32"] = round(row.ratio("sublayer", "eager"), 2)
    row.extra["int8 x vs HF fp32"] = round(row.ratio("sublayer", "HF fp32"), 2)
    if ct2 is not None:
        import numpy as np

        out = ct2.forward_batch(lists).last_hidden_state
        h = torch.zeros(b, t, cfg.d_model)
        arr = torch.from_numpy(np.array(out))
        h[:, : arr.shape[1]] = arr
        h = h * mask[..., None]
        tok, sent = accuracy(h, ref, mask)
        row.extra["CT2 int8 min token cos"] = round(tok, 5)
        row.extra["CT2 int8 min sentence cos"] = round(sent, 5)
        row.extra["int8 x vs CT2 int8"] = round(row.ratio("sublayer", "CT2 int8"), 2)
    row.extra["seq/s int8"] = round(b / (row.times_ms["sublayer"] / 1e3), 1)
    row.extra["real tokens"] = f"{int(mask.sum())}/{b * t}"
    return [row]
