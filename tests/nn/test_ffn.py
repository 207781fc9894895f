"""PositionWiseFFN vs nn.Sequential, HF GPT2MLP (through our Conv1D) and HF LlamaMLP; lazy input size; dropout."""

from __future__ import annotations

import copy

import pytest
import torch
import torch.nn.functional as F
from safetensors.torch import load_file, save_file
from torch import nn
from torch.testing import assert_close
from transformers import GPT2Config, LlamaConfig
from transformers.activations import ACT2FN
from transformers.models.gpt2.modeling_gpt2 import GPT2MLP
from transformers.models.llama.modeling_llama import LlamaMLP

import sublayer
from sublayer import Conv1D, PositionWiseFFN
from sublayer import kernels
from sublayer.functional import fused

D, FF, OUT = 5, 11, 7

# Reference activation modules (torch's own, and HF's for relu2 = squared ReLU).
REF_ACT = {
    "relu": lambda: nn.ReLU(),
    "gelu": lambda: nn.GELU(),
    "gelu_tanh": lambda: nn.GELU(approximate="tanh"),
    "silu": lambda: nn.SiLU(),
    "relu2": lambda: ACT2FN["relu2"],
}


def _randomize_(module: nn.Module) -> nn.Module:
    with torch.no_grad():
        for p in module.parameters():
            p.copy_(torch.randn_like(p) * 0.5)
    return module


def _leaf(x: torch.Tensor) -> torch.Tensor:
    return x.detach().clone().requires_grad_(True)


# --------------------------------------------------------------------------------------------------------------
# parity
# --------------------------------------------------------------------------------------------------------------
@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
@pytest.mark.parametrize("activation", list(REF_ACT))
def test_matches_nn_sequential(activation, dtype):
    ffn = _randomize_(PositionWiseFFN(D, FF, d_out=OUT, activation=activation, dtype=dtype))
    ref = nn.Sequential(
        nn.Linear(D, FF, dtype=dtype), REF_ACT[activation](), nn.Linear(FF, OUT, dtype=dtype)
    )
    ref[0].load_state_dict(ffn.fc1.state_dict())
    ref[2].load_state_dict(ffn.fc2.state_dict())
    x = torch.randn(2, 3, D, dtype=dtype)
    x1, x2 = _leaf(x), _leaf(x)
    y1, y2 = ffn(x1), ref(x2)
    assert y1.shape == (2, 3, OUT)
    assert_close(y1, y2)
    gy = torch.randn_like(y1)
    y1.backward(gy)
    y2.backward(gy)
    assert_close(x1.grad, x2.grad)
    for a, b in zip([ffn.fc1, ffn.fc2], [ref[0], ref[2]]):
        assert_close(a.weight.grad, b.weight.grad)
        assert_close(a.bias.grad, b.bias.grad)


def _gpt2_mlp(resid_pdrop: float = 0.0) -> GPT2MLP:
    cfg = GPT2Config(n_embd=D, n_head=1, n_layer=1, n_inner=FF, activation_function="gelu_new", resid_pdrop=resid_pdrop)
    return _randomize_(GPT2MLP(FF, cfg))


def _ffn_from_gpt2(hf: GPT2MLP, output_dropout: float = 0.0) -> PositionWiseFFN:
    """Load HF's c_fc / c_proj (Conv1D layout, weight (in, out)) through our Conv1D, then Conv1D.to_linear()."""
    ffn = PositionWiseFFN(D, FF, activation="gelu_tanh", output_dropout=output_dropout)
    for ours, theirs in [(ffn.fc1, hf.c_fc), (ffn.fc2, hf.c_proj)]:
        conv = Conv1D(theirs.nf, theirs.nx)
        conv.load_state_dict(theirs.state_dict())  # strict: same keys and shapes as HF's Conv1D
        ours.load_state_dict(conv.to_linear().state_dict())
    return ffn


def test_matches_hf_gpt2_mlp():
    hf = _gpt2_mlp()
    ffn = _ffn_from_gpt2(hf)
    x = torch.randn(2, 3, D)
    x1, x2 = _leaf(x), _leaf(x)
    y1, y2 = ffn(x1), hf(x2)
    # HF's gelu_new is the hand-written tanh formula; ours is F.gelu(approximate="tanh"): equal to fp32 rounding.
    assert_close(y1, y2)
    gy = torch.randn_like(y1)
    y1.backward(gy)
    y2.backward(gy)
    assert_close(x1.grad, x2.grad)
    # Conv1D stores (in, out): the transpose of nn.Linear's weight gradient.
    assert_close(ffn.fc1.weight.grad, hf.c_fc.weight.grad.T)
    assert_close(ffn.fc2.weight.grad, hf.c_proj.weight.grad.T)
    assert_close(ffn.fc1.bias.grad, hf.c_fc.bias.grad)
    assert_close(ffn.fc2.bias.grad, hf.c_proj.bias.grad)


def test_output_dropout_is_gpt2_resid_pdrop_placement():
    # GPT-2 drops the MLP's output (resid_pdrop). The modules may run a fused kernel whose dropout mask is not
    # F.dropout's (same distribution, different stream), so compare where neither output was dropped: there the
    # values agree (same placement; the fused path scales by 1 / its real keep rate, 1/(1-p) to 2^-17/(1-p)
    # relative, see fused.keep_probability), and whole output elements are zeroed.
    hf = _gpt2_mlp(resid_pdrop=0.3).train()
    ffn = _ffn_from_gpt2(hf, output_dropout=0.3).train()
    x = torch.randn(40, 5, D)
    y1, y2 = ffn(x), hf(x)
    both = (y1 != 0) & (y2 != 0)
    assert (y1 == 0).any() and both.float().mean() > 0.3
    assert_close(y1[both], y2[both], rtol=2**-17 / 0.7 + 1.3e-6, atol=1e-5)


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
def test_swiglu_matches_hf_llama_mlp(dtype):
    cfg = LlamaConfig(
        hidden_size=D, intermediate_size=FF, hidden_act="silu", mlp_bias=False, num_attention_heads=1,
        num_key_value_heads=1, head_dim=2,
    )
    hf = _randomize_(LlamaMLP(cfg).to(dtype))
    ffn = PositionWiseFFN(D, FF, activation="swiglu", bias=False, dtype=dtype)
    assert ffn.gated and ffn.fc1.weight.shape == (2 * FF, D) and ffn.fc1.bias is None
    with torch.no_grad():  # packed fc1 = [gate; up], gate first
        ffn.fc1.weight.copy_(torch.cat([hf.gate_proj.weight, hf.up_proj.weight]))
        ffn.fc2.weight.copy_(hf.down_proj.weight)
    x = torch.randn(2, 3, D, dtype=dtype)
    x1, x2 = _leaf(x), _leaf(x)
    y1, y2 = ffn(x1), hf(x2)
    assert_close(y1, y2)
    gy = torch.randn_like(y1)
    y1.backward(gy)
    y2.backward(gy)
    assert_close(x1.grad, x2.grad)
    assert_close(ffn.fc1.weight.grad, torch.cat([hf.gate_proj.weight.grad, hf.up_proj.weight.grad]))
    assert_close(ffn.fc2.weight.grad, hf.down_proj.weight.grad)


@pytest.mark.parametrize(("activation", "gate_fn"), [("geglu", F.gelu), ("reglu", F.relu), ("swiglu", F.silu)])
def test_gated_matches_formula_with_biases(activation, gate_fn):
    ffn = _randomize_(PositionWiseFFN(D, FF, d_out=OUT, activation=activation, dtype=torch.float64))
    gate, up, down = (nn.Linear(D, FF, dtype=torch.float64), nn.Linear(D, FF, dtype=torch.float64),
                      nn.Linear(FF, OUT, dtype=torch.float64))
    with torch.no_grad():
        gate.weight.copy_(ffn.fc1.weight[:FF])
        gate.bias.copy_(ffn.fc1.bias[:FF])
        up.weight.copy_(ffn.fc1.weight[FF:])
        up.bias.copy_(ffn.fc1.bias[FF:])
    down.load_state_dict(ffn.fc2.state_dict())
    x = torch.randn(2, 3, D, dtype=torch.float64)
    x1, x2 = _leaf(x), _leaf(x)
    y1 = ffn(x1)
    y2 = down(gate_fn(gate(x2)) * up(x2))
    assert_close(y1, y2)
    y1.sum().backward()
    y2.sum().backward()
    assert_close(x1.grad, x2.grad)
    assert_close(ffn.fc1.weight.grad, torch.cat([gate.weight.grad, up.weight.grad]))
    assert_close(ffn.fc2.weight.grad, down.weight.grad)


@pytest.mark.parametrize("activation", ["relu", "gelu_tanh", "swiglu"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
def test_module_equals_functional_reference(activation, dtype):
    # Whatever path the module dispatches to (reference or a fused CPU kernel), it computes SF.feed_forward.
    ffn = _randomize_(PositionWiseFFN(D, FF, d_out=OUT, activation=activation, dtype=dtype))
    x = torch.randn(3, 4, D, dtype=dtype)
    w = (ffn.fc1.weight, ffn.fc1.bias, ffn.fc2.weight, ffn.fc2.bias)
    assert_close(ffn(x), sublayer.functional.feed_forward(x, *w, activation=activation))


# --------------------------------------------------------------------------------------------------------------
# structure and sizes
# --------------------------------------------------------------------------------------------------------------
@pytest.mark.parametrize("activation", list(REF_ACT))
def test_plain_ffn_holds_exactly_two_linears(activation):
    ffn = PositionWiseFFN(D, FF, activation=activation)
    linears = [m for m in ffn.modules() if isinstance(m, nn.Linear)]
    assert linears == [ffn.fc1, ffn.fc2]
    assert sorted(ffn.state_dict()) == ["fc1.bias", "fc1.weight", "fc2.bias", "fc2.weight"]


def test_sizes_and_defaults():
    ffn = PositionWiseFFN(D)
    assert (ffn.d_model, ffn.d_ff, ffn.d_out) == (D, 4 * D, D)
    assert ffn.fc1.weight.shape == (4 * D, D) and ffn.fc2.weight.shape == (D, 4 * D)
    assert ffn.activation == "relu" and ffn.dropout == 0.0 and ffn.output_dropout == 0.0
    ffn = PositionWiseFFN(D, FF, d_out=OUT)
    assert ffn(torch.randn(2, 3, D)).shape == (2, 3, OUT)
    gated = PositionWiseFFN(D, activation="geglu")
    assert gated.fc1.weight.shape == (8 * D, D) and gated.fc2.weight.shape == (D, 4 * D)


def test_no_bias():
    ffn = PositionWiseFFN(D, FF, bias=False)
    assert ffn.fc1.bias is None and ffn.fc2.bias is None
    x = torch.randn(3, D)
    assert_close(ffn(x), F.relu(x @ ffn.fc1.weight.T) @ ffn.fc2.weight.T)


def test_dtype_and_meta_device():
    assert all(p.dtype == torch.float64 for p in PositionWiseFFN(D, dtype=torch.float64).parameters())
    assert all(p.is_meta for p in PositionWiseFFN(D, activation="swiglu", device="meta").parameters())


# --------------------------------------------------------------------------------------------------------------
# the seeds' examples
# --------------------------------------------------------------------------------------------------------------
def test_d2l_example_keeps_shape_and_is_position_wise():
    # d2l's example is written PositionWiseFFN(4, 8) on ones((2, 3, 4)). Our signature is
    # PositionWiseFFN(d_model, d_ff): (4, 8) reads as d_model=4, d_ff=8, so the shape (2, 3, 4) is kept.
    ffn = PositionWiseFFN(4, 8).eval()
    out = ffn(torch.ones(2, 3, 4))
    assert out.shape == (2, 3, 4)
    assert_close(out, out[0, 0].expand_as(out), rtol=0, atol=0)  # same input at each position → same output
    assert out.abs().sum() > 0


def test_d2l_1x_lazy_example():
    # d2l 1.x writes PositionWiseFFN(ffn_num_hiddens=4, ffn_num_outputs=8) over nn.LazyLinear: that is ours with
    # d_model=None (inferred), d_ff=4, d_out=8 — (2, 3, 4) → (2, 3, 8).
    ffn = PositionWiseFFN(None, 4, d_out=8).eval()
    out = ffn(torch.ones(2, 3, 4))
    assert out.shape == (2, 3, 8) and ffn.d_model == 4
    assert type(ffn.fc1) is nn.Linear and ffn.fc1.weight.shape == (4, 4)
    assert_close(out, out[0, 0].expand_as(out), rtol=0, atol=0)


def test_transformer_base_ffn_512_2048():
    # The "Attention Is All You Need" base FFN (512 → 2048 → 512) on (64, 256, 512), eval, no grad.
    # To keep it cheap (2 shared CPU cores) the reference runs on 4 of the 64 sequences: the map is position-wise,
    # so those rows of our full-batch output must equal the reference's.
    ffn = PositionWiseFFN(512, 2048, dropout=0.1).eval()
    ref = nn.Sequential(nn.Linear(512, 2048), nn.ReLU(), nn.Dropout(0.1), nn.Linear(2048, 512)).eval()
    ref[0].load_state_dict(ffn.fc1.state_dict())
    ref[3].load_state_dict(ffn.fc2.state_dict())
    x = torch.randn(64, 256, 512)
    with torch.no_grad():
        out = ffn(x)
        assert out.shape == (64, 256, 512)
        assert_close(out[:4], ref(x[:4]))


# --------------------------------------------------------------------------------------------------------------
# lazy input size: deepcopy, state_dict, save/load
# --------------------------------------------------------------------------------------------------------------
def test_lazy_deepcopy_before_first_call():
    ffn = PositionWiseFFN(None, FF, d_out=OUT)
    twin = copy.deepcopy(ffn)  # LazyLinear's deepcopy-before-forward bug (pytorch#65051) must not bite
    x = torch.randn(2, 3, D)
    assert twin(x).shape == (2, 3, OUT) and twin.d_model == D
    assert ffn.d_model is None and isinstance(ffn.fc1, nn.LazyLinear)  # the original is untouched
    assert ffn(torch.randn(3, D + 2)).shape == (3, OUT) and ffn.d_model == D + 2


def test_lazy_deepcopy_after_first_call():
    ffn = PositionWiseFFN(None, FF, d_out=OUT)
    x = torch.randn(2, 3, D)
    y = ffn(x)
    twin = copy.deepcopy(ffn)
    assert torch.equal(twin(x), y) and twin.d_model == D


def test_lazy_load_state_dict_before_first_call():
    # A materialised FFN's weights load into a fresh (never called) lazy one; the output then matches.
    src = PositionWiseFFN(D, FF, d_out=OUT)
    lazy = PositionWiseFFN(None, FF, d_out=OUT)
    lazy.load_state_dict(src.state_dict())
    x = torch.randn(2, 3, D)
    assert torch.equal(lazy(x), src(x))
    assert lazy.d_model == D


def test_lazy_save_load_after_first_call(tmp_path):
    ffn = PositionWiseFFN(None, FF, d_out=OUT, activation="swiglu")
    x = torch.randn(2, 3, D)
    y = ffn(x)
    path = tmp_path / "ffn.safetensors"
    save_file(ffn.state_dict(), path)
    for target in [PositionWiseFFN(None, FF, d_out=OUT, activation="swiglu"),
                   PositionWiseFFN(D, FF, d_out=OUT, activation="swiglu")]:
        missing_unexpected = target.load_state_dict(load_file(path))
        assert not missing_unexpected.missing_keys and not missing_unexpected.unexpected_keys
        assert torch.equal(target(x), y)


def test_lazy_needs_d_ff_and_d_out():
    with pytest.raises(ValueError, match=r"d_ff must be given when d_model is None.*got d_ff=None"):
        PositionWiseFFN(None)
    with pytest.raises(ValueError, match=r"d_out must be given when d_model is None.*got d_out=None"):
        PositionWiseFFN(None, 4)


# --------------------------------------------------------------------------------------------------------------
# dropout
# --------------------------------------------------------------------------------------------------------------
def _identity_ffn(n: int, **kw) -> PositionWiseFFN:
    """fc1 = I with bias +1, fc2 = I: for x in [0, 1) the output is dropout(x + 1) exactly."""
    ffn = PositionWiseFFN(n, n, **kw)
    with torch.no_grad():
        ffn.fc1.weight.copy_(torch.eye(n))
        ffn.fc1.bias.fill_(1.0)
        ffn.fc2.weight.copy_(torch.eye(n))
        ffn.fc2.bias.zero_()
    return ffn


@pytest.mark.parametrize("where", ["dropout", "output_dropout"])
@pytest.mark.parametrize("p", [0.2, 0.6])
def test_dropout_statistics_in_training(where, p):
    ffn = _identity_ffn(16, **{where: p}).train()
    x = torch.rand(1250, 16)  # 20000 elements
    out = ffn(x)
    kept = out != 0
    # Keep-rate within 5 standard deviations of 1-p; kept values scaled by 1/(1-p) (the fused path: by 1 / its
    # real keep rate, 1 - p rounded to 2^-16, so that the mean is unbiased).
    assert abs(kept.float().mean().item() - (1 - p)) < 5 * (p * (1 - p) / kept.numel()) ** 0.5
    keep = fused.keep_probability(p) if kernels.enabled() else 1 - p
    assert_close(out[kept], (x + 1)[kept] / keep)


def test_dropout_eval_identity_and_p0_exact():
    x = torch.rand(7, 16)
    ffn = _identity_ffn(16, dropout=0.5, output_dropout=0.5).eval()
    assert torch.equal(ffn(x), x + 1)
    assert torch.equal(_identity_ffn(16).train()(x), x + 1)


# --------------------------------------------------------------------------------------------------------------
# bad input
# --------------------------------------------------------------------------------------------------------------
@pytest.mark.parametrize(
    ("args", "kwargs", "name"),
    [((0,), {}, "d_model"), ((-5,), {}, "d_model"), ((5, 0), {}, "d_ff"), ((5, -1), {}, "d_ff"),
     ((5,), {"d_out": 0}, "d_out")],
)
def test_non_positive_sizes(args, kwargs, name):
    with pytest.raises(ValueError, match=rf"{name} must be a positive int, got -?\d"):
        PositionWiseFFN(*args, **kwargs)


@pytest.mark.parametrize(
    ("args", "kwargs", "name"),
    [((True,), {}, "d_model"), (("5",), {}, "d_model"), ((5, 2.0), {}, "d_ff"), ((5,), {"d_out": False}, "d_out")],
)
def test_bool_and_str_sizes_are_type_errors(args, kwargs, name):
    with pytest.raises(TypeError, match=rf"{name} must be a positive int, got .*\((bool|str|float)\)"):
        PositionWiseFFN(*args, **kwargs)


def test_unknown_activation_lists_choices():
    with pytest.raises(ValueError, match=r"unknown activation 'gelu_new'; choose one of: relu, gelu, gelu_tanh, silu, "
                                         r"relu2, swiglu, geglu, reglu"):
        PositionWiseFFN(D, activation="gelu_new")


@pytest.mark.parametrize("kw", ["dropout", "output_dropout"])
@pytest.mark.parametrize("p", [-0.1, 1.0])
def test_dropout_out_of_range(kw, p):
    with pytest.raises(ValueError, match=rf"{kw} must be in \[0, 1\), got {p}"):
        PositionWiseFFN(D, **{kw: p})


def test_wrong_input_last_dim():
    with pytest.raises(ValueError, match=rf"x must have last dim d_model={D}, got shape \(2, 3, 4\)"):
        PositionWiseFFN(D)(torch.randn(2, 3, 4))


@pytest.mark.parametrize("activation", list(REF_ACT))
def test_bf16_matches_nn_sequential_within_its_own_error(activation):
    # bf16 (the module may take a fused CPU kernel here). Tolerance per the "fused tolerances" convention: our error
    # vs an fp64 run on the same rounded inputs/weights is at most 2x that of torch's bf16 nn.Sequential, plus one
    # bf16 ulp of the largest value.
    ffn = _randomize_(PositionWiseFFN(D, FF, d_out=OUT, activation=activation, dtype=torch.bfloat16))
    ref = nn.Sequential(nn.Linear(D, FF), REF_ACT[activation](), nn.Linear(FF, OUT)).to(torch.bfloat16)
    ref[0].load_state_dict(ffn.fc1.state_dict())
    ref[2].load_state_dict(ffn.fc2.state_dict())
    f64 = copy.deepcopy(ffn).double()
    x = torch.randn(4, 3, D, dtype=torch.bfloat16)
    gy = torch.randn(4, 3, OUT, dtype=torch.bfloat16)
    results = []
    for m, xx, g in [(ffn, x, gy), (ref, x, gy), (f64, x.double(), gy.double())]:
        xl = _leaf(xx)
        y = m(xl)
        y.backward(g)
        results.append([y.detach(), xl.grad] + [p.grad for p in m.parameters()])
    ulp = torch.finfo(torch.bfloat16).eps
    for ours, theirs, truth in zip(*results):
        err_ours = (ours.double() - truth).abs().max().item()
        err_ref = (theirs.double() - truth).abs().max().item()
        assert err_ours <= 2 * err_ref + ulp * truth.abs().max().item(), (err_ours, err_ref)


def test_lazy_rejects_scalar_and_non_tensor():
    with pytest.raises(ValueError, match=r"x must have a last dim \(the input size\), got shape \(\)"):
        PositionWiseFFN(None, 4, d_out=8)(torch.tensor(1.0))
    with pytest.raises(TypeError, match="x must be a torch.Tensor, got list"):
        PositionWiseFFN(None, 4, d_out=8)([1.0, 2.0])
