"""What the int8 paths share: the symmetric per-channel quantization of one weight, the dense layers that
``keep_float`` patterns name, the saved folder's tensors (name -> shape, dtype) and its ``quantization_config``, and
the wrappers' snapshot-or-follow bookkeeping (:class:`Int8Wrapper`)."""

from __future__ import annotations

import fnmatch
from typing import Any

import torch
from torch import Tensor

from .. import checkpoints as ckpt
from ..runtime.linear import int8_screens_rows, quantize_weight
from ..runtime.rows import kernels_on
from ..runtime.weights import prepared

__all__ = [
    "QUANTIZE_CHOICES", "QUANT_METHOD", "LINEARS", "Spec", "check_quantize", "quantize_weight", "check_float_cpu",
    "dense_names", "check_keep_float", "is_dense", "folder_spec", "int8_tensors",
    "check_tensors", "quant_config", "own_int8_gemm", "Int8Wrapper",
]  # fmt: skip

LINEARS = ("qkv", "out", "fc1", "fc2")  # the dense layers of a block, as keep_float patterns name them

QUANTIZE_CHOICES = ("int8",)
QUANT_METHOD = "sublayer-int8"

def own_int8_gemm() -> bool:
    """Whether int8 layers with int8 activations run on sublayer's ``int8_linear`` kernel: the kernels on and a
    CPU with AVX512-VNNI or AMX-INT8. Elsewhere fbgemm's ``linear_dynamic`` multiplies faster than that kernel's
    portable loop (BERT), and several rows of a causal LM stay weight-only. Decided when a model is built."""
    return kernels_on() and int8_screens_rows()


def check_quantize(quantize: object) -> None:
    """Raises ValueError unless ``quantize`` is None or one of :data:`QUANTIZE_CHOICES`."""
    if quantize is not None and quantize not in QUANTIZE_CHOICES:
        raise ValueError(f"quantize must be None or one of {', '.join(map(repr, QUANTIZE_CHOICES))}, got {quantize!r}")


def check_float_cpu(model: torch.nn.Module) -> None:
    for name, p in model.named_parameters():
        if p.device.type != "cpu":
            raise ValueError(f"int8 quantization runs on the CPU only; parameter {name} is on {p.device}")
        if p.dtype != torch.float32:
            raise ValueError(f"int8 quantization needs float32 parameters; {name} is {p.dtype} (call model.float())")


def dense_names(n_layers: int, head: bool = False) -> list[str]:
    """The dense layers ``keep_float`` patterns are matched against: ``layers.{i}.{qkv,out,fc1,fc2}`` (and
    ``head``, GPT-2's LM head)."""
    return [f"layers.{i}.{k}" for i in range(n_layers) for k in LINEARS] + (["head"] if head else [])


def check_keep_float(keep_float: object, names: list[str]) -> tuple[str, ...]:
    """``keep_float`` as a tuple of ``fnmatch`` patterns, each matching at least one of ``names``.

    Raises:
        TypeError: not a sequence of str. ValueError: a pattern that matches no layer, listing the layer names.
    """
    if isinstance(keep_float, str) or not all(isinstance(p, str) for p in keep_float):  # type: ignore[union-attr]
        raise TypeError(f"keep_float must be a sequence of fnmatch patterns (str), got {keep_float!r}")
    unmatched = [p for p in keep_float if not fnmatch.filter(names, p)]  # type: ignore[union-attr]
    if unmatched:
        n = sum(name.startswith("layers.") for name in names) // len(LINEARS)
        head = ", head" if "head" in names else ""
        raise ValueError(
            f"keep_float pattern(s) {', '.join(map(repr, unmatched))} match no layer; the layers are "
            f"layers.{{i}}.{{{','.join(LINEARS)}}} for i in 0..{n - 1}{head} (e.g. {names[0]!r})"
        )
    return tuple(keep_float)  # type: ignore[arg-type]


Spec = dict[str, tuple[tuple[int, ...], torch.dtype]]


def is_dense(name: str) -> bool:
    """Whether a tensor name is a dense layer's weight (what int8 stores as qweight + scale):
    ``layers.{i}.{qkv,out,fc1,fc2}.weight`` or ``head.weight``."""
    parts = name.split(".")
    return name == "head.weight" or (len(parts) == 4 and parts[0] == "layers" and parts[2] in LINEARS and parts[3] == "weight")


def folder_spec(
    tensors: dict[str, Tensor], keep_float: tuple[str, ...], *, smooth: bool = False, tied: bool = False
) -> Spec:
    """What a saved folder holds for a float model's ``tensors`` (meta tensors: shapes only): name -> (shape,
    dtype) of what :func:`int8_tensors` stores, run on them: float32, but a dense weight (:func:`is_dense`) that
    ``keep_float`` does not match is ``{layer}.qweight`` int8 + ``{layer}.scale`` (+ ``{layer}.smooth`` with
    ``smooth``); with ``tied``, a float head is ``wte`` itself."""
    ones = {n.rsplit(".", 1)[0]: torch.ones(v.shape[1], device="meta") for n, v in tensors.items() if is_dense(n)}
    t = int8_tensors(tensors, keep_float, copy=False, tied=tied, smooth=ones if smooth else None)
    return {name: (tuple(v.shape), v.dtype) for name, v in t.items()}


def int8_tensors(tensors: dict[str, Tensor], keep_float: tuple[str, ...], *, copy: bool, tied: bool = False,
                 smooth: dict[str, Tensor] | None = None) -> dict[str, Tensor]:  # fmt: skip
    """A float model's named ``tensors`` as int8 stores them: each dense weight (:func:`is_dense`) ``keep_float``
    does not match as ``{layer}.qweight`` + ``{layer}.scale`` (of ``W * smooth[layer]`` where given, stored as
    ``{layer}.smooth``); the rest float32, contiguous, cloned with ``copy`` (a snapshot); with ``tied``, a float
    head is ``wte`` itself."""
    t: dict[str, Tensor] = {}
    for name, v in tensors.items():
        layer = name.rsplit(".", 1)[0]
        if is_dense(name) and not any(fnmatch.fnmatchcase(layer, p) for p in keep_float):
            w = v.detach().float()
            if smooth and layer in smooth:
                t[f"{layer}.smooth"] = smooth[layer]
                w = w * smooth[layer]
            t[f"{layer}.qweight"], t[f"{layer}.scale"] = quantize_weight(w)
        elif not (tied and name == "head.weight"):
            v = v.detach().float().contiguous()
            t[name] = v.clone() if copy else v
    return t


def check_tensors(tensors: dict[str, Tensor], spec: Spec, source, optional: set[str] = frozenset()) -> None:
    """Every tensor of ``spec`` present with its shape and dtype, none other (one CheckpointError lists all)."""
    ckpt.check_and_convert(
        tensors, {k: v[0] for k, v in spec.items()}, canonical=lambda k: k, source=source, optional=optional,
        dtypes={k: v[1] for k, v in spec.items()},
    )  # fmt: skip


def quant_config(keep_float: tuple[str, ...], activations: str) -> dict[str, Any]:
    return {
        "quant_method": QUANT_METHOD,
        "weights": "int8 symmetric per output channel",
        "activations": activations,
        "keep_float": list(keep_float),
    }


class Int8Wrapper:
    """What the int8 wrappers share (:class:`~.quantized.QuantizedBert`, :class:`~.quantized_gpt2.QuantizedCausalLM`):
    a snapshot of its own tensors (``model`` None), or a ``model`` followed, its current weights re-quantized on the
    next call after any change (:func:`sublayer.runtime.weights.prepared`). Subclasses call ``_follow`` and give
    ``_key`` (the cache key, with :func:`kernels_on` added), ``_quantize(model)`` -> tensors and
    ``_build(tensors)`` -> ``(tensors, prepared form)``; ``_activations``: the saved config's words for them."""

    _activations = "int8 dynamic per token, chosen at run time (not stored)"
    compute_dtype = torch.float32  # what the float parts (embeddings, norms, attention) run in

    def _follow(self, config, keep_float: tuple[str, ...], model, tensors: dict[str, Tensor] | None) -> None:
        self.config, self.keep_float = config, tuple(keep_float)
        self.model, self._own, self._form = model, tensors, None
        if model is not None:
            self._train_error = "is an inference-only wrapper; train the model itself: it re-quantizes on the next call"

    def _parts(self) -> tuple[dict[str, Tensor], Any]:
        """``(tensors, prepared form)``: a following wrapper's from :func:`sublayer.runtime.weights.prepared`
        (re-quantized whenever a parameter of the model changed), a snapshot's built once."""
        if self.model is not None:
            return prepared(self.model, (*self._key, kernels_on()), lambda m: self._build(self._quantize(m)))
        if self._form is None:
            self._form = self._build(self._own)
        return self._form

    @property
    def tensors(self) -> dict[str, Tensor]:
        """The stored tensors (dense layers as ``{name}.qweight`` + ``{name}.scale`` unless kept float)."""
        return self._own if self.model is None else self._parts()[0]

    def save_pretrained(self, folder) -> None:
        """``model.safetensors`` (the int8 and float tensors), ``config.json`` (the model's HF config with
        ``quantization_config``) and, for a causal LM, ``generation_config.json``; read back with
        :func:`sublayer.models.quantized.load_quantized`."""
        cfg = self.config.to_hf_dict()
        cfg["quantization_config"] = quant_config(self.keep_float, self._activations)
        ckpt.write_folder(folder, self.tensors, cfg)
        if getattr(self, "generation_config", None) is not None:
            ckpt.write_generation_config(folder, self.generation_config)
