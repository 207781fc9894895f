"""The demo's training loop: data-parallel aware, resumable, Ctrl-C saves a checkpoint."""

from __future__ import annotations

import contextlib
import dataclasses
import functools
import time
from collections.abc import Callable, Iterator
from pathlib import Path

import torch
from torch import Tensor, nn

from .._checks import check_positive_int
from ..models.transformer import Transformer
from ..checkpoints.io import CheckpointError
from ..runtime.rows import eval_mode
from .checkpoint import STATE_NAME, load_optimizer, load_checkpoint, save_checkpoint
from .config import DemoConfig, demo_threads
from .signals import hold_signals, interrupts_raise
from .report import echo, finish_run
from .task import Batch, Vocab, collate, held_out_pairs, train_batch


class LMLoss(nn.Module):
    """Routes ``model.loss`` (the fused LM head + cross-entropy: no (B, T, vocab) logits kept for backward) through
    ``forward``, the keyword arguments ``fixed`` added to every call, so a wrapper such as DistributedDataParallel
    sees the call."""

    def __init__(self, model: nn.Module, **fixed) -> None:
        super().__init__()
        self.model, self.fixed = model, fixed

    def forward(self, *args, **kw) -> Tensor:
        return self.model.loss(*args, **self.fixed, **kw)


TransformerLoss = functools.partial(LMLoss, ignore_index=0)  # the demo's Transformer: pad id 0 is ignored


def batch_loss(net: nn.Module, batch: Batch, label_smoothing: float, reduction: str = "sum") -> Tensor:
    """``net``: a :data:`TransformerLoss` (possibly wrapped, e.g. by DDP)."""
    return net(batch.src, batch.tgt_in, batch.tgt_out, src_key_padding_mask=batch.src_mask,
               label_smoothing=label_smoothing, reduction=reduction)  # fmt: skip


@torch.no_grad()
def _val_loss(model: Transformer, batch: Batch) -> float:
    with eval_mode(model):
        return float(batch_loss(TransformerLoss(model), batch, 0.0, "mean"))


def progress_bar(enabled: bool, total: int, start: int, title: str = "training"):
    """A rich ``Progress`` bar (loss, validation, tokens/s, ETA) on rank 0, disabled when quiet, with its one task
    (``total`` steps, ``start`` done)."""
    from rich.progress import (BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn,
                               TimeRemainingColumn)  # fmt: skip

    bar = Progress(
        TextColumn(f"[bold]{title}"), BarColumn(), MofNCompleteColumn(),
        TextColumn("loss {task.fields[loss]:.3f}  val {task.fields[val]}  {task.fields[tps]:,.0f} tok/s"),
        TimeElapsedColumn(), TextColumn("ETA"), TimeRemainingColumn(), disable=not enabled,
    )  # fmt: skip
    bar.add_task("train", total=total, completed=start, loss=float("nan"), val="–", tps=0.0)
    return bar


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
    out = check_start(cfg, rank, world_size, "world_size")
    with torch_threads(cfg.threads or demo_threads()[0]):
        return _train(cfg, rank, world_size, wrap_model, on_step, rank == 0, cfg.quiet or rank != 0, out)


def check_start(cfg, rank: int, world_size: int, group: str) -> Path:
    """``cfg.out`` as a Path, after checking ``rank``/``world_size`` (``cfg.batch_size`` divisible by it, named
    ``group`` in the message), that ``cfg.out`` is not a file, that a run that resumes finds a checkpoint and that
    a run that neither resumes nor overwrites finds no earlier one."""
    check_positive_int("world_size", world_size)
    if isinstance(rank, bool) or not isinstance(rank, int) or not 0 <= rank < world_size:
        raise ValueError(f"rank must be an int in [0, {world_size}), got {rank!r}")
    if cfg.batch_size % world_size:
        raise ValueError(f"batch_size ({cfg.batch_size}) must be divisible by {group} ({world_size})")
    out = Path(cfg.out)
    if out.exists() and not out.is_dir():
        raise ValueError(f"out {str(out)!r} is a file: give a folder, new or existing")
    if cfg.resume and not (out / STATE_NAME).is_file():
        raise FileNotFoundError(f"--resume: no checkpoint in {out} ({STATE_NAME} missing)")
    if not cfg.resume and not cfg.overwrite and (out / STATE_NAME).exists():
        raise FileExistsError(
            f"{out} holds the checkpoint of an earlier run ({STATE_NAME}): continue it with --resume, replace it "
            "with --overwrite, or give another --out"
        )
    return out


# the demo's settings a resumed run keeps: the model's (it comes from the checkpoint) and the data order's
RESUME_KEEPS = ("seed", "batch_size", "d_model", "n_heads", "d_ff", "n_layers", "dropout", "norm_first")


def check_kept(
    cfg, saved: object, names: tuple[str, ...], out: Path, *,
    keeps: str = "the model and the data order it started with", required: str | None = None,
) -> None:  # fmt: skip
    """ValueError naming the first of ``names`` whose value in ``cfg`` differs from ``saved`` (the settings the
    checkpoint in ``out`` was trained with; not a dict: nothing to compare): a resumed run keeps ``keeps``. A value
    None in ``cfg`` takes the checkpoint's. A name missing from ``saved`` is skipped, or with ``required`` (the
    name of ``saved`` in the trainer state) a CheckpointError naming the trainer state file."""
    if not isinstance(saved, dict):
        return
    for name in names:
        if name not in saved:
            if required is not None:
                raise CheckpointError(f"trainer state {out / STATE_NAME} is not valid: {required} lacks {name!r}")
            continue
        given = getattr(cfg, name)
        if given is not None and given != saved[name]:
            raise ValueError(f"{name} ({given!r}) differs from the checkpoint's ({saved[name]!r}) in {out}: a resumed "
                             f"run keeps {keeps}")  # fmt: skip


@contextlib.contextmanager
def torch_threads(n: int | None) -> Iterator[None]:
    """torch's thread count set to ``n`` (None: left as it is) inside the block, restored after it."""
    old = torch.get_num_threads()
    if n is not None:
        torch.set_num_threads(n)
    try:
        yield
    finally:
        torch.set_num_threads(old)


def optimizer_steps(opt: torch.optim.Optimizer) -> int:
    """How many updates the optimizer has made (AdamW's per-parameter ``step`` counters; 0 before the first)."""
    return max((int(s["step"]) for s in opt.state.values() if "step" in s), default=0)


def adamw(model: nn.Module, lr: float, weight_decay: float, **kw) -> torch.optim.AdamW:
    """AdamW over the trainable parameters, with weight decay on the matrices only (not on biases and gains)."""
    params = [p for p in model.parameters() if p.requires_grad]
    return torch.optim.AdamW(
        [{"params": [p for p in params if p.dim() >= 2], "weight_decay": weight_decay},
         {"params": [p for p in params if p.dim() < 2], "weight_decay": 0.0}],
        lr=lr, **kw,
    )  # fmt: skip


@dataclasses.dataclass
class Run:
    """Where a training run stands, as its checkpoint keeps it: ``step`` updates done, ``history`` (``train`` and
    ``val`` lists of ``[step, loss]``), ``train_seconds``, ``tokens_seen``, and ``rng``: torch's RNG state at the
    start of step ``step`` (whatever point of a step an interrupt hits)."""

    step: int = 0
    history: dict = dataclasses.field(default_factory=lambda: {"train": [], "val": []})
    train_seconds: float = 0.0
    tokens_seen: int = 0
    rng: Tensor | None = None

    @classmethod
    def resumed(cls, state: dict, steps: int, out: Path) -> Run:
        """Where the checkpoint in ``out`` (its trainer ``state``) stands; ValueError when it is past ``steps``."""
        run = cls(state["step"], state["history"], state["train_seconds"], state["tokens_seen"])
        if run.step > steps:
            raise ValueError(f"steps ({steps}): the checkpoint in {out} is at step {run.step} already: nothing to "
                             "train (give a larger --steps to continue)")  # fmt: skip
        return run

    def state(self, **extra) -> dict:
        """The checkpoint's ``trainer_state.json`` fields, ``extra`` after them."""
        return {"step": self.step, "history": self.history, "train_seconds": self.train_seconds,
                "tokens_seen": self.tokens_seen, **extra}  # fmt: skip


def run_steps(run: Run, steps: int, model: nn.Module, opt: torch.optim.Optimizer, one_step: Callable[[int], tuple],
              *, lr_at: Callable[[int], float], clip_norm: float, eval_every: int, validate: Callable[[], float | None],
              val_text: Callable[[float], str], save_every: int, checkpoint: Callable[[], None],
              on_step: Callable[[int, dict], None] | None, main: bool, quiet: bool, out: Path) -> None:  # fmt: skip
    """The training loop of ``sublayer demo`` and ``sublayer train``, from ``run.step`` to ``steps``.

    Each step sets ``lr_at(step)``, runs ``one_step(step)`` (forward and backward; returns the step's loss and
    tokens), clips the gradient norm and updates. On rank 0 (``main``): ``validate()`` (a loss, or None: none)
    every ``eval_every`` steps and at the end, shown by ``val_text``; the progress bar; ``checkpoint()`` every
    ``save_every`` steps, at the end, and on an interrupt, which is raised again. ``on_step`` as :func:`train`'s.
    """
    run.rng = torch.get_rng_state()
    model.train()
    try:
        with interrupts_raise(), progress_bar(not quiet, steps, run.step) as bar:
            (task,) = bar.task_ids
            t_last = time.perf_counter()
            while run.step < steps:
                t0 = time.perf_counter()
                lr = lr_at(run.step)
                for g in opt.param_groups:
                    g["lr"] = lr
                loss, tokens = one_step(run.step)
                torch.nn.utils.clip_grad_norm_(model.parameters(), clip_norm)
                # The step lands whole or not at all: signals are held until its bookkeeping (validation
                # included) is done, and an interrupt raised as the update returns still counts the step
                # (AdamW's counter says it landed).
                val = None
                with hold_signals():
                    try:
                        opt.step()
                    finally:
                        if optimizer_steps(opt) > run.step:
                            opt.zero_grad(set_to_none=True)
                            run.step += 1
                            run.history["train"].append([run.step, loss])
                            run.rng = torch.get_rng_state()
                    if main and (run.step % eval_every == 0 or run.step == steps):
                        val = validate()
                        if val is not None:
                            run.history["val"].append([run.step, val])
                run.train_seconds += time.perf_counter() - t0
                run.tokens_seen += tokens
                if on_step is not None:
                    on_step(run.step, {"loss": loss, "lr": lr, "tokens": tokens})
                if main:
                    fields = {"completed": run.step, "loss": loss}
                    if val is not None:
                        fields["val"] = val_text(val)
                    if time.perf_counter() - t_last > 0.5 or run.step == steps:
                        # the run's mean, as the summary's (a recent window swings with the machine's load)
                        fields["tps"] = run.tokens_seen / max(run.train_seconds, 1e-9)
                        t_last = time.perf_counter()
                    bar.update(task, **fields)
                    if run.step % save_every == 0 and run.step < steps:
                        checkpoint()
    except KeyboardInterrupt as e:
        if main:
            checkpoint()
            why = f" by {e}" if str(e).startswith("SIG") else ""
            echo(False, f"interrupted{why} at step {run.step}: checkpoint saved in {out}/ — continue with --resume")
        raise
    if main:
        checkpoint()


def run_rank(train_fn: Callable, rank: int, world_size: int, cfg) -> None:
    """One rank of a training command: ``train_fn(cfg)`` alone, or data-parallel with DistributedDataParallel."""
    from ..memory import set_memory_reuse

    set_memory_reuse()  # a spawned rank is a fresh process
    if world_size == 1:
        train_fn(cfg)
        return
    from torch.nn.parallel import DistributedDataParallel

    train_fn(cfg, rank=rank, world_size=world_size, wrap_model=DistributedDataParallel)


def _train(cfg, rank, world_size, wrap_model, on_step, main, quiet, out) -> dict | None:
    vocab = Vocab.default()
    run = Run()
    if cfg.resume:
        model, vocab, state = load_checkpoint(out)
        check_kept(cfg, state.get("demo_config"), RESUME_KEEPS, out)
        run = Run.resumed(state, cfg.steps, out)
    else:
        torch.manual_seed(cfg.seed)  # the same initial weights on every rank
        model = Transformer.from_config(cfg.model_config(len(vocab)))
    opt = adamw(model, cfg.lr, cfg.weight_decay, betas=(0.9, 0.98), eps=1e-9)
    if cfg.resume:
        load_optimizer(out, opt, state["param_groups"], run.step)
    net = wrap_model(TransformerLoss(model))
    val_batch = collate(held_out_pairs(cfg.seed, cfg.n_val, salt=1), vocab)

    def one_step(step: int) -> tuple[float, int]:
        batch = train_batch(cfg.seed, step, cfg.batch_size, vocab)
        local = batch.rows(slice(rank, None, world_size))
        loss_sum = batch_loss(net, local, cfg.label_smoothing)
        # sum over this rank's tokens / global tokens · world_size: averaged over ranks = global mean
        (loss_sum * (world_size / batch.n_target_tokens)).backward()
        return float(loss_sum.detach()) / max(1, local.n_target_tokens), batch.n_tokens

    def checkpoint() -> None:
        save_checkpoint(out, model, opt, vocab, run.state(demo_config=dataclasses.asdict(cfg)), rng_state=run.rng)

    if main:
        out.mkdir(parents=True, exist_ok=True)
        n_params = sum(p.numel() for p in model.parameters())
        what = f"resuming at step {run.step}" if cfg.resume else "training"
        echo(quiet, f"[bold]sublayer demo[/]: numbers in words ↔ digits; {what} a {n_params / 1e3:.0f}k-parameter "
                     f"Transformer for {cfg.steps} steps on {torch.get_num_threads()} thread(s) → {out}/")  # fmt: skip

    run_steps(run, cfg.steps, model, opt, one_step, lr_at=cfg.lr_at, clip_norm=cfg.clip_norm, eval_every=cfg.eval_every,
              validate=lambda: _val_loss(model, val_batch), val_text="{:.3f}".format, save_every=cfg.save_every,
              checkpoint=checkpoint, on_step=on_step, main=main, quiet=quiet, out=out)  # fmt: skip
    if not main:
        return None
    return finish_run(cfg, model, vocab, run.history, run.step, run.train_seconds, run.tokens_seen, out, quiet)
