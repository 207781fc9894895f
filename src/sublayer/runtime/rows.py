"""The row operations of the prepared (inference) paths, on 2-D (N, d) rows: one copy each.

Each runs the fused C++ kernel when the kernels are on, the PyTorch expression otherwise (its reference).
"""

from __future__ import annotations

import contextlib
import functools

import torch
import torch.nn.functional as F
from torch import Tensor

from .. import functional as SF
from .. import kernels
from ..functional import ffn, fused
from .rules import fast_path_allowed

__all__ = [
    "kernels_on", "inference", "eval_mode", "InferenceOnly", "layer_norm", "norm_rows", "add_norm", "bias_act",
    "ffn_hidden", "residual_out", "EPILOGUE",
]  # fmt: skip

EPILOGUE = fused.ACT_IDS  # activations the kernels fuse into a GEMM epilogue or a bias pass


def kernels_on() -> bool:
    """The fused kernels are switched on and built."""
    return kernels.enabled()


def inference(fn):
    """No autograd and no autocast inside: the prepared weights' dtype decides every GEMM's dtype (autocast would
    send them to bf16 GEMMs even where those are slower than fp32)."""

    @functools.wraps(fn)
    def wrapper(*args, **kwargs):
        with torch.no_grad(), torch.autocast("cpu", enabled=False):
            return fn(*args, **kwargs)

    return wrapper


@contextlib.contextmanager
def eval_mode(module: torch.nn.Module):
    """``module`` in eval mode (dropout off) inside the block; after it every submodule's training flag is as it
    was (a part kept in eval mode inside a training model stays so, as one left training inside an eval model)."""
    modes = [(m, m.training) for m in module.modules()]
    module.eval()
    try:
        yield module
    finally:
        for m, training in modes:
            m.training = training


class InferenceOnly:
    """What the prepared (inference-only) forms share: ``training`` False, ``eval()`` returns the object,
    ``train(True)`` raises RuntimeError ``"<class name> " + _train_error``, and calling one calls ``forward``.
    ``_reference()``: the model the prepared form steps aside for, when it must (None: it runs itself)."""

    training = False
    _train_error = "is inference-only; train the model itself and prepare it again"
    model = None  # the model a wrapper follows (None: it holds its own weights)

    def _reference(self):
        """The followed ``model`` while a fast path may not run on it (hooks, sharding:
        :func:`sublayer.runtime.rules.fast_path_allowed`), else None."""
        return None if self.model is None or fast_path_allowed(self.model) else self.model

    def __call__(self, *args, **kwargs):
        return self.forward(*args, **kwargs)

    def eval(self):
        return self

    def train(self, mode: bool = True):
        if mode:
            raise RuntimeError(f"{type(self).__name__} {self._train_error}")
        return self


def layer_norm(x: Tensor, w: Tensor, b: Tensor, eps: float) -> Tensor:
    """LayerNorm over the last dim, fp32 statistics, output in x's dtype."""
    if x.dtype == torch.float32:
        return F.layer_norm(x, w.shape, w, b, eps)
    return F.layer_norm(x.float(), w.shape, w, b, eps).to(x.dtype)


def norm_rows(x: Tensor, w: Tensor, b: Tensor | None, eps: float, rms: bool = False) -> Tensor:
    """LayerNorm, or RMSNorm when ``rms`` (``b`` unused), over the last dim; fp32 statistics, output in x's dtype."""
    return SF.rms_norm(x, x.shape[-1:], w, eps) if rms else layer_norm(x, w, b, eps)


def add_norm(
    x: Tensor, y: Tensor, w: Tensor, b: Tensor | None, eps: float, rms: bool = False, *, want_sum: bool = True
) -> tuple[Tensor, Tensor | None]:
    """``(norm(x + y), x + y if want_sum)`` for (N, d) rows: LayerNorm, or RMSNorm when ``rms`` (``b`` unused);
    w, b float32; fp32 statistics."""
    if kernels_on():
        out, s, _, _, _ = kernels.ops().add_norm_fwd(x, y, w, b, eps, 0.0, 0, rms, want_sum)
        return out, (s if want_sum else None)
    s = x + y
    return norm_rows(s, w, b, eps, rms), s


def bias_act(a: Tensor, bias: Tensor | None, act: str) -> Tensor:
    """``act(a + bias)``, in place where the kernels run; a (N, f) contiguous, bias float32 (f,) or None."""
    if kernels_on() and act in EPILOGUE:
        return kernels.ops().act_fwd(a, bias, EPILOGUE[act], 0.0, 0, True)
    if bias is not None:
        a = (a.float() + bias).to(a.dtype) if a.dtype != torch.float32 else a + bias
    return SF.activation_fn(act)(a)


def ffn_hidden(a: Tensor, bias: Tensor | None, act: str) -> Tensor:
    """An FFN's hidden activation from fc1's output ``a`` (N, d_ff) without its bias: ``act(a + bias)``, or for a
    gated activation (``a`` (N, 2·d_ff), gate first) ``act(gate) * up``, as :func:`sublayer.functional.feed_forward`."""
    if act not in SF.GATED_ACTIVATIONS:
        return bias_act(a, bias, act)
    return ffn.activate(a if bias is None else a + bias, act)


def residual_out(pre: bool, x: Tensor, y: Tensor, norm: tuple, after: tuple | None) -> tuple[Tensor, Tensor]:
    """``(x, h)`` after a sublayer's output ``y`` joins the residual stream ``x`` (N, d):

    post-norm ``x = LN(x + y)`` with this sublayer's ``norm``, and ``h = x``; pre-norm ``x = x + y`` and ``h`` the
    next sublayer's input, ``after(x)`` (the norm that follows: the next sublayer's, or the stack's final one;
    ``x`` itself when there is none). Norms are ``(weight, bias, eps)``; the add and the norm run fused.
    """
    if not pre:
        x, _ = add_norm(x, y, *norm, want_sum=False)
        return x, x
    if after is None:
        x = x + y
        return x, x
    h, x = add_norm(x, y, *after)
    return x, h
