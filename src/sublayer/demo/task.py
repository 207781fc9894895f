"""The demo's task: numbers 0–999,999 in English words ↔ digits, its vocabulary, held-out split and batches."""

from __future__ import annotations

import dataclasses
import json
import random
from collections.abc import Sequence
from pathlib import Path

import torch
from torch import Tensor

from ..checkpoints.io import read_json

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


def detokenize(tokens: Sequence[str]) -> str:
    if all(len(t) == 1 and t.isdigit() for t in tokens):
        return "".join(tokens)
    return " ".join(tokens).replace(" - ", "-")


def make_pair(n: int, direction: str) -> tuple[list[str], list[str]]:
    """(source tokens with the direction tag first, target tokens) for number ``n``."""
    words, digits = number_to_words(n).replace("-", " - ").split(), list(str(n))  # "-" a token: see detokenize
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
        data = read_json(path, "vocabulary file")
        try:
            return cls(data["tokens"])
        except (KeyError, TypeError) as e:
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
    src, tgt_in, tgt_out = (torch.full(shape, vocab.pad, dtype=torch.long) for shape in ((b, s), (b, t), (b, t)))
    for i, (x, y) in enumerate(pairs):
        xi, yi = vocab.encode(x), vocab.encode(y)
        src[i, : len(xi)] = torch.tensor(xi)
        tgt_in[i, : len(yi) + 1] = torch.tensor([vocab.bos, *yi])
        tgt_out[i, : len(yi) + 1] = torch.tensor([*yi, vocab.eos])
    return Batch(src, src == vocab.pad, tgt_in, tgt_out)


def train_batch(seed: int, step: int, batch_size: int, vocab: Vocab) -> Batch:
    """The global batch of ``step``: a pure function of (seed, step), so every rank and a resumed run draw the
    same one."""
    rng = random.Random(seed * 1_000_003 + step)
    numbers = sample_numbers(rng, batch_size, held_out=False)
    return collate([make_pair(n, rng.choice(DIRECTIONS)) for n in numbers], vocab)


def held_out_pairs(seed: int, k: int, *, salt: int) -> list[tuple[list[str], list[str]]]:
    """``k`` held-out pairs (numbers of 4–6 digits, never trained on), half in each direction."""
    rng = random.Random(f"{seed}-{salt}")
    nums = sample_numbers(rng, k, held_out=True, min_digits=4)
    return [make_pair(n, DIRECTIONS[i % 2]) for i, n in enumerate(nums)]
