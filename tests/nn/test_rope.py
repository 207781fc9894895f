"""RotaryEmbedding module: the functional's numbers, HF ``LlamaRotaryEmbedding``'s, no state, bad input."""

from __future__ import annotations

import pytest
import torch

import sublayer.functional as SF
from sublayer.nn import RotaryEmbedding

transformers = pytest.importorskip("transformers")
from transformers.models.llama.modeling_llama import LlamaRotaryEmbedding  # noqa: E402

LLAMA3 = {
    "rope_type": "llama3", "factor": 4.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
    "original_max_position_embeddings": 64,
}  # fmt: skip


@pytest.mark.parametrize("scaling", [None, LLAMA3], ids=["default", "llama3"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.float64, torch.bfloat16])
def test_equals_hf_module(scaling, dtype):
    rope = {"rope_type": "default", "rope_theta": 500.0} if scaling is None else {**scaling, "rope_theta": 500.0}
    config = transformers.LlamaConfig(hidden_size=30, num_attention_heads=3, rope_parameters=rope)
    # frequencies stay float32 (as in a model HF loads with dtype=...; HF's ``.to(bfloat16)`` would round its
    # inv_freq buffer, which we never do); the result takes the input's dtype
    ref = LlamaRotaryEmbedding(config)
    ours = RotaryEmbedding(10, theta=500.0, scaling=scaling)
    pos = torch.tensor([[0, 3, 1, 4, 1, 5], [9, 2, 6, 5, 3, 5]])
    want = ref(torch.zeros(1, dtype=dtype), pos)
    got = ours(pos, dtype=dtype)
    assert all(torch.equal(a, b) for a, b in zip(got, want))
    assert all(torch.equal(a, b) for a, b in zip(got, SF.rotary_cos_sin(pos, 10, 500.0, scaling, dtype=dtype)))


def test_stateless_and_meta_safe():
    m = RotaryEmbedding(6, device="meta", dtype=torch.float64)
    assert list(m.parameters()) == [] and list(m.buffers()) == [] and m.state_dict() == {}
    cos, sin = m.to_empty(device="cpu")(torch.arange(4)[None])
    assert torch.equal(cos[0, 0], torch.ones(6)) and torch.equal(sin[0, 0], torch.zeros(6))
    assert "head_dim=6" in repr(m) and "theta=10000.0" in repr(m)


@pytest.mark.parametrize(
    ("kwargs", "match"),
    [
        ({"head_dim": 5}, "head_dim must be even"),
        ({"head_dim": 6, "theta": -1.0}, "theta must be a number > 0"),
        ({"head_dim": 6, "scaling": {"rope_type": "dynamic", "factor": 2.0}}, "rope_type='dynamic'"),
    ],
)
def test_bad_arguments(kwargs, match):
    with pytest.raises(ValueError, match=match):
        RotaryEmbedding(**kwargs)
