"""``sublayer bench`` rows for the fused LM-head loss (:func:`sublayer.functional.linear_cross_entropy`).

* the op alone, training (forward + backward): eager ``F.cross_entropy(F.linear(h, W), t)`` vs the fused op
  (default: logits recomputed in backward) and the fused op with ``grad_in_forward=True``; bytes saved for
  backward (and, for ``grad_in_forward``, the gradients held from forward to backward), and the saved-bytes ratio
  at GPT-2's vocabulary (50257 x 768, 4 x 256 tokens);
* a GPT-2 training step (6 layers, d 512, 8 heads, vocab 8192, 8 x 128 right-padded, lengths 32..128, dropout
  0.1, AdamW step included): ``GPT2.loss`` vs the model's logits + ``F.cross_entropy`` (same model code and
  weights on both sides, so the difference is the head + loss alone).

``python -m sublayer.bench.loss [--quick]`` prints the rows; ``sublayer bench`` includes them.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from ..functional import linear_cross_entropy
from ..models import GPT2, GPT2Config
from .harness import Row, adamw_step, padded_batch, saved_bytes, time_interleaved

__all__ = ["bench_loss", "bench_lm_head", "bench_gpt2_loss_step"]


def bench_lm_head(quick: bool, reps: int, warmup: int) -> Row:
    n, d, v = (48, 32, 512) if quick else (8 * 127, 512, 8192)
    g = torch.Generator().manual_seed(0)
    h = torch.randn(n, d, generator=g, requires_grad=True)
    w = (torch.randn(v, d, generator=g) * 0.02).requires_grad_()
    t = torch.randint(0, v, (n,), generator=g)

    def step(f):
        def run():
            h.grad = w.grad = None
            f().backward()

        return run

    impls = {
        "eager": lambda: F.cross_entropy(F.linear(h, w), t),
        "sublayer": lambda: linear_cross_entropy(h, w, t),
        "sublayer grad_in_forward": lambda: linear_cross_entropy(h, w, t, grad_in_forward=True),
    }
    res = time_interleaved({k: step(f) for k, f in impls.items()}, reps, warmup)
    row = Row("LM head: fused linear + cross-entropy", f"{n}x{d} vocab {v}", "fp32", "training").fill(res)
    saved = {k: saved_bytes(f, [w]) for k, f in impls.items()}
    # and the gradients a grad_in_forward loss holds for its backward (not seen by saved-tensor hooks)
    held = getattr(impls["sublayer grad_in_forward"]().grad_fn, "grads", ()) or ()
    saved["sublayer grad_in_forward"] += sum(t.untyped_storage().nbytes() for t in held if t is not None)
    row.extra |= {f"saved MiB {k}": round(b / 2**20, 2) for k, b in saved.items()}
    row.extra["saved ratio"] = round(saved["sublayer"] / saved["eager"], 3)
    row.extra["saved ratio grad_in_forward"] = round(saved["sublayer grad_in_forward"] / saved["eager"], 3)
    row.extra["x grad_in_forward"] = round(row.ratio("sublayer grad_in_forward"), 2)
    if not quick:  # GPT-2's head, 4 x 256 tokens (1020 targets after the shift)
        n2, d2, v2 = 4 * 255, 768, 50257
        h2 = torch.randn(n2, d2, requires_grad=True)
        w2 = (torch.randn(v2, d2) * 0.02).requires_grad_()
        t2 = torch.randint(0, v2, (n2,))
        e2 = saved_bytes(lambda: F.cross_entropy(F.linear(h2, w2), t2), [w2])
        s2 = saved_bytes(lambda: linear_cross_entropy(h2, w2, t2), [w2])
        row.extra["saved ratio @ vocab 50257 d 768 4x256"] = round(s2 / e2, 4)
    return row


def bench_gpt2_loss_step(quick: bool, reps: int, warmup: int) -> Row:
    cfg = GPT2Config(**dict(vocab_size=512, max_positions=16, d_model=32, n_layers=2, n_heads=4) if quick else
                     dict(vocab_size=8192, max_positions=128, d_model=512, n_layers=6, n_heads=8))  # fmt: skip
    b, t, lo = (2, 16, 4) if quick else (8, 128, 32)
    torch.manual_seed(0)
    eager, ours = GPT2(cfg).train(), GPT2(cfg).train()
    ours.load_state_dict(eager.state_dict())
    ids, mask = padded_batch(b, t, lo, cfg.vocab_size, seed=1)
    labels = ids.masked_fill(mask == 0, -100)

    def eager_loss(m):
        logits = m(ids, attention_mask=mask)
        return F.cross_entropy(logits[:, :-1].flatten(0, 1), labels[:, 1:].flatten())

    def fused_loss(m):
        return m.loss(ids, attention_mask=mask)

    fns = {"eager": adamw_step(eager, lambda: eager_loss(eager)),
           "sublayer": adamw_step(ours, lambda: fused_loss(ours))}  # fmt: skip
    res = time_interleaved(fns, reps, warmup)
    shape = f"{cfg.n_layers}L d{cfg.d_model} vocab {cfg.vocab_size} {b}x{t}"
    row = Row("GPT-2 train step: GPT2.loss vs logits + F.cross_entropy", shape, "fp32", "training").fill(res)
    row.extra["real tokens"] = f"{int(mask.sum())}/{b * t}"
    row.extra["dropout"] = cfg.dropout
    for name, loss in (("eager", eager_loss), ("sublayer", fused_loss)):  # both on the eager model's weights
        row.extra[f"saved MiB {name}"] = round(saved_bytes(lambda: loss(eager), list(eager.parameters())) / 2**20, 3)
    return row


def bench_loss(quick: bool, reps: int, warmup: int) -> list[Row]:
    """Both rows (see the module doc)."""
    return [bench_lm_head(quick, reps, warmup), bench_gpt2_loss_step(quick, reps, warmup)]


def main(argv: list[str] | None = None) -> None:
    import argparse

    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--quick", action="store_true")
    ap.add_argument("--reps", type=int, default=None)
    a = ap.parse_args(argv)
    reps = a.reps or (3 if a.quick else 5)
    for r in bench_loss(a.quick, reps, 1):
        times = "  ".join(f"{k} {v:.1f} ms" for k, v in r.times_ms.items())
        print(f"{r.case} [{r.shape}]: {times}  x{r.ratio():.2f}  {r.extra}")


if __name__ == "__main__":
    main()
