"""The reference generation loop for decoder-only language models: greedy or sampled, eos, left padding.

Model-agnostic: it drives any model that provides ``config.vocab_size``, ``blocks`` (one KV cache per block),
``lm_head`` and ``_hidden(input_ids, position_ids, key_padding_mask, caches) -> (B, T, d_model)`` final hidden
states that read and extend the caches (:class:`sublayer.models.Llama`). The semantics are those of
:meth:`sublayer.models.GPT2.generate` (and HF ``generate``).
"""

from __future__ import annotations

import torch
from torch import Tensor, nn

from .. import functional as SF
from .._checks import check_positive_int
from .gpt2 import check_attention_mask, check_input_ids

__all__ = ["check_eos_ids", "check_token_id", "filtered_probs", "generate"]


def check_token_id(name: str, value: object) -> None:
    """``value`` must be None or an int >= 0 (a special token id)."""
    if value is None:
        return
    if isinstance(value, bool) or not isinstance(value, int) or value < 0:
        raise ValueError(f"{name} must be None or an int >= 0, got {value!r}")


def check_eos_ids(name: str, value: object) -> list[int]:
    """End-of-sequence ids: None -> [], an id -> [id], a non-empty list/tuple of ids -> a list (Llama 3 and Qwen
    instruct checkpoints end a turn with any of several tokens)."""
    ids = list(value) if isinstance(value, (list, tuple)) else [value]
    if value is None or not ids:
        if value is not None:
            raise ValueError(f"{name} must be None, an int >= 0 or a non-empty list of them, got {value!r}")
        return []
    for i in ids:
        if isinstance(i, bool) or not isinstance(i, int) or i < 0:
            raise ValueError(f"{name} must be None, an int >= 0 or a non-empty list of them, got {value!r}")
    return ids


def filtered_probs(logits: Tensor, temperature: float, top_k: int | None, top_p: float | None) -> Tensor:
    """Sampling distribution (B, V) after temperature, top-k and top-p (nucleus) filtering (HF's order)."""
    logits = logits / temperature
    if top_k is not None and top_k < logits.shape[-1]:
        kth = logits.topk(top_k, dim=-1).values[..., -1:]
        logits = logits.masked_fill(logits < kth, float("-inf"))
    if top_p is not None and top_p < 1.0:
        sorted_logits, order = logits.sort(dim=-1, descending=True)
        p = sorted_logits.softmax(dim=-1)
        before = p.cumsum(dim=-1) - p  # probability mass of the more likely tokens
        drop = before >= top_p
        drop[..., 0] = False  # always keep the most likely token
        logits = logits.masked_fill(torch.zeros_like(drop).scatter(-1, order, drop), float("-inf"))
    return logits.softmax(dim=-1)


@torch.no_grad()
def generate(
    model: nn.Module,
    input_ids: Tensor,
    max_new_tokens: int,
    *,
    temperature: float = 1.0,
    top_k: int | None = None,
    top_p: float | None = None,
    do_sample: bool = False,
    eos_token_id: int | list[int] | None = None,
    pad_token_id: int | None = None,
    attention_mask: Tensor | None = None,
    generator: torch.Generator | None = None,
) -> Tensor:
    """Continue ``input_ids`` token by token with a KV cache per block (greedy: HF ``generate``'s tokens).

    Runs ``model`` in eval mode (dropout off) without gradients and restores its training flag afterwards.

    Args:
        model: see the module docstring.
        input_ids: (B, T) prompt ids. With ``attention_mask`` (1 = token, 0 = pad) prompts may be left-padded;
            positions then count real tokens only (as HF's ``generate``).
        max_new_tokens: tokens to add (>= 0).
        temperature, top_k, top_p: sampling filters (:func:`filtered_probs`).
        do_sample: sample from the filtered distribution; False -> greedy argmax (filters ignored).
        eos_token_id: an id or a list of ids: a row that produced one is finished; later positions get
            ``pad_token_id`` (None -> the first eos id); decoding stops early once every row is finished.
        generator: a ``torch.Generator`` for reproducible sampling.

    Returns:
        (B, T + n) ids: the prompt followed by n <= max_new_tokens new tokens.

    Raises:
        ValueError/TypeError: bad ids or mask (a row with no token), max_new_tokens < 0, temperature <= 0,
        top_k < 1, top_p outside (0, 1], bad eos/pad ids.
    """
    check_input_ids("input_ids", input_ids, model.config.vocab_size)
    if isinstance(max_new_tokens, bool) or not isinstance(max_new_tokens, int) or max_new_tokens < 0:
        raise ValueError(f"max_new_tokens must be an int >= 0, got {max_new_tokens!r}")
    if isinstance(temperature, bool) or not isinstance(temperature, (int, float)) or not temperature > 0:
        raise ValueError(f"temperature must be a float > 0, got {temperature!r}")
    check_positive_int("top_k", top_k, allow_none=True)
    if top_p is not None and (isinstance(top_p, bool) or not isinstance(top_p, (int, float)) or not 0 < top_p <= 1):
        raise ValueError(f"top_p must be in (0, 1], got {top_p!r}")
    eos = check_eos_ids("eos_token_id", eos_token_id)
    check_token_id("pad_token_id", pad_token_id)
    pad = (eos[0] if eos else None) if pad_token_id is None else pad_token_id
    eos_ids = torch.tensor(eos, dtype=input_ids.dtype, device=input_ids.device)
    b, t = input_ids.shape
    device = input_ids.device
    if attention_mask is None:
        kpm = None
        positions = torch.arange(t, device=device)[None].expand(b, t)
    else:
        kpm = check_attention_mask(attention_mask, (b, t))
        if bool(kpm.all(dim=1).any()):
            raise ValueError("attention_mask has a row with no token (all 0)")
        positions = (attention_mask.long().cumsum(-1) - 1).masked_fill(kpm, 0)
        kpm = kpm if bool(kpm.any()) else None

    def pick(logits: Tensor) -> Tensor:  # (B, V) float32 -> (B,) next ids
        if do_sample:
            return torch.multinomial(filtered_probs(logits, temperature, top_k, top_p), 1, generator=generator)[:, 0]
        return logits.argmax(dim=-1)

    was_training = model.training
    model.eval()
    try:
        caches = [SF.KVCache() for _ in model.blocks]
        out, step_ids, step_pos = input_ids, input_ids, positions
        finished = torch.zeros(b, dtype=torch.bool, device=device)
        for _ in range(max_new_tokens):
            h = model._hidden(step_ids, step_pos, kpm, caches)
            nxt = pick(model.lm_head(h[:, -1]).float())
            if eos:
                nxt = torch.where(finished, torch.full_like(nxt, pad), nxt)
                finished = finished | torch.isin(nxt, eos_ids)
            out = torch.cat([out, nxt[:, None]], dim=1)
            if eos and bool(finished.all()):
                break
            step_ids, step_pos = nxt[:, None], step_pos[:, -1:] + 1
            if kpm is not None:
                kpm = torch.cat([kpm, kpm.new_zeros(b, 1)], dim=1)
        return out
    finally:
        model.train(was_training)
