"""Whole-model training steps vs Hugging Face on padded batches (rows of ``sublayer bench``).

One step = forward, loss over the real tokens, backward, ``AdamW.step()`` and ``zero_grad``, dropout 0.1, fp32, the
same initial weights and batch on both sides (each side has its own optimizer). Columns: ``eager`` = HF,
``sublayer`` = our model (padding-free: dense sub-layers on the real tokens only, see
:mod:`sublayer.models.padding_free`), ``sublayer padded`` = our model with the padding-free path switched off.

* BERT, MiniLM size (6 layers, d 384, 12 heads, d_ff 1536), 16 x 128, lengths uniform in 32..128; loss: mean
  square of the last hidden states at real tokens; HF ``BertModel``.
* GPT-2, 6 layers, d 512, 8 heads, vocab 8192, 8 x 128 right-padded, lengths uniform in 32..128; loss: next-token
  cross-entropy over the real tokens; HF ``GPT2LMHeadModel(..., labels=)``. Ours uses ``GPT2.loss`` where the
  model has one (the fused LM-head + cross-entropy), else the LM head and ``F.cross_entropy`` on the packed real
  tokens (:func:`sublayer.models.padding_free.gpt2_hidden`).

``python -m sublayer.bench.models [--quick] [--reps N] [--threads N] [--only bert|gpt2]`` prints the rows alone.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from .kernels import Row, _fill, _time_interleaved

__all__ = ["bench_training_steps"]

DROPOUT = 0.1


def _padded_batch(b: int, t: int, lo: int, vocab: int, g: torch.Generator) -> tuple[torch.Tensor, torch.Tensor]:
    lens = torch.randint(lo, t + 1, (b,), generator=g)
    mask = (torch.arange(t)[None] < lens[:, None]).long()  # right padding
    ids = torch.randint(1, vocab, (b, t), generator=g) * mask
    return ids, mask


def _time_steps(sides: dict, reps: int, warmup: int) -> dict:
    """Interleaved timings of one AdamW training step per side: ``sides`` maps a name to (model, loss_fn)."""

    def step(model: torch.nn.Module, loss_fn):
        opt = torch.optim.AdamW(model.parameters(), lr=1e-4)

        def f() -> None:
            loss_fn().backward()
            opt.step()
            opt.zero_grad(set_to_none=True)

        return f

    return _time_interleaved({name: step(m, fn) for name, (m, fn) in sides.items()}, reps, warmup)


def _row(case: str, shape: str, res: dict, mask: torch.Tensor, extra: dict) -> Row:
    row = _fill(Row(case, shape, "fp32", "training"), res)
    n = int(mask.sum())
    row.extra["real tokens"] = f"{n}/{mask.numel()} ({100 * n / mask.numel():.0f} %)"
    row.extra["own padded path ms"] = round(row.times_ms["sublayer padded"], 1)
    row.extra["x vs own padded path"] = round(row.ratio("sublayer", "sublayer padded") or 0.0, 2)
    row.extra.update(extra)
    return row


def bench_bert_training(quick: bool, reps: int, warmup: int) -> Row:
    import transformers

    from ..checkpoints import bert as keymap
    from ..models import Bert, BertConfig, padding_free

    torch.manual_seed(0)
    if quick:
        cfg = BertConfig(vocab_size=1000, d_model=96, n_layers=2, n_heads=12, d_ff=384, dropout=DROPOUT,
                         attn_dropout=DROPOUT)  # fmt: skip
        b, t, lo, name = 4, 32, 8, "tiny 4x32 (len 8..32)"
    else:
        cfg = BertConfig(d_model=384, n_layers=6, n_heads=12, d_ff=1536, dropout=DROPOUT, attn_dropout=DROPOUT)
        b, t, lo, name = 16, 128, 32, "MiniLM 16x128 (len 32..128)"
    ours = Bert(cfg, pooler=False).train()
    padded = Bert(cfg, pooler=False).train()
    padded.load_state_dict(ours.state_dict())
    hf_cfg = {k: v for k, v in cfg.to_hf_dict().items() if k not in ("model_type", "architectures")}
    hf = transformers.BertModel(transformers.BertConfig(**hf_cfg), add_pooling_layer=False).train()
    hf.load_state_dict(keymap.to_hf(ours.state_dict(), cfg.n_layers, pooler=False))
    ids, mask = _padded_batch(b, t, lo, cfg.vocab_size, torch.Generator().manual_seed(0))
    m = mask[..., None].float()
    n = m.sum()

    def hf_loss():
        return (hf(input_ids=ids, attention_mask=mask).last_hidden_state.square() * m).sum() / n

    def ours_loss():
        return (ours(ids, mask).square() * m).sum() / n

    def padded_loss():
        with padding_free.disabled():
            return (padded(ids, mask).square() * m).sum() / n

    res = _time_steps({"eager": (hf, hf_loss), "sublayer": (ours, ours_loss), "sublayer padded": (padded, padded_loss)},
                      reps, warmup)  # fmt: skip
    extra = {"HF attn": str(hf.config._attn_implementation), "loss": "mean square of real hidden states"}
    return _row("BERT training step (AdamW) vs HF BertModel", name, res, mask, extra)


def _gpt2_loss_fn(model, ids: torch.Tensor, mask: torch.Tensor, *, fused: bool | None = None):
    """Our GPT-2 loss: ``GPT2.loss`` when the model has it (``fused=None``) or ``fused=True``, else the LM head +
    cross-entropy on the packed rows. Returns (a function giving the loss, a description)."""
    from ..models import padding_free

    if fused or (fused is None and hasattr(model, "loss")):
        return (lambda: model.loss(ids, attention_mask=mask)), "GPT2.loss"
    labels = ids.masked_fill(mask == 0, -100)
    nxt = torch.cat([labels[:, 1:], torch.full_like(labels[:, :1], -100)], dim=1)  # target of each position
    pos = torch.arange(ids.shape[1])[None]

    def f():
        h, pk = padding_free.gpt2_hidden(model, ids, pos, mask == 0)
        tgt = pk.pack(nxt)
        keep = (tgt != -100).nonzero().squeeze(1)
        return F.cross_entropy(model.lm_head(h.index_select(0, keep)), tgt.index_select(0, keep))

    return f, "LM head + F.cross_entropy on packed rows"


def bench_gpt2_training(quick: bool, reps: int, warmup: int) -> Row:
    import transformers

    from ..checkpoints import gpt2 as keymap
    from ..models import GPT2, GPT2Config, padding_free

    torch.manual_seed(0)
    if quick:
        cfg = GPT2Config(vocab_size=1000, d_model=64, n_layers=2, n_heads=4, max_positions=64, bos_token_id=0, eos_token_id=0, dropout=DROPOUT,
                         embd_dropout=DROPOUT, attn_dropout=DROPOUT)  # fmt: skip
        b, t, lo, name = 4, 32, 8, "tiny 4x32 (len 8..32)"
    else:
        cfg = GPT2Config(vocab_size=8192, d_model=512, n_layers=6, n_heads=8, max_positions=128, bos_token_id=0, eos_token_id=0, dropout=DROPOUT,
                         embd_dropout=DROPOUT, attn_dropout=DROPOUT)  # fmt: skip
        b, t, lo, name = 8, 128, 32, "6x512 V8192 8x128 (len 32..128)"
    ours = GPT2(cfg).train()
    padded = GPT2(cfg).train()
    padded.load_state_dict(ours.state_dict())
    hf_cfg = {k: v for k, v in cfg.to_hf_dict().items() if k not in ("model_type", "architectures")}
    hf = transformers.GPT2LMHeadModel(transformers.GPT2Config(**hf_cfg)).train()
    sd = keymap.to_hf(ours.state_dict(), cfg.n_layers, tied=cfg.tie_word_embeddings)
    hf.transformer.load_state_dict(sd, strict=False)
    ids, mask = _padded_batch(b, t, lo, cfg.vocab_size, torch.Generator().manual_seed(0))
    labels = ids.masked_fill(mask == 0, -100)
    ours_loss, how = _gpt2_loss_fn(ours, ids, mask)

    def hf_loss():
        return hf(input_ids=ids, attention_mask=mask, labels=labels).loss

    def padded_loss():
        with padding_free.disabled():
            logits = padded(ids, attention_mask=mask)
        return F.cross_entropy(logits[:, :-1].reshape(-1, cfg.vocab_size), labels[:, 1:].reshape(-1))

    res = _time_steps({"eager": (hf, hf_loss), "sublayer": (ours, ours_loss), "sublayer padded": (padded, padded_loss)},
                      reps, warmup)  # fmt: skip
    extra = {"HF attn": str(hf.config._attn_implementation), "our loss": how}
    return _row("GPT-2 training step (AdamW) vs HF GPT2LMHeadModel", name, res, mask, extra)


def bench_training_steps(quick: bool, reps: int, warmup: int) -> list[Row]:
    """The BERT and GPT-2 training-step rows (none when ``transformers`` is missing)."""
    try:
        import transformers  # noqa: F401
    except Exception:  # noqa: BLE001 - transformers is optional here
        return []
    reps = min(reps, 5)  # whole steps take seconds each
    return [bench_bert_training(quick, reps, warmup), bench_gpt2_training(quick, reps, warmup)]


if __name__ == "__main__":
    import argparse

    ap = argparse.ArgumentParser(description="whole-model training steps vs HF")
    ap.add_argument("--quick", action="store_true")
    ap.add_argument("--reps", type=int, default=3)
    ap.add_argument("--only", choices=["bert", "gpt2"], default=None)
    ap.add_argument("--threads", type=int, default=None)
    a = ap.parse_args()
    if a.threads:
        torch.set_num_threads(a.threads)
    for name, fn in (("bert", bench_bert_training), ("gpt2", bench_gpt2_training)):
        if a.only in (None, name):
            r = fn(a.quick, a.reps, 1)
            print(r.case, r.shape, {k: round(v, 1) for k, v in r.times_ms.items()}, f"x{r.ratio():.2f}", r.extra)
