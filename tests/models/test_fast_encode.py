"""The encoder pass of Transformer.translate on the kernels (sublayer.models.fast_encode) against
Transformer.encode, the reference; and when it must step aside."""

from __future__ import annotations

import pytest
import torch

from sublayer import kernels, record_attention
from sublayer.models import Transformer, decoding, fast_encode

pytestmark = pytest.mark.skipif(not kernels.enabled(), reason="C++ kernels switched off or unavailable")


def _model(d_model: int, n_heads: int, *, norm_first: bool, activation: str = "relu", seed: int = 0) -> Transformer:
    torch.manual_seed(seed)
    m = Transformer(17, 19, d_model=d_model, n_heads=n_heads, d_ff=23, n_layers=2, dropout=0.1, max_len=13,
                    norm_first=norm_first, activation=activation)  # fmt: skip
    return m.eval()


def _src(b: int = 5, s: int = 7) -> tuple[torch.Tensor, torch.Tensor]:
    src = torch.randint(3, 17, (b, s), generator=torch.Generator().manual_seed(b * s))
    mask = torch.zeros(b, s, dtype=torch.bool)
    mask[1, 4:] = True
    mask[3, 1:] = True  # a single real token
    return src, mask


@pytest.mark.parametrize("norm_first", [False, True])
@pytest.mark.parametrize("activation", ["relu", "gelu", "swiglu"])
@pytest.mark.parametrize("d_model,n_heads", [(15, 3), (24, 3)])  # head size 5 (scalar loops) and 8 (AVX2)
@pytest.mark.parametrize("masked", [False, True])
def test_encode_matches_the_reference(norm_first, activation, d_model, n_heads, masked):
    m = _model(d_model, n_heads, norm_first=norm_first, activation=activation)
    src, mask = _src()
    mask = mask if masked else None
    with torch.no_grad():
        ref = m.encode(src, src_key_padding_mask=mask)
    got = fast_encode.encode(m, src, mask)
    torch.testing.assert_close(got, ref)
    if masked:
        assert torch.equal(got[mask], torch.zeros(int(mask.sum()), d_model))  # as the padding-free reference


@pytest.mark.parametrize("norm_first", [False, True])
def test_encode_matches_the_reference_with_left_padding_and_a_row_of_padding_only(norm_first):
    m = _model(15, 3, norm_first=norm_first)
    src, _ = _src()
    mask = torch.zeros(5, 7, dtype=torch.bool)
    mask[0, :3] = True  # left padding
    mask[2] = True  # no real token
    with torch.no_grad():
        ref = m.encode(src, src_key_padding_mask=mask)
    got = fast_encode.encode(m, src, mask)
    torch.testing.assert_close(got, ref)
    assert torch.equal(got[mask], torch.zeros(int(mask.sum()), 15))


def test_encode_without_a_final_norm():
    m = _model(15, 3, norm_first=True)
    m.encoder.norm = None  # a pre-norm stack that ends on its last residual add
    src, mask = _src()
    with torch.no_grad():
        ref = m.encode(src, src_key_padding_mask=mask)
    torch.testing.assert_close(fast_encode.encode(m, src, mask), ref)


def test_follows_parameter_updates():
    m = _model(15, 3, norm_first=False)
    src, _ = _src()
    fast_encode.encode(m, src)  # weights cached
    with torch.no_grad():
        m.encoder.layers[0].self_attn.k_proj.weight.mul_(2.0)
        m.encoder.layers[1].ffn.fc1.bias.add_(0.5)
        ref = m.encode(src)
    torch.testing.assert_close(fast_encode.encode(m, src), ref)


def test_steps_aside_when_it_cannot_run():
    m = _model(15, 3, norm_first=True)
    src, _ = _src()
    assert fast_encode.supports(m)
    was = kernels.switched_on()
    kernels.set_enabled(False)
    try:
        assert fast_encode.encode(m, src) is None
    finally:
        kernels.set_enabled(was)
    with record_attention(m):  # hooks on the attention modules: their own forwards must run
        assert fast_encode.encode(m, src) is None
    assert fast_encode.encode(m.double(), src) is None
    no_bias = _model(15, 3, norm_first=True)
    no_bias.encoder.layers[1].ffn.fc2.bias = None  # a linear without bias: the reference encoder runs
    assert fast_encode.encode(no_bias, src) is None
    assert no_bias.translate(src, 3, bos=1, eos=2).shape[0] == src.shape[0]


def test_translate_runs_it_and_equals_the_reference(monkeypatch):
    m = _model(24, 3, norm_first=True)
    src, mask = _src()
    calls = []
    real = fast_encode.encode
    monkeypatch.setattr(fast_encode, "encode", lambda *a, **k: calls.append(1) or real(*a, **k))
    kw = {"bos": 1, "eos": 2, "src_key_padding_mask": mask}
    got = m.translate(src, 8, **kw)
    assert calls == [1]
    decoding.set_enabled(False)  # the switch covers the encoder pass too: the reference encode runs
    try:
        ref = m.translate(src, 8, **kw)
    finally:
        decoding.set_enabled(True)
    assert calls == [1] and got.tolist() == ref.tolist()


def test_translate_with_recorded_attention_fires_the_hooks():
    m = _model(15, 3, norm_first=False)
    src, mask = _src()
    with record_attention(m) as maps:
        m.translate(src, 4, bos=1, eos=2, src_key_padding_mask=mask)
    assert maps["encoder.layers.0.self_attn"] and maps["decoder.layers.1.cross_attn"]


def test_encode_with_float32_products_on_onednn_matches_the_reference(monkeypatch):
    """Where torch's BLAS runs a generic path (AMD CPUs with AVX-512) the encoder's large float32 products run on
    oneDNN (``fused.linear``): the same hidden states as the reference with every kernel switched off."""
    from sublayer.kernels import onednn

    if not onednn.available():
        pytest.skip("torch without oneDNN's linear ops")
    torch.manual_seed(1)
    m = Transformer(17, 19, d_model=64, n_heads=4, d_ff=263, n_layers=2, dropout=0.1, max_len=31).eval()
    src = torch.randint(3, 17, (61, 29), generator=torch.Generator().manual_seed(2))
    lengths = torch.randint(20, 30, (61, 1), generator=torch.Generator().manual_seed(3))  # ~1,500 real rows
    mask = torch.arange(29)[None] >= lengths
    kernels.set_enabled(False)
    try:
        with torch.no_grad():
            ref = m.encode(src, src_key_padding_mask=mask)
    finally:
        kernels.set_enabled(True)
    monkeypatch.setattr(kernels.cpu, "onednn_fp32_gemm", lambda: True)
    calls, real = [], onednn.linear
    monkeypatch.setattr(onednn, "linear", lambda *a, **k: calls.append(a[0].shape) or real(*a, **k))
    got = fast_encode.encode(m, src, mask)
    assert len(calls) >= 2 * 3  # every layer's q|k|v, fc1 and fc2 (the output projection is below the minimum)
    torch.testing.assert_close(got, ref, rtol=1e-4, atol=1e-5)
