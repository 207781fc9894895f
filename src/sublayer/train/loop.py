"""``sublayer train``'s settings (:class:`TrainConfig`) and loop (:func:`train`): resumable, data-parallel aware,
Ctrl-C saves a checkpoint (the demo's machinery: :mod:`sublayer.demo.checkpoint`, :mod:`sublayer.demo.signals`)."""

from __future__ import annotations

import dataclasses
import json
import math
import shutil
from collections.abc import Callable
from pathlib import Path

import torch
from torch import nn

from .._checks import check_positive_int, check_probability
from ..demo.config import warmup_cosine
from ..demo.checkpoint import STATE_NAME, load_optimizer, read_training_state, save_checkpoint, write_text
from ..demo.plots import plot_losses
from ..demo.report import echo
from ..demo.signals import hold_signals
from ..demo.training import LMLoss, Run, adamw, check_kept, check_start, run_rank, run_steps, torch_threads
from ..runtime.rows import eval_mode
from ..text import causal_lm_class
from . import data as D
from .starter import STARTERS, save_tokenizer, starter_model

# the tokenizer files of a Hugging Face folder, copied next to the trained weights
TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "special_tokens_map.json", "vocab.json", "merges.txt",
                   "tokenizer.model", "added_tokens.json", "chat_template.jinja")  # fmt: skip
# settings that decide which rows each step trains on: a resumed run must keep them
DATA_ORDER = ("seq_len", "batch_size", "seed", "val_fraction", "split")


@dataclasses.dataclass
class TrainConfig:
    """Settings of ``sublayer train`` (each field is the flag of the same name).

    ``model``: a Hugging Face GPT-2, Llama or Qwen2 folder with ``tokenizer.json`` (fine-tuning), or
    ``builtin:gpt2-tiny`` / ``builtin:llama-tiny`` (:mod:`.starter`: from scratch). ``data``: a text file, a
    folder of ``.txt``/``.md`` files or ``builtin:numbers`` (:mod:`.data`). ``steps`` or ``epochs`` (neither: one
    epoch). ``seq_len``: None -> the model's positions, at most 256. ``lr``: None -> 1e-3 from scratch, 5e-5
    fine-tuning; linear warm-up over ``warmup`` steps (None: a tenth of the run, at most 100), then cosine decay
    to ``min_lr_ratio · lr``. ``val_fraction``: the documents held out for the perplexity, measured every
    ``eval_every`` steps (None: ten times a run) and at the end, when a checkpoint is also written.
    ``threads``: torch threads per process (None: 1 for a built-in model, whose small matrix products gain little
    from a second thread while spinning OpenMP threads collapse on a shared machine; else torch's default).
    """

    model: str
    data: str
    out: str = "runs/train"
    steps: int | None = None
    epochs: int | None = None
    batch_size: int = 8
    seq_len: int | None = None
    lr: float | None = None
    warmup: int | None = None
    min_lr_ratio: float = 0.1
    weight_decay: float = 0.01
    clip_norm: float = 1.0
    val_fraction: float = 0.05
    split: str = "paragraphs"
    eval_every: int | None = None
    seed: int = 0
    threads: int | None = None
    resume: bool = False
    overwrite: bool = False
    quiet: bool = False

    def __post_init__(self) -> None:
        for name in ("steps", "epochs", "seq_len", "warmup", "eval_every", "threads"):
            check_positive_int(name, getattr(self, name), allow_none=True)
        check_positive_int("batch_size", self.batch_size)
        if self.seq_len == 1:
            raise ValueError("seq_len must be at least 2 (a row's last token has no next one to predict), got 1")
        if self.steps is not None and self.epochs is not None:
            raise ValueError(f"steps ({self.steps}) and --epochs ({self.epochs}) exclude each other: give one")
        if isinstance(self.seed, bool) or not isinstance(self.seed, int) or not 0 <= self.seed < 2**63:
            raise ValueError(f"seed must be an int in [0, 2**63), got {self.seed!r}")
        for name in ("lr", "clip_norm"):
            v = getattr(self, name)
            if v is not None and (isinstance(v, bool) or not isinstance(v, (int, float)) or not v > 0):
                raise ValueError(f"{name} must be a positive number, got {v!r}")
        for name in ("min_lr_ratio", "weight_decay"):
            check_probability(name, getattr(self, name))
        v = self.val_fraction
        if isinstance(v, bool) or not isinstance(v, (int, float)) or not 0 <= v < 1:
            raise ValueError(f"val_fraction must be a number in [0, 1), got {v!r}")
        if self.split not in D.SPLITS:
            raise ValueError(f"split must be one of {', '.join(D.SPLITS)}, got {self.split!r}")


def load_start(spec: str, seed: int):
    """``(model in train mode, tokenizer, tokenizer files to copy or None)`` from ``--model``: a built-in starter
    or a Hugging Face folder with ``tokenizer.json``."""
    from ..checkpoints import resolve_folder

    if spec.startswith("builtin:"):
        model, tokenizer = starter_model(spec[len("builtin:") :], seed=seed)
        return model.train(), tokenizer, None
    try:
        folder = resolve_folder(spec)
    except (FileNotFoundError, NotADirectoryError) as e:
        raise ValueError(f"model {spec!r}: {e}; or use one of {', '.join('builtin:' + s for s in STARTERS)}") from None
    model = causal_lm_class(folder, "train").from_pretrained(folder, dtype=torch.float32)
    return model.train(), read_tokenizer(folder), folder


def read_tokenizer(folder: Path):
    from tokenizers import Tokenizer

    path = folder / "tokenizer.json"
    if not path.is_file():
        raise ValueError(f"model {str(folder)!r} has no tokenizer.json: train tokenizes --data with the model's "
                         "tokenizer")  # fmt: skip
    try:
        return Tokenizer.from_file(str(path))
    except Exception as e:  # tokenizers raises a bare Exception on a malformed file
        raise ValueError(f"model {str(folder)!r}: cannot read {path}: {e}") from None


def eos_id(config) -> int:
    eos = config.eos_token_id
    eos = eos[0] if isinstance(eos, list) and eos else eos
    if eos is None:
        raise ValueError("model: config.json has no eos_token_id, and documents need an end token")
    return eos


@dataclasses.dataclass
class Data:
    """The packed training and held-out rows, with their document counts."""

    train: D.Rows
    val: D.Rows | None
    n_train_docs: int
    n_val_docs: int


def prepare_data(cfg: TrainConfig, tokenizer, config, seq_len: int) -> Data:
    docs = D.read_documents(cfg.data, split=cfg.split)
    ids = D.tokenize(tokenizer, docs, eos_id(config))
    top = max(max(d) for d in ids)
    if top >= config.vocab_size:
        raise ValueError(f"model {cfg.model!r}: its tokenizer gives id {top}, outside the vocabulary "
                         f"({config.vocab_size} ids)")  # fmt: skip
    val_idx = set(D.held_out(len(ids), cfg.val_fraction, cfg.seed))
    train_docs = [d for i, d in enumerate(ids) if i not in val_idx]
    val_docs = [d for i, d in enumerate(ids) if i in val_idx]
    pad = eos_id(config)
    val = D.pack_documents(val_docs, seq_len, pad_id=pad) if val_docs else None
    return Data(D.pack_documents(train_docs, seq_len, pad_id=pad), val, len(train_docs), len(val_docs))


@torch.no_grad()
def evaluate(model: nn.Module, rows: D.Rows, batch_size: int) -> float:
    """Mean next-token cross-entropy over every target of ``rows`` (eval mode; perplexity = exp of it)."""
    total, count = 0.0, 0
    with eval_mode(model):
        for i in range(0, len(rows), batch_size):
            part = rows[i : i + batch_size]
            n = part.n_targets
            if n:
                total += float(model.loss(part.input_ids, **part.loss_kwargs())) * n
                count += n
    return total / max(count, 1)


def _same_model(given: str, saved: str) -> bool:
    """Whether ``--model`` names the model a checkpoint was started from: the same built-in name, or the same folder
    however spelled (a relative path read from the current folder)."""
    if given == saved:
        return True
    if given.startswith("builtin:") or saved.startswith("builtin:"):
        return False
    return Path(given).expanduser().resolve() == Path(saved).expanduser().resolve()


def train(
    cfg: TrainConfig,
    *,
    rank: int = 0,
    world_size: int = 1,
    wrap_model: Callable[[nn.Module], nn.Module] = lambda m: m,
    on_step: Callable[[int, dict], None] | None = None,
) -> dict | None:
    """Train (or resume) a causal LM on text and write an HF folder, ``metrics.json`` and ``loss.png`` to ``out``.

    Args:
        cfg: the run's settings. rank, world_size: this process's place in a data-parallel group; each rank keeps
            rows ``rank::world_size`` of every global batch (``cfg.batch_size`` must divide evenly).
        wrap_model: applied to the :class:`LMLoss` before training (e.g. ``DistributedDataParallel``).
        on_step: called on every rank after each optimizer step with ``(step, {"loss", "lr", "tokens"})``.

    Returns:
        The metrics dict on rank 0 (also in ``metrics.json``), None on other ranks.

    Raises:
        ValueError: a bad setting, naming it; FileNotFoundError: ``resume`` without a checkpoint;
        FileExistsError: ``out`` holds an earlier run's checkpoint and neither ``resume`` nor ``overwrite``.
        KeyboardInterrupt: after saving a checkpoint of the steps done so far (rank 0).
    """
    out = check_start(cfg, rank, world_size, "--nproc")
    if not cfg.resume and out.exists() and Path(cfg.model).exists() and out.resolve() == Path(cfg.model).resolve():
        raise ValueError(f"out {str(out)!r} is the --model folder: give another folder for the trained model")
    with torch_threads(cfg.threads or (1 if cfg.model.startswith("builtin:") else None)):
        return _train(cfg, rank, world_size, wrap_model, on_step, out)


def _train(cfg: TrainConfig, rank, world_size, wrap_model, on_step, out: Path) -> dict | None:
    main = rank == 0
    quiet = cfg.quiet or not main
    if cfg.resume:
        state = read_training_state(out)
        if not isinstance(state.get("train_config"), dict):
            raise ValueError(f"--resume: {out / STATE_NAME} is not a checkpoint of sublayer train (no train_config)")
        saved_model = state["train_config"].get("model")
        if isinstance(saved_model, str) and not _same_model(cfg.model, saved_model):
            raise ValueError(f"model ({cfg.model!r}) differs from the checkpoint's ({saved_model!r}) in {out}: a "
                             "resumed run continues the model it started with")  # fmt: skip
        # (seq_len: None takes the checkpoint's)
        check_kept(cfg, state["train_config"], DATA_ORDER, out, keeps="its data order", required="train_config")
        model = causal_lm_class(out, "train").from_pretrained(out, dtype=torch.float32).train()
        tokenizer, source = read_tokenizer(out), None
        seq_len = state["train_config"]["seq_len"]
    else:
        torch.manual_seed(cfg.seed)
        model, tokenizer, source = load_start(cfg.model, cfg.seed)
        seq_len = cfg.seq_len or min(256, model.config.max_positions)
    if seq_len > model.config.max_positions:
        raise ValueError(f"seq_len ({seq_len}) must be at most the model's max_positions ({model.config.max_positions})")
    data = prepare_data(cfg, tokenizer, model.config, seq_len)
    fingerprint = data.train.fingerprint()
    n_rows = len(data.train)
    if n_rows < cfg.batch_size:
        raise ValueError(f"batch_size ({cfg.batch_size}) is more than the {n_rows} rows of {seq_len} tokens that "
                         f"--data packs into: give a smaller --batch-size or --seq-len")  # fmt: skip
    per_epoch = n_rows // cfg.batch_size
    steps = cfg.steps if cfg.steps is not None else per_epoch * (cfg.epochs or 1)
    warmup = cfg.warmup if cfg.warmup is not None else max(1, min(100, steps // 10))
    lr = cfg.lr if cfg.lr is not None else (1e-3 if cfg.model.startswith("builtin:") else 5e-5)
    eval_every = cfg.eval_every or max(1, steps // 10)
    settings = {**dataclasses.asdict(cfg), "seq_len": seq_len, "steps": steps, "lr": lr, "warmup": warmup}
    run = Run()
    if cfg.resume:
        if state.get("data") != fingerprint:
            raise ValueError(f"data {cfg.data!r} does not give the rows the checkpoint in {out} was trained on")
        run = Run.resumed(state, steps, out)
    opt = adamw(model, lr, cfg.weight_decay, betas=(0.9, 0.95))
    if cfg.resume:
        load_optimizer(out, opt, state["param_groups"], run.step)  # and torch's RNG state
    net = wrap_model(LMLoss(model))

    def one_step(step: int) -> tuple[float, int]:
        batch = data.train[D.batch_index(cfg.seed, step, n_rows, cfg.batch_size)]
        local = batch[rank::world_size]
        loss = net(local.input_ids, **local.loss_kwargs())
        # this rank's mean · its share of the targets · world_size: averaged over ranks = the global mean
        (loss * (local.n_targets * world_size / batch.n_targets)).backward()
        return float(loss.detach()), batch.n_tokens

    def checkpoint() -> None:
        save_checkpoint(out, model, opt, None, run.state(train_config=settings, data=fingerprint), run.rng)

    if main:
        out.mkdir(parents=True, exist_ok=True)
        if not cfg.resume:  # the tokenizer beside the weights: the starter's, or the --model folder's files
            with hold_signals():
                if source is None:
                    save_tokenizer(tokenizer, out, seq_len)
                for name in [n for n in TOKENIZER_FILES if source is not None and (source / n).is_file()]:
                    shutil.copyfile(source / name, out / name)
        n_params = sum(p.numel() for p in model.parameters())
        what = f"resuming at step {run.step} of" if cfg.resume else "training for"
        echo(quiet, f"[bold]sublayer train[/]: {type(model).__name__} ({n_params / 1e6:.2f}M parameters), "
                    f"{data.n_train_docs} documents in {n_rows} rows of {seq_len} tokens ({data.n_val_docs} held "
                    f"out); {what} {steps} steps ({steps / per_epoch:.2f} epochs) of {cfg.batch_size} rows on "
                    f"{torch.get_num_threads()} thread(s) × {world_size} → {out}/")  # fmt: skip

    run_steps(run, steps, model, opt, one_step, clip_norm=cfg.clip_norm, eval_every=eval_every,
              lr_at=lambda step: warmup_cosine(step, steps, warmup, lr, cfg.min_lr_ratio),
              validate=lambda: None if data.val is None else evaluate(model, data.val, cfg.batch_size),
              val_text=lambda val: f"{val:.3f} (ppl {math.exp(val):.1f})", save_every=eval_every,
              checkpoint=checkpoint, on_step=on_step, main=main, quiet=quiet, out=out)  # fmt: skip
    if not main:
        return None
    return _finish(cfg, model, data, run.history, run.step, run.train_seconds, run.tokens_seen, out, quiet)


def _finish(cfg, model, data: Data, history, step, train_seconds, tokens_seen, out: Path, quiet: bool) -> dict:
    val = history["val"][-1][1] if history["val"] and history["val"][-1][0] == step else None
    if val is None and data.val is not None:
        val = evaluate(model, data.val, cfg.batch_size)
    tail = [loss for _, loss in history["train"][-20:]]
    metrics = {
        "steps": step,
        "final_train_loss": sum(tail) / len(tail) if tail else None,
        "val_loss": val,
        "val_perplexity": None if val is None else math.exp(val),
        "n_train_documents": data.n_train_docs,
        "n_val_documents": data.n_val_docs,
        "train_seconds": round(train_seconds, 2),
        "tokens_per_second": round(tokens_seen / max(train_seconds, 1e-9), 1),
        "threads": torch.get_num_threads(),
        "torch": torch.__version__,
        "n_parameters": sum(p.numel() for p in model.parameters()),
        "model": type(model).__name__,
    }
    write_text(out / "metrics.json", json.dumps(metrics, indent=1) + "\n")
    plot_losses(history, out / "loss.png", title=f"sublayer train: {type(model).__name__} on {cfg.data}")
    held = "no held-out documents" if val is None else (
        f"held-out perplexity {math.exp(val):.2f} (loss {val:.3f}) on {data.n_val_docs} documents")  # fmt: skip
    echo(False, f"[bold]{held}[/]; {step} steps, {train_seconds:.0f} s training, "
                f"{metrics['tokens_per_second']:,.0f} tok/s")  # fmt: skip
    echo(quiet, f"wrote {out}/: a Hugging Face folder (config.json, model.safetensors, tokenizer), "
                f"metrics.json, loss.png — try: sublayer generate --model {out} \"some text\"")  # fmt: skip
    return metrics


def rank_main(rank: int, world_size: int, cfg: TrainConfig) -> None:
    """One rank of ``sublayer train`` (module level: it is pickled into the spawned processes)."""
    run_rank(train, rank, world_size, cfg)
