"""``sublayer demo``: train the encoder–decoder Transformer to translate numbers between English words and digits.

The task is generated in code: "three hundred forty-two thousand six" ↔ "342006", for 0 ≤ n < 1,000,000, in
both directions (a tag token at the start of the source picks the direction). It is real sequence-to-sequence
work: the output length differs from the input's, zeros appear that have no source word ("six" in the thousands
→ "006"), and the order of the digits follows the words only through "hundred" and "thousand".

Held-out numbers (one in ten of those ≥ 1000, chosen by a fixed hash) are never trained on, in either direction;
the exact-match accuracy is measured on them with greedy decoding.

Everything is written to ``--out`` (default ``runs/demo``): ``metrics.json``, ``loss.png`` (train and
validation loss), ``attention.png`` (cross-attention heatmaps of one sample, one panel per layer and head) and a
checkpoint (``model.safetensors`` + ``config.json``, ``vocab.json``, ``optimizer.safetensors`` +
``trainer_state.json`` for ``--resume``). Every file is written to a temporary name in the same folder and then
renamed, so an interrupted run (Ctrl-C) never leaves a half-written file.

:func:`train` is written for data parallelism: every rank draws the same global batch from ``(seed, step)`` and
keeps rows ``rank::world_size``; the loss is normalised by the global token count times ``world_size``, so
gradients averaged across ranks (as DDP does) equal the one-process gradient. Only rank 0 writes files and
shows progress.
"""

from __future__ import annotations

import contextlib
import dataclasses
import json
import math
import os
import random
import signal
import threading
import time
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from ._checks import check_positive_int, check_probability
from .checkpoints.io import atomic_write
from .models.transformer import Transformer, TransformerConfig

__all__ = [
    "DemoConfig",
    "Vocab",
    "number_to_words",
    "words_to_number",
    "make_pair",
    "is_held_out",
    "sample_numbers",
    "Batch",
    "collate",
    "train",
    "evaluate",
    "load_checkpoint",
]

# ---- the task ------------------------------------------------------------------------------------------------

ONES = ("zero one two three four five six seven eight nine ten eleven twelve thirteen fourteen fifteen sixteen "
        "seventeen eighteen nineteen").split()  # fmt: skip
TENS = "_ _ twenty thirty forty fifty sixty seventy eighty ninety".split()
PAD, BOS, EOS, UNK = "<pad>", "<bos>", "<eos>", "<unk>"
TO_DIGITS, TO_WORDS = "<to-digits>", "<to-words>"
DIRECTIONS = (TO_DIGITS, TO_WORDS)
MAX_NUMBER = 999_999


def _below_1000(n: int) -> list[str]:
    out: list[str] = []
    h, r = divmod(n, 100)
    if h:
        out += [ONES[h], "hundred"]
    if r >= 20:
        out.append(TENS[r // 10] + (f"-{ONES[r % 10]}" if r % 10 else ""))
    elif r:
        out.append(ONES[r])
    return out


def number_to_words(n: int) -> str:
    """English words for 0 ≤ n ≤ 999,999: ``342006`` -> ``"three hundred forty-two thousand six"``."""
    if isinstance(n, bool) or not isinstance(n, int) or not 0 <= n <= MAX_NUMBER:
        raise ValueError(f"n must be an int in [0, {MAX_NUMBER}], got {n!r}")
    if n == 0:
        return "zero"
    th, r = divmod(n, 1000)
    words = (_below_1000(th) + ["thousand"] if th else []) + _below_1000(r)
    return " ".join(words)


_WORD_VALUE = {w: i for i, w in enumerate(ONES)} | {w: 10 * i for i, w in enumerate(TENS) if i >= 2}


def words_to_number(text: str) -> int:
    """Inverse of :func:`number_to_words` (used to check the generator; raises ValueError on other text)."""
    total, cur = 0, 0
    for w in text.replace("-", " ").split():
        if w in _WORD_VALUE:
            cur += _WORD_VALUE[w]
        elif w == "hundred":
            cur *= 100
        elif w == "thousand":
            total, cur = (total + cur) * 1000, 0
        else:
            raise ValueError(f"not a number word: {w!r} in {text!r}")
    return total + cur


def _word_tokens(text: str) -> list[str]:
    return text.replace("-", " - ").split()


def _detokenize(tokens: Sequence[str]) -> str:
    if all(len(t) == 1 and t.isdigit() for t in tokens):
        return "".join(tokens)
    return " ".join(tokens).replace(" - ", "-")


def make_pair(n: int, direction: str) -> tuple[list[str], list[str]]:
    """(source tokens with the direction tag first, target tokens) for number ``n``."""
    words, digits = _word_tokens(number_to_words(n)), list(str(n))
    if direction == TO_DIGITS:
        return [TO_DIGITS, *words], digits
    if direction == TO_WORDS:
        return [TO_WORDS, *digits], words
    raise ValueError(f"direction must be one of {DIRECTIONS}, got {direction!r}")


class Vocab:
    """Token <-> id; one vocabulary for source and target. ``tokens[0]`` is the padding token."""

    def __init__(self, tokens: Sequence[str]) -> None:
        self.tokens = list(tokens)
        self.index = {t: i for i, t in enumerate(self.tokens)}
        if len(self.index) != len(self.tokens):
            raise ValueError("vocabulary tokens must be unique")
        for t in (PAD, BOS, EOS, UNK):
            if t not in self.index:
                raise ValueError(f"vocabulary lacks the special token {t!r}")
        self.pad, self.bos, self.eos, self.unk = (self.index[t] for t in (PAD, BOS, EOS, UNK))
        if self.pad != 0:
            raise ValueError(f"the padding token {PAD!r} must come first (id 0), got id {self.pad}")

    @classmethod
    def default(cls) -> Vocab:
        words = ONES + TENS[2:] + ["hundred", "thousand", "-"]
        return cls([PAD, BOS, EOS, UNK, *DIRECTIONS, *words, *"0123456789"])

    def __len__(self) -> int:
        return len(self.tokens)

    def encode(self, tokens: Sequence[str]) -> list[int]:
        return [self.index.get(t, self.unk) for t in tokens]

    def decode(self, ids: Sequence[int]) -> list[str]:
        """Ids -> tokens, stopping at the first eos; padding and bos are dropped."""
        out = []
        for i in ids:
            if i == self.eos:
                break
            if i not in (self.pad, self.bos):
                out.append(self.tokens[i])
        return out

    def to_json(self) -> str:
        return json.dumps({"tokens": self.tokens}, indent=1) + "\n"

    @classmethod
    def load(cls, path: str | Path) -> Vocab:
        path = Path(path)
        if not path.is_file():
            raise FileNotFoundError(f"vocabulary file not found: {path}")
        try:
            return cls(json.loads(path.read_text())["tokens"])
        except (json.JSONDecodeError, KeyError, TypeError) as e:
            raise ValueError(f"vocabulary file {path} is not valid: {e}") from None


def is_held_out(n: int) -> bool:
    """One in ten numbers ≥ 1000 (by a fixed multiplicative hash) is kept out of training."""
    return n >= 1000 and ((n * 2654435761) % 2**32) % 10 == 0


# how often each digit count is drawn for training: few one-digit numbers, mostly long ones
_LENGTH_WEIGHTS = (1, 2, 3, 4, 4, 4)


def sample_numbers(rng: random.Random, k: int, *, held_out: bool, min_digits: int = 1) -> list[int]:
    """``k`` numbers: digit count by ``_LENGTH_WEIGHTS``, then uniform; only held-out ones or only others."""
    out: list[int] = []
    lengths = list(range(min_digits, 7))
    weights = _LENGTH_WEIGHTS[min_digits - 1 :]
    while len(out) < k:
        d = rng.choices(lengths, weights)[0]
        n = rng.randrange(0 if d == 1 else 10 ** (d - 1), 10**d)
        if is_held_out(n) == held_out:
            out.append(n)
    return out


@dataclasses.dataclass
class Batch:
    """Padded tensors of one batch: src (B, S), src_mask (B, S) True = padding, tgt_in (B, T) = bos + target,
    tgt_out (B, T) = target + eos (pad where there is no token)."""

    src: Tensor
    src_mask: Tensor
    tgt_in: Tensor
    tgt_out: Tensor

    @property
    def n_target_tokens(self) -> int:
        return int((self.tgt_out != 0).sum())

    @property
    def n_tokens(self) -> int:
        return int((~self.src_mask).sum()) + self.n_target_tokens

    def rows(self, index: slice) -> Batch:
        return Batch(self.src[index], self.src_mask[index], self.tgt_in[index], self.tgt_out[index])


def collate(pairs: Sequence[tuple[list[str], list[str]]], vocab: Vocab) -> Batch:
    b = len(pairs)
    s = max(len(p[0]) for p in pairs)
    t = max(len(p[1]) for p in pairs) + 1
    src = torch.full((b, s), vocab.pad, dtype=torch.long)
    tgt_in = torch.full((b, t), vocab.pad, dtype=torch.long)
    tgt_out = torch.full((b, t), vocab.pad, dtype=torch.long)
    for i, (x, y) in enumerate(pairs):
        xi, yi = vocab.encode(x), vocab.encode(y)
        src[i, : len(xi)] = torch.tensor(xi)
        tgt_in[i, : len(yi) + 1] = torch.tensor([vocab.bos, *yi])
        tgt_out[i, : len(yi) + 1] = torch.tensor([*yi, vocab.eos])
    return Batch(src, src == vocab.pad, tgt_in, tgt_out)


def _pairs(numbers: Sequence[int], rng: random.Random | None = None, direction: str | None = None):
    return [make_pair(n, direction or rng.choice(DIRECTIONS)) for n in numbers]


def train_batch(seed: int, step: int, batch_size: int, vocab: Vocab) -> Batch:
    """The global batch of ``step``: a pure function of (seed, step), so every rank and a resumed run draw the
    same one."""
    rng = random.Random(seed * 1_000_003 + step)
    return collate(_pairs(sample_numbers(rng, batch_size, held_out=False), rng), vocab)


def held_out_pairs(seed: int, k: int, *, salt: int) -> list[tuple[list[str], list[str]]]:
    """``k`` held-out pairs (numbers of 4–6 digits, never trained on), half in each direction."""
    rng = random.Random(f"{seed}-{salt}")
    nums = sample_numbers(rng, k, held_out=True, min_digits=4)
    return [make_pair(n, DIRECTIONS[i % 2]) for i, n in enumerate(nums)]


# ---- configuration ---------------------------------------------------------------------------------------------


@dataclasses.dataclass
class DemoConfig:
    """Settings of the demo run (the model's sizes included). Defaults reach ≥ 90% exact match in a few
    minutes on 2 CPU cores."""

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

    def __post_init__(self) -> None:
        for name in ("steps", "batch_size", "warmup", "d_model", "n_heads", "d_ff", "n_layers", "eval_every",
                     "save_every", "n_val", "n_test"):  # fmt: skip
            check_positive_int(name, getattr(self, name))
        check_positive_int("threads", self.threads, allow_none=True)
        if isinstance(self.seed, bool) or not isinstance(self.seed, int) or self.seed < 0:
            raise ValueError(f"seed must be an int ≥ 0, got {self.seed!r}")
        check_probability("dropout", self.dropout)
        check_probability("label_smoothing", self.label_smoothing)
        check_probability("min_lr_ratio", self.min_lr_ratio)
        for name in ("lr", "clip_norm"):
            v = getattr(self, name)
            if isinstance(v, bool) or not isinstance(v, (int, float)) or not v > 0:
                raise ValueError(f"{name} must be a positive number, got {v!r}")
        if self.d_model % self.n_heads:
            raise ValueError(f"d_model ({self.d_model}) must be divisible by n_heads ({self.n_heads})")

    def model_config(self, vocab_size: int) -> TransformerConfig:
        return TransformerConfig(
            src_vocab_size=vocab_size, tgt_vocab_size=vocab_size, d_model=self.d_model, n_heads=self.n_heads,
            d_ff=self.d_ff, n_layers=self.n_layers, dropout=self.dropout, max_len=32, norm_first=self.norm_first,
        )  # fmt: skip

    def lr_at(self, step: int) -> float:
        """Linear warm-up over ``warmup`` steps, then cosine decay to ``min_lr_ratio · lr`` at ``steps``."""
        if step < self.warmup:
            return self.lr * (step + 1) / self.warmup
        t = min(1.0, (step - self.warmup) / max(1, self.steps - self.warmup))
        return self.lr * (self.min_lr_ratio + (1 - self.min_lr_ratio) * 0.5 * (1 + math.cos(math.pi * t)))


# ---- checkpoints -----------------------------------------------------------------------------------------------

OPTIMIZER_NAME = "optimizer.safetensors"
STATE_NAME = "trainer_state.json"
VOCAB_NAME = "vocab.json"


@contextlib.contextmanager
def _defer_sigint():
    """Hold Ctrl-C until the block ends, so that a checkpoint's files are written together."""
    if threading.current_thread() is not threading.main_thread():
        yield
        return
    got: list[Any] = []
    old = signal.signal(signal.SIGINT, lambda *a: got.append(a))
    try:
        yield
    finally:
        signal.signal(signal.SIGINT, old)
        if got:
            raise KeyboardInterrupt


def _write_text(path: Path, text: str) -> None:
    atomic_write(path, lambda p: Path(p).write_text(text))


def save_checkpoint(folder: Path, model: Transformer, opt: torch.optim.Optimizer, vocab: Vocab, state: dict) -> None:
    """Model (safetensors + config), vocabulary, optimizer state (tensors in safetensors, the rest in JSON) and
    the trainer state (step, loss history, RNG), each file written atomically, Ctrl-C held meanwhile."""
    from safetensors.torch import save_file

    sd = opt.state_dict()
    tensors = {f"state.{i}.{k}": v.detach().contiguous().cpu() for i, st in sd["state"].items() for k, v in st.items()}
    tensors["torch_rng_state"] = torch.get_rng_state()
    groups = [{k: (list(v) if isinstance(v, tuple) else v) for k, v in g.items()} for g in sd["param_groups"]]
    with _defer_sigint():
        folder.mkdir(parents=True, exist_ok=True)
        model.save_pretrained(folder)
        _write_text(folder / VOCAB_NAME, vocab.to_json())
        atomic_write(folder / OPTIMIZER_NAME, lambda p: save_file(tensors, p))
        _write_text(folder / STATE_NAME, json.dumps({**state, "param_groups": groups}, indent=1) + "\n")


def load_checkpoint(folder: str | Path) -> tuple[Transformer, Vocab, dict]:
    """(model, vocabulary, trainer state) from a demo folder. Raises FileNotFoundError naming a missing file."""
    folder = Path(folder)
    model = Transformer.from_pretrained(folder)
    vocab = Vocab.load(folder / VOCAB_NAME)
    path = folder / STATE_NAME
    if not path.is_file():
        raise FileNotFoundError(f"trainer state not found: {path} (not a demo checkpoint?)")
    try:
        state = json.loads(path.read_text())
    except json.JSONDecodeError as e:
        raise ValueError(f"trainer state {path} is not valid JSON: {e}") from None
    return model, vocab, state


def _load_optimizer(folder: Path, opt: torch.optim.Optimizer, groups: list[dict]) -> None:
    from safetensors.torch import load_file

    path = folder / OPTIMIZER_NAME
    if not path.is_file():
        raise FileNotFoundError(f"optimizer state not found: {path}")
    try:
        tensors = load_file(str(path))
    except Exception as e:
        raise ValueError(f"cannot read optimizer state {path}: {e}") from None
    state: dict[int, dict[str, Tensor]] = {}
    for key, v in tensors.items():
        if key.startswith("state."):
            _, i, name = key.split(".", 2)
            state.setdefault(int(i), {})[name] = v
    groups = [{k: (tuple(v) if k == "betas" else v) for k, v in g.items()} for g in groups]
    opt.load_state_dict({"state": state, "param_groups": groups})
    if "torch_rng_state" in tensors:
        torch.set_rng_state(tensors["torch_rng_state"])


# ---- training --------------------------------------------------------------------------------------------------


def _loss(model: nn.Module, batch: Batch, label_smoothing: float, reduction: str = "sum") -> Tensor:
    logits = model(batch.src, batch.tgt_in, src_key_padding_mask=batch.src_mask)
    return F.cross_entropy(
        logits.flatten(0, 1), batch.tgt_out.flatten(), ignore_index=0, label_smoothing=label_smoothing,
        reduction=reduction,
    )  # fmt: skip


@torch.no_grad()
def _val_loss(model: Transformer, batch: Batch) -> float:
    was = model.training
    model.eval()
    try:
        return float(_loss(model, batch, 0.0, "mean"))
    finally:
        model.train(was)


def evaluate(
    model: Transformer, vocab: Vocab, pairs: Sequence[tuple[list[str], list[str]]], *, batch_size: int = 500
) -> tuple[float, list[dict]]:
    """Greedy-decode every source; returns (exact-match accuracy, one record per pair)."""
    records = []
    for i in range(0, len(pairs), batch_size):
        chunk = pairs[i : i + batch_size]
        b = collate(chunk, vocab)
        max_len = max(len(y) for _, y in chunk) + 4
        out = model.translate(b.src, max_len, bos=vocab.bos, eos=vocab.eos, pad=vocab.pad,
                              src_key_padding_mask=b.src_mask)  # fmt: skip
        for (x, y), ids in zip(chunk, out.tolist()):
            pred = vocab.decode(ids)
            records.append({
                "direction": x[0], "source": _detokenize(x[1:]), "target": _detokenize(y),
                "prediction": _detokenize(pred), "correct": pred == y,
            })  # fmt: skip
    acc = sum(r["correct"] for r in records) / max(1, len(records))
    return acc, records


class _Progress:
    """A rich progress bar (loss, tokens/s, ETA) on rank 0; nothing when quiet."""

    def __init__(self, enabled: bool, total: int, start: int) -> None:
        self.bar = None
        if not enabled:
            return
        from rich.progress import (BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn,
                                   TimeRemainingColumn)  # fmt: skip

        self.bar = Progress(
            TextColumn("[bold]training"), BarColumn(), MofNCompleteColumn(),
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


def _echo(quiet: bool, text: str) -> None:
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
        ValueError: bad rank/world_size; FileNotFoundError: ``--resume`` without a checkpoint.
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
    old_threads = torch.get_num_threads()
    torch.set_num_threads(cfg.threads or max(1, (os.cpu_count() or 1) // world_size))
    try:
        return _train(cfg, rank, world_size, wrap_model, on_step, main, quiet, out)
    finally:
        torch.set_num_threads(old_threads)


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
        _load_optimizer(out, opt, state["param_groups"])
    net = wrap_model(model)
    val_batch = collate(held_out_pairs(cfg.seed, cfg.n_val, salt=1), vocab)

    def checkpoint(step: int) -> None:
        if main:
            state = {"step": step, "history": history, "train_seconds": train_seconds, "tokens_seen": tokens_seen,
                     "demo_config": dataclasses.asdict(cfg)}  # fmt: skip
            save_checkpoint(out, model, opt, vocab, state)

    if main:
        out.mkdir(parents=True, exist_ok=True)
        n_params = sum(p.numel() for p in model.parameters())
        what = f"resuming at step {start}" if cfg.resume else "training"
        _echo(quiet, f"[bold]sublayer demo[/]: numbers in words ↔ digits; {what} a {n_params / 1e3:.0f}k-parameter "
                     f"Transformer for {cfg.steps} steps on {torch.get_num_threads()} thread(s) → {out}/")  # fmt: skip

    step = start
    model.train()
    try:
        with _Progress(not quiet, cfg.steps, start) as bar:
            t_last, tok_window, t_window = time.perf_counter(), 0, 0.0
            while step < cfg.steps:
                t0 = time.perf_counter()
                batch = train_batch(cfg.seed, step, cfg.batch_size, vocab)
                n_global = batch.n_target_tokens
                local = batch.rows(slice(rank, None, world_size))
                lr = cfg.lr_at(step)
                for g in opt.param_groups:
                    g["lr"] = lr
                loss_sum = _loss(net, local, cfg.label_smoothing)
                # sum over this rank's tokens / global tokens · world_size: averaged over ranks = global mean
                (loss_sum * (world_size / n_global)).backward()
                torch.nn.utils.clip_grad_norm_(model.parameters(), cfg.clip_norm)
                opt.step()
                opt.zero_grad(set_to_none=True)
                step += 1
                dt = time.perf_counter() - t0
                train_seconds += dt
                tokens_seen += batch.n_tokens
                tok_window += batch.n_tokens
                t_window += dt
                loss = float(loss_sum.detach()) / max(1, local.n_target_tokens)
                history["train"].append([step, loss])
                if on_step is not None:
                    on_step(step, {"loss": loss, "lr": lr, "tokens": batch.n_tokens})
                if main:
                    fields = {"completed": step, "loss": loss}
                    if step % cfg.eval_every == 0 or step == cfg.steps:
                        v = _val_loss(model, val_batch)
                        history["val"].append([step, v])
                        fields["val"] = f"{v:.3f}"
                    if time.perf_counter() - t_last > 0.5 or step == cfg.steps:
                        fields["tps"] = tok_window / max(t_window, 1e-9)
                        t_last, tok_window, t_window = time.perf_counter(), 0, 0.0
                    bar.update(**fields)
                    if step % cfg.save_every == 0 and step < cfg.steps:
                        checkpoint(step)
    except KeyboardInterrupt:
        if main:
            checkpoint(step)
            _echo(False, f"interrupted at step {step}: checkpoint saved in {out}/ — continue with --resume")
        raise
    if not main:
        return None
    checkpoint(step)
    return _finish(cfg, model, vocab, history, step, train_seconds, tokens_seen, out, quiet)


def _finish(cfg, model, vocab, history, step, train_seconds, tokens_seen, out, quiet) -> dict:
    t0 = time.perf_counter()
    acc, records = evaluate(model, vocab, held_out_pairs(cfg.seed, cfg.n_test, salt=2))
    eval_seconds = time.perf_counter() - t0
    by_dir = {
        d: sum(r["correct"] for r in records if r["direction"] == d) / max(1, sum(r["direction"] == d for r in records))
        for d in DIRECTIONS
    }
    val = history["val"][-1][1] if history["val"] else None
    tail = [loss for _, loss in history["train"][-20:]]
    metrics = {
        "exact_match": acc,
        "exact_match_by_direction": {"words→digits": by_dir[TO_DIGITS], "digits→words": by_dir[TO_WORDS]},
        "n_test": len(records),
        "steps": step,
        "train_seconds": round(train_seconds, 2),
        "eval_seconds": round(eval_seconds, 2),
        "tokens_per_second": round(tokens_seen / max(train_seconds, 1e-9), 1),
        "final_train_loss": sum(tail) / len(tail) if tail else None,
        "final_val_loss": val,
        "seed": cfg.seed,
        "batch_size": cfg.batch_size,
        "threads": torch.get_num_threads(),
        "torch": torch.__version__,
        "n_parameters": sum(p.numel() for p in model.parameters()),
        "model": model.config.to_dict(),
        "samples": records[:12],
    }
    _write_text(out / "metrics.json", json.dumps(metrics, indent=1, ensure_ascii=False) + "\n")
    plot_losses(history, out / "loss.png")
    sample = next(r for r in records if r["direction"] == TO_DIGITS)
    plot_cross_attention(model, vocab, make_pair(int(sample["target"]), TO_DIGITS), out / "attention.png")
    if not quiet:
        from rich.table import Table
        from rich.console import Console

        table = Table(title="held-out samples (never seen in training)")
        for col in ("source", "prediction", ""):
            table.add_column(col)
        shown = [r for r in records if r["direction"] == TO_DIGITS][:4] + [r for r in records if r["direction"] == TO_WORDS][:4]
        for r in shown + [r for r in records if not r["correct"]][:2]:
            mark = "[green]✓[/]" if r["correct"] else f"[red]✗[/] (expected {r['target']})"
            table.add_row(r["source"], r["prediction"], mark)
        console = Console(highlight=False)
        console.print(table)
        console.print(
            f"[bold]exact match on {len(records)} held-out numbers: {acc:.1%}[/] "
            f"(words→digits {by_dir[TO_DIGITS]:.1%}, digits→words {by_dir[TO_WORDS]:.1%}); "
            f"{step} steps, {train_seconds:.0f} s training, {metrics['tokens_per_second']:,.0f} tok/s"
        )
        console.print(f"wrote {out}/: metrics.json, loss.png, attention.png, model.safetensors, config.json, vocab.json")
    return metrics


# ---- plots -----------------------------------------------------------------------------------------------------


def _save_figure(fig, path: Path) -> None:
    atomic_write(path, lambda p: fig.savefig(p, format="png", dpi=110, bbox_inches="tight"))


def plot_losses(history: dict, path: str | Path) -> None:
    """Training loss (raw and smoothed) and validation loss against steps, log scale."""
    from matplotlib.figure import Figure

    fig = Figure(figsize=(6.4, 4.0))
    ax = fig.add_subplot()
    if history["train"]:
        steps, losses = zip(*history["train"])
        ax.plot(steps, losses, color="tab:blue", alpha=0.25, lw=0.8)
        ema, sm = [], losses[0]
        for v in losses:
            sm = 0.95 * sm + 0.05 * v
            ema.append(sm)
        ax.plot(steps, ema, color="tab:blue", label="train (smoothed)")
    if history["val"]:
        vs, vl = zip(*history["val"])
        ax.plot(vs, vl, "o-", color="tab:orange", ms=3, label="validation (held-out)")
    ax.set_yscale("log")
    ax.set_xlabel("step")
    ax.set_ylabel("cross-entropy per token")
    ax.set_title("sublayer demo: numbers words ↔ digits")
    ax.grid(True, which="both", alpha=0.3)
    ax.legend()
    _save_figure(fig, Path(path))


def plot_cross_attention(model: Transformer, vocab: Vocab, pair: tuple[list[str], list[str]], path: str | Path) -> None:
    """Cross-attention heatmaps of one pair, d2l style: a grid of layers × heads, keys (source tokens) on x,
    queries (the target token each position predicts) on y, one shared colour bar."""
    from matplotlib.figure import Figure

    b = collate([pair], vocab)
    weights = model.cross_attention_weights(b.src, b.tgt_in, src_key_padding_mask=b.src_mask)
    src_tokens, tgt_tokens = pair[0], [*pair[1], EOS]
    n_layers, n_heads = len(weights), weights[0].shape[1]
    # size each panel from its token counts (square cells), plus room for labels, so rows don't float apart
    cell = 2.4 / max(len(src_tokens), 1)
    fig = Figure(figsize=(2.6 * n_heads + 1, n_layers * (cell * len(tgt_tokens) + 0.3) + 1.3), layout="constrained")
    axes = fig.subplots(n_layers, n_heads, squeeze=False, sharex=True, sharey=True)
    im = None
    for i in range(n_layers):
        for j in range(n_heads):
            ax = axes[i][j]
            im = ax.imshow(weights[i][0, j].numpy(), cmap="Reds", vmin=0.0, vmax=1.0)
            ax.set_xticks(range(len(src_tokens)), src_tokens, rotation=90, fontsize=7)
            ax.set_yticks(range(len(tgt_tokens)), tgt_tokens, fontsize=7)
            ax.set_title(f"layer {i + 1}, head {j + 1}", fontsize=8)
            if i == n_layers - 1:
                ax.set_xlabel("Key positions (source)", fontsize=8)
            if j == 0:
                ax.set_ylabel("Query positions (output)", fontsize=8)
    fig.colorbar(im, ax=axes, shrink=0.6)
    fig.suptitle(f"cross-attention: {_detokenize(pair[0][1:])} → {_detokenize(pair[1])}", fontsize=9)
    _save_figure(fig, Path(path))
