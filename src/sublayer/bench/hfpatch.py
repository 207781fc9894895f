"""``sublayer bench --jobs --only hf``: live Hugging Face models patched by :func:`sublayer.hf.patch` vs unpatched.

Every row times the same HF model twice (two copies of one set of weights, each with its own optimizer),
interleaved; ratio = unpatched time / patched time (> 1: the patch is faster).

* ``Trainer``-style fine-tuning step (``model(**batch).loss``, backward, a fused AdamW step as ``Trainer``'s
  default ``optim="adamw_torch_fused"``, ``zero_grad``; HF's default dropout 0.1), fp32 and, where the CPU has
  native bf16 GEMMs (:func:`sublayer.kernels.native_bf16_gemm`), ``torch.autocast("cpu", dtype=torch.bfloat16)``:
  ``BertForSequenceClassification`` of MiniLM's shape (6 layers, d 384, vocab 30522) on 16 x 128 right-padded
  (lengths 51..128: about 70 % real tokens), and ``GPT2LMHeadModel`` of 6 layers, d 512 (vocab 50257) on 8 x 128
  (the same padding, ``labels`` -100 at the padding).
* sentence-transformers ``encode`` of 1,000 sentences (batch 32, 5..60 words) with a MiniLM-shape BERT and mean
  pooling; a random WordPiece vocabulary; the ``SentenceTransformer`` is built from a saved folder when
  ``sentence-transformers`` is installed, else its steps (sort by length, tokenize, ``BertModel``, mean pool,
  normalise) are run directly.

``quick``: tiny shapes, for tests.
"""

from __future__ import annotations

import copy
from pathlib import Path

import torch

from .. import hf, kernels
from .harness import Row, adamw_step, mean_pool, padded_batch, time_interleaved

__all__ = ["hf_rows"]

# the BERTs' sizes (transformers.BertConfig's names): MiniLM's shape, or (quick) a tiny one
_BERT = {False: dict(hidden_size=384, num_hidden_layers=6, num_attention_heads=12, intermediate_size=1536),
         True: dict(hidden_size=64, num_hidden_layers=2, num_attention_heads=4, intermediate_size=256)}  # fmt: skip


def _pair(model: torch.nn.Module):
    patched = copy.deepcopy(model)
    hf.patch(patched)
    return {"sublayer": patched, "HF": model}


def _training_rows(quick: bool, reps: int) -> list[Row]:
    import transformers

    bert = transformers.BertConfig(vocab_size=1000 if quick else 30522, num_labels=2, **_BERT[quick])
    gpt2 = transformers.GPT2Config(**dict(vocab_size=1000, n_embd=64, n_layer=2, n_head=4, n_positions=64,
                                          bos_token_id=0, eos_token_id=0) if quick else
                                   dict(n_embd=512, n_layer=6, n_head=8, n_positions=128))  # fmt: skip
    shapes = ((4, 32, 12), (4, 32, 12)) if quick else ((16, 128, 51), (8, 128, 51))
    dtypes = ["fp32", "bf16"] if kernels.native_bf16_gemm() else ["fp32"]
    rows = []
    heads = (transformers.BertForSequenceClassification, transformers.GPT2LMHeadModel)
    for cls, cfg, (b, t, lo) in zip(heads, (bert, gpt2), shapes):
        torch.manual_seed(0)
        model = cls(cfg)
        ids, mask = padded_batch(b, t, lo, cfg.vocab_size)
        labels = torch.arange(b) % 2 if cfg is bert else ids.masked_fill(mask == 0, -100)
        batch = {"input_ids": ids, "attention_mask": mask, "labels": labels}
        for dt in dtypes:
            res = time_interleaved({k: adamw_step(m, lambda m=m: m(**batch).loss, lr=1e-5, bf16=dt == "bf16")
                                    for k, m in _pair(model.train()).items()}, reps, 1)
            rows.append(Row(f"HF {cls.__name__} fine-tuning step, hf.patch vs HF", f"{cfg.num_hidden_layers}L "
                            f"d{cfg.hidden_size} {b}x{t} (len {lo}..{t})", dt, "training", base="HF",
                            work=float(mask.sum()), unit="real tok").fill(res))  # fmt: skip
    return rows


def _encode_row(quick: bool, reps: int, work: Path) -> Row:
    import transformers

    g = torch.Generator().manual_seed(0)
    n_words = 300 if quick else 30000
    words = ["[PAD]", "[UNK]", "[CLS]", "[SEP]", "[MASK]", *(f"w{i}" for i in range(n_words))]
    n, hi = (40, 20) if quick else (1000, 60)
    lens = torch.randint(5, hi + 1, (n,), generator=g).tolist()
    texts = [" ".join(f"w{int(i)}" for i in torch.randint(0, n_words, (k,), generator=g)) for k in lens]
    cfg = transformers.BertConfig(vocab_size=len(words), **_BERT[quick])
    folder = work / f"hf-encode-{'quick' if quick else 'minilm'}"
    folder.mkdir(parents=True, exist_ok=True)
    (folder / "vocab.txt").write_text("\n".join(words) + "\n")
    tok = transformers.BertTokenizerFast(vocab_file=str(folder / "vocab.txt"))
    torch.manual_seed(0)
    bert = transformers.BertModel(cfg).eval()
    try:
        import sentence_transformers as st

        try:
            from sentence_transformers.sentence_transformer.modules import Pooling, Transformer
        except ImportError:  # sentence-transformers < 6
            from sentence_transformers.models import Pooling, Transformer
        bert.save_pretrained(folder)
        tok.save_pretrained(folder)
        model = st.SentenceTransformer(modules=[Transformer(str(folder)), Pooling(cfg.hidden_size)], device="cpu")

        def encoder(m):
            return lambda: m.encode(texts, batch_size=32, normalize_embeddings=True, convert_to_tensor=True)

        peer = "sentence-transformers"
    except ImportError:  # the same steps, run here
        model, peer = bert, "sentence-transformers' steps"

        def encoder(m):
            order = sorted(range(n), key=lambda i: -len(texts[i]))

            @torch.inference_mode()
            def run():
                out = []
                for s in range(0, n, 32):
                    enc = tok([texts[i] for i in order[s : s + 32]], padding=True, truncation=True,
                              return_tensors="pt")  # fmt: skip
                    out.append(mean_pool(m(**enc).last_hidden_state, enc["attention_mask"]))
                return torch.cat(out)

            return run

    res = time_interleaved({k: encoder(m) for k, m in _pair(model).items()}, reps, 1)
    return Row(f"{peer} encode, hf.patch vs HF", f"{n} sentences ({cfg.num_hidden_layers}L d{cfg.hidden_size}), "
               "batch 32", "fp32", "forward", base="HF", work=float(n), unit="sentences").fill(res)  # fmt: skip


def hf_rows(quick: bool, reps: int, work: Path, model=None) -> list[Row]:
    """The rows of the module doc (``model`` is unused: the shapes are fixed, the weights random)."""
    return [*_training_rows(quick, reps), _encode_row(quick, reps, work)]
