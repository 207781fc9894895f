"""Generation, written once: the loops over a model's decoding step.

* :func:`generate` continues prompts token by token for a causal language model (greedy, sampling with
  temperature / top-k / top-p, eos, left-padded prompts with an attention mask) — GPT-2 and any model that provides
  the same few methods (see :class:`CausalLM`), its prepared (``fast_inference``) and int8 forms included;
* :func:`greedy_search` and :func:`beam_search` run an encoder–decoder's steps (``Transformer.translate``).

A model supplies the step; the loops, the eos bookkeeping and the sampling filters live here. Where a model offers
a fast decoding step (static KV cache, packed weights, one C++ call per step) the same loop drives it; the
reference step runs the model's own forward with a growing :class:`sublayer.functional.KVCache`.
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Iterator
from contextvars import ContextVar
from typing import Protocol

import torch
from torch import Tensor

from .. import settings
from .._checks import check_attention_mask, check_input_ids, check_positive_int
from ..kernels import cpu
from . import weights
from .rows import eval_mode

__all__ = [
    "CausalLM", "generate", "token_loop", "filtered_probs", "greedy_search", "beam_search", "check_token_id",
    "check_eos_ids", "fitted_threads",
]  # fmt: skip


class CausalLM(Protocol):
    """What :func:`generate` needs from a model.

    Attributes:
        config: ``vocab_size``, ``max_positions``.
    """

    config: object

    def hidden_states(
        self, input_ids: Tensor, position_ids: Tensor, key_padding_mask: Tensor | None, caches: list | None
    ) -> Tensor:
        """(B, T) ids at (B, T) positions -> final hidden states (B, T, d); ``caches`` from :meth:`new_caches`
        are read and extended; ``key_padding_mask`` (B, T_cached + T) True = padding."""

    def lm_head(self, h: Tensor) -> Tensor:
        """(B, d) -> (B, vocab) logits."""

    def new_caches(self) -> list:
        """One empty :class:`sublayer.functional.KVCache` per layer."""

    def fast_decoder(self):
        """A fast decoding loop ``fn(input_ids, positions, kpm, max_new_tokens, *, prefill, pick, eos_token_id,
        pad, greedy) -> ids``, or None where the reference loop runs."""


_neighbours = {"busy": 0.0}  # CPUs other processes kept busy during the last measured decoding call
_MEASURE_S = 0.05  # shorter calls span too few of /proc/stat's clock ticks to measure


@contextlib.contextmanager
def fitted_threads() -> Iterator[int]:
    """Runs a decoding call on torch's thread count less the CPUs that other processes kept busy during the
    previous call (rounded: a neighbour that takes 0.6 of a CPU counts as one; at least one thread), restored
    afterwards; yields the count. Measures that load again meanwhile (:func:`sublayer.kernels.cpu.others_busy`,
    calls of at least 50 ms), so the count follows the machine from call to call.

    A decoding step is dozens of short parallel loops, and each waits for its slowest thread: beside a busy
    neighbour, a thread sharing a core with it stalls the step at every scheduler slice, and fewer threads on
    the free cores decode faster. The kernels' results do not depend on the thread count.
    ``SUBLAYER_FIT_THREADS=0`` keeps torch's count."""
    n = torch.get_num_threads()
    if n <= 1 or not settings.fit_threads():
        yield n
        return
    fit = min(n, cpu.default_threads(cpu.usable_cpus(), _neighbours["busy"], waits_sleep=False)[0])
    since = cpu.load_snapshot()
    if fit != n:
        torch.set_num_threads(fit)
    try:
        yield fit
    finally:
        if fit != n:
            torch.set_num_threads(n)
        if since[2] + _MEASURE_S <= cpu.load_snapshot()[2] and (busy := cpu.others_busy(since)) is not None:
            _neighbours["busy"] = busy


def check_token_id(name: str, value: object, vocab_size: int | None = None, *, negative: bool = False) -> None:
    """``value`` is None or an int id in ``[0, vocab_size)`` (``>= 0`` without ``vocab_size``; ``negative``: also
    ``[-vocab_size, 0)``, counted from the end)."""
    if value is None:
        return
    if vocab_size is None:
        if isinstance(value, bool) or not isinstance(value, int) or value < 0:
            raise ValueError(f"{name} must be None or an int >= 0, got {value!r}")
        return
    low = -vocab_size if negative else 0
    if isinstance(value, bool) or not isinstance(value, int) or not low <= value < vocab_size:
        raise ValueError(f"{name} must be None or an int in [{low}, vocab_size={vocab_size}), got {value!r}")


def check_eos_ids(name: str, value: object, vocab_size: int | None = None) -> list[int]:
    """End-of-sequence ids: None -> [], an id -> [id], a non-empty list/tuple of ids -> a list (Llama 3 and Qwen
    instruct checkpoints end a turn with any of several tokens)."""
    if value is None:
        return []
    ids = list(value) if isinstance(value, (list, tuple)) else [value]
    if not ids:
        raise ValueError(f"{name} must be None, an int >= 0 or a non-empty list of them, got {value!r}")
    for i in ids:
        if isinstance(i, bool) or not isinstance(i, int) or i < 0:
            raise ValueError(f"{name} must be None, an int >= 0 or a non-empty list of them, got {value!r}")
        check_token_id(name, i, vocab_size)
    return ids


def filtered_probs(logits: Tensor, temperature: float, top_k: int | None, top_p: float | None) -> Tensor:
    """Sampling distribution (B, V) after temperature, top-k and top-p (nucleus) filtering, in HF's order."""
    logits = logits / temperature
    if top_k is not None and top_k < logits.shape[-1]:
        kth = logits.topk(top_k, dim=-1).values[..., -1:]
        logits = logits.masked_fill(logits < kth, float("-inf"))
    if top_p is not None and top_p < 1.0:  # HF's steps: tied logits at the edge keep the tokens HF keeps
        sorted_logits, order = logits.sort(dim=-1, descending=False)
        drop = sorted_logits.softmax(dim=-1).cumsum(dim=-1) <= 1 - top_p  # the least likely, up to 1 - top_p
        drop[..., -1] = False  # always keep the most likely token
        logits = logits.masked_fill(drop.scatter(-1, order, drop), float("-inf"))
    return logits.softmax(dim=-1)


_STREAMER: ContextVar = ContextVar("sublayer_streamer", default=None)  # generate's streamer, read by token_loop


def token_loop(
    input_ids: Tensor,
    max_new_tokens: int,
    first: Tensor,
    step: Callable[[Tensor, int], Tensor],
    eos_token_id: int | list[int] | None,
    pad: int | None,
) -> Tensor:
    """The token loop shared by every decoding step: ``first`` (B,) ids after the prompt; ``step(ids, s)`` gives
    the ids after step ``s``'s (B,) ids. A row that produced ``eos_token_id`` (one of them, for a list) is
    finished: later positions get ``pad``; the loop stops once every row is finished. Returns (B, T + n) ids.
    Each step's (B,) ids go to the streamer of the :func:`generate` call that runs the loop (``put``), if any."""
    streamer = _STREAMER.get()
    b, t = input_ids.shape
    eos = None if eos_token_id is None else torch.tensor(eos_token_id, device=input_ids.device).reshape(-1)
    out = torch.empty(b, t + max_new_tokens, dtype=torch.long, device=input_ids.device)
    out[:, :t] = input_ids
    finished = torch.zeros(b, dtype=torch.bool, device=input_ids.device)
    nxt, n = first, 0
    for s in range(max_new_tokens):
        if eos is not None:
            nxt = torch.where(finished, torch.full_like(nxt, pad), nxt)
            finished = finished | torch.isin(nxt, eos)
        out[:, t + s] = nxt
        n = s + 1
        if streamer is not None:
            with weights.pinned(False):  # the user's code: what it calls sees weights it changes
                streamer.put(nxt)
        if s + 1 == max_new_tokens or (eos is not None and bool(finished.all())):
            break
        nxt = step(nxt, s)
    return out[:, : t + n]


@torch.no_grad()
def generate(
    lm: CausalLM,
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
    streamer=None,
) -> Tensor:
    """Continue ``input_ids`` token by token (see :meth:`sublayer.models.GPT2.generate` for the arguments;
    ``eos_token_id`` may be a list of ids: a row ends at any of them, and ``pad_token_id`` defaults to the first).
    ``streamer`` (HF's protocol: ``put(ids)``, ``end()``) gets the prompt (B, T), each step's (B,) ids as they are
    made (by the reference or the fast loop: both run :func:`token_loop`), then ``end()``.

    Runs in eval mode (dropout off) without gradients and restores every submodule's training flag afterwards. An
    empty batch (B = 0) gives an empty (0, T + max_new_tokens) result.

    Raises:
        ValueError/TypeError: bad ids or mask, max_new_tokens < 0, too long, temperature < 0 (or 0 to sample), top_k < 1, top_p
        outside (0, 1], token ids outside the vocabulary, a generator that is not a ``torch.Generator``, a streamer
        without ``put`` and ``end``.
    """
    cfg = lm.config
    max_positions = getattr(cfg, "max_positions", None)
    check_input_ids("input_ids", input_ids, cfg.vocab_size, max_positions)
    if isinstance(max_new_tokens, bool) or not isinstance(max_new_tokens, int) or max_new_tokens < 0:
        raise ValueError(f"max_new_tokens must be an int >= 0, got {max_new_tokens!r}")
    b, t = input_ids.shape
    if max_positions is not None and t + max_new_tokens > max_positions:
        raise ValueError(f"prompt length {t} + max_new_tokens {max_new_tokens} exceeds max_positions={cfg.max_positions}")
    if isinstance(temperature, bool) or not isinstance(temperature, (int, float)) or not temperature >= 0:
        raise ValueError(f"temperature must be a float > 0, got {temperature!r}")
    if do_sample and temperature == 0:  # greedy ignores it (HF's greedy configs may hold 0.0)
        raise ValueError(f"temperature must be a float > 0 to sample, got {temperature!r}")
    check_positive_int("top_k", top_k, allow_none=True)
    if top_p is not None and (isinstance(top_p, bool) or not isinstance(top_p, (int, float)) or not 0 < top_p <= 1):
        raise ValueError(f"top_p must be in (0, 1], got {top_p!r}")
    if generator is not None and not isinstance(generator, torch.Generator):
        raise TypeError(f"generator must be None or a torch.Generator, got {generator!r}")
    if streamer is not None and not all(callable(getattr(streamer, f, None)) for f in ("put", "end")):
        raise TypeError(f"streamer must be None or an object with put(ids) and end(), got {type(streamer).__name__}")
    eos = check_eos_ids("eos_token_id", eos_token_id, cfg.vocab_size)
    check_token_id("pad_token_id", pad_token_id, cfg.vocab_size)
    pad = (eos[0] if eos else None) if pad_token_id is None else pad_token_id
    eos_token_id = eos or None

    device = input_ids.device
    # HF's generate: without a mask, a pad id that is no end token marks padding wherever the prompt holds it
    inferred = attention_mask is None and pad is not None and pad not in eos and bool((input_ids == pad).any())
    if inferred:
        attention_mask = (input_ids != pad).long()
    if attention_mask is None:
        kpm = None
        positions = torch.arange(t, device=device)[None].expand(b, t)
    else:
        kpm = check_attention_mask(attention_mask, (b, t))
        positions = (attention_mask.long().cumsum(-1) - 1).masked_fill(kpm, 0)
        if bool(kpm.all(dim=1).any()):
            if inferred:
                raise ValueError(
                    f"input_ids has a row of pad_token_id={pad} only (without attention_mask, pad ids mark "
                    "padding, as in HF's generate)"
                )
            raise ValueError("attention_mask has a row with no token (all 0)")
        kpm = kpm if bool(kpm.any()) else None
    if streamer is not None:
        streamer.put(input_ids)
    if max_new_tokens == 0 or b == 0:  # nothing to decode; an empty batch at the full length
        if streamer is not None:
            streamer.end()
        return input_ids if b else input_ids.new_empty(0, t + max_new_tokens)

    def pick(logits: Tensor) -> Tensor:  # (B, V) float32 -> (B,) next ids
        if do_sample:
            probs = filtered_probs(logits, temperature, top_k, top_p)
            return torch.multinomial(probs, 1, generator=generator).squeeze(1)
        return logits.argmax(dim=-1)

    modes = eval_mode(lm) if isinstance(lm, torch.nn.Module) else contextlib.nullcontext()
    streaming = _STREAMER.set(streamer)
    try:
        with modes, fitted_threads(), weights.pinned():
            fast = lm.fast_decoder()
            if fast is not None:
                out = fast(input_ids, positions, kpm, max_new_tokens, prefill=lm.hidden_states, pick=pick,
                           eos_token_id=eos_token_id, pad=pad, greedy=not do_sample)  # fmt: skip
            else:
                caches = lm.new_caches()
                h = lm.hidden_states(input_ids, positions, kpm, caches)
                state = {"pos": positions[:, -1:], "kpm": kpm}

                def step(nxt: Tensor, s: int) -> Tensor:
                    state["pos"] = state["pos"] + 1
                    if state["kpm"] is not None:
                        state["kpm"] = torch.cat([state["kpm"], state["kpm"].new_zeros(b, 1)], dim=1)
                    h = lm.hidden_states(nxt[:, None], state["pos"], state["kpm"], caches)
                    return pick(lm.lm_head(h[:, -1]).float())

                out = token_loop(input_ids, max_new_tokens, pick(lm.lm_head(h[:, -1]).float()), step, eos_token_id, pad)
        if streamer is not None:
            streamer.end()
        return out
    finally:
        _STREAMER.reset(streaming)


# ----------------------------------------------------------------------------------------------- encoder-decoder
def greedy_search(steps, b: int, max_len: int, bos: int, eos: int, pad: int, device) -> Tensor:
    """Greedy search over ``steps = (step, reorder[, next_ids])``; a row that emitted ``eos`` leaves the batch
    (``reorder`` keeps the others), so the steps after it cost nothing for it. Rows are independent, so the tokens
    are those of the full batch. ``step(tok (N, 1)) -> (N, V)`` logits; ``next_ids(tok) -> (N,)`` their argmax.

    Returns (B, L) ids, L <= max_len, each row filled with ``pad`` after its eos."""
    step, reorder, *fast = steps
    next_ids = fast[0] if fast else (lambda tok: step(tok).argmax(-1))
    out = torch.full((b, max_len), pad, dtype=torch.long, device=device)
    live = torch.arange(b, device=device)  # the batch row of each row still running
    tok = torch.full((b, 1), bos, dtype=torch.long, device=device)
    for i in range(max_len):
        nxt = next_ids(tok)
        out[live, i] = nxt
        running = nxt != eos
        if not bool(running.any()):
            return out[:, : i + 1]
        if not bool(running.all()):
            keep = running.nonzero().squeeze(1)
            reorder(keep)
            live, nxt = live[keep], nxt[keep]
        tok = nxt[:, None]
    return out


def beam_search(steps, b: int, max_len: int, bos: int, eos: int, pad: int, k: int, length_penalty: float, device) -> Tensor:
    """Beam search with ``k`` beams per sentence over ``steps = (step, reorder, ...)``: row i*k + j is beam j of
    sentence i; finished hypotheses are ranked by ``logprob / length**length_penalty``. Returns (B, L) ids."""
    step, reorder = steps[:2]
    scores = torch.full((b, k), float("-inf"), device=device)
    scores[:, 0] = 0.0  # start from one live beam, so the first step does not pick k copies of one token
    seqs = torch.zeros(b * k, 0, dtype=torch.long, device=device)
    lengths = torch.zeros(b, k, device=device)
    done = torch.zeros(b, k, dtype=torch.bool, device=device)
    tok = torch.full((b * k, 1), bos, dtype=torch.long, device=device)
    for _ in range(max_len):
        logp = step(tok).log_softmax(-1)
        v = logp.shape[-1]
        logp = logp.view(b, k, v).float()
        if bool(done.any()):  # a finished beam continues only with `pad` at no cost, so it keeps its score
            logp = logp.masked_fill(done[..., None], float("-inf"))
            logp[..., pad] = logp[..., pad].masked_fill(done, 0.0)
        cand = (scores[..., None] + logp).view(b, k * v)
        scores, idx = cand.topk(k, dim=-1)
        beam, nxt = idx // v, idx % v
        rows = (beam + torch.arange(b, device=device)[:, None] * k).view(-1)
        reorder(rows)
        seqs = torch.cat([seqs.index_select(0, rows), nxt.view(-1, 1)], dim=1)
        was_done = done.gather(1, beam)
        lengths = lengths.gather(1, beam) + (~was_done).float()
        done = was_done | (nxt == eos)
        tok = nxt.view(-1, 1)
        if bool(done.all()):
            break
    ranked = scores / lengths.clamp(min=1.0) ** length_penalty
    best = ranked.argmax(-1) + torch.arange(b, device=device) * k
    return seqs.index_select(0, best)
