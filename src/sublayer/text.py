"""Text in, results out: a Hugging Face folder and its tokenizer as one-call tasks.

* :class:`Encoder` — sentence vectors: ``Encoder.from_pretrained(folder).encode(texts)`` (BERT; mean pooling over
  the real tokens, L2-normalised, as sentence-transformers' MiniLM models; a sentence-transformers folder's own
  pooling and normalisation), batches sorted by length;
* :class:`TextGenerator` — continuation of prompts: ``TextGenerator.from_pretrained(folder).generate("Once")``
  (GPT-2, Llama, Qwen2: the class from ``config.json``'s ``model_type``), with the decoding defaults of the folder's
  ``generation_config.json``, and :meth:`TextGenerator.stream`, an iterator of the new text as it is made.

The tokenizer is the folder's, read with ``transformers`` (an optional dependency, needed only here): the
folder's ``tokenizer_config.json`` through ``AutoTokenizer`` when it has one, else its ``tokenizer.json`` as
written (``PreTrainedTokenizerFast``). ``sublayer generate`` and ``sublayer embed`` run these same calls.
"""

from __future__ import annotations

import os
import queue
import threading
from collections.abc import Iterator
from pathlib import Path

import torch
import torch.nn.functional as F
from torch import Tensor

from ._checks import check_positive_int
from .checkpoints import CONFIG_NAME, FROM_CONFIG, CheckpointError, read_config, resolve_folder
from .checkpoints.io import read_json
from .models import GPT2, Bert, Llama, fast_inference
from .models import quantized as q
from .models.bert import mean_pooled
from .runtime.generation import check_eos_ids

__all__ = ["Encoder", "TextGenerator", "load_tokenizer", "load_causal_lm", "causal_lm_class", "GENERATE_TYPES"]

GENERATE_TYPES = ("gpt2", "llama", "qwen2")  # config.json model_type -> GPT2 or Llama (generate, train)
_TOKENIZER_FILES = ("tokenizer_config.json", "tokenizer.json", "vocab.txt", "vocab.json", "tokenizer.model")


def load_tokenizer(folder: str | os.PathLike, *, why: str = "the text"):
    """The folder's tokenizer: ``AutoTokenizer.from_pretrained(folder)`` when it has a ``tokenizer_config.json``
    (or only a vocabulary file), else ``PreTrainedTokenizerFast(tokenizer_file=FOLDER/tokenizer.json)``.

    Raises:
        ModuleNotFoundError: ``transformers`` is not installed (named, with its install command).
        FileNotFoundError: the folder has no tokenizer file (``why`` says what needed it).
        ValueError: the tokenizer file cannot be read.
    """
    folder = Path(folder)
    if not any((folder / name).is_file() for name in _TOKENIZER_FILES):
        raise FileNotFoundError(f"{why} needs a tokenizer file, but {folder / 'tokenizer.json'} does not exist")
    try:
        import transformers
    except ModuleNotFoundError:
        raise ModuleNotFoundError(
            "reading a folder's tokenizer needs 'transformers': pip install transformers", name="transformers"
        ) from None
    path = folder / "tokenizer.json"
    as_written = path.is_file() and not (folder / "tokenizer_config.json").is_file()
    try:
        if as_written:
            return transformers.PreTrainedTokenizerFast(tokenizer_file=str(path))
        return transformers.AutoTokenizer.from_pretrained(folder)
    except Exception as e:  # tokenizers raises a bare Exception on a malformed file
        raise ValueError(f"cannot read tokenizer file {path if as_written else folder}: {e}") from None


def _saved_int8(folder: str | os.PathLike, cls: type, kind: str, job: str):
    """The model of a saved int8 folder (:func:`sublayer.models.quantized.load_quantized`), None for a float folder.

    Raises:
        ValueError: the folder holds another quantized model than ``cls`` (``kind``, what ``job`` needs).
    """
    if not q.is_quantized_folder(folder):
        return None
    net = q.load_quantized(folder)
    if not isinstance(net, cls):
        raise ValueError(f"{folder} holds a quantized {type(net).__name__}, not a {kind}: {job} needs a {kind}")
    return net


def load_causal_lm(folder: str | os.PathLike, *, quantize: str | None = None):
    """The causal LM of ``folder`` in eval mode: :class:`GPT2` or :class:`Llama` from ``config.json``'s
    ``model_type`` (a saved int8 folder: its :class:`QuantizedCausalLM`); ``quantize="int8"``: the model's int8
    snapshot (:func:`sublayer.models.quantized.quantize`).

    Raises:
        ValueError: a model type other than :data:`GENERATE_TYPES`, ``quantize`` of an unknown kind, a quantized
        folder that holds another model.
    """
    q.check_quantize(quantize)
    net = _saved_int8(folder, q.QuantizedCausalLM, "causal LM", "generate")
    if net is not None:
        return net
    net = causal_lm_class(folder).from_pretrained(folder).eval()
    return q.quantize(net) if quantize is not None else net


def causal_lm_class(folder: str | os.PathLike, job: str = "generate") -> type:
    """:class:`GPT2` or :class:`Llama`, by ``config.json``'s ``model_type`` in ``folder``.

    Raises:
        ValueError: a model type other than :data:`GENERATE_TYPES` (the message names ``job``, what needs the model).
    """
    kind = read_config(folder).get("model_type")
    if kind not in GENERATE_TYPES:
        raise ValueError(f"model {str(folder)!r} has model_type {kind!r} in config.json: {job} supports "
                         f"{', '.join(GENERATE_TYPES)}")  # fmt: skip
    return GPT2 if kind == "gpt2" else Llama


def _pad(rows: list[list[int]], pad: int, *, left: bool) -> tuple[Tensor, Tensor]:
    """Id lists -> (B, T) ids padded with ``pad`` and the (B, T) attention mask (1 = token)."""
    t = max(len(r) for r in rows)
    ids = torch.full((len(rows), t), pad, dtype=torch.long)
    mask = torch.zeros((len(rows), t), dtype=torch.long)
    for i, r in enumerate(rows):
        span = slice(t - len(r), t) if left else slice(0, len(r))
        ids[i, span], mask[i, span] = torch.tensor(r, dtype=torch.long), 1
    return ids, mask


def _texts(name: str, texts: str | list[str]) -> list[str]:
    items = [texts] if isinstance(texts, str) else texts
    if not isinstance(items, (list, tuple)):
        raise TypeError(f"{name} must be a str or a list of str, got {type(texts).__name__}")
    for i, t in enumerate(items):
        if not isinstance(t, str):
            raise TypeError(f"{name}[{i}] must be a str, got {type(t).__name__}")
    return list(items)


def _token_rows(rows: list[list[int]], texts: list[str], name: str) -> list[list[int]]:
    """The tokenizer's id ``rows`` of ``texts``, checked: each text gave a token (``name``: ``{i}`` is its index)."""
    for i, r in enumerate(rows):
        if not r:
            raise ValueError(f"{name.format(i=i)} {texts[i][:40]!r} encodes to no tokens")
    return rows


_POOLINGS = ("mean", "cls")
_ST_POOLING_FLAGS = {"pooling_mode_cls_token": "cls", "pooling_mode_max_tokens": "max",
                     "pooling_mode_mean_tokens": "mean", "pooling_mode_mean_sqrt_len_tokens": "mean_sqrt_len_tokens",
                     "pooling_mode_weightedmean_tokens": "weightedmean",
                     "pooling_mode_lasttoken": "lasttoken"}  # fmt: skip


def _sentence_transformers_modules(folder: Path) -> tuple[str, bool]:
    """``(pooling, normalize)`` of a folder's sentence-transformers modules (``modules.json``: the transformer,
    one ``Pooling`` module, optionally ``Normalize``); ``("mean", True)`` for a folder without ``modules.json``.

    Raises:
        CheckpointError: a module other than these, or a pooling mode other than mean or CLS (naming the file).
    """
    path = folder / "modules.json"
    if not path.is_file():
        return "mean", True
    modules = read_json(path, "sentence-transformers modules file")
    if not isinstance(modules, list) or not all(isinstance(m, dict) for m in modules):
        raise CheckpointError(f"sentence-transformers modules file {path} must hold a JSON list of objects")
    pooling, normalize = None, False
    for m in modules:
        kind = str(m.get("type", "")).rsplit(".", 1)[-1]
        if kind == "Transformer" and m.get("path", "") in ("", "."):
            continue
        if kind == "Normalize":
            normalize = True
            continue
        if kind == "Pooling" and pooling is None and not normalize:
            cfg_path = folder / str(m.get("path", "")) / CONFIG_NAME
            what = "sentence-transformers pooling config"
            cfg = read_json(cfg_path, what, dict_only=True) if cfg_path.is_file() else {}
            mode = cfg.get("pooling_mode")
            if mode is None:  # older files: one flag per mode (none set: mean)
                modes = [name for key, name in _ST_POOLING_FLAGS.items() if cfg.get(key)]
                mode = modes or ["mean"]
            mode = mode[0] if isinstance(mode, list) and len(mode) == 1 else mode
            if mode not in _POOLINGS:
                raise CheckpointError(f"{cfg_path}: pooling mode {mode!r}; Encoder pools with {' or '.join(_POOLINGS)}")
            pooling = mode
            continue
        raise CheckpointError(
            f"sentence-transformers modules file {path}: module {m.get('type')!r} (path {m.get('path')!r}); Encoder "
            f"runs the transformer, then one Pooling (mean or cls), then Normalize"
        )
    return pooling or "mean", normalize


class Encoder:
    """Sentence vectors from a BERT folder: mean of the last hidden states over the real tokens (or the first
    token's), L2-normalised on request (sentence-transformers' mean / CLS pooling; mean: what ``Bert.embed``
    computes).

    Args:
        model: a :class:`Bert`, its ``fast_inference`` or int8 form (anything with Bert's forward).
        tokenizer: an HF tokenizer (a callable giving ``input_ids``).
        max_length: tokens kept per text (longer texts are truncated); at most the model's positions and the
            tokenizer's ``model_max_length`` (where sentence-transformers writes its ``max_seq_length``).
        pooling: ``"mean"`` (over the real tokens) or ``"cls"`` (the first token's hidden state).
        normalize: :meth:`encode`'s default for its ``normalize``.
    """

    def __init__(
        self, model, tokenizer, *, max_length: int | None = None, pooling: str = "mean", normalize: bool = True
    ) -> None:
        self.model, self.tokenizer = model, tokenizer
        check_positive_int("max_length", max_length, allow_none=True)
        if pooling not in _POOLINGS:
            raise ValueError(f"pooling must be one of {', '.join(map(repr, _POOLINGS))}, got {pooling!r}")
        if not isinstance(normalize, bool):
            raise TypeError(f"normalize must be a bool, got {normalize!r}")
        self.pooling, self.normalize = pooling, normalize
        limits = [model.config.max_positions, getattr(tokenizer, "model_max_length", None), max_length]
        self.max_length = min(n for n in limits if isinstance(n, int))

    @classmethod
    def from_pretrained(
        cls, folder: str | os.PathLike, *, dtype: torch.dtype = torch.float32, quantize: str | None = None
    ) -> Encoder:
        """The folder's BERT and tokenizer. The model runs through :func:`sublayer.models.fast_inference`
        (``dtype``: float32, the model's numbers; ``torch.bfloat16``: bf16 where the CPU multiplies bf16
        natively); ``quantize="int8"``: int8 (a saved int8 folder loads as it is). A sentence-transformers folder's
        ``max_seq_length`` (its tokenizer's ``model_max_length``, or ``sentence_bert_config.json``'s) sets
        :attr:`max_length`, and its ``modules.json`` the pooling (its ``Pooling`` module's mode: mean or CLS) and
        whether :meth:`encode` normalises by default (a ``Normalize`` module), so that ``encode`` gives the
        folder's sentence-transformers vectors.

        Raises:
            FileNotFoundError/ValueError: no folder, no tokenizer, not a BERT, bad ``dtype`` or ``quantize``; a
            sentence-transformers folder with a module or pooling mode other than these (a ``Dense`` layer,
            max pooling, ...), named with its file.
        """
        folder = resolve_folder(folder)
        q.check_quantize(quantize)
        net = _saved_int8(folder, q.QuantizedBert, "BERT", "embed")
        if net is None:
            bert = Bert.from_pretrained(folder)
            net = q.quantize(bert) if quantize is not None else fast_inference(bert, dtype=dtype)
        st = folder / "sentence_bert_config.json"
        st_config = read_json(st, "sentence-transformers config", dict_only=True) if st.is_file() else {}
        max_length = st_config.get("max_seq_length")
        pooling, normalize = _sentence_transformers_modules(folder)
        return cls(net, load_tokenizer(folder, why="embed"), max_length=max_length, pooling=pooling,
                   normalize=normalize)  # fmt: skip

    @torch.no_grad()
    def encode(
        self,
        texts: str | list[str],
        *,
        batch_size: int = 32,
        normalize: bool | None = None,
        show_progress_bar: bool = False,
    ) -> Tensor:
        """Vectors of ``texts``, in their order.

        Texts are tokenized once, sorted by length (longest first) and run ``batch_size`` at a time, so a batch
        pads little (sentence-transformers' order); each vector equals the text's alone (up to rounding).

        Args:
            texts: a str, or a list of them. batch_size: texts per forward (>= 1). normalize: unit L2 norm (None:
            :attr:`normalize`, True unless a sentence-transformers folder has no ``Normalize`` module).
            show_progress_bar: a ``tqdm`` bar over the batches.

        Returns:
            (N, d_model) float32 for a list (N = len(texts), (0, d_model) for an empty one); (d_model,) for a str.

        Raises:
            TypeError: ``texts`` not a str or a list of str (naming the item). ValueError: bad ``batch_size``, a
            text that encodes to no tokens.
        """
        items = _texts("texts", texts)
        check_positive_int("batch_size", batch_size)
        normalize = self.normalize if normalize is None else normalize
        if not items:
            return torch.empty(0, self.model.config.d_model)
        rows = self.tokenizer(items, truncation=True, max_length=self.max_length)
        ids = _token_rows(rows["input_ids"], items, "texts[{i}]")
        types = rows.get("token_type_ids") or [[0] * len(r) for r in ids]
        order = sorted(range(len(ids)), key=lambda i: -len(ids[i]))
        out = torch.empty(len(ids), self.model.config.d_model)
        batches = [order[s : s + batch_size] for s in range(0, len(order), batch_size)]
        if show_progress_bar:
            from tqdm.auto import tqdm

            batches = tqdm(batches, desc="Batches")
        pad = self.model.config.pad_token_id or 0
        for batch in batches:
            x, mask = _pad([ids[i] for i in batch], pad, left=False)
            tt, _ = _pad([types[i] for i in batch], 0, left=False)
            h = self.model(x, mask, tt)
            if self.pooling == "cls":  # (right padding: the first token is a real one)
                out[batch] = F.normalize(h[:, 0].float(), dim=-1) if normalize else h[:, 0].float()
            else:
                out[batch] = mean_pooled(h.float(), mask, normalize=normalize)
        return out[0] if isinstance(texts, str) else out


class TextGenerator:
    """Continuation of text prompts by a causal LM and its tokenizer.

    ``generate``'s options are the model's (:meth:`sublayer.models.GPT2.generate`: ``max_new_tokens``,
    ``max_length``, ``do_sample``, ``temperature``, ``top_k``, ``top_p``, ``eos_token_id``, ``pad_token_id``,
    ``generator``); what is not given comes from the folder's ``generation_config.json`` (else ``config.json``'s
    special ids, else HF's defaults), as HF's ``generate``. The text after the first end token is dropped.

    Args:
        model: a :class:`GPT2` / :class:`Llama`, or a prepared (``fast_inference``, int8) form.
        tokenizer: an HF tokenizer, or None: the folder's, read at first use (id prompts need none).
        folder: where that tokenizer lives (with ``tokenizer=None``).
    """

    def __init__(self, model, tokenizer=None, *, folder: str | os.PathLike | None = None) -> None:
        self.model, self._tokenizer, self.folder = model, tokenizer, folder

    @classmethod
    def from_pretrained(
        cls, folder: str | os.PathLike, *, quantize: str | None = None, tokenizer=None
    ) -> TextGenerator:
        """The folder's model (:func:`load_causal_lm`) and tokenizer (read at first use; ``tokenizer``: this one
        instead)."""
        folder = resolve_folder(folder)
        return cls(load_causal_lm(folder, quantize=quantize), tokenizer, folder=folder)

    @property
    def tokenizer(self):
        if self._tokenizer is None:
            if self.folder is None:
                raise ValueError("this TextGenerator has no tokenizer: pass tokenizer= or use from_pretrained")
            self._tokenizer = load_tokenizer(self.folder, why="a text prompt")
        return self._tokenizer

    def _prompt_ids(self, prompts: list[str]) -> list[list[int]]:
        return _token_rows(self.tokenizer(prompts)["input_ids"], prompts, "the prompt")

    def _eos(self, options: dict) -> list[int]:
        eos = options.get("eos_token_id", FROM_CONFIG)
        return check_eos_ids("eos_token_id", self.model.generation_config.get("eos_token_id") if eos is FROM_CONFIG else eos)

    def continuation(self, prompt_ids: list[int], new_ids: list[int], eos: list[int] = ()) -> str:
        """The text that ``new_ids`` add after ``prompt_ids`` (decoded together, so merged tokens and leading
        spaces come out as in the whole text), cut before the first of the ``eos`` ids."""
        cut = next((i for i, t in enumerate(new_ids) if t in eos), len(new_ids))
        decode = lambda ids: self.tokenizer.decode(ids, skip_special_tokens=True)  # noqa: E731
        return decode(prompt_ids + new_ids[:cut])[len(decode(prompt_ids)) :]

    def generate(self, prompt: str | list[str], *, return_full_text: bool = True, **options) -> str | list[str]:
        """Continue ``prompt`` (a str, or a list of them decoded as one left-padded batch).

        Args:
            return_full_text: the prompt followed by its continuation (HF pipeline's default), or the
                continuation only.
            options: the model's ``generate`` options (see the class docstring).

        Returns:
            A str for a str prompt, else a list of str in the prompts' order.

        Raises:
            TypeError/ValueError: a prompt that is not a str or encodes to no tokens; the model's errors for the
            options (named as its ``generate`` names them).
        """
        prompts = _texts("prompt", prompt)
        if not prompts:
            return []
        rows = self._prompt_ids(prompts)
        ids, mask = _pad(rows, 0, left=True)
        out = self.model.generate(ids, attention_mask=mask if len(rows) > 1 else None, **options)
        eos = self._eos(options)
        texts = [self.continuation(r, out[i, ids.shape[1] :].tolist(), eos) for i, r in enumerate(rows)]
        if return_full_text:
            texts = [p + t for p, t in zip(prompts, texts)]
        return texts[0] if isinstance(prompt, str) else texts

    def stream(self, prompt: str, **options) -> Iterator[str]:
        """The continuation of ``prompt`` as it is made: an iterator of text pieces that join to
        ``generate(prompt, return_full_text=False, **options)`` (HF's ``TextIteratorStreamer``). A piece is
        yielded once it is final: an incomplete character (a token that ends inside a multi-byte character) is
        held back until the tokens that complete it. Decoding runs in a background thread; leaving the loop early
        stops it at the next token. Option errors are raised by the first ``next``.

        Raises:
            TypeError: ``prompt`` not a str.
        """
        if not isinstance(prompt, str):
            raise TypeError(f"prompt must be a str (stream continues one prompt), got {type(prompt).__name__}")
        return self._pieces(self._prompt_ids([prompt])[0], options)

    def _pieces(self, prompt_ids: list[int], options: dict) -> Iterator[str]:
        pieces: queue.Queue = queue.Queue()
        streamer = _TextPieces(self, prompt_ids, self._eos(options), pieces.put)
        done = object()

        def run() -> None:
            try:
                self.model.generate(torch.tensor([prompt_ids]), streamer=streamer, **options)
            except _Stopped:
                pass
            except BaseException as e:  # raised in the consumer's thread
                pieces.put(e)
            finally:
                pieces.put(done)

        worker = threading.Thread(target=run, name="sublayer-stream", daemon=True)
        worker.start()
        try:
            while (item := pieces.get()) is not done:
                if isinstance(item, BaseException):
                    raise item
                yield item
        finally:
            streamer.closed = True
            worker.join()


class _Stopped(Exception):
    """The consumer of :meth:`TextGenerator.stream` left: stop decoding."""


class _TextPieces:
    """HF's streamer protocol (``put``/``end``) turning a one-row decode into final text pieces (see
    :meth:`TextGenerator.stream`)."""

    def __init__(self, gen: TextGenerator, prompt_ids: list[int], eos: list[int], emit) -> None:
        self.gen, self.prompt_ids, self.eos, self.emit = gen, prompt_ids, eos, emit
        self.new: list[int] = []
        self.sent, self.started, self.finished, self.closed = "", False, False, False

    def put(self, ids: Tensor) -> None:
        if self.closed:
            raise _Stopped
        if not self.started:  # the prompt
            self.started = True
            return
        if self.finished:
            return
        token = int(ids.reshape(-1)[0])
        self.finished = token in self.eos
        self.new.append(token)
        self._flush(final=False)

    def end(self) -> None:
        self._flush(final=True)

    def _flush(self, final: bool) -> None:
        text = self.gen.continuation(self.prompt_ids, self.new, self.eos)
        if not text.startswith(self.sent) or (not final and text.endswith("\ufffd")):
            return  # not final yet: an incomplete character, or a later token changed the text before it
        if len(text) > len(self.sent):
            self.emit(text[len(self.sent) :])
            self.sent = text
