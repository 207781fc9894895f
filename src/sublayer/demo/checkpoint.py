"""The demo's checkpoint: model, vocabulary, optimizer and trainer state, written atomically with Ctrl-C held."""

from __future__ import annotations

import json
from pathlib import Path

import torch
from torch import Tensor, nn

from ..checkpoints.io import CheckpointError, atomic_write, read_json
from ..models.transformer import Transformer
from .signals import hold_signals
from .task import Vocab

OPTIMIZER_NAME = "optimizer.safetensors"
STATE_NAME = "trainer_state.json"
VOCAB_NAME = "vocab.json"


def write_text(path: Path, text: str) -> None:
    atomic_write(path, lambda p: Path(p).write_text(text))


def save_checkpoint(
    folder: Path, model: nn.Module, opt: torch.optim.Optimizer, vocab: Vocab | None, state: dict,
    rng_state: Tensor | None = None,
) -> None:
    """Model (``save_pretrained``: safetensors + config), vocabulary (the demo's; None: ``sublayer train``, whose
    tokenizer is written once, at the start), ``optimizer.safetensors`` (the optimizer's tensors and torch's RNG
    state: ``rng_state``, default torch's now) and ``trainer_state.json`` (``state``: step, loss history...; plus the
    optimizer's param groups), each file written atomically, Ctrl-C and SIGTERM held meanwhile. The optimizer goes
    first and the trainer state last: a checkpoint cut short between its files (SIGKILL, a power cut) is one whose
    optimizer has made more updates than the trainer state's ``step``, which :func:`load_optimizer` refuses."""
    from safetensors.torch import save_file

    with hold_signals():
        folder.mkdir(parents=True, exist_ok=True)
        sd = opt.state_dict()
        tensors = {f"state.{i}.{k}": v.detach().contiguous().cpu()
                   for i, st in sd["state"].items() for k, v in st.items()}
        tensors["torch_rng_state"] = torch.get_rng_state() if rng_state is None else rng_state
        groups = [{k: (list(v) if isinstance(v, tuple) else v) for k, v in g.items()} for g in sd["param_groups"]]
        atomic_write(folder / OPTIMIZER_NAME, lambda p: save_file(tensors, p))
        model.save_pretrained(folder)
        if vocab is not None:
            write_text(folder / VOCAB_NAME, vocab.to_json())
        write_text(folder / STATE_NAME, json.dumps({**state, "param_groups": groups}, indent=1) + "\n")


def load_checkpoint(folder: str | Path) -> tuple[Transformer, Vocab, dict]:
    """(model, vocabulary, trainer state) from a demo folder. Raises FileNotFoundError naming a missing file."""
    folder = Path(folder)
    model = Transformer.from_pretrained(folder)
    vocab = Vocab.load(folder / VOCAB_NAME)
    return model, vocab, read_training_state(folder)


def read_training_state(folder: Path) -> dict:
    """``folder/trainer_state.json``, checked. Raises FileNotFoundError or ValueError naming the file."""
    path = folder / STATE_NAME
    if not path.is_file():
        raise FileNotFoundError(f"trainer state not found: {path} (not a demo checkpoint?)")
    state = read_json(path, "trainer state")
    _check_state(state, path)
    return state


# key: (types, what the error says)
_STATE_TYPES = {
    "step": (int, "an int ≥ 0"), "history": (dict, "an object"), "train_seconds": ((int, float), "a number ≥ 0"),
    "tokens_seen": (int, "an int ≥ 0"), "param_groups": (list, "a list"),
}  # fmt: skip


def _is_number(v: object) -> bool:
    return isinstance(v, (int, float)) and not isinstance(v, bool)


def _check_state(state: object, path: Path) -> None:
    """ValueError naming ``path`` and the first problem, unless ``state`` has the trainer state's keys and types."""

    def bad(what: str):
        return ValueError(f"trainer state {path} is not valid: {what}")

    if not isinstance(state, dict):
        raise bad(f"expected a JSON object, got {type(state).__name__}")
    for key, (types, what) in _STATE_TYPES.items():
        if key not in state:
            raise bad(f"{key!r} is missing")
        v = state[key]
        if isinstance(v, bool) or not isinstance(v, types) or (isinstance(v, (int, float)) and v < 0):
            raise bad(f"{key!r} must be {what}, got {json.dumps(v)[:40]}")
    for name in ("train", "val"):
        rows = state["history"].get(name)
        if not isinstance(rows, list) or not all(isinstance(r, list) and len(r) == 2 and _is_number(r[1])
                                                 and isinstance(r[0], int) and not isinstance(r[0], bool)
                                                 for r in rows):  # fmt: skip
            raise bad(f"history[{name!r}] must be a list of [step, loss] pairs")
    if not all(isinstance(g, dict) for g in state["param_groups"]):
        raise bad("'param_groups' must be a list of objects")


def load_optimizer(folder: Path, opt: torch.optim.Optimizer, groups: list[dict], step: int | None = None) -> None:
    """``folder/optimizer.safetensors`` with ``groups`` (the trainer state's param groups) into ``opt``, and
    torch's RNG state. ``step``: the trainer state's step, which the optimizer's update counters (``step``
    tensors, where it keeps them) must equal. Raises FileNotFoundError, or CheckpointError naming the file (and
    the tensor that does not fit its parameter, or the two steps)."""
    from safetensors.torch import load_file

    path = folder / OPTIMIZER_NAME
    if not path.is_file():
        raise FileNotFoundError(f"optimizer state not found: {path}")
    try:
        tensors = load_file(str(path))
    except Exception as e:
        raise CheckpointError(f"cannot read optimizer state {path}: {e}") from None
    counters = [float(t) for k, t in tensors.items() if k.startswith("state.") and k.endswith(".step") and t.dim() == 0]
    if step is not None and counters and max(counters) != step:
        raise CheckpointError(f"optimizer state {path} has made {max(counters):g} updates but {STATE_NAME} is at "
                              f"step {step}: the checkpoint's files come from different steps (a save cut short?)")
    state: dict[int, dict[str, Tensor]] = {}
    try:
        for key, v in tensors.items():
            if key.startswith("state."):
                _, i, name = key.split(".", 2)
                state.setdefault(int(i), {})[name] = v
        groups = [{k: (tuple(v) if k == "betas" else v) for k, v in g.items()} for g in groups]
        rng = tensors.get("torch_rng_state", torch.get_rng_state())
        if rng.dtype != torch.uint8 or rng.shape != torch.get_rng_state().shape:
            raise ValueError(f"torch_rng_state must be torch's RNG state (uint8, {tuple(torch.get_rng_state().shape)}),"
                             f" got {rng.dtype} of shape {tuple(rng.shape)}")
        _check_state_tensors(state, groups, opt)
        opt.load_state_dict({"state": state, "param_groups": groups})
        for i, g in enumerate(opt.param_groups):  # after the defaults torch fills in for settings newer than the file
            if opt.defaults.keys() - g.keys():  # else the update would fail on the setting
                raise ValueError(f"param group {i} lacks {sorted(opt.defaults.keys() - g.keys())}")
    except (ValueError, KeyError, TypeError, RuntimeError) as e:
        raise CheckpointError(f"optimizer state {path} does not fit this model and {STATE_NAME}: {e}") from None
    torch.set_rng_state(rng)


def _check_state_tensors(state: dict[int, dict[str, Tensor]], groups: list[dict], opt: torch.optim.Optimizer) -> None:
    """ValueError naming the first tensor of ``state`` that does not fit its parameter (the one ``groups`` gives
    its index): floating point, and a scalar (``step``, NAdam's ``mu_product``) or of the parameter's shape, where
    a factored moment (Adafactor's ``row_var``) keeps 1 for a reduced dim. ``load_state_dict`` would cast any
    dtype to the parameter's and leave a wrong shape to fail in the update."""
    params = dict(zip((i for g in groups for i in g["params"]), (p for g in opt.param_groups for p in g["params"])))
    for i, tensors in state.items():
        if i not in params:  # the groups do not fit the model: load_state_dict says so
            continue
        shape = tuple(params[i].shape)
        for name, t in tensors.items():
            fits = t.dim() == 0 or (t.dim() == len(shape) and all(a in (b, 1) for a, b in zip(t.shape, shape)))
            if not t.is_floating_point() or not fits:
                raise ValueError(f"state.{i}.{name} must be a floating-point scalar, or a tensor (dims may be 1) of "
                                 f"shape {shape}, got {t.dtype} of shape {tuple(t.shape)}")  # fmt: skip
