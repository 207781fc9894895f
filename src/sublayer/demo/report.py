"""The demo's evaluation (greedy exact match on held-out numbers) and final report: metrics.json, plots, table."""

from __future__ import annotations

import json
import time
from collections.abc import Sequence

import torch

from ..models.transformer import Transformer
from .checkpoint import write_text
from .plots import plot_cross_attention, plot_losses
from .task import DIRECTIONS, TO_DIGITS, TO_WORDS, Vocab, detokenize, collate, held_out_pairs, make_pair


def translate_pairs(
    model: Transformer, vocab: Vocab, pairs: Sequence[tuple[list[str], list[str]]], *, batch_size: int = 500
) -> list[torch.Tensor]:
    """Greedy translations of the pairs' sources, ``batch_size`` at a time (padded, with their masks): one
    (B, L) id tensor per batch, each row ending at its eos and padded after it."""
    outs = []
    for i in range(0, len(pairs), batch_size):
        chunk = pairs[i : i + batch_size]
        b = collate(chunk, vocab)
        max_len = max(len(y) for _, y in chunk) + 4
        outs.append(model.translate(b.src, max_len, bos=vocab.bos, eos=vocab.eos, pad=vocab.pad,
                                    src_key_padding_mask=b.src_mask))  # fmt: skip
    return outs


def evaluate(
    model: Transformer, vocab: Vocab, pairs: Sequence[tuple[list[str], list[str]]], *, batch_size: int = 500
) -> tuple[float, list[dict]]:
    """Greedy-decode every source; returns (exact-match accuracy, one record per pair)."""
    records = []
    rows = [ids for out in translate_pairs(model, vocab, pairs, batch_size=batch_size) for ids in out.tolist()]
    for (x, y), ids in zip(pairs, rows):  # the batches' rows in the pairs' order
        pred = vocab.decode(ids)
        records.append({
            "direction": x[0], "source": detokenize(x[1:]), "target": detokenize(y),
            "prediction": detokenize(pred), "correct": pred == y,
        })  # fmt: skip
    acc = sum(r["correct"] for r in records) / max(1, len(records))
    return acc, records


def finish_run(cfg, model, vocab, history, step, train_seconds, tokens_seen, out, quiet) -> dict:
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
    write_text(out / "metrics.json", json.dumps(metrics, indent=1, ensure_ascii=False) + "\n")
    plot_losses(history, out / "loss.png")
    sample = next(r for r in records if r["direction"] == TO_DIGITS)
    plot_cross_attention(model, vocab, make_pair(int(sample["target"]), TO_DIGITS), out / "attention.png")
    echo(quiet, sample_table(records))
    echo(False, f"[bold]exact match on {len(records)} held-out numbers: {acc:.1%}[/] "  # even quiet: the run's result
                f"(words→digits {by_dir[TO_DIGITS]:.1%}, digits→words {by_dir[TO_WORDS]:.1%}); "
                f"{step} steps, {train_seconds:.0f} s training, {metrics['tokens_per_second']:,.0f} tok/s")  # fmt: skip
    echo(quiet, f"wrote {out}/: metrics.json, loss.png, attention.png, model.safetensors, config.json, vocab.json")
    return metrics


def echo(quiet: bool, text) -> None:
    """``text`` (rich markup, or a rich renderable) on stdout, unless ``quiet``."""
    if not quiet:
        from rich.console import Console

        Console(highlight=False).print(text)


def sample_rows(records: list[dict], per_direction: int = 4, wrong: int = 2) -> list[dict]:
    """The records the sample table shows: the first ``per_direction`` of each direction, then up to ``wrong``
    mistakes not already among them — each record once."""
    shown = [r for d in DIRECTIONS for r in [r for r in records if r["direction"] == d][:per_direction]]
    shown += [r for r in records if not r["correct"] and not any(r is s for s in shown)][:wrong]
    return shown


def sample_table(records: list[dict]):
    """A rich Table of :func:`sample_rows`: direction, source, prediction, and whether it is right."""
    from rich.table import Table

    table = Table(title="held-out samples (never seen in training)")
    for col in ("direction", "source", "prediction", "correct?"):
        table.add_column(col)
    for r in sample_rows(records):
        mark = "[green]✓[/]" if r["correct"] else f"[red]✗[/] expected {r['target']}"
        table.add_row(_DIRECTION_LABELS[r["direction"]], r["source"], r["prediction"], mark)
    return table


_DIRECTION_LABELS = {TO_DIGITS: "words→digits", TO_WORDS: "digits→words"}
