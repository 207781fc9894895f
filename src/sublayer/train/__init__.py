"""``sublayer train``: train or fine-tune a GPT-2 or Llama-family model on your own text, on the CPU.

``--model`` is a Hugging Face folder with its ``tokenizer.json`` (or a small model made in code,
``builtin:gpt2-tiny`` / ``builtin:llama-tiny``, with a byte-level tokenizer: :mod:`.starter`); ``--data`` is a
text file, a folder of ``.txt``/``.md`` files or ``builtin:numbers`` (:mod:`.data`). The text is tokenized with
the model's tokenizer, cut into documents (paragraphs, or whole files), each ended by eos, and packed into rows of
``--seq-len`` tokens where documents never attend to one another (positions restart at 0 per document). Training
runs the padding-free path and the fused LM-head loss with AdamW, warm-up and cosine decay; a fraction of the
documents is held out for the perplexity.

Everything goes to ``--out``: a Hugging Face folder (``config.json``, ``model.safetensors``,
``generation_config.json``, the tokenizer files) that ``transformers.AutoModelForCausalLM.from_pretrained`` and
``sublayer generate`` load, ``metrics.json``, ``loss.png``, and ``optimizer.safetensors`` +
``trainer_state.json`` for ``--resume``. Checkpoints are written as the demo's (:mod:`sublayer.demo`): atomically,
whole steps only, so Ctrl-C then ``--resume`` gives the uninterrupted run bit for bit; ``--nproc N`` trains
data-parallel (each rank takes rows ``rank::N`` of every global batch).
"""

from .data import IGNORE, Rows, batch_index, held_out, numbers_text, pack_documents, read_documents, tokenize
from .loop import LMLoss, TrainConfig, evaluate, rank_main, train
from .starter import STARTERS, byte_tokenizer, starter_model

__all__ = [
    "TrainConfig",
    "train",
    "evaluate",
    "read_documents",
    "tokenize",
    "pack_documents",
    "Rows",
    "starter_model",
    "byte_tokenizer",
]
