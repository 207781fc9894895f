"""``torch.compile(module, fullgraph=True)`` works on every public module: no graph break, and the compiled module
gives the eager numbers.

Cost on CI's 2 cores decides the backends (the graph capture is the same for all of them):
- ``backend="eager"`` for every module: Dynamo traces the whole forward (``fullgraph=True`` turns any graph break
  into an error) and runs the captured graph with eager kernels — what we test is the capture, cheaply (~0.2 s each).
- ``backend="aot_eager"`` for two blocks (a pre-norm RMS encoder block; a post-norm decoder block, which holds
  self- and cross-attention with padding masks): AOTAutograd also traces the backward and functionalizes the graph,
  so gradients are checked through the compiled path too (~2 s each).
- the default inductor backend for two modules only (MultiHeadAttention and LayerNorm): it generates and compiles
  C++ (several seconds each, cold), and they cover SDPA with masks and our own normalization math.
"""

from __future__ import annotations

import pytest
import torch
import torch._dynamo

from ._weights import MODULE_CASES, output, randomize_

CASES = {c.name: c for c in MODULE_CASES}
# raised inside torch while Dynamo/inductor import their own modules, not by our code
pytestmark = pytest.mark.filterwarnings("ignore:`torch.jit.script_method` is deprecated:DeprecationWarning")
B, T = 3, 4


@pytest.fixture(autouse=True)
def _fresh_dynamo():
    # every test compiles new module instances of the same classes: start from empty caches so no test hits the
    # recompile limit (which would silently fall back to eager and test nothing)
    torch._dynamo.reset()
    yield
    torch._dynamo.reset()


def _leafs(args):
    return tuple(
        a.detach().clone().requires_grad_(True) if isinstance(a, torch.Tensor) and a.is_floating_point() else a
        for a in args
    )


@pytest.mark.parametrize("case", MODULE_CASES, ids=[c.name for c in MODULE_CASES])
def test_fullgraph_compile_matches_eager(case):
    m = randomize_(case.build()).eval()
    args, kwargs = case.inputs(B, T, torch.float32, "cpu")
    compiled = torch.compile(m, fullgraph=True, backend="eager")
    with torch.no_grad():
        torch.testing.assert_close(output(compiled(*args, **kwargs)), output(m(*args, **kwargs)))


@pytest.mark.parametrize("name", ["MultiHeadAttention"])
def test_compiled_module_handles_new_shapes(name):
    """Another batch and sequence length: recompiles or runs a dynamic graph, still without graph breaks."""
    case = CASES[name]
    m = randomize_(case.build()).eval()
    compiled = torch.compile(m, fullgraph=True, backend="eager")
    with torch.no_grad():
        for b, t in [(B, T), (B + 2, T + 3)]:
            args, kwargs = case.inputs(b, t, torch.float32, "cpu")
            torch.testing.assert_close(output(compiled(*args, **kwargs)), output(m(*args, **kwargs)))


@pytest.mark.parametrize("name", ["EncoderBlock_prenorm_rms", "DecoderBlock"])
def test_aot_compile_forward_and_backward_match_eager(name):
    case = CASES[name]
    m = randomize_(case.build()).train()  # dropout 0: train mode is deterministic
    args, kwargs = case.inputs(B, T, torch.float32, "cpu")
    a1, a2 = _leafs(args), _leafs(args)
    compiled = torch.compile(m, fullgraph=True, backend="aot_eager")
    out_c = output(compiled(*a1, **kwargs))
    grads_c = torch.autograd.grad(
        out_c.square().sum(), [p for p in m.parameters()] + [a for a in a1 if isinstance(a, torch.Tensor)]
    )
    out_e = output(m(*a2, **kwargs))
    grads_e = torch.autograd.grad(
        out_e.square().sum(), [p for p in m.parameters()] + [a for a in a2 if isinstance(a, torch.Tensor)]
    )
    torch.testing.assert_close(out_c, out_e)
    for gc, ge in zip(grads_c, grads_e, strict=True):
        torch.testing.assert_close(gc, ge)


@pytest.mark.parametrize("name", ["MultiHeadAttention", "LayerNorm"])
def test_inductor_compile_matches_eager(name):
    case = CASES[name]
    m = randomize_(case.build()).eval()
    args, kwargs = case.inputs(B, T, torch.float32, "cpu")
    compiled = torch.compile(m, fullgraph=True)
    with torch.no_grad():
        torch.testing.assert_close(output(compiled(*args, **kwargs)), output(m(*args, **kwargs)))


def test_compile_with_kv_cache_decoding():
    """Incremental decoding through a compiled MultiHeadAttention (the cache object is a plain Python object that
    Dynamo guards on) equals the eager full causal pass."""
    from sublayer import KVCache

    m = randomize_(CASES["MultiHeadAttention"].build()).eval()
    x = torch.randn(B, T, m.d_model)
    compiled = torch.compile(m, fullgraph=True, backend="eager")
    with torch.no_grad():
        full, _ = m(x, is_causal=True)
        cache = KVCache()
        steps = [compiled(x[:, t : t + 1], is_causal=True, kv_cache=cache)[0] for t in range(T)]
    torch.testing.assert_close(torch.cat(steps, 1), full)
