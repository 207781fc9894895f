"""The demo run's settings (:class:`DemoConfig`) and its learning-rate schedule."""

from __future__ import annotations

import dataclasses
import math

from .. import settings
from .._checks import check_positive_int, check_probability
from ..models.transformer import TransformerConfig


@dataclasses.dataclass
class DemoConfig:
    """Settings of the demo run (the model's sizes included). Defaults train the task in minutes on a
    small CPU (the run reports its held-out exact match).

    ``threads``: torch threads per process; None -> :func:`demo_threads` (1 unless ``SUBLAYER_THREADS`` says
    otherwise). The model is small (d_model 128): its matrix products gain nothing from a second thread, whose
    barriers cost more than they save (``sublayer bench --jobs --only demo`` measures it), and far more when
    another busy process shares the cores. ``overwrite``: a run that does not ``resume`` replaces an earlier run's
    checkpoint in ``out`` only with it (else :func:`~sublayer.demo.train` refuses).
    """

    out: str = "runs/demo"
    steps: int = 1200
    batch_size: int = 96
    seed: int = 0
    resume: bool = False
    lr: float = 1e-3
    warmup: int = 100
    min_lr_ratio: float = 0.05
    weight_decay: float = 0.01
    clip_norm: float = 1.0
    label_smoothing: float = 0.0
    d_model: int = 128
    n_heads: int = 4
    d_ff: int = 256
    n_layers: int = 2
    dropout: float = 0.0
    norm_first: bool = True
    eval_every: int = 100
    save_every: int = 500
    n_val: int = 256
    n_test: int = 1000
    threads: int | None = None
    quiet: bool = False
    overwrite: bool = False

    def __post_init__(self) -> None:
        for name in ("steps", "batch_size", "warmup", "eval_every", "save_every", "n_val", "n_test"):
            check_positive_int(name, getattr(self, name))
        check_positive_int("threads", self.threads, allow_none=True)
        if isinstance(self.seed, bool) or not isinstance(self.seed, int) or not 0 <= self.seed < 2**63:
            raise ValueError(f"seed must be an int in [0, 2**63), got {self.seed!r}")  # torch.manual_seed's range
        for name in ("label_smoothing", "min_lr_ratio"):
            check_probability(name, getattr(self, name))
        for name in ("lr", "clip_norm"):
            v = getattr(self, name)
            if isinstance(v, bool) or not isinstance(v, (int, float)) or not v > 0:
                raise ValueError(f"{name} must be a positive number, got {v!r}")
        self.model_config(1)  # the model's settings, checked by TransformerConfig

    def model_config(self, vocab_size: int) -> TransformerConfig:
        return TransformerConfig(
            src_vocab_size=vocab_size, tgt_vocab_size=vocab_size, d_model=self.d_model, n_heads=self.n_heads,
            d_ff=self.d_ff, n_layers=self.n_layers, dropout=self.dropout, max_len=32, norm_first=self.norm_first,
        )  # fmt: skip

    def lr_at(self, step: int) -> float:
        """Linear warm-up over ``warmup`` steps, then cosine decay to ``min_lr_ratio · lr`` at ``steps``."""
        return warmup_cosine(step, self.steps, self.warmup, self.lr, self.min_lr_ratio)


def warmup_cosine(step: int, steps: int, warmup: int, lr: float, min_lr_ratio: float) -> float:
    """:meth:`DemoConfig.lr_at` with the settings as arguments (``sublayer train``'s schedule too)."""
    if step < warmup:
        return lr * (step + 1) / warmup
    t = min(1.0, (step - warmup) / max(1, steps - warmup))
    return lr * (min_lr_ratio + (1 - min_lr_ratio) * 0.5 * (1 + math.cos(math.pi * t)))


def demo_threads() -> tuple[int, str]:
    """The demo's threads per process and why: ``SUBLAYER_THREADS`` when set, else 1 (its model is small)."""
    n = settings.threads()
    return (n, "SUBLAYER_THREADS") if n is not None else (1, "the demo's model is small: one thread per process")
