"""The demo's training loop: data-parallel aware, resumable, Ctrl-C saves a checkpoint."""

from __future__ import annotations

import dataclasses
import time
from collections.abc import Callable
from pathlib import Path

import torch
from torch import Tensor, nn

from .._checks import check_positive_int
from ..models.transformer import Transformer
from .checkpoint import STATE_NAME, load_optimizer, load_checkpoint, save_checkpoint
from .config import demo_threads
from .config import DemoConfig
from .signals import hold_signals, interrupts_raise
from .report import finish_run
from .task import Batch, Vocab, collate, held_out_pairs, train_batch


class TransformerLoss(nn.Module):
    """Routes ``Transformer.loss`` (the fused LM-head + cross-entropy: no (B, T, vocab) logits kept for backward)
    through ``forward``, so a wrapper such as DistributedDataParallel sees the call. Pad id 0 is ignored."""

    def __init__(self, model: Transformer) -> None:
        super().__init__()
        self.model = model

    def forward(self, src: Tensor, tgt_in: Tensor, tgt_out: Tensor, **kw) -> Tensor:
        return self.model.loss(src, tgt_in, tgt_out, ignore_index=0, **kw)


def batch_loss(net: nn.Module, batch: Batch, label_smoothing: float, reduction: str = "sum") -> Tensor:
    """``net``: a :class:`TransformerLoss` (possibly wrapped, e.g. by DDP)."""
    return net(batch.src, batch.tgt_in, batch.tgt_out, src_key_padding_mask=batch.src_mask,
               label_smoothing=label_smoothing, reduction=reduction)  # fmt: skip


@torch.no_grad()
def _val_loss(model: Transformer, batch: Batch) -> float:
    was = model.training
    model.eval()
    try:
        return float(batch_loss(TransformerLoss(model), batch, 0.0, "mean"))
    finally:
        model.train(was)


class Progress:
    """A rich progress bar (loss, validation, tokens/s, ETA) on rank 0; nothing when quiet."""

    def __init__(self, enabled: bool, total: int, start: int, title: str = "training") -> None:
        self.bar = None
        if not enabled:
            return
        from rich.progress import (BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn,
                                   TimeRemainingColumn)  # fmt: skip

        self.bar = Progress(
            TextColumn(f"[bold]{title}"), BarColumn(), MofNCompleteColumn(),
            TextColumn("loss {task.fields[loss]:.3f}  val {task.fields[val]}  {task.fields[tps]:,.0f} tok/s"),
            TimeElapsedColumn(), TextColumn("ETA"), TimeRemainingColumn(),
        )  # fmt: skip
        self.task = self.bar.add_task("train", total=total, completed=start, loss=float("nan"), val="–", tps=0.0)

    def __enter__(self):
        if self.bar is not None:
            self.bar.__enter__()
        return self

    def __exit__(self, *exc):
        if self.bar is not None:
            self.bar.__exit__(*exc)

    def update(self, **fields) -> None:
        if self.bar is not None:
            self.bar.update(self.task, **fields)


def echo(quiet: bool, text: str) -> None:
    if not quiet:
        from rich.console import Console

        Console(highlight=False).print(text)


def train(
    cfg: DemoConfig,
    *,
    rank: int = 0,
    world_size: int = 1,
    wrap_model: Callable[[nn.Module], nn.Module] = lambda m: m,
    on_step: Callable[[int, dict], None] | None = None,
) -> dict | None:
    """Train (or resume), evaluate and write the outputs of the demo.

    Args:
        cfg: the run's settings. rank, world_size: this process's place in a data-parallel group; each rank
            keeps rows ``rank::world_size`` of every global batch (``cfg.batch_size`` must divide evenly).
        wrap_model: applied to the model before training (e.g. ``DistributedDataParallel``, which must average
            gradients over ranks); evaluation uses the unwrapped model.
        on_step: called on every rank after each optimizer step with ``(step, {"loss", "lr", "tokens"})``.

    Returns:
        The metrics dict on rank 0 (also written to ``metrics.json``), None on other ranks.

    Raises:
        ValueError: bad rank/world_size; FileNotFoundError: ``--resume`` without a checkpoint;
        FileExistsError: ``cfg.out`` holds an earlier run's checkpoint and neither ``resume`` nor ``overwrite``.
        KeyboardInterrupt: after saving a checkpoint of the steps done so far (rank 0).
    """
    check_positive_int("world_size", world_size)
    if isinstance(rank, bool) or not isinstance(rank, int) or not 0 <= rank < world_size:
        raise ValueError(f"rank must be an int in [0, {world_size}), got {rank!r}")
    if cfg.batch_size % world_size:
        raise ValueError(f"batch_size ({cfg.batch_size}) must be divisible by world_size ({world_size})")
    main = rank == 0
    quiet = cfg.quiet or not main
    out = Path(cfg.out)
    if not cfg.resume and not cfg.overwrite and (out / STATE_NAME).exists():
        raise FileExistsError(
            f"{out} holds the checkpoint of an earlier run ({STATE_NAME}): continue it with --resume, replace it "
            "with --overwrite, or give another --out"
        )
    old_threads = torch.get_num_threads()
    torch.set_num_threads(cfg.threads or demo_threads()[0])
    try:
        return _train(cfg, rank, world_size, wrap_model, on_step, main, quiet, out)
    finally:
        torch.set_num_threads(old_threads)


def optimizer_steps(opt: torch.optim.Optimizer) -> int:
    """How many updates the optimizer has made (AdamW's per-parameter ``step`` counters; 0 before the first)."""
    return max((int(s["step"]) for s in opt.state.values() if "step" in s), default=0)


def _train(cfg, rank, world_size, wrap_model, on_step, main, quiet, out) -> dict | None:
    vocab = Vocab.default()
    history: dict[str, list] = {"train": [], "val": []}
    start, train_seconds, tokens_seen = 0, 0.0, 0
    if cfg.resume:
        if not (out / STATE_NAME).is_file():
            raise FileNotFoundError(f"--resume: no checkpoint in {out} ({STATE_NAME} missing)")
        model, vocab, state = load_checkpoint(out)
        start, history = state["step"], state["history"]
        train_seconds, tokens_seen = state["train_seconds"], state["tokens_seen"]
        if start > cfg.steps:
            raise ValueError(
                f"--resume: the checkpoint in {out} is at step {start}, past steps={cfg.steps}: nothing to train "
                f"(give a larger --steps to continue)"
            )
    else:
        torch.manual_seed(cfg.seed)  # the same initial weights on every rank
        model = Transformer.from_config(cfg.model_config(len(vocab)))
    params = [p for p in model.parameters() if p.requires_grad]
    decay = [p for p in params if p.dim() >= 2]
    no_decay = [p for p in params if p.dim() < 2]
    opt = torch.optim.AdamW(
        [{"params": decay, "weight_decay": cfg.weight_decay}, {"params": no_decay, "weight_decay": 0.0}],
        lr=cfg.lr, betas=(0.9, 0.98), eps=1e-9,
    )  # fmt: skip
    if cfg.resume:
        load_optimizer(out, opt, state["param_groups"])
    net = wrap_model(TransformerLoss(model))
    val_batch = collate(held_out_pairs(cfg.seed, cfg.n_val, salt=1), vocab)

    # the state at the start of step `step`: what a checkpoint saves, whatever point of a step an interrupt hits
    rng = torch.get_rng_state()

    def checkpoint(step: int) -> None:
        if main:
            state = {"step": step, "history": history, "train_seconds": train_seconds, "tokens_seen": tokens_seen,
                     "demo_config": dataclasses.asdict(cfg)}  # fmt: skip
            save_checkpoint(out, model, opt, vocab, state, rng_state=rng)

    if main:
        out.mkdir(parents=True, exist_ok=True)
        n_params = sum(p.numel() for p in model.parameters())
        what = f"resuming at step {start}" if cfg.resume else "training"
        echo(quiet, f"[bold]sublayer demo[/]: numbers in words ↔ digits; {what} a {n_params / 1e3:.0f}k-parameter "
                     f"Transformer for {cfg.steps} steps on {torch.get_num_threads()} thread(s) → {out}/")  # fmt: skip

    step = start
    model.train()
    try:
        with interrupts_raise(), Progress(not quiet, cfg.steps, start) as bar:
            t_last = time.perf_counter()
            while step < cfg.steps:
                t0 = time.perf_counter()
                batch = train_batch(cfg.seed, step, cfg.batch_size, vocab)
                n_global = batch.n_target_tokens
                local = batch.rows(slice(rank, None, world_size))
                lr = cfg.lr_at(step)
                for g in opt.param_groups:
                    g["lr"] = lr
                loss_sum = batch_loss(net, local, cfg.label_smoothing)
                # sum over this rank's tokens / global tokens · world_size: averaged over ranks = global mean
                (loss_sum * (world_size / n_global)).backward()
                torch.nn.utils.clip_grad_norm_(model.parameters(), cfg.clip_norm)
                loss = float(loss_sum.detach()) / max(1, local.n_target_tokens)
                # The step lands whole or not at all: signals are held until its bookkeeping (validation
                # included) is done, and an interrupt raised as the update returns still counts the step
                # (AdamW's counter says it landed).
                val = None
                with hold_signals():
                    try:
                        opt.step()
                    finally:
                        if optimizer_steps(opt) > step:
                            opt.zero_grad(set_to_none=True)
                            step += 1
                            history["train"].append([step, loss])
                            rng = torch.get_rng_state()
                    if main and (step % cfg.eval_every == 0 or step == cfg.steps):
                        val = _val_loss(model, val_batch)
                        history["val"].append([step, val])
                dt = time.perf_counter() - t0
                train_seconds += dt
                tokens_seen += batch.n_tokens
                if on_step is not None:
                    on_step(step, {"loss": loss, "lr": lr, "tokens": batch.n_tokens})
                if main:
                    fields = {"completed": step, "loss": loss}
                    if val is not None:
                        fields["val"] = f"{val:.3f}"
                    if time.perf_counter() - t_last > 0.5 or step == cfg.steps:
                        # the run's mean, as the summary's (a recent window swings with the machine's load)
                        fields["tps"] = tokens_seen / max(train_seconds, 1e-9)
                        t_last = time.perf_counter()
                    bar.update(**fields)
                    if step % cfg.save_every == 0 and step < cfg.steps:
                        checkpoint(step)
    except KeyboardInterrupt as e:
        if main:
            checkpoint(step)
            why = f" by {e}" if str(e).startswith("SIG") else ""
            echo(False, f"interrupted{why} at step {step}: checkpoint saved in {out}/ — continue with --resume")
        raise
    if not main:
        return None
    checkpoint(step)
    return finish_run(cfg, model, vocab, history, step, train_seconds, tokens_seen, out, quiet)
