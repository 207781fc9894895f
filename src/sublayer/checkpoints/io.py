"""Reading and writing Hugging Face-format checkpoint folders, with errors that name the file.

A folder holds ``config.json`` and the weights in one of (first found wins):
``model.safetensors``, ``model.safetensors.index.json`` (sharded safetensors), ``pytorch_model.bin``
(read only with ``torch.load(weights_only=True)``: never unpickles arbitrary objects).

:func:`check_and_convert` is the strict part of loading: one :class:`CheckpointError` lists every missing,
unexpected and wrong-shape key at once. This module knows nothing about any model; the key maps
(:mod:`sublayer.checkpoints.gpt2`, :mod:`sublayer.checkpoints.bert`) say how names and layouts differ.
"""

from __future__ import annotations

import json
import os
import tempfile
from collections.abc import Callable, Mapping
from pathlib import Path
from typing import Any

import torch
from torch import Tensor

__all__ = [
    "CheckpointError",
    "CONFIG_NAME",
    "SAFETENSORS_NAME",
    "SAFETENSORS_INDEX_NAME",
    "TORCH_BIN_NAME",
    "folder_path",
    "resolve_folder",
    "hub_cache",
    "cached_snapshot",
    "read_json",
    "read_config",
    "read_state_dict",
    "read_hf_folder",
    "atomic_write",
    "write_folder",
    "check_and_convert",
    "HF_ACTIVATIONS",
    "TO_HF_ACTIVATIONS",
    "hf_activation",
]

CONFIG_NAME = "config.json"
SAFETENSORS_NAME = "model.safetensors"
SAFETENSORS_INDEX_NAME = "model.safetensors.index.json"
TORCH_BIN_NAME = "pytorch_model.bin"


class CheckpointError(ValueError):
    """A checkpoint that cannot be loaded: bad file contents, or keys/shapes that do not fit the model."""


def hub_cache() -> Path:
    """The Hugging Face hub cache folder (``huggingface_hub``'s rule: ``HF_HUB_CACHE``, else ``HF_HOME/hub``, else
    ``XDG_CACHE_HOME/huggingface/hub``, else ``~/.cache/huggingface/hub``)."""
    if os.environ.get("HF_HUB_CACHE"):
        return Path(os.environ["HF_HUB_CACHE"]).expanduser()
    if os.environ.get("HF_HOME"):
        return Path(os.environ["HF_HOME"]).expanduser() / "hub"
    return Path(os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache").expanduser() / "huggingface" / "hub"


def cached_snapshot(name: str) -> Path | None:
    """The local Hugging Face cache's folder of the model ``name`` (``"gpt2"``, ``"org/model"``): the snapshot of
    ``refs/main``, else the newest snapshot; None when the cache does not hold it. Never uses the network."""
    parts = name.split("/")
    if not 1 <= len(parts) <= 2 or not all(p and p not in (".", "..") for p in parts):
        return None
    repo = hub_cache() / ("models--" + "--".join(parts))
    snapshots = repo / "snapshots"
    try:
        main = (repo / "refs" / "main").read_text().strip()
    except OSError:
        main = ""
    if main and (snapshots / main / CONFIG_NAME).is_file():
        return snapshots / main
    found = sorted((p for p in snapshots.glob("*") if (p / CONFIG_NAME).is_file()), key=lambda p: p.stat().st_mtime)
    return found[-1] if found else None


def folder_path(folder: str | os.PathLike, name: str = "folder") -> Path:
    """``folder`` (a ``str`` or an ``os.PathLike`` of a str path) as a ``Path``.

    Raises:
        TypeError: anything else (None, bytes, a number...), naming ``name``, the value and the rule.
    """
    if isinstance(folder, str) or (isinstance(folder, os.PathLike) and isinstance(os.fspath(folder), str)):
        return Path(folder)
    raise TypeError(f"{name} must be a folder's path (a str or an os.PathLike such as pathlib.Path), got {folder!r} "
                    f"({type(folder).__name__})")  # fmt: skip


def resolve_folder(folder: str | os.PathLike) -> Path:
    """The folder as a ``Path``: a local folder, or a model name (``"gpt2"``, ``"org/model"``) that the local
    Hugging Face cache holds (:func:`cached_snapshot`; nothing is downloaded).

    Raises:
        FileNotFoundError: neither (saying how to get a folder). NotADirectoryError: it is a file. TypeError:
        ``folder`` is not a str or an ``os.PathLike`` (:func:`folder_path`).
    """
    path = folder_path(folder)
    if not path.exists():
        cached = cached_snapshot(str(folder))
        if cached is not None:
            return cached
        raise FileNotFoundError(
            f"checkpoint folder not found: {path} (a local folder with config.json and the weights is needed; nothing "
            f"is downloaded: get one with `hf download MODEL --local-dir DIR` or transformers' "
            f"save_pretrained(DIR), and pass DIR; a model name is also looked up in the local Hugging Face cache "
            f"{hub_cache()})"
        )
    if not path.is_dir():
        raise NotADirectoryError(f"checkpoint path is not a folder: {path}")
    return path


def read_json(path: str | os.PathLike, what: str, *, dict_only: bool = False) -> Any:
    """The JSON value in the file ``path``, read as UTF-8 (``dict_only``: it must be a JSON object).

    Raises:
        FileNotFoundError: no such file. CheckpointError: not UTF-8, not valid JSON, or (``dict_only``) not a JSON
        object. Each names ``what`` (``"config file"``) and the file.
    """
    if not Path(path).is_file():
        raise FileNotFoundError(f"{what} not found: {path}")
    try:
        value = json.loads(Path(path).read_text(encoding="utf-8"))
    except (json.JSONDecodeError, UnicodeDecodeError) as e:
        raise CheckpointError(f"{what} {path} is not valid JSON: {e}") from None
    if dict_only and not isinstance(value, dict):
        raise CheckpointError(f"{what} {path} must hold a JSON object, got {type(value).__name__}")
    return value


def read_config(folder: str | os.PathLike) -> dict[str, Any]:
    """``FOLDER/config.json`` as a dict.

    Raises:
        FileNotFoundError: no folder or no config.json. CheckpointError: not valid JSON, or not a JSON object.
    """
    return read_json(resolve_folder(folder) / CONFIG_NAME, "config file", dict_only=True)


def _load_safetensors(path: Path) -> dict[str, Tensor]:
    from safetensors import SafetensorError
    from safetensors.torch import load_file

    try:
        return load_file(str(path), device="cpu")
    except (SafetensorError, OSError, RuntimeError, ValueError) as e:
        raise CheckpointError(f"cannot read safetensors file {path} (truncated or not safetensors?): {e}") from None


def _load_sharded(index_path: Path) -> dict[str, Tensor]:
    try:
        index = json.loads(index_path.read_text(encoding="utf-8"))
        shards = set(index["weight_map"].values())
        if not all(isinstance(s, str) for s in shards):
            raise TypeError(f"weight_map's values must be shard file names, got {sorted(map(repr, shards))}")
        shards = sorted(shards)
    except (json.JSONDecodeError, UnicodeDecodeError, KeyError, TypeError, AttributeError) as e:
        raise CheckpointError(f"index file {index_path} is not a valid safetensors index: {e!r}") from None
    out: dict[str, Tensor] = {}
    where: dict[str, str] = {}
    for shard in shards:
        shard_path = index_path.parent / shard
        if not shard_path.is_file():
            raise FileNotFoundError(f"shard {shard_path} listed in {index_path} not found")
        for key, t in _load_safetensors(shard_path).items():
            if key in out:  # which copy is meant cannot be told: never keep one silently
                raise CheckpointError(f"tensor {key} is in two shards of {index_path}: {where[key]} and {shard}")
            out[key], where[key] = t, shard
    return out


def _load_torch_bin(path: Path) -> dict[str, Tensor]:
    try:
        # weights_only=True: tensors and plain containers only; a pickle carrying code is refused.
        sd = torch.load(str(path), map_location="cpu", weights_only=True)
    except Exception as e:  # UnpicklingError, RuntimeError (bad zip), EOFError (truncated) ...
        msg = str(e).splitlines()[0] if str(e) else type(e).__name__
        raise CheckpointError(
            f"cannot read {path} with torch.load(weights_only=True) (truncated, or holds more than tensors?): {msg}"
        ) from None
    if not isinstance(sd, Mapping) or not all(isinstance(v, Tensor) for v in sd.values()):
        raise CheckpointError(f"{path} must hold a dict of tensors (a state dict), got {type(sd).__name__}")
    return dict(sd)


def read_state_dict(folder: str | os.PathLike) -> tuple[dict[str, Tensor], Path]:
    """The tensors of a checkpoint folder on the CPU, and the file (or index) they came from.

    Raises:
        FileNotFoundError: no folder, or no weights file in it (listing the names looked for).
        CheckpointError: unreadable or truncated file (naming it).
    """
    path = resolve_folder(folder)
    for name, loader in (
        (SAFETENSORS_NAME, _load_safetensors),
        (SAFETENSORS_INDEX_NAME, _load_sharded),
        (TORCH_BIN_NAME, _load_torch_bin),
    ):
        f = path / name
        if f.is_file():
            return loader(f), f
    raise FileNotFoundError(
        f"no weights file in {path}: expected {SAFETENSORS_NAME}, {SAFETENSORS_INDEX_NAME} or {TORCH_BIN_NAME}"
    )


def read_hf_folder(
    folder: str | os.PathLike, from_hf_dict: Callable[[dict[str, Any]], Any]
) -> tuple[Any, dict[str, Tensor], Path]:
    """Read an HF model folder: ``(config built by from_hf_dict(config.json), tensors, weights file)``.

    Raises:
        FileNotFoundError: no folder, config or weights file. CheckpointError: bad JSON, a config that
        ``from_hf_dict`` rejects (named with the file), a quantized folder (``quantization_config``), an
        unreadable weights file.
    """
    hf_config = read_config(folder)
    quant = hf_config.get("quantization_config")
    if quant is not None:
        method = quant.get("quant_method") if isinstance(quant, dict) else quant
        hint = (
            " (written by sublayer's QuantizedBert/QuantizedGPT2.save_pretrained: load it with "
            "sublayer.models.quantized.load_quantized(folder))" if method == "sublayer-int8" else ""
        )
        raise CheckpointError(
            f"config file {os.path.join(folder, CONFIG_NAME)}: the folder holds quantized weights "
            f"(quantization_config quant_method={method!r}), not float ones{hint}"
        )
    try:
        config = from_hf_dict(hf_config)
    except (ValueError, TypeError) as e:
        raise CheckpointError(f"config file {os.path.join(folder, CONFIG_NAME)}: {e}") from None
    tensors, source = read_state_dict(folder)
    return config, tensors, source


def atomic_write(path: str | os.PathLike, write: Callable[[str], None]) -> None:
    """Write a file through ``write(tmp_path)`` to a temporary name in the same folder, then rename it over
    ``path`` (``os.replace`` is atomic): an interrupted write (Ctrl-C, a full disk) never leaves a half file.

    The file gets the permissions ``open()`` would give it: an existing file's mode, else ``0o666`` less the
    umask (``mkstemp``'s ``0o600`` would hide checkpoints from the other users of a shared file system)."""
    path = Path(path)
    try:
        mode = path.stat().st_mode & 0o7777
    except FileNotFoundError:
        umask = os.umask(0o022)  # the only portable way to read it is to set it
        os.umask(umask)
        mode = 0o666 & ~umask
    fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=f".{path.name}.", suffix=".tmp")
    os.close(fd)
    try:
        write(tmp)
        os.chmod(tmp, mode)
        os.replace(tmp, path)
    except BaseException:
        Path(tmp).unlink(missing_ok=True)
        raise


def write_folder(folder: str | os.PathLike, tensors: Mapping[str, Tensor], config: Mapping[str, Any]) -> Path:
    """Write ``model.safetensors`` (contiguous, unshared CPU copies) and ``config.json`` into ``folder``.

    Returns:
        The folder's path (created if missing).

    Raises:
        TypeError: ``folder`` is not a str or an ``os.PathLike`` (:func:`folder_path`).
    """
    from safetensors.torch import save_file

    path = folder_path(folder)
    path.mkdir(parents=True, exist_ok=True)
    # clone: safetensors refuses tensors that share memory (tied weights) and non-contiguous views.
    data = {k: v.detach().to("cpu").contiguous().clone() for k, v in tensors.items()}
    atomic_write(path / SAFETENSORS_NAME, lambda p: save_file(data, p, metadata={"format": "pt"}))
    text = json.dumps(dict(config), indent=2, sort_keys=True) + "\n"
    atomic_write(path / CONFIG_NAME, lambda p: Path(p).write_text(text, encoding="utf-8"))
    return path


def _preview(keys: list[str], limit: int = 20) -> str:
    shown = ", ".join(keys[:limit])
    return shown + (f", ... ({len(keys) - limit} more)" if len(keys) > limit else "")


def check_and_convert(
    file_tensors: Mapping[str, Tensor],
    expected_shapes: Mapping[str, tuple[int, ...]],
    *,
    canonical: Callable[[str], str | None],
    source: str | os.PathLike,
    optional: frozenset[str] | set[str] = frozenset(),
    dtypes: Mapping[str, torch.dtype] | None = None,
) -> dict[str, Tensor]:
    """Rename a file's keys to their canonical (HF base-model) names and check them against the model.

    Args:
        file_tensors: the tensors as read from the file.
        expected_shapes: canonical name -> shape the model needs.
        canonical: file key -> canonical name, or None for a key that is ignored on purpose (buffers, heads).
        source: the file, named in the error.
        optional: canonical names that may be absent.
        dtypes: canonical name -> the dtype it must have (None: any dtype; float checkpoints are cast on load).

    Returns:
        canonical name -> tensor, exactly the expected keys (minus absent optional ones).

    Raises:
        CheckpointError: one error listing every missing, unexpected, duplicate, wrong-shape and wrong-dtype key.
    """
    found: dict[str, Tensor] = {}
    origin: dict[str, str] = {}
    unexpected: list[str] = []
    duplicate: list[str] = []
    for key, t in file_tensors.items():
        name = canonical(key)
        if name is None:
            continue
        if name not in expected_shapes:
            unexpected.append(key)
        elif name in found:
            duplicate.append(f"{key} (same as {origin[name]})")
        else:
            found[name], origin[name] = t, key
    missing = sorted(k for k in expected_shapes if k not in found and k not in optional)
    wrong = [
        f"{origin[k]}: expected {tuple(expected_shapes[k])}, got {tuple(t.shape)}"
        for k, t in sorted(found.items())
        if tuple(t.shape) != tuple(expected_shapes[k])
    ]
    wrong_dtype = [
        f"{origin[k]}: expected {dtypes[k]}, got {t.dtype}"
        for k, t in sorted(found.items())
        if dtypes is not None and k in dtypes and t.dtype != dtypes[k]
    ]
    kinds = {"missing keys": missing, "unexpected keys": sorted(unexpected), "keys given twice": sorted(duplicate),
             "wrong shapes": wrong, "wrong dtypes": wrong_dtype}  # fmt: skip
    problems = [f"{kind} ({len(keys)}): {_preview(keys)}" for kind, keys in kinds.items() if keys]
    if problems:
        raise CheckpointError(f"checkpoint {source} does not fit the model: " + "; ".join(problems))
    return found


# Hugging Face activation names (config ``activation_function`` / ``hidden_act``) -> ours, and back.
HF_ACTIVATIONS: dict[str, str] = {
    "gelu_new": "gelu_tanh",
    "gelu_pytorch_tanh": "gelu_tanh",
    "gelu": "gelu",
    "relu": "relu",
    "silu": "silu",
    "swish": "silu",
}
TO_HF_ACTIVATIONS: dict[str, str] = {"gelu_tanh": "gelu_new", "gelu": "gelu", "relu": "relu", "silu": "silu"}


def hf_activation(field: str, name: object) -> str:
    """Our activation name for a Hugging Face one.

    Raises:
        ValueError: an activation we do not implement exactly (never a silent default), naming the field.
    """
    if not isinstance(name, str) or name not in HF_ACTIVATIONS:
        raise ValueError(f"unsupported {field} {name!r}; supported: {', '.join(HF_ACTIVATIONS)}")
    return HF_ACTIVATIONS[name]
