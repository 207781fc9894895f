"""Converting live (in-memory) Hugging Face models, both ways — the folder loaders' logic without the files.

:func:`read_hf_model` is :func:`~sublayer.checkpoints.io.read_hf_folder` for a model object (its config and state
dict); :func:`load_checked` fills a model built on the meta device from HF-named tensors through a key map, with
the same strict checks as loading a folder; :func:`build_hf_model` makes a ``transformers`` model from our config
dict and HF-named tensors. The models' ``from_hf``/``to_hf`` are thin wrappers over these and the key maps
(:mod:`.gpt2`, :mod:`.bert`). ``transformers`` is imported only by :func:`build_hf_model`.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from typing import Any

import torch
from torch import Tensor, nn

from .io import CheckpointError, check_and_convert

__all__ = ["read_hf_model", "placement", "load_checked", "build_hf_model"]


def placement(model: nn.Module) -> tuple[torch.device, torch.dtype]:
    """The device and dtype of a model's first floating-point parameter (where a conversion puts its copy)."""
    for p in model.parameters():
        if p.is_floating_point():
            return p.device, p.dtype
    raise ValueError(f"{type(model).__name__} has no floating-point parameter to take a device and dtype from")


def read_hf_model(model: object, from_hf_dict: Callable[[dict[str, Any]], Any]) -> tuple[Any, dict[str, Tensor], str]:
    """A live Hugging Face model as ``(config built by from_hf_dict(model.config.to_dict()), its tensors, a name
    for error messages)``.

    Raises:
        TypeError: not an ``nn.Module`` with a ``config`` that has ``to_dict()`` (a ``PreTrainedModel``).
        CheckpointError (a ValueError): a config that ``from_hf_dict`` rejects, naming the model class.
    """
    name = type(model).__name__
    if not isinstance(model, nn.Module) or not callable(getattr(getattr(model, "config", None), "to_dict", None)):
        raise TypeError(f"model must be a Hugging Face PreTrainedModel (an nn.Module with .config), got {name}")
    try:
        config = from_hf_dict(model.config.to_dict())
    except (ValueError, TypeError) as e:
        raise CheckpointError(f"{name}.config: {e}") from None
    return config, {k: v.detach() for k, v in model.state_dict().items()}, f"{name} (in memory)"


def load_checked(
    model: nn.Module,
    tensors: Mapping[str, Tensor],
    source: str,
    *,
    to_hf: Callable[[dict[str, Tensor]], dict[str, Tensor]],
    from_hf: Callable[[dict[str, Tensor]], dict[str, Tensor]],
    canonical: Callable[[str], str | None],
    device: torch.device | str | None,
    after_empty: Callable[[], None] | None = None,
) -> nn.Module:
    """Fill ``model`` (built on the meta device) from HF-named ``tensors``: check every key and shape against what
    the model needs (one :class:`CheckpointError` listing all problems), allocate on ``device`` (None -> CPU),
    run ``after_empty`` (re-tie shared weights), load strictly, and return the model."""
    expected = {k: tuple(v.shape) for k, v in to_hf(model.state_dict()).items()}
    found = check_and_convert(tensors, expected, canonical=canonical, source=source)
    model.to_empty(device=device if device is not None else "cpu")
    if after_empty is not None:
        after_empty()
    model.load_state_dict(from_hf(found))  # strict: fills every parameter
    return model


def build_hf_model(
    architecture: str, hf_config: Mapping[str, Any], tensors: Mapping[str, Tensor], *, training: bool = False, **kwargs
) -> nn.Module:
    """A ``transformers`` model (``architecture``, e.g. ``"GPT2LMHeadModel"``) made from an HF config dict (as our
    configs' ``to_hf_dict`` give) and its HF-named tensors (copied), on their device and dtype.

    Raises:
        ImportError: transformers is not installed. CheckpointError: a parameter of the HF model that the tensors
        do not fill, or a tensor it has no place for (both listed).
    """
    try:
        import transformers
    except ImportError:  # pragma: no cover - depends on the environment
        raise ImportError("to_hf() needs Hugging Face transformers: pip install transformers") from None
    d = dict(hf_config)
    d.pop("architectures", None)
    config = transformers.AutoConfig.for_model(d.pop("model_type"), **d)
    model = getattr(transformers, architecture)(config, **kwargs)
    ref = next(iter(tensors.values()))
    model.to(device=ref.device, dtype=ref.dtype)
    missing, unexpected = model.load_state_dict(dict(tensors), strict=False)
    params = {n for n, _ in model.named_parameters()}  # shared (tied) parameters are listed once
    missing = sorted(k for k in missing if k in params)
    if missing or unexpected:
        raise CheckpointError(
            f"cannot build {architecture}: parameters not filled {missing}, tensors with no place {sorted(unexpected)}"
        )
    return model.train(training)
