"""Rotary embeddings: ``rotary_cos_sin`` / ``apply_rotary`` vs HF ``LlamaRotaryEmbedding`` / ``apply_rotary_pos_emb``
(default and llama3 scaling, fp32 and fp64), rotation properties, gradcheck and bad input."""

from __future__ import annotations

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st
from torch.testing import assert_close

import sublayer.functional as SF

transformers = pytest.importorskip("transformers")
from transformers.models.llama.modeling_llama import LlamaRotaryEmbedding, apply_rotary_pos_emb  # noqa: E402

LLAMA3 = {
    "rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
    "original_max_position_embeddings": 64,
}  # fmt: skip  (a short original context, so all three wavelength bands occur at head_dim 22)


def hf_rotary(head_dim: int, theta: float, scaling: dict | None) -> LlamaRotaryEmbedding:
    rope = {"rope_type": "default", "rope_theta": theta} if scaling is None else {**scaling, "rope_theta": theta}
    config = transformers.LlamaConfig(
        hidden_size=head_dim * 3, num_attention_heads=3, head_dim=head_dim, rope_parameters=rope,
        max_position_embeddings=64,
    )  # fmt: skip
    return LlamaRotaryEmbedding(config)


POSITIONS = torch.tensor([[0, 1, 2, 3, 5, 8, 13, 21, 34, 55, 89, 1000, 70000]])


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
@pytest.mark.parametrize("scaling", [None, LLAMA3], ids=["default", "llama3"])
@pytest.mark.parametrize(("head_dim", "theta"), [(22, 10000.0), (10, 500000.0), (6, 1e6)])
def test_cos_sin_equal_hf_rotary_embedding(dtype, scaling, head_dim, theta):
    ref = hf_rotary(head_dim, theta, scaling).to(dtype)  # HF computes in float32 for every dtype, then casts
    x = torch.zeros(1, dtype=dtype)
    want_cos, want_sin = ref(x, POSITIONS)
    cos, sin = SF.rotary_cos_sin(POSITIONS, head_dim, theta, scaling, dtype=dtype)
    assert cos.dtype == sin.dtype == dtype and cos.shape == (1, POSITIONS.shape[1], head_dim)
    assert torch.equal(cos, want_cos) and torch.equal(sin, want_sin)


def test_inv_freq_equals_hf_bit_for_bit_and_llama3_changes_the_long_wavelengths():
    for scaling in (None, LLAMA3):
        assert torch.equal(SF.rotary_inv_freq(22, 10000.0, scaling), hf_rotary(22, 10000.0, scaling).inv_freq)
    plain, scaled = SF.rotary_inv_freq(22, 10000.0), SF.rotary_inv_freq(22, 10000.0, LLAMA3)
    assert scaled[0] == plain[0]  # the shortest wavelength is kept
    assert_close(scaled[-1], plain[-1] / 8.0)  # the longest divided by factor
    assert bool(((scaled < plain) & (scaled > plain / 8.0)).any())  # some are interpolated in between


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
def test_apply_rotary_equals_hf_apply_rotary_pos_emb(dtype):
    g = torch.Generator().manual_seed(0)
    q = torch.randn(2, 5, 7, 10, generator=g, dtype=dtype)
    k = torch.randn(2, 1, 7, 10, generator=g, dtype=dtype)
    pos = torch.tensor([[0, 1, 2, 3, 4, 5, 6], [3, 4, 5, 6, 7, 8, 9]])
    cos, sin = SF.rotary_cos_sin(pos, 10, 10000.0, dtype=dtype)
    want_q, want_k = apply_rotary_pos_emb(q, k, cos, sin)
    assert torch.equal(SF.apply_rotary(q, cos, sin), want_q)
    assert torch.equal(SF.apply_rotary(k, cos, sin), want_k)


def test_apply_rotary_gradcheck_float64():
    g = torch.Generator().manual_seed(1)
    x = torch.randn(2, 3, 5, 6, generator=g, dtype=torch.float64, requires_grad=True)
    cos, sin = SF.rotary_cos_sin(torch.arange(5)[None], 6, 100.0, dtype=torch.float64)
    assert torch.autograd.gradcheck(lambda t: SF.apply_rotary(t, cos, sin), (x,))


@settings(max_examples=25, deadline=None)
@given(p=st.integers(0, 5000), s=st.integers(0, 5000), shift=st.integers(0, 5000), seed=st.integers(0, 2**16))
def test_rotation_keeps_norms_and_scores_depend_on_the_offset_only(p, s, shift, seed):
    g = torch.Generator().manual_seed(seed)
    q, k = torch.randn(2, 1, 1, 1, 10, generator=g, dtype=torch.float64).unbind(0)

    def rot(x, pos):
        cos, sin = SF.rotary_cos_sin(torch.tensor([[pos]]), 10, 10000.0, dtype=torch.float64)
        return SF.apply_rotary(x, cos, sin)

    assert_close(rot(q, p).norm(), q.norm())
    score = (rot(q, p) * rot(k, s)).sum()
    shifted = (rot(q, p + shift) * rot(k, s + shift)).sum()
    # the angles are float32 (as HF's): p·f and (p+shift)·f round differently, so only ~1e-3 relative here
    assert_close(score, shifted, rtol=0, atol=2e-3 * q.norm() * k.norm())


def test_no_scaling_for_default_type():
    assert SF.check_rope_scaling(None) is None
    assert SF.check_rope_scaling({"rope_type": "default", "rope_theta": 5.0}) is None
    assert SF.check_rope_scaling({"type": "llama3", **{k: v for k, v in LLAMA3.items() if k != "rope_type"}}) == LLAMA3


@pytest.mark.parametrize(
    ("call", "exc", "match"),
    [
        (lambda: SF.rotary_inv_freq(7, 10000.0), ValueError, "head_dim must be even .* got 7"),
        (lambda: SF.rotary_inv_freq(0, 10000.0), ValueError, "head_dim must be a positive int, got 0"),
        (lambda: SF.rotary_inv_freq(6, 0.0), ValueError, "theta must be a number > 0, got 0.0"),
        (lambda: SF.check_rope_scaling({"rope_type": "yarn", "factor": 2.0}), ValueError, "rope_type='yarn'"),
        (lambda: SF.check_rope_scaling({"rope_type": "linear", "factor": 2.0}), ValueError, "rope_type='linear'"),
        (lambda: SF.check_rope_scaling({**LLAMA3, "factor": None}), ValueError, "factor must be a number > 0"),
        (lambda: SF.check_rope_scaling({**LLAMA3, "high_freq_factor": 1.0}), ValueError, "high_freq_factor"),
        (lambda: SF.check_rope_scaling([1]), TypeError, "rope_scaling must be a dict or None, got list"),
        (lambda: SF.rotary_cos_sin(torch.ones(1, 3), 6), TypeError, "position_ids must be an integer tensor"),
        (lambda: SF.apply_rotary(torch.ones(1, 1, 3, 6), torch.ones(1, 3, 4), torch.ones(1, 3, 4)), ValueError,
         "cos and sin must have one shape"),
    ],
)  # fmt: skip
def test_bad_input_is_refused(call, exc, match):
    with pytest.raises(exc, match=match):
        call()
