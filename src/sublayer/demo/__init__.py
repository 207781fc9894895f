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
renamed, so an interrupted run (Ctrl-C, SIGTERM) never leaves a half-written file; a checkpoint holds whole steps
only (:mod:`.signals`), so ``--resume`` continues exactly where the uninterrupted run would be.

:func:`train` is written for data parallelism: every rank draws the same global batch from ``(seed, step)`` and
keeps rows ``rank::world_size``; the loss is normalised by the global token count times ``world_size``, so
gradients averaged across ranks (as DDP does) equal the one-process gradient. Only rank 0 writes files and
shows progress.
"""

from ..models.transformer import Transformer
from .checkpoint import OPTIMIZER_NAME, STATE_NAME, VOCAB_NAME, load_checkpoint, save_checkpoint
from .config import DemoConfig
from .plots import loss_figure, plot_cross_attention, plot_losses, smooth
from .report import evaluate, sample_rows, sample_table
from .task import (BOS, DIRECTIONS, EOS, MAX_NUMBER, PAD, TO_DIGITS, TO_WORDS, UNK, Batch, Vocab, detokenize,
                   collate, held_out_pairs, is_held_out, make_pair, number_to_words, sample_numbers, train_batch,
                   words_to_number)  # fmt: skip
from .training import batch_loss, TransformerLoss, train

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
