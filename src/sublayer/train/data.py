"""``sublayer train``'s data: text -> documents -> token ids -> packed rows, and the batch of every step.

Documents are the paragraphs of the text (split on blank lines; ``split="files"``: one document per file). Each
gets the tokenizer's own special tokens (as ``tokenizer(text)`` in HF) and an eos at its end, then the documents
are laid end to end and cut into rows of ``seq_len`` tokens: no padding except at the end of the last row.
Positions restart at 0 where a document (or a row) starts, so a model attends block-diagonally: no token sees
another document (:func:`sublayer.functional.packing.document_mask`). A document's first token has no target
(label ``IGNORE``): no document learns to predict the start of the next one.
"""

from __future__ import annotations

import dataclasses
import hashlib
import random
import re
from collections.abc import Sequence
from pathlib import Path

import torch
from torch import Tensor

IGNORE = -100
SPLITS = ("paragraphs", "files")
SUFFIXES = (".txt", ".md")
BUILTIN_PREFIX = "builtin:"


def numbers_text(n_docs: int = 3000, *, seed: int = 0) -> str:
    """The built-in text ``builtin:numbers``: ``n_docs`` paragraphs of one to four lines such as
    ``"342006 is three hundred forty-two thousand six."`` (numbers 0-999,999, drawn by ``seed``)."""
    from ..demo.task import number_to_words

    rng = random.Random(seed)

    def line() -> str:
        n = rng.randrange(10 ** rng.randint(1, 6))
        return f"{n} is {number_to_words(n)}."

    return "\n\n".join("\n".join(line() for _ in range(rng.randint(1, 4))) for _ in range(n_docs)) + "\n"


BUILTIN_TEXTS = {"numbers": numbers_text}


def read_documents(data: str | Path, *, split: str = "paragraphs") -> list[str]:
    """The documents of ``data``: ``builtin:NAME`` (:data:`BUILTIN_TEXTS`), a text file, or a folder whose
    ``.txt``/``.md`` files (searched recursively, in sorted order) are read.

    Raises:
        ValueError: ``data`` does not exist, an unknown built-in text or split, a folder without text files, no
            text at all.
    """
    if split not in SPLITS:
        raise ValueError(f"split must be one of {', '.join(SPLITS)}, got {split!r}")
    data = str(data)
    if data.startswith(BUILTIN_PREFIX):
        name = data[len(BUILTIN_PREFIX) :]
        if name not in BUILTIN_TEXTS:
            raise ValueError(f"data {data!r} is not a built-in text: use one of "
                             f"{', '.join(BUILTIN_PREFIX + n for n in BUILTIN_TEXTS)}, a file or a folder")  # fmt: skip
        texts = [BUILTIN_TEXTS[name]()]
    else:
        path = Path(data)
        if not path.exists():
            raise ValueError(f"data {data!r} does not exist: give a text file, a folder of {'/'.join(SUFFIXES)} "
                             f"files or {BUILTIN_PREFIX}NAME")  # fmt: skip
        files = [path] if path.is_file() else sorted(p for p in path.rglob("*") if p.suffix in SUFFIXES and p.is_file())
        if not files:
            raise ValueError(f"data {data!r} is a folder without {' or '.join(SUFFIXES)} files")
        texts = [p.read_text(encoding="utf-8", errors="replace") for p in files]
    pieces = texts if split == "files" else [d for t in texts for d in re.split(r"\n[ \t]*\n", t)]
    docs = [d.strip() for d in pieces if d.strip()]
    if not docs:
        raise ValueError(f"data {data!r} holds no text")
    return docs


def tokenize(tokenizer, docs: Sequence[str], eos: int) -> list[list[int]]:
    """Each document's ids (a ``tokenizers.Tokenizer``, its special tokens included) with ``eos`` appended."""
    return [e.ids + ([] if e.ids[-1:] == [eos] else [eos]) for e in tokenizer.encode_batch(list(docs))]


def held_out(n_docs: int, fraction: float, seed: int) -> list[int]:
    """Indices of the held-out documents: ``round(fraction · n_docs)`` of them (at least one when ``fraction`` > 0
    and there are two documents or more, never all), drawn by ``seed``; sorted."""
    k = round(fraction * n_docs)
    k = min(max(k, 1 if fraction > 0 else 0), n_docs - 1)
    return sorted(random.Random(seed).sample(range(n_docs), k)) if k > 0 else []


@dataclasses.dataclass
class Rows:
    """Packed rows (R, T): ``input_ids``, ``position_ids`` (restarting at 0 per document and per row),
    ``labels`` (``IGNORE`` at each document's first token and at padding) and ``attention_mask`` (1 = token,
    0 = padding: only the last row's tail)."""

    input_ids: Tensor
    position_ids: Tensor
    labels: Tensor
    attention_mask: Tensor

    def __len__(self) -> int:
        return self.input_ids.shape[0]

    def __getitem__(self, index) -> Rows:
        return Rows(*(t[index] for t in dataclasses.astuple(self)))

    @property
    def n_tokens(self) -> int:
        return int(self.attention_mask.sum())

    @property
    def n_targets(self) -> int:
        """Positions with a target after the shift (label t + 1 is not ``IGNORE``)."""
        return int((self.labels[:, 1:] != IGNORE).sum())

    def loss_kwargs(self) -> dict:
        """``model.loss``'s keyword arguments (no mask when nothing is padded)."""
        mask = None if bool(self.attention_mask.all()) else self.attention_mask
        return {"position_ids": self.position_ids, "labels": self.labels, "attention_mask": mask}

    def fingerprint(self) -> str:
        """SHA-256 of the ids and positions: a resumed run checks that its data packs to the same rows."""
        h = hashlib.sha256()
        for t in (self.input_ids, self.position_ids):
            h.update(t.contiguous().numpy().tobytes())
        return h.hexdigest()


def pack_documents(docs: Sequence[Sequence[int]], seq_len: int, *, pad_id: int = 0) -> Rows:
    """Lay ``docs`` (lists of ids) end to end and cut the stream into rows of ``seq_len`` (see the module
    docstring); a document that runs past a row's end continues in the next row as a new document."""
    if not docs:
        raise ValueError("pack_documents needs at least one document")
    ids = torch.tensor([i for d in docs for i in d], dtype=torch.long)
    n = ids.numel()
    starts = torch.zeros(n, dtype=torch.bool)
    starts[torch.tensor([0] + [len(d) for d in docs[:-1]]).cumsum(0)] = True  # each document's first token
    labels = ids.masked_fill(starts, IGNORE)
    rows = -(-n // seq_len)
    pad = rows * seq_len - n
    index = torch.arange(rows * seq_len)
    restart = torch.cat([starts, torch.ones(pad, dtype=torch.bool)]) | (index % seq_len == 0)
    position = index - torch.cummax(torch.where(restart, index, 0), 0).values

    def shaped(x: Tensor, fill: int) -> Tensor:
        return torch.cat([x, x.new_full((pad,), fill)]).view(rows, seq_len)

    mask = shaped(torch.ones(n, dtype=torch.long), 0)
    return Rows(shaped(ids, pad_id), position.view(rows, seq_len), shaped(labels, IGNORE), mask)


def batch_index(seed: int, step: int, n_rows: int, batch_size: int) -> Tensor:
    """The rows of ``step``'s global batch: epoch ``e`` visits the rows in a permutation drawn from ``(seed, e)``,
    ``batch_size`` at a time (the last ``n_rows % batch_size`` of each permutation are left out). A pure function
    of its arguments, so every rank and a resumed run draw the same batch."""
    per_epoch = n_rows // batch_size
    epoch, i = divmod(step, per_epoch)
    perm = torch.randperm(n_rows, generator=torch.Generator().manual_seed(seed * 1_000_003 + epoch))
    return perm[i * batch_size : (i + 1) * batch_size]
